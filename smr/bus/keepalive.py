"""Beating for a step's state while a worker acts on its request.

A step's state (KV_STEPS) says ``running`` with a fresh ``heartbeat`` while
a worker is alive on it; other workers, the exhausted handler and
``JobLock`` (smr.jobs) take a stale one for a dead worker's. So every
worker acting on a request beats for it: one running the step, and one
recovering what a dead worker left (a recovery may store a dump for as
long as SMR_COMMIT_DEADLINE; a later checkpoint of the same job must wait
for it, not take its lock over).

Whose a step's state is (``other_request``) is decided here too, for the
worker's deliveries and for the requests JetStream gave up on alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from nats.aio.msg import Msg
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from smr.aio import cancelling, quietly
from smr.bus.topology import kind_of, namespace_of_subject, node_token
from smr.contract.errors import ContractError

log = logging.getLogger("smr.bus")


async def beat(kv: KeyValue, rid: str, claim: dict[str, Any], rev: int, *, every: float,
               msg: Msg | None = None, refresh: Callable[[dict[str, Any]], None] | None = None,
               service: str = "") -> None:
    """Every ``every`` seconds: ``msg`` kept from redelivery, and a fresh
    heartbeat written over our own ``claim`` (compare-and-set: a state another
    worker or the exhausted handler wrote is theirs; then the beats end).
    Failures of a beat are let go (the next one may pass); a cancel ends it."""
    while not cancelling():  # a cancel nats-py dropped inside a beat still ends it
        await asyncio.sleep(every)
        if msg is not None:
            await quietly(msg.in_progress())
        claim["heartbeat"] = time.time()
        if refresh is not None:
            refresh(claim)
        try:
            rev = await kv.update(rid, orjson.dumps(claim), last=rev)
            continue
        except KeyWrongLastSequenceError:
            pass
        except Exception as e:  # NATS away: the next beat may pass
            if not isinstance(e, BadRequestError) or e.err_code != 10071:
                continue
        # The state moved on since our last write: another writer's, or our
        # own write whose answer was lost (NATS restarting after it stored
        # it). Only the former ends the beats.
        with contextlib.suppress(Exception):  # unreadable now: look again next beat
            if (now := await held(kv, rid, claim)) is not None:
                rev = now
                continue
            log.error("%s: the state of %s was taken over by another writer; this worker "
                      "no longer beats for it", service, rid)
            return


async def held(kv: KeyValue, rid: str, claim: dict[str, Any]) -> int | None:
    """The revision of the state of ``rid`` if it is still our running
    ``claim``; None where another writer's (or none) is there."""
    try:
        e = await kv.get(rid)
    except KeyNotFoundError:
        return None
    if not e.value:
        return None
    state = orjson.loads(e.value)
    if state.get("claim") == claim["claim"] and state.get("state") == "running":
        return e.revision or 0
    return None


def recovery_claim(state: dict[str, Any], owner: str) -> dict[str, Any]:
    """The state a worker writes over a dead worker's before it recovers
    the request: running, by us, beating."""
    return {**state, "state": "running", "owner": owner, "claim": uuid.uuid4().hex,
            "heartbeat": time.time(), "phase": "recovering"}


def other_request(state: dict[str, Any], req: Any, kind: str) -> str | None:
    """What the step state's request was, when it is not ``req``, a request of
    ``kind``. An id is one key for every namespace, and a tenant may publish
    any id on its own subject: a request that reuses the id of another
    target's step must never recover it, run on it, or get its answer."""
    if state.get("state") == "running":
        theirs, ckpt = state.get("subject", ""), state.get("checkpoint_id")
        target, was = state.get("target"), kind_of(theirs)
        # A claim from before claims named targets: its subject's namespace.
        ns = namespace_of_subject(theirs)
        if target is None and ns and ns != node_token(req.target.namespace_name):
            return f"a request of namespace {ns}"
    else:
        result = state.get("result") or {}
        was, ckpt, target = state.get("kind"), result.get("checkpoint_id"), result.get("target")
    if was and was != kind:
        return f"a {was} request"
    if ckpt and ckpt != req.checkpoint_id:
        return f"checkpoint {ckpt}"
    if target and target != req.target.to_dict():
        return f"another target ({target})"
    return None


def reused(rid: str, other: str) -> ContractError:
    """The dead letter's reason for a request refused by other_request."""
    return ContractError(f"request_id {rid} was already used for {other}",
                         code="request-id-reused",
                         hint="give every distinct request its own request_id")
