"""asyncio helpers that service loops share."""

from __future__ import annotations

import asyncio
import io
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for ``event`` up to ``timeout`` seconds; True if it is set.

    The loops of smr's services sleep with this, not with ``wait_for`` inside
    ``suppress(TimeoutError)``: on Python 3.11 a cancellation that arrives as
    the timeout fires can come out of ``wait_for`` as TimeoutError, and such a
    loop then never ends (a watcher's shutdown hung on it)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


def cancelling() -> bool:
    """Is the current task being cancelled? A loop that runs until cancelled
    and catches broad errors checks this: nats-py (github.com/nats-io/nats.py/issues/373) and
    aiohttp can hand a cancellation back as a TimeoutError, and the loop would
    take it for an ordinary failure and go on forever."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def quietly(aw: Awaitable[Any]) -> None:
    """Await a clean-up (an unsubscribe, a nak) whose failure must not hide
    the error or the stop already under way.

    The caller's own cancellation is never swallowed: a loop of quiet calls
    (a keepalive) whose cancel arrived inside one would otherwise run on for
    ever, and whoever awaits its end with it (the fault campaign found a
    worker that stopped serving its node that way when NATS restarted)."""
    try:
        await aw
    except asyncio.CancelledError:
        if cancelling():
            raise
    except Exception:
        pass


async def stop_task(task: asyncio.Future[Any], *, again_every: float | None = None) -> None:
    """Cancel ``task`` and wait until it has ended, whatever its outcome.

    ``again_every``: cancel again at that interval until it ends, for loops
    with nothing to clean up (keepalives, pollers). nats-py drops a
    cancellation that arrives while a publish waits on the connection
    (``_flush_pending``); a keepalive that lost its cancel so beat on while
    its worker waited for it for ever (found by the fault campaign). A step's
    task is cancelled once: a second cancel could cut its clean-up short."""
    task.cancel()
    while not task.done():
        await asyncio.wait([task], timeout=again_every)
        task.cancel()
    if not task.cancelled():
        task.exception()  # read: an error of a task being stopped is not news


def dump_tasks_on_signal(sig: int = signal.SIGUSR1) -> None:
    """``kill -USR1`` logs where every task of the running loop waits: how to
    see what a step that does not end is stuck on, without stopping it."""
    loop = asyncio.get_running_loop()

    def dump() -> None:
        out = io.StringIO()
        tasks = asyncio.all_tasks(loop)
        for task in sorted(tasks, key=lambda t: t.get_name()):
            task.print_stack(limit=12, file=out)
        logging.getLogger("smr").warning("%d tasks on SIGUSR1:\n%s", len(tasks), out.getvalue())

    loop.add_signal_handler(sig, dump)


async def until_stopped(stop: asyncio.Event, tasks: list[asyncio.Task[Any]]
                        ) -> asyncio.Task[Any] | None:
    """Wait for ``stop``; or for one of ``tasks``, which should run until then,
    to end on its own: that task is returned (None once stopped). A worker that
    died would otherwise leave its process up and its node unserved."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if stopping in done:
        return None
    return next(iter(done))


def ended_why(task: asyncio.Task[Any]) -> str:
    """How a task that should not have ended did: its error, or how it ended."""
    if task.cancelled():
        return "cancelled"
    e = task.exception()
    return f"{type(e).__name__}: {e}" if e else "returned"


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, as asyncio.to_thread, except that a
    cancel waits for the thread to end before it is raised: a thread cannot
    be stopped, and a write it makes must never land after its caller has
    given up (and, say, written the same name again on a retry)."""
    running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise
