"""Starting the disk's writeback of a range just written, without waiting for it.

The local backend fsyncs each object before its name appears (durable
storage). Left to the kernel, an object's dirty pages mostly wait in memory
(writeback starts at dirty_background_ratio, a tenth of a large node's RAM)
and the fsync at the end then writes all of them in one piece, after the
dump. Asked as each part lands, the disk writes while the dump goes on and
the final fsync finds little left: the fsync stays, its wait goes.

``sync_file_range(SYNC_FILE_RANGE_WRITE)`` queues the range's dirty pages
for writing and returns; it guarantees nothing about durability (the fsync
does), so where it is missing or refused nothing is lost but the overlap.
Python's os module lacks it: it is called through libc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int


def start(fd: int, offset: int, length: int) -> bool:
    """Queue ``length`` bytes of ``fd`` from ``offset`` for writing to disk.
    False where the system would not (no such call, a filesystem that
    refuses it): the caller's fsync then writes them, as before."""
    if length <= 0:
        return True
    if _sync_file_range is not None:
        return _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0
    # Elsewhere (not glibc): DONTNEED also starts the writeback of dirty pages.
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        return False
    return True
