"""The event consumer (smr.bus.consume_events: the storage service's retention,
the watcher's outcomes) and the worker's fetch, against a real nats-server:
each runs until it is stopped, whatever NATS or its handler does meanwhile.
In `smr up` they are the node's tasks, and one that ends takes the node down
(exit 1, to be restarted): the fault campaign counts that as a node crash."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js.client import JetStreamContext
from nats.js.errors import APIError

from smr.aio import ended_why
from smr.bus import STREAM_EVENTS, STREAM_REQUESTS, Bus, BusConfig, consume_events, node_token
from smr.contract.messages import CkptDone
from smr.gpu import frozen
from smr.natsserver import NatsServer
from tests.test_bus import CountingStep, request, run_worker, stop

Handler = Callable[[CkptDone], Awaitable[None]]


def consume(bus: Bus, handle: Handler) -> tuple[asyncio.Event, asyncio.Task[None]]:
    """A consumer of ckpt.done events of its own (a durable no other test shares)."""
    stopping = asyncio.Event()
    task = asyncio.create_task(consume_events(
        bus, f"test-{uuid.uuid4().hex[:8]}", "ckpt.done", handle, service="test", stop=stopping,
        retry_s=0.2))
    return stopping, task


def done(node: str, rid: str) -> CkptDone:
    return CkptDone.for_request(request(node, rid), status="succeeded", generation=1)


def ours(rid: str, seen: list[str], then: Callable[[int], Awaitable[None]] | None = None
         ) -> Handler:
    """Records the deliveries of ``rid`` (the session's server holds other
    tests' events too); ``then(n)`` on the n-th."""
    async def handle(ev: CkptDone) -> None:
        if ev.request_id == rid:
            seen.append(rid)
            if then:
                await then(len(seen))
    return handle


async def until(cond: Callable[[], bool], task: asyncio.Task[Any], timeout: float) -> None:
    """Until ``cond`` holds (or ``task`` ended: the failure the tests look for)."""
    for _ in range(int(timeout / 0.05)):
        if cond() or task.done():
            return
        await asyncio.sleep(0.05)


def still_running(task: asyncio.Task[Any]) -> str:
    return f"it ended on its own: {ended_why(task)}" if task.done() else ""


async def test_a_handler_cancelled_from_inside_gets_its_event_again(bus: Bus,
                                                                     node: str) -> None:
    """A handler's call that a library gave up by raising CancelledError
    (not the consumer's own cancel) is a failed handling: the event comes
    again, and the consumer goes on. It ended the consumer before (its task
    cancelled), and with it the storage service of `smr up`."""
    rid = f"ev-{uuid.uuid4().hex[:8]}"
    seen: list[str] = []

    async def first_cancelled(n: int) -> None:
        if n == 1:
            raise asyncio.CancelledError  # as aiohttp or nats-py can hand one back

    stopping, task = consume(bus, ours(rid, seen, first_cancelled))
    await bus.publish(done(node, rid))
    await until(lambda: len(seen) >= 2, task, 20)
    assert not task.done(), still_running(task)
    assert seen == [rid, rid]
    stopping.set()
    await asyncio.wait_for(task, 10)


async def test_the_consumers_own_cancel_still_ends_it(bus: Bus, node: str) -> None:
    rid = f"ev-{uuid.uuid4().hex[:8]}"
    seen: list[str] = []

    async def hangs(n: int) -> None:
        await asyncio.sleep(60)

    _, task = consume(bus, ours(rid, seen, hangs))
    await bus.publish(done(node, rid))
    await until(lambda: bool(seen), task, 20)
    assert seen and not task.done()
    task.cancel()
    finished, _ = await asyncio.wait([task], timeout=5)
    assert task in finished and task.cancelled()


async def test_an_event_consumer_started_while_nats_is_away_consumes_once_it_is_back(
        tmp_path: Path, nats_server: NatsServer, bus_config: BusConfig, node: str) -> None:
    """The consumer is made as the loop starts: NATS away at that moment (a
    restart; the storage service of a node restarted with it, the watcher)
    is waited out, as every other NATS call of a service's start is. The
    creation's timeout ended the consumer before."""
    srv = NatsServer(nats_server.binary, tmp_path / "nats").start()
    assert srv.proc
    bus = await Bus.connect(srv.url, name="test", config=bus_config)
    # JetStream calls time out after 1 s here, not Bus.connect's 10 s: NATS
    # is away longer than that within a short test.
    bus.js = bus.nc.jetstream(timeout=1)
    rid = f"ev-{uuid.uuid4().hex[:8]}"
    seen: list[str] = []
    try:
        os.kill(srv.proc.pid, signal.SIGSTOP)  # away: its answers do not come
        # Every thread stopped (on a busy machine a running one takes a moment).
        for _ in range(200):
            if all(frozen.state(t) == "T" for t in frozen.threads(srv.proc.pid)):
                break
            await asyncio.sleep(0.01)
        stopping, task = consume(bus, ours(rid, seen))
        await asyncio.sleep(2.5)
        os.kill(srv.proc.pid, signal.SIGCONT)
        await bus.publish(done(node, rid))
        await until(lambda: bool(seen), task, 30)
        assert not task.done(), still_running(task)
        assert seen == [rid]
        stopping.set()
        await asyncio.wait_for(task, 10)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        await bus.close()
        srv.stop()


def fetch_fails_once(monkeypatch: pytest.MonkeyPatch, stream: str,
                     error: BaseException) -> list[int]:
    """The next pull fetch on ``stream`` raises ``error`` (what nats-py
    raises), the rest are real (others' too: a worker's dead-letter answerer
    fetches beside it); returns the count of fetches that raised."""
    real = JetStreamContext.PullSubscription.fetch
    raised: list[int] = []

    async def fetch(self: Any, *a: Any, **kw: Any) -> Any:
        if not raised and self._stream == stream:
            raised.append(1)
            raise error
        return await real(self, *a, **kw)

    monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", fetch)
    return raised


async def test_a_fetch_error_outside_the_transient_ones_is_retried(
        bus: Bus, node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """nats-py raises a bare APIError for a pull answered with a status it
    does not know: retried like NATS being away, not the consumer's end."""
    raised = fetch_fails_once(monkeypatch, STREAM_EVENTS,
                              APIError(code=400, description="injected"))
    rid = f"ev-{uuid.uuid4().hex[:8]}"
    seen: list[str] = []
    stopping, task = consume(bus, ours(rid, seen))
    await until(lambda: bool(raised), task, 10)
    await bus.publish(done(node, rid))
    await until(lambda: bool(seen), task, 20)
    assert raised and not task.done(), still_running(task)
    assert seen == [rid]
    stopping.set()
    await asyncio.wait_for(task, 10)


async def test_a_workers_fetch_cancelled_from_inside_is_retried(
        bus: Bus, node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull that nats-py gives up with CancelledError (not the worker's
    stop) is one more failed fetch: the worker goes on serving its node. It
    ended the worker before, and `smr up` with it."""
    step = CountingStep()
    w, task = await run_worker(bus, step, node)
    raised = fetch_fails_once(monkeypatch, STREAM_REQUESTS, asyncio.CancelledError())
    await until(lambda: bool(raised), task, 10)
    await bus.publish(request(node, f"after-{uuid.uuid4().hex[:8]}"))
    await until(lambda: bool(step.seen), task, 20)
    assert raised and not task.done(), still_running(task)
    assert len(step.seen) == 1
    await stop(w, task)


async def test_an_event_consumer_whose_durable_was_deleted_consumes_again(
        bus: Bus, node: str) -> None:
    """Its durable consumer gone (an operator's `nats consumer rm`, a stream
    made again): the events after that are still handled, or the loop ends
    (its node restarts and makes it again); never a loop that fetches from
    nothing for good while the events wait unseen."""
    first, second = f"ev-{uuid.uuid4().hex[:8]}", f"ev-{uuid.uuid4().hex[:8]}"
    seen: list[str] = []

    async def handle(ev: CkptDone) -> None:
        if ev.request_id in (first, second):
            seen.append(ev.request_id)

    durable = f"test-{uuid.uuid4().hex[:8]}"
    stopping = asyncio.Event()
    task = asyncio.create_task(consume_events(bus, durable, "ckpt.done", handle, service="test",
                                                  stop=stopping, retry_s=0.2))
    await bus.publish(done(node, first))
    await until(lambda: bool(seen), task, 20)
    assert seen == [first], still_running(task)
    await bus.js.delete_consumer(STREAM_EVENTS, durable)
    await bus.publish(done(node, second))
    await until(lambda: second in seen, task, 20)
    assert second in seen or task.done(), "deleted consumer: the loop fetches from nothing"
    stopping.set()
    await asyncio.wait([task], timeout=10)


async def test_a_worker_whose_consumer_was_deleted_serves_its_node_again(
        bus: Bus, node: str) -> None:
    """The same for a worker's request consumer: deleted, the node's
    requests were never fetched again while the worker ran on."""
    step = CountingStep()
    w, task = await run_worker(bus, step, node)
    await bus.publish(request(node, f"before-{uuid.uuid4().hex[:8]}"))
    await until(lambda: len(step.seen) == 1, task, 20)
    assert len(step.seen) == 1, still_running(task)
    await bus.js.delete_consumer(STREAM_REQUESTS, f"{step.kind.replace('.', '-')}-"
                                 f"{node_token(node)}")
    await bus.publish(request(node, f"after-{uuid.uuid4().hex[:8]}"))
    await until(lambda: len(step.seen) == 2, task, 20)
    assert len(step.seen) == 2 and not task.done(), still_running(task) or "never served"
    await stop(w, task)
