"""Transfer buffers stay with the process between ranges and parts.

Ranges and parts are a few MiB each. glibc serves allocations that large
with a fresh mmap (or trims them off the heap once freed), so every range
or part page-faults its memory in anew: 2,048 faults per 8 MiB, and on a VM
whose freed memory goes back to the host (virtio-balloon free page
reporting, as on the machines measured here) each one is a host fault too.
Measured on the 2-core VM (bench/storage.py's download of 2 GiB, client
pinned to one core): 7.3 s of system time without, 3.9 s with.

glibc's own knobs (mallopt), set once per process: blocks up to 32 MiB
come from the heap, and up to 512 MiB of freed heap is kept for reuse.
Elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("smr.storage")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest
TRIM_THRESHOLD = 512 << 20

_done = False


def keep_transfer_buffers() -> None:
    global _done
    if _done:
        return
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD,
                                                                   TRIM_THRESHOLD)):
        log.debug("mallopt refused the transfer-buffer thresholds; left as they were")
