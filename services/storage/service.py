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

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.storage.layout import namespace_of
from services.storage.store import CheckpointStore, Generation
from smr import tracing
from smr.aio import wait_event
from smr.bus import QUERY_GENERATIONS, QUERY_LATEST, Bus
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
        await self.bus.ensure_event_consumer(self.durable, "ckpt.done")
        gc = asyncio.create_task(self._gc_loop())
        self.ready.set()
        try:
            await self.bus.consume_events(self.durable, "ckpt.done", self._retain,
                                          service="storage", stop=self._stop)
        finally:
            gc.cancel()
            with contextlib.suppress(BaseException):
                await gc
            for sub in subs:
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

    async def _retain(self, done: CkptDone) -> None:
        """Retention after a checkpoint; raising makes the event come again."""
        if done.status != "succeeded" or not (self.keep or self.max_age_s):
            return
        ns = namespace_of(done.target)
        removed = await self.store.prune(ns, done.checkpoint_id, keep=self.keep,
                                         max_age_s=self.max_age_s)
        if removed:
            log.info("retention: removed generations %s of %s/%s", removed, ns,
                     done.checkpoint_id)
        trace.get_current_span().set_attribute("smr.removed", len(removed))

    async def _gc_loop(self) -> None:
        while True:
            with tracing.tracer.start_as_current_span("gc"):
                try:
                    await self.store.gc(grace_s=self.gc_grace_s)
                except SmrError as e:
                    log.warning("garbage collection failed, will retry: %s", e)
            if await wait_event(self._stop, self.gc_interval_s):
                return
