"""The worker loop: a request becomes exactly one executed step.

The step-state KV bucket (``request_id`` → state) makes a step run at most
once: a redelivered request whose state is ``done`` republishes the stored
result; one whose state is ``running`` with a stale heartbeat (its worker
died) is handed to the step's ``recover``, which decides from the world
whether the step finished, failed, or can safely run again. A bad request is
dead-lettered (smr/bus/deadletters.py), as is one that keeps failing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import nats
import orjson
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from smr import metrics, tracing
from smr.aio import cancelling, quietly, stop_task
from smr.bus.ahead import Admission, Ahead, Waiting
from smr.bus.client import Bus
from smr.bus.deadletters import peek_request_id
from smr.bus.exhausted import Exhausted
from smr.bus.keepalive import beat, held, other_request, recovery_claim, reused
from smr.bus.liveness import StepLocks
from smr.bus.progress import Progress, Step
from smr.bus.topology import (
    KV_STEPS,
    RESULT_OF,
    STREAM_EXHAUSTED,
    STREAM_REQUESTS,
    SUBJECT_TYPES,
    kind_of,
    misdelivered,
    node_filter,
)
from smr.contract.errors import ContractError, SmrError, StepError, TemporaryError, disk_full
from smr.contract.messages import CkptDone, RestoreDone
from smr.retry import NATS_TRANSIENT, NATS_UNAVAILABLE, retry_nats

log = logging.getLogger("smr.bus")


LAG_EVERY_S = 5.0  # how often the backlog metric is read from the consumer


FETCH_RETRY_S = 0.5  # after a fetch that failed for another reason than "nothing new"


KEEP_CANCELLING_S = 0.5  # a loop whose cancel nats-py dropped is cancelled again (smr.aio)


class Worker:
    """Runs one step kind for one node: fetch, validate, dedupe, run, answer."""

    def __init__(self, bus: Bus, step: Step[Any, Any], node: str, *, service: str,
                 locks: StepLocks, concurrency: int = 1, ahead: int = 0,
                 admission: Admission | None = None) -> None:
        self.bus = bus
        self.step = step
        self.node = node
        self.service = service
        # Which requests a live worker of this node runs (ours or another
        # process's): none is taken over, recovered or failed beside it.
        self.locks = locks
        # Requests served at once (each on its own job: steps lock their job),
        # so one waiting for a busy job does not hold back the node's others.
        self.concurrency = concurrency
        # Requests fetched beyond those served, to start the most urgent of
        # them first and only what fits (smr/bus/ahead.py); 0: in order.
        self.ahead = ahead
        self.admission = admission
        self.owner = f"{service}@{node}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._failing = 0  # fetches failed in a row
        self._stop = asyncio.Event()
        self.idle = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        # NATS may be restarting as this starts: its API calls time out until it is back.
        async for attempt in retry_nats():
            with attempt:
                durable = await self.bus.ensure_consumer(self.step.kind, self.node,
                                                         self.concurrency + self.ahead)
                psub = await self.bus.js.pull_subscribe_bind(durable, STREAM_REQUESTS)
                exhausted = await self.bus.js.pull_subscribe_bind(
                    await self.bus.ensure_exhausted_consumer(durable), STREAM_EXHAUSTED)
        log.info("%s consuming %s", self.service, node_filter(self.step.kind, self.node))
        answering = asyncio.create_task(Exhausted(
            self.bus, self.step.kind, self.service, self.node, self._record,
            self.locks, self.step.recover).answer(exhausted))
        lag = asyncio.create_task(self._report_lag(psub))
        waiting = Ahead(SUBJECT_TYPES[self.step.kind], self.admission, self.node)
        beating = asyncio.create_task(waiting.keep_alive(self.bus.config.keepalive))
        fetching: asyncio.Task[list[Msg]] | None = None
        serving: set[asyncio.Task[None]] = set()
        try:
            while not self._stop.is_set():
                starting = waiting.riders()  # outside the slots (smr/bus/ahead.rides)
                while (w := waiting.next(self.concurrency)) is not None:
                    starting.append(w)
                for w in starting:
                    t = self._start(waiting, w)
                    serving.add(t)
                    t.add_done_callback(serving.discard)
                if not serving and not waiting:
                    self.idle.set()
                if fetching is None and \
                        (room := self.concurrency + self.ahead - len(serving) - len(waiting)) > 0:
                    fetching = asyncio.create_task(self._fetch(psub, room))
                # Whichever comes first: new requests, a slot set free, an estimate made.
                await asyncio.wait({*serving, *waiting.estimating(),
                                    *([fetching] if fetching else [])}, timeout=0.5,
                                   return_when=asyncio.FIRST_COMPLETED)
                if fetching is not None and fetching.done():
                    msgs, fetching = fetching.result(), None
                    if msgs:
                        self.idle.clear()
                    for m in msgs:
                        waiting.add(m)
            if serving:  # a graceful stop lets the steps in flight end
                await asyncio.wait(serving)
        finally:
            for t in list(serving):
                await stop_task(t)
            if fetching is not None and fetching.done() and not fetching.cancelled() \
                    and fetching.exception() is None:
                for m in fetching.result():
                    waiting.add(m)
            for task in (answering, lag, beating, *([fetching] if fetching else [])):
                await stop_task(task, again_every=KEEP_CANCELLING_S)
            for m in waiting.drop_all():  # not started: another worker serves them
                await quietly(m.nak())
            await quietly(psub.unsubscribe())
            await quietly(exhausted.unsubscribe())

    def _start(self, waiting: Ahead, w: Waiting) -> asyncio.Task[None]:
        """Serve ``w`` in a task of its own; its slot, estimate and job are
        held in ``waiting`` until it ends."""
        self.idle.clear()
        t = asyncio.create_task(self._serve(w.msg))
        t.add_done_callback(lambda _: waiting.landed(w))
        return t

    async def _fetch(self, psub: Any, n: int) -> list[Msg]:
        """Up to ``n`` new requests; [] when none came or NATS is away."""
        try:
            msgs: list[Msg] = await psub.fetch(n, timeout=0.5)
            self._failing = 0
            return msgs
        except (TimeoutError, nats.errors.TimeoutError):
            if cancelling():  # nats-py can hand a cancel back so (see smr.aio)
                raise
            return []
        except (Exception, asyncio.CancelledError) as e:
            # NATS restarting (connection closed, JetStream not ready
            # yet), or a cancel nats-py hands back that is not this fetch's
            # (stop_task's is raised): the node keeps being served once it is back.
            if cancelling():
                raise
            self._failing += 1
            if self._failing == 1:
                log.warning("%s: fetching from %s failed (%s: %s); retrying",
                            self.service, node_filter(self.step.kind, self.node),
                            type(e).__name__, e)
            await asyncio.sleep(FETCH_RETRY_S)
            # Or the consumer is gone (deleted, its stream made again): no
            # fetch succeeds, and the node is not served, until it is made again.
            await quietly(self.bus.ensure_consumer(self.step.kind, self.node,
                                                   self.concurrency + self.ahead))
            return []

    async def _serve(self, m: Msg) -> None:
        """One message: nothing escapes it, so the node goes on being served."""
        try:
            await self.handle(m)
        except asyncio.CancelledError:
            if cancelling() or self._stop.is_set():
                raise
            # Not this worker's stop: a library gave up a call that way (NATS
            # closing a request as it restarts). The message is redelivered,
            # and recovery looks at what was done.
            log.warning("%s: handling %s was cancelled from inside; it is redelivered",
                        self.service, m.subject)
            await quietly(m.nak(delay=self.bus.config.nak_base_delay))
        except NATS_TRANSIENT as e:
            # NATS away for a moment (a server of a cluster lost, a leader
            # being elected): redelivered, and the step state says what was done.
            log.warning("%s: NATS failed while handling %s (%s: %s); it is redelivered",
                        self.service, m.subject, type(e).__name__, e)
            await quietly(m.nak(delay=self.bus.config.nak_base_delay))
        except Exception:
            log.exception("%s: unexpected error on %s", self.service, m.subject)
            await quietly(m.nak(delay=self.bus.config.nak_base_delay))

    async def _report_lag(self, psub: Any) -> None:
        """The consumer's backlog as a metric: requests waiting or not yet acknowledged."""
        while True:
            try:
                info = await psub.consumer_info()
                metrics.PENDING.labels(metrics.kind_label(self.step.kind)).set(
                    (info.num_pending or 0) + (info.num_ack_pending or 0))
            except Exception as e:  # a metric is never worth a failed step
                log.debug("%s: consumer info: %s", self.service, e)
            await asyncio.sleep(LAG_EVERY_S)

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
            if (wrong := misdelivered(m.subject, req, self.node)) is not None:
                raise wrong
        except ContractError as e:
            rid = peek_request_id(m.data)
            await self.bus.dead_letter(m.subject, m.data, e, service=self.service,
                                       deliveries=deliveries, request_id=rid)
            span.set_status(Status(StatusCode.ERROR, e.message))
            await m.term()
            return
        rid = req.request_id  # type: ignore[attr-defined]
        span.set_attribute("smr.request_id", rid)
        with self.locks.hold(rid) as ours:
            if not ours:
                # A live worker of this node runs it: ours (serving several at
                # once, it fetched the redelivery), or another process's whose
                # beats do not get through. Its answer will come; look again later.
                await m.nak(delay=self.bus.config.ack_wait)
                return
            await self._run_request(m, span, req, rid, deliveries)

    async def _run_request(self, m: Msg, span: trace.Span, req: Any, rid: str,
                           deliveries: int) -> None:
        kv = self.bus.kv(KV_STEPS)
        state, rev = await self.bus.step_state(rid)

        if state and (other := other_request(state, req, self.step.kind)):
            # An idempotency key names one request: never answer another with its result.
            await self.bus.dead_letter(m.subject, m.data, reused(rid, other),
                                       service=self.service, deliveries=deliveries,
                                       request_id=rid)
            span.set_status(Status(StatusCode.ERROR, "request-id-reused"))
            await m.term()
            return

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
            # Its worker is dead: we hold the request's lock, which a live one
            # keeps. The state is ours, beating, while we recover: a step
            # waiting on the job's lock sees a live holder, not a dead one.
            mine = recovery_claim(state, self.owner)
            try:  # over the state we judged, never over an answer written since
                rev = await kv.update(rid, orjson.dumps(mine), last=rev)
            except KeyWrongLastSequenceError:
                await m.nak(delay=self.bus.config.nak_base_delay)
                return
            beats = asyncio.create_task(beat(
                kv, rid, mine, rev, every=self.bus.config.keepalive, msg=m,
                service=self.service))
            try:
                with tracing.tracer.start_as_current_span("recover " + self.step.kind):
                    result = await self.step.recover(req, state)
            finally:
                await stop_task(beats, again_every=KEEP_CANCELLING_S)
            if (now := await held(kv, rid, mine)) is None:
                await m.nak(delay=self.bus.config.nak_base_delay)  # taken over meanwhile
                return
            rev = now
            if result is not None:
                try:
                    await self._record(result, last=rev, ours=True)
                except KeyWrongLastSequenceError:
                    await m.nak(delay=self.bus.config.nak_base_delay)
                    return
                await m.ack()
                return

        claim = {"state": "running", "owner": self.owner, "claim": uuid.uuid4().hex,
                 "heartbeat": time.time(),
                 "attempt": deliveries, "subject": m.subject, "phase": "starting",
                 "checkpoint_id": req.checkpoint_id, "target": req.target.to_dict()}
        try:
            if state is None:
                rev = await kv.create(rid, orjson.dumps(claim))
            else:
                rev = await kv.update(rid, orjson.dumps(claim), last=rev)
        except KeyWrongLastSequenceError:
            await m.nak(delay=self.bus.config.nak_base_delay)  # lost a race: look again later
            return

        progress = Progress()
        keepalive = asyncio.create_task(self._keepalive(m, rid, claim, rev, progress))
        try:
            with tracing.tracer.start_as_current_span(
                f"step {self.step.kind}", attributes={"smr.request_id": rid}
            ) as step_span:
                progress.span = step_span
                step_span.set_attribute("smr.checkpoint_id", req.checkpoint_id)
                try:
                    try:
                        result = await self.step.run(req, progress)
                    except NATS_UNAVAILABLE as e:
                        # NATS away past the step's own retries (a whole cluster
                        # restarting): retried like any temporary failure, and
                        # recover() sees what was done. Before, internal-error.
                        raise TemporaryError(
                            f"NATS unavailable: {type(e).__name__}: {e}",
                            code="nats-unavailable",
                            hint="NATS was away; the step is retried") from e
                except TemporaryError as e:
                    if deliveries < self.bus.config.max_deliver:
                        step_span.record_exception(e)
                        await stop_task(keepalive, again_every=KEEP_CANCELLING_S)
                        # Not deleted: marked interrupted (a heartbeat of 0), so
                        # the redelivery asks the step's recover() what was
                        # done (a finished dump is stored, never dumped again).
                        claim.update(heartbeat=0.0, interrupted=e.message)
                        await kv.put(rid, orjson.dumps(claim))
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
                    if (full := disk_full(e)) is not None:
                        log.warning("%s: %s failed: %s", self.service, rid, full.message)
                        result = self._failed(req, full)
                    else:
                        log.exception("%s: step %s crashed", self.service, rid)
                        result = self._failed(req, SmrError(
                            f"internal error: {type(e).__name__}: {e}", code="internal-error",
                            hint="this is a bug in smr; please report it with the service log"))
                annotate(step_span, result)
        finally:
            await stop_task(keepalive, again_every=KEEP_CANCELLING_S)
        await self._finish(m, result)

    def _failed(self, req: Any, e: SmrError) -> Any:
        return RESULT_OF[self.step.kind].for_request(req, status="failed", error=e.as_dict())

    async def _finish(self, m: Msg, result: CkptDone | RestoreDone) -> None:
        # Order matters: state first (a crash after it republishes the stored
        # result on redelivery), then the event, then the ack.
        await self._record(result, ours=True)
        await m.ack()

    async def _record(self, result: CkptDone | RestoreDone, *, last: int | None = None,
                      ours: bool = False) -> None:
        """Store the answer, then publish it. ``last``: only over that revision
        of the state (0: only where there is none), else KeyWrongLastSequenceError.
        ``ours``: the answer of a step this worker ran or recovered, under the
        request's lock: its write is tried again until it is stored."""
        doc = {"state": "failed" if result.status == "failed" else "done",
               "kind": self.step.kind, "result": result.to_dict(), "finished": time.time()}
        state = orjson.dumps(doc)
        kv = self.bus.kv(KV_STEPS)
        delay, tried = self.bus.config.nak_base_delay, False
        while True:
            try:
                if last is None:
                    await kv.put(result.request_id, state)
                elif last == 0:
                    await kv.create(result.request_id, state)
                else:
                    await kv.update(result.request_id, state, last=last)
                break
            except KeyWrongLastSequenceError:
                # A write tried again whose first try landed (its answer lost
                # as NATS went away) finds our own answer there.
                if tried and (await self.bus.step_state(result.request_id))[0] == doc:
                    break
                raise
            except NATS_TRANSIENT as e:
                # The answer is the one record of what the step did, and the
                # lock goes when this returns: let go with no answer stored,
                # the handler of a request JetStream gave up on would answer
                # "failed" for a step that succeeded (a restore that landed).
                # A stop's cancel still ends it (the kernel lets the lock go).
                if not ours or cancelling():
                    raise
                tried = True
                log.warning("%s: storing the answer of %s failed (%s: %s); trying again in "
                            "%.1fs", self.service, result.request_id, type(e).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.bus.config.nak_max_delay)
        metrics.observe_result(result)
        await self.bus.publish(result)

    async def _keepalive(self, m: Msg, rid: str, claim: dict[str, Any], rev: int,
                         p: Progress) -> None:
        def refresh(claim: dict[str, Any]) -> None:
            claim.update(phase=p.phase, done_bytes=p.done_bytes, total_bytes=p.total_bytes,
                         **p.extra)
        await beat(self.bus.kv(KV_STEPS), rid, claim, rev,
                   every=self.bus.config.keepalive, msg=m, refresh=refresh,
                             service=self.service)


def annotate(span: trace.Span, result: CkptDone | RestoreDone) -> None:
    """What a step did, on its span: the outcome, the generation, and each phase's seconds."""
    span.set_attribute("smr.outcome", result.status)
    if result.status == "failed":
        error = result.error or {}
        span.set_attribute("smr.error.code", error.get("code", "unknown"))
        span.set_status(Status(StatusCode.ERROR, error.get("message")))
        return
    if result.generation is not None:
        span.set_attribute("smr.generation", result.generation)
    if result.size_bytes is not None:
        span.set_attribute("smr.size_bytes", result.size_bytes)
    if isinstance(result, RestoreDone) and result.pid:
        span.set_attribute("smr.pid", result.pid)
    for phase, seconds in result.durations.items():
        span.set_attribute(f"smr.seconds.{phase}", round(seconds, 6))


