"""The storage service: answers queries, applies retention, collects garbage.

- ``storage.latest.<ns>`` / ``storage.generations.<ns>`` (NATS request/reply, queue
  group ``smr-storage``): a checkpoint_id's latest or every committed
  generation. A malformed query is answered with an error and dead-lettered.
- Retention on ``ckpt.done``: after each successful checkpoint, the
  generations of that checkpoint_id beyond SMR_KEEP_GENERATIONS or older than
  SMR_MAX_AGE are removed (never the latest).
- ``storage.checkpoints[.<ns>]``: the latest generation of every stored checkpoint
  (``smr status`` shows them).
- Every SMR_GC_INTERVAL: uploads and manifest-less generations older than
  SMR_GC_GRACE are removed (what crashed writers left).
- Every SCAN_INTERVAL_S: the metrics of what is stored (bytes, generations,
  each checkpoint's newest commit time) are read from storage itself; with a
  ``mirror`` (on Kubernetes), the Checkpoint resources are brought up to
  date from the same reading (services/storage/mirror.py).

Every handler is idempotent, so replicas can run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.storage.generation import Generation, created_epoch
from services.storage.layout import LOCAL_NAMESPACE, namespace_of
from services.storage.mirror import Mirror
from services.storage.store import CheckpointStore
from smr import metrics, tracing
from smr.aio import wait_event
from smr.bus import (
    QUERY_CHECKPOINTS,
    QUERY_GENERATIONS,
    QUERY_LATEST,
    Bus,
    consume_events,
    query_subject,
)
from smr.contract.errors import ContractError, SmrError
from smr.contract.messages import CkptDone, StorageQuery, StorageReply
from smr.retry import retry_nats

log = logging.getLogger("smr.storage")

SCAN_INTERVAL_S = 60.0  # how fresh the stored-bytes and latest-checkpoint metrics are
SCAN_SETTLE_S = 1.0

SUMMARY_FIELDS = ("generation", "created_at", "size_bytes", "stored_bytes", "node",
                  "request_id", "reason", "gpu", "traceparent")


def summary(g: Generation) -> dict[str, Any]:
    out = {k: g.manifest[k] for k in SUMMARY_FIELDS if g.manifest.get(k) is not None}
    out["location"] = g.location
    return out


class StorageService:
    def __init__(self, bus: Bus, store: CheckpointStore, *, keep: int = 0,
                 max_age_s: float = 0, gc_grace_s: float = 3600,
                 gc_interval_s: float = 600, durable: str = "storage-retention",
                 scan_interval_s: float = SCAN_INTERVAL_S, mirror: Mirror | None = None) -> None:
        self.bus = bus
        self.mirror = mirror
        self.durable = durable
        self.store = store
        self.keep = keep
        self.max_age_s = max_age_s
        self.gc_grace_s = gc_grace_s
        self.gc_interval_s = gc_interval_s
        self.scan_interval_s = scan_interval_s
        self._reported: set[tuple[str, str]] = set()
        self._rescan = asyncio.Event()  # a checkpoint finished: storage changed
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()
        self._rescan.set()

    async def run(self) -> None:
        # storage.<what>.<ns> (a tenant's user may ask of its namespace only),
        # and storage.checkpoints alone: every namespace's (admin).
        subs = [await self.bus.nc.subscribe(s, queue="smr-storage", cb=self._answer)
                for s in (f"{QUERY_LATEST}.*", f"{QUERY_GENERATIONS}.*",
                          f"{QUERY_CHECKPOINTS}.*", QUERY_CHECKPOINTS)]
        async for attempt in retry_nats():  # NATS may be restarting as this starts
            with attempt:
                await self.bus.ensure_event_consumer(self.durable, "ckpt.done")
        loops = [asyncio.create_task(self._gc_loop()), asyncio.create_task(self._scan_loop())]
        self.ready.set()
        try:
            await consume_events(self.bus, self.durable, "ckpt.done", self._retain,
                                 service="storage", stop=self._stop)
        finally:
            for loop in loops:
                loop.cancel()
                with contextlib.suppress(BaseException):
                    await loop
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _answer(self, m: Msg) -> None:
        with tracing.tracer.start_as_current_span(
            f"answer {m.subject}", context=tracing.extract(m.headers), kind=SpanKind.SERVER,
        ) as span:
            try:
                q = StorageQuery.from_payload(m.data)
                what = ".".join(m.subject.split(".")[:2])
                if query_subject(what, q.namespace) != m.subject:
                    # The subject's namespace is what NATS permitted: the
                    # query must not name another one.
                    raise ContractError(
                        f"a query of namespace {q.namespace or LOCAL_NAMESPACE!r} arrived "
                        f"on {m.subject}", code="wrong-namespace",
                        hint=f"ask on {query_subject(what, q.namespace)}")
                if what == QUERY_CHECKPOINTS:
                    reply = StorageReply(namespace=q.namespace, generations=[
                        {**summary(gens[-1]), "checkpoint_id": ckpt, "namespace": ns,
                         "stored_generations": len(gens)}
                        for (ns, ckpt), gens in (await self.store.inventory()).items()
                        if q.namespace in (None, ns)])
                else:
                    if q.checkpoint_id is None:
                        raise ContractError(f"{m.subject} needs a checkpoint_id",
                                            code="invalid-message",
                                            hint="storage.checkpoints lists them all")
                    ns = q.namespace or LOCAL_NAMESPACE
                    if what == QUERY_LATEST:
                        latest = await self.store.latest(ns, q.checkpoint_id)
                        gens = [latest] if latest else []
                    else:
                        gens = await self.store.generations(ns, q.checkpoint_id)
                    reply = StorageReply(checkpoint_id=q.checkpoint_id, namespace=ns,
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
        self._rescan.set()
        if done.status != "succeeded" or not (self.keep or self.max_age_s):
            return
        ns = namespace_of(done.target)
        removed = await self.store.prune(ns, done.checkpoint_id, keep=self.keep,
                                         max_age_s=self.max_age_s)
        if removed:
            metrics.GC_ACTIONS.labels("generation_retired").inc(len(removed))
            log.info("retention: removed generations %s of %s/%s", removed, ns,
                     done.checkpoint_id)
        trace.get_current_span().set_attribute("smr.removed", len(removed))

    async def _gc_loop(self) -> None:
        while True:
            with tracing.tracer.start_as_current_span("gc"):
                try:
                    report = await self.store.gc(grace_s=self.gc_grace_s)
                    metrics.GC_ACTIONS.labels("upload_aborted").inc(report.uploads_aborted)
                    metrics.GC_ACTIONS.labels("generation_removed").inc(
                        len(report.generations_removed))
                except SmrError as e:
                    log.warning("garbage collection failed, will retry: %s", e)
                except Exception:  # a bug must not end GC for the service's life
                    log.exception("garbage collection failed unexpectedly, will retry")
            if await wait_event(self._stop, self.gc_interval_s):
                return

    async def _scan_loop(self) -> None:
        while True:
            try:
                every = await self.scan()
                if self.mirror is not None:
                    await self.mirror.sync(every)
            except SmrError as e:
                log.warning("reading storage for metrics failed, will retry: %s", e)
            except ApiException as e:
                log.warning("the Checkpoint resources could not be brought up to date, will "
                            "retry: %s %s", e.status, e.reason)
            except Exception:  # a bug must not freeze the metrics for good
                log.exception("reading storage for metrics failed unexpectedly, will retry")
            await wait_event(self._rescan, self.scan_interval_s)
            if self._stop.is_set():
                return
            self._rescan.clear()
            await asyncio.sleep(SCAN_SETTLE_S)  # one scan for a burst of checkpoints

    async def scan(self) -> dict[tuple[str, str], list[Generation]]:
        """Set the storage metrics from what storage holds now, and return it."""
        every = await self.store.inventory()
        metrics.STORED_BYTES.set(sum(g.manifest.get("stored_bytes", g.size_bytes)
                                     for gens in every.values() for g in gens))
        metrics.STORED_GENERATIONS.set(sum(len(gens) for gens in every.values()))
        for ns, ckpt in self._reported - every.keys():
            with contextlib.suppress(KeyError):  # deleted: no longer a workload to alert on
                metrics.LATEST.remove(ns, ckpt)
        for (ns, ckpt), gens in every.items():
            metrics.LATEST.labels(ns, ckpt).set(created_epoch(gens[-1]))
        self._reported = set(every)
        return every
