"""The data directory's lock, held by its one `smr up`, and how a command
finds that `smr up`. Light on purpose (no NATS, no services): `smr up` takes
the lock before its heavy imports, so a command started right after
`smr up &` finds it starting and waits, rather than calling it not running."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from smr.config import Settings
from smr.contract.errors import SmrError

STARTING_WAIT_S = 60.0  # a `smr up` that holds its data directory but has no URL yet
UP_POLL_S = 0.25  # how often a waiting command looks whether its `smr up` still runs
T = TypeVar("T")
LOOK_WAIT_S = 10.0  # commands looking at the lock, each for an instant, before `smr up` takes it


def url_file(settings: Settings) -> Path:
    """The embedded NATS's URL with its token: root-only, like the data dir."""
    return settings.data_path / "nats.url"


def lock_file(settings: Settings) -> Path:
    """Held by the one `smr up` of a data directory; says its PID and its nats-server's."""
    return settings.data_path / "up.lock"


def hold_data_dir(settings: Settings) -> tuple[int, str]:
    """An flock on the data directory's lock file for as long as this node
    runs: a second `smr up` there would start a second nats-server on the
    same JetStream directory and take over the first one's URL file. The
    kernel lets it go however this process ends. Returns the descriptor and
    what the last holder wrote (its nats-server may have outlived it)."""
    # Checkpoint images are copies of memory, and the URL file holds the
    # NATS token: the data dir is its owner's alone.
    settings.data_path.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.data_path, 0o700)
    path = lock_file(settings)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _lock_past_lookers(fd)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").split()
        os.close(fd)
        raise SmrError(
            f"smr up is already running on {settings.data_path} "
            f"(pid {holder[0] if holder else '?'})", code="already-running",
            hint="use that one (`smr ps`), or stop it first; for a second node on this "
            "machine give it its own SMR_DATA_DIR") from None
    except BaseException:
        os.close(fd)
        raise
    last = os.pread(fd, 256, 0).decode(errors="replace")
    write_holder(fd, f"{os.getpid()}\n")
    # A URL file now is a dead `smr up`'s (killed, or the machine rebooted):
    # gone, so that a command waits for this one's rather than calling that.
    url_file(settings).unlink(missing_ok=True)
    return fd, last


def _lock_past_lookers(fd: int) -> None:
    """The exclusive lock, or BlockingIOError where another `smr up` holds
    it. A command's look (holder()) holds a shared lock for an instant: that
    is no `smr up`, and is waited out rather than taken for one."""
    deadline = time.monotonic() + LOOK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            # A shared lock is granted only where no one holds it exclusively.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def write_holder(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def holder(settings: Settings) -> str | None:
    """The PID of the `smr up` that holds this data directory (starting or
    running; "?" before it wrote it), or None where none does."""
    try:
        fd = os.open(lock_file(settings), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        words = os.pread(fd, 256, 0).decode(errors="replace").split()
        return words[0] if words else "?"
    finally:
        os.close(fd)


async def url_of_running(settings: Settings) -> str:
    """The running `smr up`'s URL. One that is still starting (`smr up &`
    then a command at once) is waited for, saying so, for a bounded time.
    Where no `smr up` holds the data directory the command fails at once:
    waiting there would hang every command on a machine where none runs."""
    deadline = time.monotonic() + STARTING_WAIT_S
    said: str | None = None
    while True:
        pid = holder(settings)
        if pid is None:
            if said is not None:
                raise SmrError(f"smr up (pid {said}) stopped before it started serving",
                               code="not-running",
                               hint="its output says why; start it again with `smr up`")
            # No `smr up` here: a URL file left is a dead one's (only the
            # holder writes it), not worth ten seconds of reconnecting.
            return ""
        if url := _read(url_file(settings)):
            return url
        if said is None:
            said = pid
            print(f"smr up (pid {pid}) is starting on {settings.data_path}; waiting for it "
                  f"(at most {STARTING_WAIT_S:.0f}s)", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            raise SmrError(f"smr up (pid {pid}) holds {settings.data_path} but did not start "
                           f"serving within {STARTING_WAIT_S:.0f}s", code="not-running",
                           hint=f"its output says why; if it hangs, stop it (kill {pid}) and "
                           "run `smr up` again")
        await asyncio.sleep(0.1)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class UpStopped(Exception):
    """The `smr up` a command was talking to stopped (or another one took its
    data directory): its NATS went with it, on a port the next one does not
    reuse."""

    def __init__(self, pid: str) -> None:
        super().__init__(f"smr up (pid {pid}) stopped")
        self.pid = pid


async def while_up_holds(settings: Settings, work: Awaitable[T]) -> T:
    """``work``, or UpStopped as soon as the `smr up` that holds the data
    directory now no longer does. Without this a command waiting for a
    result reconnects to a dead port until its own timeout (15 minutes by
    default). Where none holds it (SMR_NATS_URL), plainly ``work``."""
    pid = None if settings.nats_url else holder(settings)
    task = asyncio.ensure_future(work)
    if pid is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=UP_POLL_S)
            if done:
                return task.result()
            if holder(settings) != pid:
                raise UpStopped(pid)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
