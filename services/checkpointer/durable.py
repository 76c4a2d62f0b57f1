"""Storing a finished dump until it is stored: what the checkpoint steps do
when storage fails after CRIU has dumped a workload.

Once a dump has finished, its images on disk are the workload's state (for a
final checkpoint, the only copy). A storage error then must never make the
step start over (the workload is stopped by then) nor drop the images: the
same images are committed again, with backoff, until they are stored or a
deadline passes. Only then does the step fail, and the caller lets the
workload run on where it was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.storage.generation import Generation
from smr.bus import Progress
from smr.contract.errors import PermanentError, SmrError, TemporaryError
from smr.contract.messages import CkptDone, CkptRequested
from smr.process import sockets

log = logging.getLogger("smr.checkpointer")

T = TypeVar("T")
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0


class StorageUnavailable(PermanentError):
    code = "storage-unavailable"


async def until_stored(commit: Callable[[], Awaitable[T]], *, what: str, deadline_s: float,
                       progress: Progress, error: TemporaryError | None = None) -> T:
    """Run ``commit`` (idempotent: it stores the same finished dump) until it
    succeeds; retried with backoff on a temporary error, for ``deadline_s``.
    ``error``: the failure that brought us here, if the first try already failed."""
    deadline = time.monotonic() + deadline_s
    delay = FIRST_DELAY_S
    while True:
        if error is not None:
            if time.monotonic() + delay > deadline:
                raise StorageUnavailable(
                    f"{what} could not be stored within {deadline_s:.0f}s ({error.message})",
                    detail=error.detail,
                    hint=f"{error.hint + '; ' if error.hint else ''}raise SMR_COMMIT_DEADLINE "
                         "to wait longer for storage")
            log.warning("%s: storing failed (%s); trying again in %.0fs", what, error.message,
                        delay)
            progress.update("commit-retry", retry_error=error.message)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)
        try:
            return await commit()
        except TemporaryError as e:
            error = e


def result(req: CkptRequested, gen: Generation, current: bool, restore: str,
           **kw: Any) -> CkptDone:
    """The answer for ``gen``, stored for ``req``: succeeded, or superseded
    where ``latest`` stays on a later dump (``current`` False: this one was
    dumped before a generation committed ahead of it; see
    services/storage/order). ``restore``: what restores latest, said in the hint."""
    outcome = sockets.outcome(gen.manifest)
    if current:
        return CkptDone.for_request(req, status="succeeded", generation=gen.number,
                                    location=gen.location, size_bytes=gen.size_bytes,
                                    sockets=outcome, **kw)
    return CkptDone.for_request(req, status="superseded", generation=gen.number,
                                location=gen.location, size_bytes=gen.size_bytes,
                                sockets=outcome, error=SmrError(
        f"checkpoint {req.checkpoint_id} generation {gen.number} was stored after a later "
        f"dump of it had been committed (its step was recovered late); latest stays on "
        "that later generation", code="superseded",
        hint=f"nothing is lost: {restore} resumes from the later state; this generation "
             f"can still be restored with --generation {gen.number}").as_dict(), **kw)
