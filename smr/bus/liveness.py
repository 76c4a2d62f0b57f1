"""Which requests a live worker on this node is running, as the kernel knows it.

A worker holds an flock on a file of the request's own, under a directory
every worker of the node shares, from before it claims a request until it has
answered it. The kernel lets the lock go when its process ends, however it
ends. So whoever would act for a worker that looks dead (a redelivery that
finds a stale heartbeat, the handler of a request JetStream gave up on) first
asks here: a worker whose heartbeats do not get through (NATS away for it, or
an agent being replaced while the old one finishes) is alive all the same,
and its step may still restore or resume a process. Acting beside it would
answer "failed" for a step that then succeeds, or run it twice.

Every worker of a node's requests runs on that node (the subjects are per
node), so one directory on the node is enough: the agent's is a hostPath, so
an old agent pod and its replacement share it (deploy/kustomize).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

READER_PATIENCE_S, READER_RETRY_S = 0.2, 0.005


class StepLocks:
    """The per-request locks of one node's workers, under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, request_id: str) -> Path:
        # Hashed: a request id is the requester's text, never a path of ours.
        return self.root / (hashlib.sha256(request_id.encode()).hexdigest()[:40] + ".lock")

    def _open_locked(self, request_id: str, how: int, patience: float = 0.0) -> int | None:
        """``request_id``'s lock file, open and locked ``how`` (LOCK_EX or
        LOCK_SH), tried again for ``patience`` seconds; None when a live
        worker holds it (or, for LOCK_EX, anyone)."""
        self.root.mkdir(parents=True, mode=0o700, exist_ok=True)
        path = self._path(request_id)
        deadline = time.monotonic() + patience
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
                mine = _same_file(fd, path)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(READER_RETRY_S)
                    continue
                return None
            except BaseException:
                os.close(fd)
                raise
            if mine:
                return fd
            # Its last holder removed it between our open and our lock: that
            # file is no one's now; the lock is the one at the path.
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self, request_id: str, how: int, patience: float = 0.0
                ) -> Iterator[int | None]:
        """``_open_locked``'s descriptor while the block runs, closed after."""
        fd = self._open_locked(request_id, how, patience)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @contextlib.contextmanager
    def hold(self, request_id: str) -> Iterator[bool]:
        """Hold ``request_id``'s lock while the block runs: True; False (holding
        nothing) when a live worker, in this process or another, holds it."""
        with self._locked(request_id, fcntl.LOCK_EX) as fd:
            try:
                yield fd is not None
            finally:
                if fd is not None:
                    # Removed while still held, so that a worker that opened it
                    # meanwhile sees, once it gets the lock, that it is not the path's.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path(request_id))

    @contextlib.contextmanager
    def reading(self, request_id: str) -> Iterator[bool]:
        """While the block runs, no worker takes ``request_id`` (one that tries
        is refused and looks again later): True; False when a live worker
        holds it. Readers share it: two looks at one request never refuse
        each other."""
        # Tried again for a moment: a reader on its way out holds the file
        # exclusively while it removes it (microseconds); a worker holds it
        # for a whole request.
        with self._locked(request_id, fcntl.LOCK_SH, READER_PATIENCE_S) as fd:
            try:
                yield fd is not None
            finally:
                if fd is not None:
                    # Removed by the last one on it only: none other reads, no worker.
                    with contextlib.suppress(BlockingIOError):
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        if _same_file(fd, self._path(request_id)):
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(self._path(request_id))

    def live(self, request_id: str) -> bool:
        """Whether a live worker holds ``request_id``'s lock now."""
        try:
            fd = os.open(self._path(request_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            # Shared and let go at once: a worker taking it meanwhile is
            # refused and looks again later, as for any live holder.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
