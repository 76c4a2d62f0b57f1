"""Requests fetched ahead of a free slot, and which of them a worker starts next.

JetStream hands a consumer its messages in the order they were published.
A node's checkpointer must not serve them so: a final checkpoint (a drain,
a preemption, a shutdown: the kubelet stops the workload seconds later)
must not wait behind leave-running ones queued before it (a cordon's, the
heartbeats'). So a worker may fetch ``ahead`` requests more than it runs,
keep each alive (``in_progress``) while it waits, and start the most urgent
first, then the oldest. An ``Admission`` (the step's) says how urgent a
request is and whether it fits the room left beside the steps in flight.

The slots are shared by every namespace on the node, so none may be held by
requests that only wait, and none taken from an urgent request by less
urgent ones:

- **By urgency**: a request starts while fewer than ``concurrency`` requests
  as urgent as it or more are in flight. Leave-running dumps fill at most
  ``concurrency`` slots, and a final one still starts beside them.
- **One job at a time**: a request whose job (``Admission.job``: its pod's
  container) has a request as urgent in flight here waits outside the slots,
  in the look-ahead, until that one ends. It would only wait for the job's
  lock in a slot: a tenant's requests queued for one container held every
  slot of the node so. (A more urgent one does not wait: a final one takes
  its container's leave-running dump over, or makes it step aside.)
- **Shared fairly**: of the requests as urgent, those of the share
  (``Admission.share``: its namespace) with the fewest as urgent in flight
  start first, the shares in turns, then the oldest. A tenant's queue for
  many containers delays another namespace's request as urgent until one of
  the dumps of that urgency in flight ends, not until the queue is served.

Nothing here touches a step's state: a waiting request is only a message
not yet acknowledged. If the worker dies, JetStream delivers it again.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from nats.aio.msg import Msg

from smr.aio import cancelling
from smr.bus.topology import misdelivered
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


def share_of(admission: Admission | None, req: Any) -> Hashable | None:
    """Whose share of the slots ``req`` takes (``Admission.share``); None: one
    for all (an admission without ``share``, a bad request)."""
    ask = getattr(admission, "share", None)
    return ask(req) if ask and req is not None else None


def job_of(admission: Admission | None, req: Any) -> Hashable | None:
    """The job ``req`` acts on (``Admission.job``), of which one request at a
    time runs here; None: none known (an admission without ``job``, a bad
    request)."""
    ask = getattr(admission, "job", None)
    return ask(req) if ask and req is not None else None


@dataclass
class Waiting:
    """A fetched request not yet started."""

    msg: Msg
    request_id: str | None
    key: tuple[int, int, int]  # (urgency, stream sequence, arrival)
    estimate: int | None = None  # asked for once, when it is next to start
    req: Any = None  # the request, parsed (None: a bad one)
    estimating: asyncio.Task[int] | None = None  # that estimate, while it is made
    job: Hashable | None = None  # what it acts on (job_of)
    rider: bool = False  # started outside the slots (rides)
    share: Hashable | None = None  # whose share of the slots it takes (share_of)

    @property
    def urgency(self) -> int:
        return self.key[0]


class Ahead:
    """The waiting requests of one worker, most urgent first."""

    def __init__(self, req_type: Any, admission: Admission | None, node: str) -> None:
        self.req_type = req_type
        self.admission = admission
        self.node = node
        self._waiting: dict[int, Waiting] = {}  # by arrival
        # Each urgency and share's waiting requests, oldest first: (seq, arrival).
        self._lines: dict[tuple[int, Hashable], list[tuple[int, int]]] = {}
        self._starts = itertools.count()
        self._last: dict[Hashable, int] = {}  # share: when it last started one (of _starts)
        self._arrivals = itertools.count()
        self._flying: dict[int, Waiting] = {}  # started, not yet ended (by arrival)
        self._estimating: set[asyncio.Task[int]] = set()  # being made

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, m: Msg) -> None:
        # A bad request is served at once (the worker dead-letters it). So is
        # one on a subject that may not name its target (another namespace's,
        # forged): it must not take that share's turn or wait as that job's.
        try:
            req = self.req_type.from_payload(m.data)
        except ContractError:
            req = None
        if req is not None and misdelivered(m.subject, req, self.node) is not None:
            req = None
        rid = getattr(req, "request_id", None)
        seq = getattr(getattr(m.metadata, "sequence", None), "stream", 0) or 0
        for w in self._waiting.values():
            if seq and w.key[1] == seq and w.msg.data == m.data:
                # Delivered again while it waited (an in_progress lost): the
                # newer delivery is the one to answer; its place stays. The
                # same request_id in another message (published again) is a
                # message of its own: dropped here, it would get no
                # keepalives and be given up on while this one waits. So is
                # another request of that sequence (the stream made again).
                w.msg = m
                return
        urgency = -1 if req is None else \
            (self.admission.urgency(req) if self.admission else 0)
        n = next(self._arrivals)
        w = self._waiting[n] = Waiting(m, rid, (urgency, seq, n), req=req,
                                       job=job_of(self.admission, req),
                                       share=share_of(self.admission, req))
        bisect.insort(self._lines.setdefault((urgency, w.share), []), (seq, n))

    def _take(self, w: Waiting) -> None:
        """``w`` out of the waiting ones: started, or dropped."""
        del self._waiting[w.key[2]]
        line = self._lines[w.urgency, w.share]
        line.remove(w.key[1:])
        if not line:
            del self._lines[w.urgency, w.share]

    def _forget(self, share: Hashable) -> None:
        """``share``'s turn, once none of it waits or runs: its next request
        comes first among equals, and the shares a tenant can name (any
        namespace, until its request is served) are not kept for ever."""
        if not any(s == share for _, s in self._lines) and \
                not any(f.share == share for f in self._flying.values()):
            self._last.pop(share, None)

    def riders(self) -> list[Waiting]:
        """The waiting requests that ride on a step in flight (``rides``),
        taken out to start now (in flight once returned: ``landed`` each).
        One of a job and urgency at a time: the step it rides on may end
        before it looks, and it then runs as any request of its job would."""
        if self.admission is None:
            return []
        out: list[Waiting] = []
        riding = sorted((w for w in self._waiting.values() if rides(self.admission, w.req)),
                        key=lambda w: w.key)
        holding = self._holding() if riding else set()
        for w in riding:
            if (w.job, w.urgency) in holding:
                continue
            if w.job is not None:
                holding.add((w.job, w.urgency))
            self._take(w)
            if w.estimating is not None:
                w.estimating.cancel()  # it waits for no slot, and so for no room
            w.rider, w.estimate = True, 0
            self._flying[w.key[2]] = w
            self._last[w.share] = next(self._starts)
            out.append(w)
        return out

    def _holding(self) -> set[tuple[Hashable, int]]:
        """The jobs and urgencies in flight: a waiting request of one is held
        (it would only wait for that job's lock)."""
        return {(f.job, f.urgency) for f in self._flying.values() if f.job is not None}

    def landed(self, w: Waiting) -> None:
        """``w``, started, has ended: its slot, room and job are free."""
        self._flying.pop(w.key[2], None)
        self._forget(w.share)

    @property
    def reserved(self) -> int:
        """The estimates of the requests in flight."""
        return sum(w.estimate or 0 for w in self._flying.values())

    def messages(self) -> list[Msg]:
        return [w.msg for w in self._waiting.values()]

    def next(self, concurrency: int) -> Waiting | None:
        """The request to start now (in flight once returned: ``landed`` it),
        or None. It is the most urgent waiting request whose job is not held
        and of whose urgency (or a more urgent one) fewer than ``concurrency``
        are in flight, then the one of the share with the fewest as urgent in
        flight, then of the share whose turn came longest ago, then the oldest
        (``_first``). None starts while its estimate is
        still being made (``estimating``: made apart, so that a more urgent
        request fetched meanwhile need not wait for it), or while it does not
        fit the room beside the requests in flight (a smaller, less urgent
        one must not take the room it waits for). One always starts when
        none is in flight, whatever its size: it could never start otherwise."""
        head = self._first(concurrency)
        if head is None:
            return None
        if self.admission is not None and head.request_id is not None:
            if head.estimate is None:
                if not self._estimate_of(head).done():
                    return None
                assert head.estimating is not None
                head.estimate = 0 if head.estimating.cancelled() else \
                    head.estimating.result()
            if self._flying and self.reserved + head.estimate > self.admission.room():
                return None
        self._take(head)
        head.estimate = head.estimate or 0
        self._flying[head.key[2]] = head
        self._last[head.share] = next(self._starts)
        if self.admission is not None and \
                (nxt := self._first()) is not None and nxt.request_id is not None:
            # The next in line's, made while this one runs: ready when a slot
            # frees. It may then be a dump old (its job's last size not yet
            # updated): the step checks the disk again with its own, fresh.
            self._estimate_of(nxt)
        return head

    def _first(self, concurrency: int = 0) -> Waiting | None:
        """The first waiting request not held by its job: the most urgent,
        then the one whose share has the fewest as urgent in flight, then the
        one whose share started one longest ago (in turns), then the oldest;
        with ``concurrency``, only of an urgency with a slot free. A request
        is held while a request of its job as urgent is in flight here: it
        would only wait for that job's lock in a slot. (One look at each
        urgency and share's oldest not held: it is asked at each start, with
        up to 256 waiting.)"""
        holding = self._holding()
        shares: dict[Hashable, list[int]] = {}  # share: the urgencies of it in flight
        for f in self._flying.values():
            shares.setdefault(f.share, []).append(f.urgency)
        # Every slot of an urgency is taken once ``concurrency`` requests as
        # urgent or more are in flight: from the concurrency-th most urgent
        # on. A rider takes none: the dump it rides on holds one already.
        slotted = sorted(f.urgency for f in self._flying.values() if not f.rider)
        full = slotted[concurrency - 1] if concurrency and len(slotted) >= concurrency \
            else None
        best, best_key = None, (0, 0, 0, 0, 0)
        for (u, share), line in self._lines.items():
            if (full is not None and u >= full) or (best is not None and u > best_key[0]):
                continue
            for seq, n in line:  # its first not held
                w = self._waiting[n]
                if (w.job, u) not in holding:
                    k = (u, sum(1 for x in shares.get(share, ()) if x == u),
                         self._last.get(share, -1), seq, n)
                    if best is None or k < best_key:
                        best, best_key = w, k
                    break
        return best

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
        self._lines.clear()
        for share in list(self._last):
            self._forget(share)
        return msgs

    async def keep_alive(self, every: float) -> None:
        """Tell JetStream every ``every`` seconds that the waiting requests are
        in hand, so that none is delivered again while it waits."""
        while True:
            await asyncio.sleep(every)
            for m in self.messages():
                with contextlib.suppress(Exception):  # NATS away: the next beat may pass
                    await m.in_progress()
