"""The requests JetStream gave up on: a request whose worker died on its last
delivery would vanish, as JetStream only announces it with a core-NATS
advisory. Those advisories are kept in a stream of their own (SMR_EXHAUSTED),
and each worker answers its consumer's, even when it starts after the fact:
with what the step's recover() finds its dead worker did (a restore that
landed), else a failed result and a dead letter (smr/bus/deadletters.py).
Never by running it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import orjson
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

from smr.aio import cancelling, quietly, stop_task
from smr.bus import keepalive
from smr.bus.client import Bus
from smr.bus.liveness import StepLocks
from smr.bus.topology import (
    KV_STEPS,
    RESULT_OF,
    STREAM_REQUESTS,
    SUBJECT_TYPES,
    request_consumer,
)
from smr.contract.errors import ContractError, SmrError

log = logging.getLogger("smr.bus")

# A request JetStream gave up on that no worker ever started is published
# again, at most this many times (header REDRIVEN): its deliveries were spent
# waiting, fetched ahead while its node was busy (smr/bus/ahead.py) and handed
# back as the agent stopped or redelivered when NATS lost its in_progress.
REDRIVEN = "Smr-Redriven"
MAX_REDRIVES = 3
PULL_RETRY_S = 1.0  # between pulls that failed (NATS away, the durable gone)


class Exhausted:
    """Answers the requests JetStream gave up on for one worker's consumer."""

    def __init__(self, bus: Bus, kind: str, service: str, node: str,
                 record: Callable[..., Awaitable[None]], locks: StepLocks,
                 recover: Callable[[Any, dict[str, Any]], Awaitable[Any]] | None = None
                 ) -> None:
        self.bus = bus
        self.kind = kind
        self.service = service
        self.node = node
        self.record = record  # Worker._record: (result, last=revision)
        self.locks = locks
        self.recover = recover  # the step's: what a dead worker's attempt did

    async def answer(self, sub: Any) -> None:
        """Answer the requests JetStream gave up on (worker died on the last delivery)."""
        failing = 0  # pulls failed in a row
        while True:
            try:
                advisories = await sub.fetch(8, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                if cancelling():  # nats-py can hand a cancel back so (see smr.aio)
                    raise
                continue
            except (Exception, asyncio.CancelledError) as e:
                # NATS restarting, or the durable gone (deleted, its stream
                # made again: no responders, which nats-py raises): ended
                # here, no request JetStream gives up on later would be
                # answered. Wait for it (the watcher makes it again) or make it.
                if cancelling():
                    raise
                failing += 1
                if failing == 1:
                    log.warning("%s: pulling the requests JetStream gave up on failed (%s: %s); "
                                "retrying", self.service, type(e).__name__, e)
                await asyncio.sleep(PULL_RETRY_S)
                await quietly(self.bus.ensure_exhausted_consumer(request_consumer(
                    self.kind, self.node, self.bus.config).durable_name or ""))
                continue
            failing = 0
            for adv in advisories:
                try:
                    await self._answer_one(adv)
                except Exception:
                    log.exception("%s: cannot answer an exhausted request", self.service)

    async def _answer_one(self, adv: Msg) -> None:
        """Answer one request: what its dead worker's attempt did, as the
        step's recover() finds it, else failed and dead-lettered; unless it was
        answered after all, or a live worker still runs it."""
        info = orjson.loads(adv.data)
        try:
            raw = await self.bus.js.get_msg(STREAM_REQUESTS, info["stream_seq"])
            req = SUBJECT_TYPES[self.kind].from_payload(raw.data or b"")
        except (NotFoundError, ContractError):
            await adv.ack()  # gone (aged out) or never valid (already dead-lettered)
            return
        rid = req.request_id  # type: ignore[attr-defined]
        # Asked before the state is read: a worker that holds the lock now has
        # not answered yet, and one that answers later is seen in the state.
        live = self.locks.live(rid)
        state, rev = await self.bus.step_state(rid)
        if state and (other := keepalive.other_request(state, req, self.kind)):
            # Another target's request reusing its id (a tenant's, on its own
            # subject): refused as a delivery is, never recovered for it.
            await self.bus.dead_letter(raw.subject or "", raw.data or b"",
                                       keepalive.reused(rid, other), service=self.service,
                                       deliveries=info.get("deliveries"), request_id=rid)
            await adv.ack()
            return
        if live or (state and state["state"] == "running" and time.time() - float(
                state.get("heartbeat", 0)) < self.bus.config.stale_after):
            # A worker of this node is alive on it (its beats may not get
            # through, or another consumer of the durable got the last
            # delivery): its answer will come, and it may still restore or
            # resume a process. Answering "failed" now would be replaced by
            # its success after a caller acted on it. Look again later.
            if live:  # said each time: a step that hangs so waits for ever
                log.warning("%s: request %s was delivered %s times, but a live worker of "
                            "node %s still runs it (its last heartbeat %.0fs ago); its answer "
                            "is waited for", self.service, rid, info.get("deliveries"),
                            self.node, time.time() - float((state or {}).get("heartbeat", 0)))
            await adv.nak(delay=self.bus.config.ack_wait)
            return
        if not state and (n := redriven(raw.headers)) < MAX_REDRIVES:
            # Never started: no claim (a worker's first write). Published again
            # it is delivered afresh; its request_id still runs it once, were
            # the old delivery still waiting somewhere.
            await self.bus.publish_raw(raw.subject or "", raw.data or b"",
                                       msg_id=f"{rid}.redriven.{n + 1}",
                                       headers={REDRIVEN: str(n + 1)})
            log.warning("%s: request %s was delivered %s times without starting (it waited "
                        "while node %s was busy); published again", self.service, rid,
                        info.get("deliveries"), self.node)
            await adv.ack()
            return
        if state and state["state"] in ("done", "failed"):
            # Answered. Its worker stores an answer, then publishes it: one
            # that died between the two on the last delivery left it
            # unannounced, and no redelivery comes to announce it. A repeat
            # is dropped (its Nats-Msg-Id).
            await self.bus.publish(RESULT_OF[self.kind].from_dict(state["result"]))
        elif not state or state["state"] == "running":
            # Held while we act for the dead worker, as a recovering worker
            # holds it: no delivery of the request runs or recovers beside us.
            with self.locks.hold(rid) as ours:
                if not ours or (await self.bus.step_state(rid))[1] != rev:
                    # A worker took it since we looked: look again later.
                    await adv.nak(delay=self.bus.config.ack_wait)
                    return
                result = None
                if state and self.recover is not None:
                    # What its dead worker did, asked of the world as a
                    # redelivery would (a restore that landed is recorded, not
                    # failed): its deliveries may have been spent while it lived,
                    # each left to it. Never run again: None fails it. The
                    # state is ours, beating, meanwhile (see keepalive).
                    kv = self.bus.kv(KV_STEPS)
                    mine = keepalive.recovery_claim(state, f"{self.service}-exhausted")
                    try:
                        rev = await kv.update(rid, orjson.dumps(mine), last=rev)
                    except KeyWrongLastSequenceError:
                        await adv.nak(delay=self.bus.config.nak_base_delay)  # look again
                        return
                    beats = asyncio.create_task(keepalive.beat(
                        kv, rid, mine, rev, every=self.bus.config.keepalive, msg=adv,
                        service=self.service))
                    try:
                        result = await self.recover(req, state)
                    finally:
                        await stop_task(beats, again_every=1.0)
                    if (now := await keepalive.held(kv, rid, mine)) is None:
                        await adv.nak(delay=self.bus.config.ack_wait)  # taken over meanwhile
                        return
                    rev = now
                err = None
                if result is None:
                    err = SmrError(
                        f"request {rid} was delivered {info.get('deliveries')} times without "
                        "an answer: its worker died or stalled each time; it was not completed",
                        code="deliveries-exhausted",
                        hint=f"see the {self.service} log on node {self.node}; to try again, "
                             "publish the request with a new request_id")
                    result = RESULT_OF[self.kind].for_request(req, status="failed",
                                                             error=err.as_dict())
                try:  # over the state judged above, never over an answer written since
                    await self.record(result, last=rev)
                except KeyWrongLastSequenceError:
                    await adv.nak(delay=self.bus.config.nak_base_delay)  # look again
                    return
                if err is not None:  # after the answer: a lost race leaves no stray letter
                    await self.bus.dead_letter(raw.subject or "", raw.data or b"", err,
                                               service=self.service,
                                               deliveries=info.get("deliveries"), request_id=rid)
        await adv.ack()


def redriven(headers: dict[str, str] | None) -> int:
    """How many times a request was published again (REDRIVEN); a header
    that is not a count counts as the most."""
    value = (headers or {}).get(REDRIVEN, "0")
    return int(value) if value.isdigit() else MAX_REDRIVES
