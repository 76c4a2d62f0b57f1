"""A pod container's writable layer, captured beside its dump, and what a
work directory shows was dumped and captured (read again by a recovery)."""

from __future__ import annotations

from pathlib import Path

import orjson

from services.containers import rootfs
from services.containers.host import Shim

CONTAINER_FILE = "container.json"
# Written once the layer and /dev/shm of a finished dump are captured whole.
CAPTURED = "captured"


async def capture(shim: Shim, work: Path, upper: Path | None, budget: rootfs.Budget) -> None:
    """Read the stopped workload's writable layer and /dev/shm into ``work``,
    within ``budget``, and then mark them complete (CAPTURED): a dump whose
    captures were cut short (the agent killed) is never stored as it is."""
    (work / CAPTURED).unlink(missing_ok=True)
    if upper is not None:
        await rootfs.capture(upper, work / rootfs.TAR, budget)
    await rootfs.capture_shm(shim.pid, work / rootfs.SHM_TAR, budget)
    (work / CAPTURED).touch()


def captured(work: Path) -> bool:
    return (work / CAPTURED).is_file()


def _dumped_in(work: Path) -> str | None:
    """The container a dump in ``work`` was taken of (None: none is left)."""
    try:
        found = orjson.loads((work / CONTAINER_FILE).read_bytes()).get("container_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None
