"""Writing a page image's frames into scratch files in parallel, each at its
own offset (the scratch of a fetch or a streamed restore)."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

from services.storage.download import Chunk
from smr.process.imagestream import FileRange

log = logging.getLogger("smr.storage")


SCRATCH_FILES = 16  # written in parallel (see Scatter)


class Scatter:
    """A sink (see download.decoded) that writes frame i, in the thread that
    decoded it, into file i % len(fds) after the earlier frames there, and
    returns the FileRange it wrote. One file for a fetch; SCRATCH_FILES for a
    page image staged on its way to CRIU, because tmpfs takes one writer per
    file at a time."""

    def __init__(self, fds: list[int], frames: list[list[int]]) -> None:
        self.fds = fds
        self.at: list[int] = []
        ends = [0] * len(fds)
        for i, (_, raw, _) in enumerate(frames):
            self.at.append(ends[i % len(fds)])
            ends[i % len(fds)] += raw
        # A decoding thread outlives the cancel of the task that awaited it:
        # the files close only once no thread writes, or a write could land
        # in whatever reuses the descriptor.
        self._writers = threading.Condition()
        self._busy = 0
        self._closed = False

    @classmethod
    def open(cls, where: Path, frames: list[list[int]]) -> Scatter | None:
        fds: list[int] = []
        try:
            while len(fds) < SCRATCH_FILES:
                fds.append(os.open(where, os.O_RDWR | os.O_TMPFILE, 0o600))
        except OSError as e:  # a filesystem without O_TMPFILE: through memory
            log.info("no scratch file in %s (%s); streaming from memory", where, e)
            _close_all(fds)
            return None
        return cls(fds, frames)

    def __call__(self, i: int, frame: Chunk) -> FileRange:
        with self._writers:
            if self._closed:
                raise OSError(errno.EBADF, "the scratch files were closed")
            self._busy += 1
        try:
            fd = self.fds[i % len(self.fds)]
            _pwrite_all(fd, frame, self.at[i])
        finally:
            with self._writers:
                self._busy -= 1
                self._writers.notify_all()
        return FileRange(fd, self.at[i], len(frame))

    def close(self) -> None:
        """Blocks until no thread writes, then closes the files."""
        with self._writers:
            self._closed = True
            self._writers.wait_for(lambda: self._busy == 0)
        _close_all(self.fds)


def _pwrite_all(fd: int, data: Chunk, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
