"""The storage service: answers queries, applies retention, collects garbage.

- ``storage.latest`` / ``storage.generations`` (NATS request/reply, queue
  group ``smr-storage``): a checkpoint_id's latest or every committed
  generation. A malformed query is answered with an error and dead-lettered.
- Retention on ``ckpt.done``: after each successful checkpoint, the
  generations of that checkpoint_id beyond SMR_KEEP_GENERATIONS or older than
  SMR_MAX_AGE are removed (never the latest).
- Every SMR_GC_INTERVAL: uploads and manifest-less generations older than
  SMR_GC_GRACE are removed (what crashed writers left).

Every handler is idempotent, so replicas can run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import nats
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.storage.layout import namespace_of
from services.storage.store import CheckpointStore, Generation
from smr import tracing
from smr.bus import QUERY_GENERATIONS, QUERY_LATEST, STREAM_EVENTS, Bus
from smr.errors import ContractError, SmrError
from smr.messages import CkptDone, StorageQuery, StorageReply

log = logging.getLogger("smr.storage")

SUMMARY_FIELDS = ("generation", "created_at", "size_bytes", "stored_bytes", "node",
                  "request_id", "reason", "gpu")


def summary(g: Generation) -> dict[str, Any]:
    out = {k: g.manifest[k] for k in SUMMARY_FIELDS if g.manifest.get(k) is not None}
    out["location"] = g.location
    return out


class StorageService:
    def __init__(self, bus: Bus, store: CheckpointStore, *, keep: int = 0,
                 max_age_s: float = 0, gc_grace_s: float = 3600,
                 gc_interval_s: float = 600, durable: str = "storage-retention") -> None:
        self.bus = bus
        self.durable = durable
        self.store = store
        self.keep = keep
        self.max_age_s = max_age_s
        self.gc_grace_s = gc_grace_s
        self.gc_interval_s = gc_interval_s
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        subs = [await self.bus.nc.subscribe(s, queue="smr-storage", cb=self._answer)
                for s in (QUERY_LATEST, QUERY_GENERATIONS)]
        durable = await self.bus.ensure_event_consumer(self.durable, "ckpt.done")
        events = await self.bus.js.pull_subscribe_bind(durable, STREAM_EVENTS)
        gc = asyncio.create_task(self._gc_loop())
        self.ready.set()
        try:
            while not self._stop.is_set():
                try:
                    msgs = await events.fetch(8, timeout=0.5)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                for m in msgs:
                    await self._retain(m)
        finally:
            gc.cancel()
            with contextlib.suppress(BaseException):
                await gc
            for sub in [*subs, events]:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _answer(self, m: Msg) -> None:
        with tracing.tracer.start_as_current_span(
            f"answer {m.subject}", context=tracing.extract(m.headers), kind=SpanKind.SERVER,
        ) as span:
            try:
                q = StorageQuery.from_payload(m.data)
                if m.subject == QUERY_LATEST:
                    latest = await self.store.latest(q.namespace, q.checkpoint_id)
                    gens = [latest] if latest else []
                else:
                    gens = await self.store.generations(q.namespace, q.checkpoint_id)
                reply = StorageReply(checkpoint_id=q.checkpoint_id, namespace=q.namespace,
                                     generations=[summary(g) for g in gens])
            except SmrError as e:
                span.set_status(Status(StatusCode.ERROR, e.message))
                if isinstance(e, ContractError):
                    await self.bus.dead_letter(m.subject, m.data, e, service="storage")
                reply = StorageReply(error=e.as_dict())
            except Exception as e:  # the asker gets an answer, not a timeout
                log.exception("storage query on %s failed", m.subject)
                reply = StorageReply(error={"code": "storage-error", "message": repr(e)})
            if m.reply:
                await m.respond(reply.to_payload())

    async def _retain(self, m: Msg) -> None:
        with tracing.tracer.start_as_current_span(
            "retention", context=tracing.extract(m.headers), kind=SpanKind.CONSUMER,
        ) as span:
            try:
                done = CkptDone.from_payload(m.data)
            except ContractError as e:
                await self.bus.dead_letter(m.subject, m.data, e, service="storage")
                await m.term()
                return
            if done.status != "succeeded" or not (self.keep or self.max_age_s):
                await m.ack()
                return
            ns = namespace_of(done.target)
            try:
                removed = await self.store.prune(ns, done.checkpoint_id, keep=self.keep,
                                                 max_age_s=self.max_age_s)
            except SmrError as e:
                span.set_status(Status(StatusCode.ERROR, e.message))
                log.warning("retention of %s failed, will retry: %s", done.checkpoint_id, e)
                await m.nak(delay=5)
                return
            if removed:
                log.info("retention: removed generations %s of %s/%s", removed, ns,
                         done.checkpoint_id)
            span.set_attribute("smr.removed", len(removed))
            await m.ack()

    async def _gc_loop(self) -> None:
        while True:
            with tracing.tracer.start_as_current_span("gc"):
                try:
                    await self.store.gc(grace_s=self.gc_grace_s)
                except SmrError as e:
                    log.warning("garbage collection failed, will retry: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.gc_interval_s)
                return
