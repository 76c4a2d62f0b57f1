"""Heartbeat checkpoints: one schedule entry per pod, kept in JetStream KV.

Only the leader runs the schedule. The state lives in KV, not in the
process, so a restarted or new leader picks it up where it was:

- an entry holds the pod, its containers, the interval and ``next_due``;
- the first beat is jittered over one interval by the pod's uid, so pods
  created together do not all fire at once;
- a beat's ``request_id`` comes from the pod, the container and the slot it
  was due at. A leader that dies between publishing and moving ``next_due``
  publishes the same ids again, and JetStream drops them: no doubled beat;
- a leader that finds slots passed (it was down) fires the latest one once,
  then goes on from there: no burst of stale beats;
- ``next_due`` only moves by compare-and-set on the entry's revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from smr import metrics
from smr.aio import cancelling, wait_event
from smr.contract.messages import CkptRequested, Target, derive_request_id

log = logging.getLogger("smr.watcher.heartbeats")


@dataclass
class Beat:
    uid: str
    namespace: str
    pod: str
    node: str
    interval: int
    next_due: float
    containers: list[list[str]]  # [container, checkpoint_id]

    def due_slot(self, now: float) -> float:
        """The latest slot at or before ``now`` (``next_due`` if just one)."""
        missed = int((now - self.next_due) // self.interval)
        return self.next_due + max(0, missed) * self.interval

    def requests(self, slot: float) -> list[CkptRequested]:
        at = datetime.fromtimestamp(slot, UTC).isoformat(timespec="milliseconds")
        return [CkptRequested(
            request_id=derive_request_id("beat", self.uid, container, f"{slot:.3f}"),
            checkpoint_id=ckpt_id, node=self.node, reason="heartbeat", leave_running=True,
            # When the beat was due, so a beat is recognisable by its slot.
            requested_at=at.replace("+00:00", "Z"),
            # The next beat supersedes one still queued a whole interval late.
            deadline=_stamp(slot + self.interval),
            target=Target(kind="pod", namespace=self.namespace, pod=self.pod,
                          container=container, pod_uid=self.uid))
            for container, ckpt_id in self.containers]


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def jitter(uid: str) -> float:
    """A stable fraction in [0, 1) from the pod's uid."""
    return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:8], "big") / 2**64


class HeartbeatSchedule:
    def __init__(self, kv: KeyValue, publish: Callable[[list[CkptRequested]], Awaitable[Any]],
                 *, keys: Callable[[], Awaitable[list[str]]],
                 clock: Callable[[], float] = time.time) -> None:
        self.kv = kv
        # Lists the bucket's keys without a consumer (``Bus.kv_keys``): the
        # watcher's user may create none on a bucket it writes (docs/security.md).
        self.keys = keys
        self.publish = publish
        self.clock = clock
        self.entries: dict[str, tuple[Beat, int]] = {}  # uid → (beat, KV revision)
        self.fired = 0
        self._retry_at: dict[str, float] = {}  # publish failed: try again then
        self._wake = asyncio.Event()

    async def load(self) -> None:
        self.entries.clear()
        for k in await self.keys():
            with contextlib.suppress(KeyNotFoundError):
                e = await self.kv.get(k)
                if e.value:
                    self.entries[k] = (Beat(**orjson.loads(e.value)), e.revision or 0)

    async def upsert(self, uid: str, namespace: str, pod: str, node: str, interval: int,
                     containers: list[list[str]]) -> None:
        """Create or update a pod's entry; an unchanged pod costs nothing."""
        have = self.entries.get(uid)
        if have:
            beat, rev = have
            if (beat.interval, beat.containers, beat.node) == (interval, containers, node):
                return
            # Keep the phase; a shorter interval takes effect at once.
            beat.next_due = min(beat.next_due, self.clock() + interval)
            beat.interval, beat.containers, beat.node = interval, containers, node
            await self._write(beat, rev)
        else:
            beat = Beat(uid, namespace, pod, node, interval,
                        self.clock() + interval * jitter(uid), containers)
            try:
                rev = await self.kv.create(uid, orjson.dumps(asdict(beat)))
            except KeyWrongLastSequenceError:
                await self._reload(uid)  # written by an earlier leader: keep its schedule
                await self.upsert(uid, namespace, pod, node, interval, containers)
                return
            self.entries[uid] = (beat, rev)
        self._wake.set()

    async def remove(self, uid: str) -> None:
        if self.entries.pop(uid, None) is not None:
            with contextlib.suppress(KeyNotFoundError):
                await self.kv.delete(uid)
            self._wake.set()

    async def _write(self, beat: Beat, rev: int) -> bool:
        try:
            new = await self.kv.update(beat.uid, orjson.dumps(asdict(beat)), last=rev)
        except KeyWrongLastSequenceError:
            await self._reload(beat.uid)  # another leader moved it: take its view
            return False
        self.entries[beat.uid] = (beat, new)
        return True

    async def _reload(self, uid: str) -> None:
        try:
            e = await self.kv.get(uid)
        except KeyNotFoundError:
            self.entries.pop(uid, None)
            return
        if e.value:
            self.entries[uid] = (Beat(**orjson.loads(e.value)), e.revision or 0)
        else:
            self.entries.pop(uid, None)

    async def run(self) -> None:
        """Fire beats as they fall due, until cancelled."""
        while True:
            if cancelling():  # a cancellation a publish turned into an error (see smr.aio)
                raise asyncio.CancelledError
            now = self.clock()
            for beat in [b for b, _ in self.entries.values() if self._when(b) <= now]:
                await self._fire(beat, now)
            upcoming = min((self._when(b) for b, _ in self.entries.values()),
                           default=now + 60)
            self._wake.clear()
            await wait_event(self._wake, max(0.0, upcoming - self.clock()))

    def _when(self, beat: Beat) -> float:
        return max(beat.next_due, self._retry_at.get(beat.uid, 0.0))

    async def _fire(self, beat: Beat, now: float) -> None:
        slot = beat.due_slot(now)
        missed = int((slot - beat.next_due) // beat.interval)
        if missed:
            log.warning("pod %s/%s: %d heartbeat(s) passed while no leader ran; firing the "
                        "latest once", beat.namespace, beat.pod, missed)
        try:
            await self.publish(beat.requests(slot))
        except Exception as e:
            log.warning("pod %s/%s: heartbeat not published, retrying: %s",
                        beat.namespace, beat.pod, e)
            self._retry_at[beat.uid] = now + 1.0
            return
        metrics.HEARTBEATS_MISSED.inc(missed)  # next_due moves once per success: counted once
        metrics.HEARTBEAT_LATENESS.observe(max(0.0, self.clock() - slot))
        self._retry_at.pop(beat.uid, None)
        if beat.uid not in self.entries:
            return  # the pod went away while its beat was being sent
        rev = self.entries[beat.uid][1]
        moved = Beat(**{**asdict(beat), "next_due": slot + beat.interval})
        if await self._write(moved, rev):
            self.fired += 1
