"""The JetStream bus: subjects, streams, consumers, KV buckets, and the worker
loop that turns a request into exactly one executed step.

Subjects (``<node>`` is ``node_token(node)``)::

    ckpt.requested.<node>      restore.requested.<node>     stream SMR_REQUESTS
    ckpt.done.<node>           restore.done.<node>          stream SMR_EVENTS
    node.draining.<node>                                    stream SMR_EVENTS
    dlq.<original subject>                                  stream SMR_DLQ
    $JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.SMR_REQUESTS.* stream SMR_EXHAUSTED

Requests are published with ``Nats-Msg-Id = request_id``, so JetStream drops a
duplicate within the dedupe window. Each node has one durable pull consumer per
request kind. The step-state KV bucket (``request_id`` → state) makes a step
run at most once: a redelivered request whose state is ``done`` republishes the
stored result; one whose state is ``running`` with a stale heartbeat (its worker
died) is handed to the step's ``recover``, which decides from the world whether
the step finished, failed, or can safely run again.

A request whose worker died on its last delivery would vanish: JetStream only
announces it with a core-NATS advisory. Those advisories are kept in a stream
of their own, and each worker answers its consumer's with a failed result and a
dead letter, even when it starts after the fact.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import nats
import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from smr import tracing
from smr.config import Settings
from smr.errors import ContractError, SmrError, StepError, TemporaryError
from smr.messages import (
    CkptDone,
    CkptRequested,
    DeadLetter,
    Message,
    NodeDraining,
    RestoreDone,
    RestoreRequested,
    StorageQuery,
    StorageReply,
)
from smr.retry import retry_nats

log = logging.getLogger("smr.bus")

STREAM_REQUESTS = "SMR_REQUESTS"
STREAM_EVENTS = "SMR_EVENTS"
STREAM_DLQ = "SMR_DLQ"
STREAM_EXHAUSTED = "SMR_EXHAUSTED"
EXHAUSTED_PREFIX = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{STREAM_REQUESTS}"
QUERY_LATEST = "storage.latest"  # core NATS request/reply, see schemas/storage.query.json
QUERY_GENERATIONS = "storage.generations"
KV_STEPS = "smr-steps"
KV_JOBS = "smr-jobs"
KV_LOCKS = "smr-locks"
KV_EPISODES = "smr-episodes"  # watcher: node drain episodes (node → episode id)
KV_BEATS = "smr-beats"  # watcher: the heartbeat schedule (pod uid → next beat)

# The message class of each subject's first two tokens.
SUBJECT_TYPES: dict[str, type[Message]] = {
    "ckpt.requested": CkptRequested,
    "restore.requested": RestoreRequested,
    "ckpt.done": CkptDone,
    "restore.done": RestoreDone,
    "node.draining": NodeDraining,
}
RESULT_OF: dict[str, type[CkptDone] | type[RestoreDone]] = {
    "ckpt.requested": CkptDone,
    "restore.requested": RestoreDone,
}

MAX_DLQ_PAYLOAD = 64 * 1024
DAY = 86400.0


def node_token(node: str) -> str:
    """A node name as one subject token (Kubernetes names may hold dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", node)


def subject(kind: str, node: str) -> str:
    if kind not in SUBJECT_TYPES:
        raise KeyError(f"unknown subject kind {kind!r}")
    return f"{kind}.{node_token(node)}"


def kind_of(subj: str) -> str:
    return ".".join(subj.split(".")[:2])


@dataclass
class BusConfig:
    max_deliver: int = 5
    ack_wait: float = 30.0
    dedupe_window: float = 3600.0
    nak_base_delay: float = 1.0
    nak_max_delay: float = 30.0
    credentials: str = ""  # a NATS .creds file (JWT + nkey)

    @classmethod
    def from_settings(cls, s: Settings) -> BusConfig:
        return cls(max_deliver=s.max_deliver, ack_wait=s.ack_wait, dedupe_window=s.dedupe_window,
                   credentials=s.nats_creds)

    @property
    def keepalive(self) -> float:
        """How often a running step says it is alive (in_progress + KV heartbeat)."""
        return max(0.2, min(self.ack_wait / 3, 2.0))

    @property
    def stale_after(self) -> float:
        """A running state whose heartbeat is older than this has lost its worker.
        Heartbeats go out with in_progress, so a redelivery (ack wait expired)
        finds one at least ack_wait old; a live worker's is under 2 keepalives."""
        return max(2 * self.keepalive, 0.8 * self.ack_wait)


class Bus:
    """One NATS connection and everything smr does over it."""

    def __init__(self, nc: NATS, js: JetStreamContext, config: BusConfig) -> None:
        self.nc = nc
        self.js = js
        self.config = config
        self._kv: dict[str, KeyValue] = {}

    @classmethod
    async def connect(cls, url: str, *, name: str = "smr", config: BusConfig | None = None) -> Bus:
        config = config or BusConfig()
        async for attempt in retry_nats():
            with attempt:
                nc = await nats.connect(
                    url, name=name, connect_timeout=2, max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5, allow_reconnect=True,
                    user_credentials=config.credentials or None,
                )
        bus = cls(nc, nc.jetstream(timeout=10), config)
        await bus.ensure()
        return bus

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    # -- topology -----------------------------------------------------------------

    async def ensure(self) -> None:
        """Create or update the streams and KV buckets; safe to call from every service."""
        streams = (
            js_api.StreamConfig(
                name=STREAM_REQUESTS, subjects=["ckpt.requested.*", "restore.requested.*"],
                duplicate_window=self.config.dedupe_window, max_age=7 * DAY,
                storage=js_api.StorageType.FILE,
            ),
            js_api.StreamConfig(
                name=STREAM_EVENTS,
                subjects=["ckpt.done.*", "restore.done.*", "node.draining.*"],
                duplicate_window=self.config.dedupe_window, max_age=7 * DAY,
                storage=js_api.StorageType.FILE,
            ),
            js_api.StreamConfig(
                name=STREAM_DLQ, subjects=["dlq.>"], max_age=30 * DAY,
                storage=js_api.StorageType.FILE,
            ),
            js_api.StreamConfig(
                name=STREAM_EXHAUSTED, subjects=[f"{EXHAUSTED_PREFIX}.*"], max_age=7 * DAY,
                storage=js_api.StorageType.FILE,
            ),
        )
        for cfg in streams:
            await self._ensure_stream(cfg)
        for bucket, history in ((KV_STEPS, 1), (KV_JOBS, 5), (KV_LOCKS, 1), (KV_EPISODES, 1),
                                (KV_BEATS, 1)):
            if bucket not in self._kv:
                self._kv[bucket] = await self.js.create_key_value(
                    js_api.KeyValueConfig(bucket=bucket, history=history,
                                          storage=js_api.StorageType.FILE)
                )

    async def _ensure_stream(self, cfg: js_api.StreamConfig) -> None:
        try:
            info = await self.js.stream_info(cfg.name or "")
        except NotFoundError:
            await self.js.add_stream(cfg)
            return
        have = info.config
        if (sorted(have.subjects or []) != sorted(cfg.subjects or [])
                or have.duplicate_window != cfg.duplicate_window
                or have.max_age != cfg.max_age):
            await self.js.update_stream(cfg)

    async def ensure_consumer(self, kind: str, node: str) -> str:
        """The durable consumer of ``kind`` requests for ``node``; returns its name."""
        name = f"{kind.replace('.', '-')}-{node_token(node)}"
        await self.js.add_consumer(
            STREAM_REQUESTS,
            js_api.ConsumerConfig(
                name=name, durable_name=name, filter_subject=subject(kind, node),
                ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
                ack_wait=self.config.ack_wait, max_deliver=self.config.max_deliver,
                # One step at a time per node and kind: a node is not dumped twice at once.
                max_ack_pending=1,
            ),
        )
        return name

    async def ensure_exhausted_consumer(self, consumer: str) -> str:
        """A durable consumer of the max-deliveries advisories of ``consumer``."""
        name = f"exhausted-{consumer}"
        await self.js.add_consumer(
            STREAM_EXHAUSTED,
            js_api.ConsumerConfig(
                name=name, durable_name=name, filter_subject=f"{EXHAUSTED_PREFIX}.{consumer}",
                ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
                ack_wait=self.config.ack_wait, max_deliver=-1,
            ),
        )
        return name

    async def ensure_event_consumer(self, name: str, kind: str) -> str:
        """A durable consumer of ``kind`` events of every node, shared by a
        service's replicas (each event goes to one of them)."""
        await self.js.add_consumer(
            STREAM_EVENTS,
            js_api.ConsumerConfig(
                name=name, durable_name=name, filter_subject=f"{kind}.*",
                ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
                ack_wait=self.config.ack_wait, max_deliver=self.config.max_deliver,
            ),
        )
        return name

    async def consume_events(self, durable: str, kind: str,
                             handle: Callable[[Any], Awaitable[None]], *, service: str,
                             stop: asyncio.Event, retry_s: float = 5.0) -> None:
        """Hand each ``kind`` event (validated) to ``handle`` until ``stop``.

        A malformed event is dead-lettered and dropped; one whose handler
        raises is redelivered after ``retry_s``. Replicas sharing ``durable``
        share the work."""
        name = await self.ensure_event_consumer(durable, kind)
        sub = await self.js.pull_subscribe_bind(name, STREAM_EVENTS)
        cls = SUBJECT_TYPES[kind]
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(16, timeout=0.5)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                for m in msgs:
                    with tracing.tracer.start_as_current_span(
                        f"consume {kind}", context=tracing.extract(m.headers),
                        kind=SpanKind.CONSUMER, attributes={"smr.service": service},
                    ) as span:
                        try:
                            event = cls.from_payload(m.data)
                        except ContractError as e:
                            await self.dead_letter(m.subject, m.data, e, service=service)
                            await m.term()
                            continue
                        try:
                            await handle(event)
                        except Exception as e:
                            span.set_status(Status(StatusCode.ERROR, str(e)))
                            log.warning("%s: handling %s failed, will retry: %s", service,
                                        m.subject, e)
                            await _quietly(m.nak(delay=retry_s))
                            continue
                        await m.ack()
        finally:
            await _quietly(sub.unsubscribe())

    async def query(self, what: str, query: StorageQuery, *, timeout: float = 10.0
                    ) -> StorageReply:
        """Ask the storage service (``QUERY_LATEST`` or ``QUERY_GENERATIONS``)."""
        hdrs = tracing.inject({})
        try:
            r = await self.nc.request(what, query.to_payload(), timeout=timeout, headers=hdrs)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            raise TemporaryError(f"no storage service answered {what}", code="storage-down",
                                 hint="start the storage service (`smr up` runs one)") from None
        return StorageReply.from_payload(r.data)

    def kv(self, bucket: str) -> KeyValue:
        return self._kv[bucket]

    # -- publishing ---------------------------------------------------------------

    async def publish(self, msg: Message, subj: str | None = None) -> js_api.PubAck:
        """Validate and publish; ``Nats-Msg-Id`` makes a repeat a no-op."""
        if subj is None:
            kind = next(k for k, t in SUBJECT_TYPES.items() if type(msg) is t)
            subj = subject(kind, msg.node)  # type: ignore[attr-defined]
        payload = msg.to_payload()
        msg_id = msg.request_id  # type: ignore[attr-defined]
        if isinstance(msg, CkptDone | RestoreDone):
            msg_id = f"{msg_id}.{msg.SCHEMA}"
        return await self.publish_raw(subj, payload, msg_id=msg_id)

    async def publish_raw(self, subj: str, payload: bytes, *, msg_id: str | None = None,
                          headers: dict[str, str] | None = None) -> js_api.PubAck:
        hdrs = dict(headers or {})
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        with tracing.tracer.start_as_current_span(
            f"publish {kind_of(subj)}", kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subj},
        ):
            tracing.inject(hdrs)
            async for attempt in retry_nats():
                with attempt:
                    return await self.js.publish(subj, payload, headers=hdrs)
        raise AssertionError("unreachable")

    async def dead_letter(self, subj: str, payload: bytes, error: SmrError, *, service: str,
                          deliveries: int | None = None, request_id: str | None = None) -> None:
        letter = DeadLetter(
            subject=subj, error=error.as_dict(), service=service, deliveries=deliveries,
            payload=payload[:MAX_DLQ_PAYLOAD].decode("utf-8", errors="replace"),
            request_id=request_id,
        )
        log.warning("dead-lettered a message on %s: %s", subj, error.message)
        await self.publish_raw(f"dlq.{subj}", letter.to_payload())

    # -- step state -----------------------------------------------------------------

    async def step_state(self, request_id: str) -> tuple[dict[str, Any] | None, int]:
        try:
            e = await self.kv(KV_STEPS).get(request_id)
        except KeyNotFoundError:
            return None, 0
        if not e.value:  # deleted: the step may run again
            return None, e.revision or 0
        return orjson.loads(e.value), e.revision or 0

    async def request(self, req: CkptRequested | RestoreRequested, *,
                      timeout: float | None = None) -> CkptDone | RestoreDone:
        """Publish a request and wait for its result."""
        await self.publish(req)
        return await self.wait_result(req.request_id, req.SCHEMA, timeout=timeout)

    async def wait_result(
        self, request_id: str, kind: str, *, timeout: float | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> CkptDone | RestoreDone:
        """Wait until the step of ``request_id`` has a result (CLI, tests)."""
        watcher = await self.kv(KV_STEPS).watch(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no result for request {request_id} within {timeout}s")
                try:
                    e = await watcher.updates(timeout=min(left or 1.0, 1.0))
                except nats.errors.TimeoutError:
                    continue
                if e is None or not e.value:
                    continue
                st = orjson.loads(e.value)
                if st.get("state") in ("done", "failed"):
                    return RESULT_OF[kind].from_dict(st["result"])
                if on_progress:
                    on_progress(st)
        finally:
            await watcher.stop()


# -- the worker ---------------------------------------------------------------------

Req = TypeVar("Req", CkptRequested, RestoreRequested)
Res = TypeVar("Res", CkptDone, RestoreDone)


@dataclass
class Progress:
    """What a running step reports; written to its KV state at each keepalive."""

    phase: str = "starting"
    done_bytes: int = 0
    total_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def update(self, phase: str | None = None, *, done_bytes: int | None = None,
               total_bytes: int | None = None, **extra: Any) -> None:
        if phase:
            self.phase = phase
        if done_bytes is not None:
            self.done_bytes = done_bytes
        if total_bytes is not None:
            self.total_bytes = total_bytes
        self.extra.update(extra)


class Step(Protocol, Generic[Req, Res]):
    """A checkpoint or restore step, as the worker runs it."""

    kind: str  # "ckpt.requested" or "restore.requested"

    async def run(self, req: Req, progress: Progress) -> Res: ...

    async def recover(self, req: Req, state: dict[str, Any]) -> Res | None:
        """An earlier attempt died mid-step. Return its result if the world shows
        one (finished, or failed for good); None if running the step again is safe."""
        ...


class Worker:
    """Runs one step kind for one node: fetch, validate, dedupe, run, answer."""

    def __init__(self, bus: Bus, step: Step[Any, Any], node: str, *, service: str) -> None:
        self.bus = bus
        self.step = step
        self.node = node
        self.service = service
        self.owner = f"{service}@{node}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._stop = asyncio.Event()
        self.idle = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        durable = await self.bus.ensure_consumer(self.step.kind, self.node)
        psub = await self.bus.js.pull_subscribe_bind(durable, STREAM_REQUESTS)
        exhausted = await self.bus.js.pull_subscribe_bind(
            await self.bus.ensure_exhausted_consumer(durable), STREAM_EXHAUSTED)
        log.info("%s consuming %s", self.service, subject(self.step.kind, self.node))
        answering = asyncio.create_task(self._answer_exhausted(exhausted))
        try:
            while not self._stop.is_set():
                self.idle.set()
                try:
                    msgs = await psub.fetch(1, timeout=0.5)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                self.idle.clear()
                for m in msgs:
                    try:
                        await self.handle(m)
                    except Exception:
                        # Nothing escapes one message: the loop keeps serving the node.
                        log.exception("%s: unexpected error on %s", self.service, m.subject)
                        await _quietly(m.nak(delay=self.bus.config.nak_base_delay))
        finally:
            answering.cancel()
            await _quietly(answering)
            await _quietly(psub.unsubscribe())
            await _quietly(exhausted.unsubscribe())

    async def _answer_exhausted(self, sub: Any) -> None:
        """Answer the requests JetStream gave up on (worker died on the last delivery)."""
        while True:
            try:
                advisories = await sub.fetch(8, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for adv in advisories:
                try:
                    await self._answer_one_exhausted(adv)
                except Exception:
                    log.exception("%s: cannot answer an exhausted request", self.service)

    async def _answer_one_exhausted(self, adv: Msg) -> None:
        """Fail and dead-letter one request, unless it was answered after all."""
        info = orjson.loads(adv.data)
        try:
            raw = await self.bus.js.get_msg(STREAM_REQUESTS, info["stream_seq"])
            req = SUBJECT_TYPES[self.step.kind].from_payload(raw.data or b"")
        except (NotFoundError, ContractError):
            await adv.ack()  # gone (aged out) or never valid (already dead-lettered)
            return
        rid = req.request_id  # type: ignore[attr-defined]
        state, _ = await self.bus.step_state(rid)
        if not state or state["state"] == "running":
            err = SmrError(
                f"request {rid} was delivered {info.get('deliveries')} times without an "
                "answer: its worker died or stalled each time; it was not completed",
                code="deliveries-exhausted",
                hint=f"see the {self.service} log on node {self.node}; to try again, "
                     "publish the request with a new request_id")
            await self.bus.dead_letter(raw.subject or "", raw.data or b"", err,
                                       service=self.service,
                                       deliveries=info.get("deliveries"), request_id=rid)
            await self._record(self._failed(req, err))
        await adv.ack()

    async def handle(self, m: Msg) -> None:
        ctx = tracing.extract(m.headers)
        with tracing.tracer.start_as_current_span(
            f"consume {kind_of(m.subject)}", context=ctx, kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination.name": m.subject,
                        "smr.service": self.service},
        ) as span:
            await self._handle(m, span)

    async def _handle(self, m: Msg, span: trace.Span) -> None:
        deliveries = m.metadata.num_delivered or 1
        req_type = SUBJECT_TYPES[self.step.kind]
        try:
            req = req_type.from_payload(m.data)
            if node_token(req.node) != node_token(self.node):  # type: ignore[attr-defined]
                raise ContractError(
                    f"request for node {req.node} arrived on {m.subject}",  # type: ignore[attr-defined]
                    code="wrong-node", hint="publish to the subject that ends in the node's name",
                )
        except ContractError as e:
            rid = _peek_request_id(m.data)
            await self.bus.dead_letter(m.subject, m.data, e, service=self.service,
                                       deliveries=deliveries, request_id=rid)
            span.set_status(Status(StatusCode.ERROR, e.message))
            await m.term()
            return
        rid = req.request_id  # type: ignore[attr-defined]
        span.set_attribute("smr.request_id", rid)
        kv = self.bus.kv(KV_STEPS)
        state, rev = await self.bus.step_state(rid)

        if state and state["state"] in ("done", "failed"):
            log.info("%s: request %s already answered; repeating its result", self.service, rid)
            await self.bus.publish(RESULT_OF[self.step.kind].from_dict(state["result"]))
            await m.ack()
            return

        if state and state["state"] == "running":
            if time.time() - state.get("heartbeat", 0) < self.bus.config.stale_after:
                # Another worker is alive on it: leave it be.
                await m.nak(delay=self.bus.config.ack_wait)
                return
            log.warning("%s: request %s was interrupted (attempt by %s); recovering",
                        self.service, rid, state.get("owner"))
            with tracing.tracer.start_as_current_span("recover " + self.step.kind):
                result = await self.step.recover(req, state)
            if result is not None:
                await self._finish(m, result)
                return

        claim = {"state": "running", "owner": self.owner, "heartbeat": time.time(),
                 "attempt": deliveries, "subject": m.subject, "phase": "starting"}
        try:
            if state is None:
                rev = await kv.create(rid, orjson.dumps(claim))
            else:
                rev = await kv.update(rid, orjson.dumps(claim), last=rev)
        except KeyWrongLastSequenceError:
            await m.nak(delay=self.bus.config.nak_base_delay)  # lost a race: look again later
            return

        progress = Progress()
        keepalive = asyncio.create_task(self._keepalive(m, rid, claim, progress))
        try:
            with tracing.tracer.start_as_current_span(
                f"step {self.step.kind}", attributes={"smr.request_id": rid}
            ) as step_span:
                try:
                    result = await self.step.run(req, progress)
                except TemporaryError as e:
                    if deliveries < self.bus.config.max_deliver:
                        step_span.record_exception(e)
                        keepalive.cancel()
                        await _quietly(keepalive)
                        await kv.delete(rid)
                        delay = min(self.bus.config.nak_base_delay * 2 ** (deliveries - 1),
                                    self.bus.config.nak_max_delay)
                        log.warning("%s: %s failed for now (%s); retrying in %.1fs",
                                    self.service, rid, e.message, delay)
                        await m.nak(delay=delay)
                        return
                    result = self._failed(req, e)
                    await self.bus.dead_letter(
                        m.subject, m.data, SmrError(
                            f"gave up after {deliveries} deliveries: {e.message}",
                            code="deliveries-exhausted", hint=e.hint),
                        service=self.service, deliveries=deliveries, request_id=rid)
                except StepError as e:
                    result = self._failed(req, e)
                except Exception as e:  # a bug: report it, never retry it forever
                    log.exception("%s: step %s crashed", self.service, rid)
                    result = self._failed(req, SmrError(
                        f"internal error: {type(e).__name__}: {e}", code="internal-error",
                        hint="this is a bug in smr; please report it with the service log"))
                if result.status == "failed":
                    why = (result.error or {}).get("message")
                    step_span.set_status(Status(StatusCode.ERROR, why))
        finally:
            keepalive.cancel()
            await _quietly(keepalive)
        await self._finish(m, result)

    def _failed(self, req: Any, e: SmrError) -> Any:
        return RESULT_OF[self.step.kind].for_request(req, status="failed", error=e.as_dict())

    async def _finish(self, m: Msg, result: CkptDone | RestoreDone) -> None:
        # Order matters: state first (a crash after it republishes the stored
        # result on redelivery), then the event, then the ack.
        await self._record(result)
        await m.ack()

    async def _record(self, result: CkptDone | RestoreDone) -> None:
        state = {"state": "done" if result.status == "succeeded" else "failed",
                 "result": result.to_dict(), "finished": time.time()}
        await self.bus.kv(KV_STEPS).put(result.request_id, orjson.dumps(state))
        await self.bus.publish(result)

    async def _keepalive(self, m: Msg, rid: str, claim: dict[str, Any], p: Progress) -> None:
        while True:
            await asyncio.sleep(self.bus.config.keepalive)
            await _quietly(m.in_progress())
            claim.update(heartbeat=time.time(), phase=p.phase, done_bytes=p.done_bytes,
                         total_bytes=p.total_bytes, **p.extra)
            await _quietly(self.bus.kv(KV_STEPS).put(rid, orjson.dumps(claim)))


def _peek_request_id(payload: bytes) -> str | None:
    try:
        rid = orjson.loads(payload).get("request_id")
        return rid if isinstance(rid, str) else None
    except (orjson.JSONDecodeError, AttributeError):
        return None


async def _quietly(aw: Awaitable[Any]) -> None:
    try:
        await aw
    except (asyncio.CancelledError, Exception):
        pass
