"""Events consumed: each ckpt.done or restore.done handed, validated, to a
service's handler (the watcher's outcomes, the storage service's
retention); requests are consumed by the worker (smr/bus/worker.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from opentelemetry.trace import SpanKind, Status, StatusCode

from smr import tracing
from smr.aio import cancelling, quietly
from smr.bus.client import Bus
from smr.bus.topology import STREAM_EVENTS, SUBJECT_TYPES
from smr.contract.errors import ContractError
from smr.retry import retry_nats

log = logging.getLogger("smr.bus")

FETCH_RETRY_S = 0.5  # after a fetch failed for another reason than "nothing new"


async def consume_events(bus: Bus, durable: str, kind: str,
                         handle: Callable[[Any], Awaitable[None]], *, service: str,
                         stop: asyncio.Event, retry_s: float = 5.0) -> None:
    """Hand each ``kind`` event (validated) to ``handle`` until ``stop``.

    A malformed event is dead-lettered and dropped; one whose handler
    raises is redelivered after ``retry_s``. Replicas sharing ``durable``
    share the work. Only ``stop``, this task's own cancel, or a connection
    closed for good end it: it is a service's loop (in `smr up`, the
    storage service's), and a service whose loop ended serves no more."""
    # NATS may be restarting as this starts (as a node is restarted with it).
    async for attempt in retry_nats():
        with attempt:
            name = await bus.ensure_event_consumer(durable, kind)
    sub = await bus.js.pull_subscribe_bind(name, STREAM_EVENTS)
    cls = SUBJECT_TYPES[kind]
    try:
        failing = 0
        while not stop.is_set():
            try:
                msgs = await sub.fetch(16, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                if cancelling():  # nats-py can hand a cancel back so (see smr.aio)
                    raise
                continue
            except (Exception, asyncio.CancelledError) as e:
                if cancelling() or bus.nc.is_closed:
                    raise
                # A NATS server lost: its stream or consumer elects a new
                # leader (503), or the client reconnects; or what else
                # nats-py raises for a pull (an APIError for a status it
                # does not know, a cancel it hands back). The events wait.
                failing += 1
                if failing == 1:
                    log.warning("%s: fetching %s events failed (%s: %s); retrying",
                                service, kind, type(e).__name__, e)
                await asyncio.sleep(FETCH_RETRY_S)
                # Or its consumer is gone (deleted, its stream made
                # again): every fetch fails until it is made again.
                await quietly(bus.ensure_event_consumer(durable, kind))
                continue
            failing = 0
            for m in msgs:
                await _consume_event(bus, m, kind, cls, handle, service=service,
                                     retry_s=retry_s)
    finally:
        await quietly(sub.unsubscribe())

async def _consume_event(bus: Bus, m: Any, kind: str, cls: Any,
                         handle: Callable[[Any], Awaitable[None]], *, service: str,
                         retry_s: float) -> None:
    """One event: nothing but this task's own cancel escapes it, so the
    loop goes on. A handling that failed, or whose ack NATS lost, comes again."""
    with tracing.tracer.start_as_current_span(
        f"consume {kind}", context=tracing.extract(m.headers),
        kind=SpanKind.CONSUMER, attributes={"smr.service": service},
    ) as span:
        try:
            try:
                event = cls.from_payload(m.data)
            except ContractError as e:
                await bus.dead_letter(m.subject, m.data, e, service=service)
                await m.term()
                return
            await handle(event)
            await m.ack()
        except asyncio.CancelledError:
            if cancelling():
                raise
            # Not this loop's cancel: a library gave up a call that way
            # (aiohttp, nats-py). A failure like any other.
            span.set_status(Status(StatusCode.ERROR, "cancelled from inside"))
            log.warning("%s: handling %s was cancelled from inside, will retry",
                        service, m.subject)
            await quietly(m.nak(delay=retry_s))
        except Exception as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            log.warning("%s: handling %s failed, will retry: %s", service, m.subject, e)
            await quietly(m.nak(delay=retry_s))
