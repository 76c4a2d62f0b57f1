"""A restore that streams: CRIU restores while the page images download.

CRIU runs with ``--stream`` as soon as the restore starts; smr.process.imagestream
answers its requests from storage (services.storage.streamed.StreamedImages).
The small images are fetched in parallel at once; the page images flow from
the ranged GETs through decoding and hashing into CRIU's pipe, so the
download overlaps the restore. The largest page image starts at once. On a
node with cores to spare it is staged by the decoding threads in scratch
files (RAM-backed when it fits, else on disk), from which the kernel splices
it into CRIU's pipe, so the download runs ahead of CRIU at its own pace; on
a small one it goes through memory, a few frames ahead (see scratch_for).

Verification is unchanged: a file's last range reaches CRIU only after its
sha256 matched, so CRIU completes (and the tree resumes) only on stored
bytes; on a mismatch CRIU fails on the short image and kills the tree.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.storage.generation import Generation
from services.storage.store import CheckpointStore
from services.storage.streamed import StreamedImages
from smr.contract.errors import SmrError
from smr.process import sockets
from smr.process.criu import Criu, CriuRun
from smr.process.imagestream import ImageStreamer

log = logging.getLogger("smr.restorer")

SOCKET_BASE = "/tmp"
SHM = Path("/dev/shm")
STAGING_MIN_CORES = 4


def memory_headroom(proc_cgroup: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> float:
    """Bytes this process may still be charged before its memory cgroup (or
    one above it) reaches its limit; infinite where none limits it."""
    room = math.inf
    for line in proc_cgroup.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            at, limit, usage = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        elif controllers == "" and (root / "cgroup.controllers").is_file():
            at, limit, usage = root, "memory.max", "memory.current"
        else:
            continue
        d = at / path.lstrip("/")
        while d != at.parent:  # the cgroup and each above it, to the root
            with contextlib.suppress(OSError, ValueError):
                cap = (d / limit).read_text().strip()
                if cap != "max":
                    room = min(room, int(cap) - int((d / usage).read_text()))
            d = d.parent
    return room


def scratch_for(gen: Generation, disk: Path) -> Path | None:
    """Where the largest page image lands on its way to CRIU: RAM (/dev/shm)
    when it fits there with room left for the process it becomes (which
    needs as much again), and within the agent's own memory limit (a tmpfs
    page is charged to the cgroup that wrote it: the agent's, which a staged
    image larger than its limit would have killed); else ``disk``, whose
    page cache the kernel reclaims under that limit, and which still serves
    CRIU.

    None (no staging: the download keeps a few frames ahead of CRIU) on a
    node with fewer than STAGING_MIN_CORES cores. Staging is one more pass
    through fresh memory, which pays only where spare cores let the download
    run ahead of CRIU. Measured, 2 GiB of random memory from local storage:
    on 2 cores 2.2-2.9 s without, 2.9-9.2 s with; on the H100 machine's 16,
    16 GiB restored 16.2 s without, 13.0 s with."""
    if (os.cpu_count() or 1) < STAGING_MIN_CORES:
        return None
    need = max((int(f["size"]) for f in gen.manifest["files"]
                if Path(f["path"]).name.startswith("pages-")), default=0)
    try:
        st = os.statvfs(SHM)
        free = st.f_bavail * st.f_frsize
        with Path("/proc/meminfo").open() as meminfo:
            avail = next(int(ln.split()[1]) * 1024 for ln in meminfo
                         if ln.startswith("MemAvailable:"))
        headroom = memory_headroom()
    except (OSError, StopIteration, ValueError):
        disk.mkdir(parents=True, exist_ok=True)
        return disk
    if need * 1.2 + (256 << 20) < min(free, avail / 2, headroom):
        return SHM
    disk.mkdir(parents=True, exist_ok=True)
    return disk


async def restore_streamed(criu: Criu, store: CheckpointStore, gen: Generation, images: Path,
                           durations: dict[str, float], *, pidfile: Path,
                           inherit: dict[str, int], tcp: sockets.Tcp,
                           on_bytes: Callable[[int], None] | None = None,
                           sockets_dir: Path | None = None,
                           leave_stopped: bool = False) -> CriuRun:
    """Run ``criu restore --stream`` fed from ``gen``; ``durations["download"]``
    becomes the time until CRIU had every byte (overlapped with the restore).
    ``sockets_dir``: where CRIU finds the streamer's socket, a directory it
    sees under a short path (a pod's volume); by default one of its own."""
    t = time.monotonic()
    scratch = scratch_for(gen, images.parent)
    log.info("restoring %s generation %s streamed, %s", gen.manifest.get("checkpoint_id"),
             gen.number, f"its largest page image staged in {scratch}" if scratch
             else "through memory")
    source = StreamedImages(store, gen, scratch=scratch)
    # CRIU cuts a socket path longer than 107 bytes short: by default the
    # socket goes in a short directory of its own.
    own = sockets_dir is None
    sockets_dir = sockets_dir or Path(tempfile.mkdtemp(prefix="smr-", dir=SOCKET_BASE))
    try:
        async with ImageStreamer(sockets_dir, source, on_bytes) as streamer:
            try:
                run = await criu.restore(images, pidfile=pidfile, inherit=inherit, tcp=tcp,
                                         stream=sockets_dir, leave_stopped=leave_stopped)
            except SmrError:
                if cause := streamer.cause():
                    raise cause from None  # CRIU failed because an image did not arrive
                raise
            await streamer.finish()
            durations["download"] = streamer.done_at - t if streamer.done_at else 0.0
    finally:
        if own:
            shutil.rmtree(sockets_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            await source.aclose()
    return run
