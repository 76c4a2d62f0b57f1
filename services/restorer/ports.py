"""Before a local job's restore: the ports its listeners bind again, freed.

A local job comes back in this host's network namespace, where connections
it closed before the dump may still hold its listeners' ports in TIME_WAIT
for up to a minute (smr.process.timewait). The restore waits that out,
saying so, rather than fail in CRIU with "Address already in use".
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.storage.generation import Generation
from services.storage.store import CheckpointStore
from smr.bus import Progress
from smr.process import timewait

log = logging.getLogger("smr.restorer")


async def wait_ports_free(store: CheckpointStore, gen: Generation, work: Path, streamed: bool,
                          progress: Progress, durations: dict[str, float]) -> None:
    """Wait until no port the restore of ``gen`` binds is held in TIME_WAIT;
    the wait, if any, goes in ``durations["time_wait"]``."""
    images = work / "images"
    if streamed:  # CRIU reads the rest from the stream: fetch the socket images alone
        names = {f"images/{n}" for n in timewait.IMAGES}
        await store.fetch(gen, work / "bound", only=lambda p: p in names)
        images = work / "bound" / "images"

    def waiting(busy: set[timewait.Endpoint], waited: float) -> None:
        ports = ", ".join(sorted(map(str, busy)))
        log.info("restore waits %.0fs so far for the kernel to let go of %s (TIME_WAIT of "
                 "connections the job closed before its dump)", waited, ports)
        progress.update("waiting-for-ports", waiting_for=f"{ports} in TIME_WAIT")

    if waited := await timewait.wait_free(images, on_wait=waiting):
        durations["time_wait"] = waited
