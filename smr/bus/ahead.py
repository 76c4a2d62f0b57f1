"""Requests fetched ahead of a free slot, and which of them a worker starts next.

JetStream hands a consumer its messages in the order they were published.
A node's checkpointer must not serve them so: a final checkpoint (a drain,
a preemption, a shutdown: the kubelet stops the workload seconds later)
must not wait behind leave-running ones queued before it (a cordon's, the
heartbeats'). So a worker may fetch ``ahead`` requests more than it runs,
keep each alive (``in_progress``) while it waits, and start the most urgent
first, then the oldest. An ``Admission`` (the step's) says how urgent a
request is and whether it fits the room left beside the steps in flight.

Nothing here touches a step's state: a waiting request is only a message
not yet acknowledged. If the worker dies, JetStream delivers it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from nats.aio.msg import Msg

from smr.aio import cancelling
from smr.contract.errors import ContractError

# How long a worker waits for a request's size estimate before starting it
# unestimated (an estimate is a guess; a stuck one must not hold a final back).
ESTIMATE_TIMEOUT_S = 5.0


class Admission(Protocol):
    """A step's say in which waiting request starts, and when."""

    def urgency(self, req: Any) -> int:
        """Lower starts first; equal ones in the order they were published."""
        ...

    async def estimate(self, req: Any) -> int:
        """The bytes of scratch (disk or memory) the step will use for ``req``."""
        ...

    def room(self) -> int:
        """The bytes of scratch the steps may use now, those in flight included."""
        ...


def rides(admission: Admission | None, req: Any) -> bool:
    """Does ``req`` only wait on a step in flight (a final checkpoint on its
    container's leave-running dump, which it takes over)? Such a request
    starts at once, outside the slots: waiting for one, it would find that
    dump over and dump again. An admission without ``rides`` says no."""
    ask = getattr(admission, "rides", None)
    return bool(ask and req is not None and ask(req))


@dataclass
class Waiting:
    """A fetched request not yet started."""

    msg: Msg
    request_id: str | None
    key: tuple[int, int, int]  # (urgency, stream sequence, arrival)
    estimate: int | None = None  # asked for once, when it is next to start
    req: Any = None  # the request, parsed (None: a bad one)
    estimating: asyncio.Task[int] | None = None  # that estimate, while it is made


class Ahead:
    """The waiting requests of one worker, most urgent first."""

    def __init__(self, req_type: Any, admission: Admission | None) -> None:
        self.req_type = req_type
        self.admission = admission
        self._waiting: dict[int, Waiting] = {}  # by arrival
        self._arrivals = itertools.count()
        self.reserved = 0  # estimates of the requests in flight
        self._estimating: set[asyncio.Task[int]] = set()  # being made

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, m: Msg) -> None:
        try:
            req = self.req_type.from_payload(m.data)
        except ContractError:
            # Bad: served at once (the worker dead-letters it).
            req = None
        rid = getattr(req, "request_id", None)
        seq = getattr(getattr(m.metadata, "sequence", None), "stream", 0) or 0
        for w in self._waiting.values():
            if seq and w.key[1] == seq:
                # Delivered again while it waited (an in_progress lost): the
                # newer delivery is the one to answer; its place stays. The
                # same request_id in another message (published again) is a
                # message of its own: dropped here, it would get no
                # keepalives and be given up on while this one waits.
                w.msg = m
                return
        urgency = -1 if req is None else \
            (self.admission.urgency(req) if self.admission else 0)
        n = next(self._arrivals)
        self._waiting[n] = Waiting(m, rid, (urgency, seq, n), req=req)

    def riders(self) -> list[Msg]:
        """The waiting requests that ride on a step in flight (``rides``),
        taken out to start now."""
        if self.admission is None:
            return []
        out = [self._waiting.pop(n) for n, w in list(self._waiting.items())
               if rides(self.admission, w.req)]
        for w in out:
            if w.estimating is not None:
                w.estimating.cancel()  # a rider takes no slot, and so no room
        return [w.msg for w in out]

    def messages(self) -> list[Msg]:
        return [w.msg for w in self._waiting.values()]

    def next(self, in_flight: int) -> tuple[Msg, int] | None:
        """The request to start now and its estimate, or None: none waits,
        the most urgent one's estimate is still being made (``estimating``:
        made apart, so that a more urgent request fetched meanwhile need not
        wait for it), or the most urgent one does not fit the room beside
        ``in_flight`` steps (then none starts: a smaller, less urgent one must
        not take the room the urgent one waits for). One always starts when
        none is in flight, whatever its size: it could never start otherwise."""
        if not self._waiting:
            return None
        head = self._head()
        if self.admission is not None and head.request_id is not None:
            if head.estimate is None:
                if not self._estimate_of(head).done():
                    return None
                assert head.estimating is not None
                head.estimate = 0 if head.estimating.cancelled() else \
                    head.estimating.result()
            if in_flight and self.reserved + head.estimate > self.admission.room():
                return None
        del self._waiting[head.key[2]]
        if self.admission is not None and self._waiting and \
                (nxt := self._head()).request_id is not None:
            # The next in line's, made while this one runs: ready when a slot
            # frees. It may then be a dump old (its job's last size not yet
            # updated): the step checks the disk again with its own, fresh.
            self._estimate_of(nxt)
        return head.msg, head.estimate or 0

    def _head(self) -> Waiting:
        return min(self._waiting.values(), key=lambda w: w.key)

    def _estimate_of(self, w: Waiting) -> asyncio.Task[int]:
        """``w``'s estimate, begun if it was not."""
        if w.estimating is None:
            w.estimating = t = asyncio.create_task(self._estimate(w))
            self._estimating.add(t)
            t.add_done_callback(self._estimating.discard)
        return w.estimating

    def estimating(self) -> frozenset[asyncio.Task[int]]:
        """The estimates being made: the worker looks again as each ends."""
        return frozenset(self._estimating)

    async def _estimate(self, w: Waiting) -> int:
        assert self.admission is not None
        try:
            req = self.req_type.from_payload(w.msg.data)
            async with asyncio.timeout(ESTIMATE_TIMEOUT_S):  # no task of its own, as wait_for's
                return max(0, await self.admission.estimate(req))
        except asyncio.CancelledError:
            if cancelling():  # ours (drop_all, riders): this estimate is not wanted
                raise
            return 0  # a cancel a library handed back (smr.aio): no estimate
        except Exception:  # no estimate: the step itself finds and reports what is wrong
            return 0

    def drop_all(self) -> list[Msg]:
        msgs = self.messages()
        for t in list(self._estimating):
            t.cancel()
        self._waiting.clear()
        return msgs

    async def keep_alive(self, every: float) -> None:
        """Tell JetStream every ``every`` seconds that the waiting requests are
        in hand, so that none is delivered again while it waits."""
        while True:
            await asyncio.sleep(every)
            for m in self.messages():
                with contextlib.suppress(Exception):  # NATS away: the next beat may pass
                    await m.in_progress()
