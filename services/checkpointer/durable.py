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
from typing import TypeVar

from smr.bus import Progress
from smr.errors import PermanentError, TemporaryError

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
