"""A final checkpoint takes over a leave-running dump of its container in flight.

``kubectl drain`` (cluster-autoscaler, Karpenter) cordons, then evicts: each
opted-in pod gets a leave-running request, and a moment later its final one.
A final that waited for the leave-running dump and then dumped again would
cost two dumps inside the pod's grace. Instead, on this agent, the final
request finds the leave-running step of the same container (the same
container id) in its own lineage (the same namespace and checkpoint id)
where it is; a leave-running dump of another lineage (a snapshot-when-ready
template, say) is neither taken over nor made to step aside: the final one
waits for the container's lock and dumps, as without a takeover:

- before the freeze (its lock taken, pre-freeze work): the leave-running step
  steps aside, nothing frozen, answered failed ``taken-over``; the final one
  dumps, once;
- frozen, not yet run on: the dump is finished as the final one. Its tree
  stays stopped; a marker beside its work directory (``<request>.final``,
  written durably) names the final request; its manifest records the final
  reason, ``leave_running: false`` and ``final_request_id``; once it is
  durable (latest moved), the tree is ended and the preStop hook told
  ``done N``. The final request answers with that generation;
- run on already (or a GPU tree, which its heartbeat resumes): the final
  request dumps again, and says so in its log.

If the taken-over dump cannot be stored, its tree runs on and the final
request dumps it itself, under the lock, as it would have. The marker makes
every recovery end the same way: a recovered leave-running step with a
marker settles as a final one (ended and ``done N`` once stored; run on,
hook left to the final request, if not), and a final request first stores a
finished dump that names it, then answers from a ``latest`` that names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from services.storage.generation import Generation
from smr.bus import Progress
from smr.contract.errors import PermanentError
from smr.contract.messages import CkptRequested, Target
from smr.identity import write_durably

log = logging.getLogger("smr.checkpointer")

SUFFIX = ".final"


@dataclass
class Flight:
    """A leave-running dump of one container in progress on this agent."""
    request_id: str
    checkpoint_id: str  # its lineage: only a final of the same one takes it over
    container_id: str
    # before → frozen → taken (held for a final) or ran-on (or failed)
    phase: str = "before"
    meta: dict[str, Any] | None = None  # its manifest-to-be, while its commit runs
    outcome: asyncio.Future[tuple[Generation, bool] | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


def key(target: Target) -> tuple[str, str, str]:
    """A pod's container, whichever of its instances runs: a final request is
    for the workload it runs now, as the leave-running dump of it is."""
    return target.namespace or "", target.pod or "", target.container or ""


Key = tuple[str, str, str]


class Flights:
    """The leave-running dumps in flight and the final requests in progress,
    per pod container (one agent's; a final is always on its pod's node).
    A final is known from the moment its step starts, before any await: a
    dump ending meanwhile sees it."""

    def __init__(self) -> None:
        self._flights: dict[Key, Flight] = {}
        self._finals: dict[Key, CkptRequested] = {}

    def begin(self, key: Key, req: CkptRequested, container_id: str) -> Flight:
        flight = self._flights[key] = Flight(req.request_id, req.checkpoint_id, container_id)
        return flight

    def end(self, key: Key, flight: Flight,
            outcome: tuple[Generation, bool] | None) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not flight.outcome.done():
            flight.outcome.set_result(outcome)

    def flight(self, key: Key) -> Flight | None:
        return self._flights.get(key)

    def flight_for(self, key: Key, final: CkptRequested) -> Flight | None:
        """The leave-running dump of this pod container in flight here that
        ``final`` may take over: one of its own lineage, never another's."""
        flight = self._flights.get(key)
        return flight if flight is not None and flight.checkpoint_id == final.checkpoint_id \
            else None

    def final_for(self, key: Key, flight: Flight) -> CkptRequested | None:
        """The final request of this pod container in progress here that
        takes ``flight`` over (or makes it step aside): one of its lineage."""
        return self.final_of(key, flight.checkpoint_id)

    def final_of(self, key: Key, checkpoint_id: str) -> CkptRequested | None:
        """The final request of this pod container and lineage in progress
        here, if one is (it may still wait for the container's lock)."""
        final = self._finals.get(key)
        return final if final is not None and final.checkpoint_id == checkpoint_id else None

    @contextlib.contextmanager
    def final(self, key: Key, req: CkptRequested) -> Iterator[None]:
        """While a final request runs: seen by a leave-running step of the
        same pod container."""
        mine = key not in self._finals
        if mine:
            self._finals[key] = req
        try:
            yield
        finally:
            if mine and self._finals.get(key) is req:
                del self._finals[key]


def make_way(flights: Flights, req: CkptRequested) -> None:
    """A leave-running request of a pod container whose final request (its
    lineage's) is in progress here steps aside, nothing frozen: raises
    ``taken-over``. Asked as the step starts, at each look at the container's
    lock while it waits, and once more before the freeze, so that no waiting
    leave-running step takes the lock ahead of the final one (the lock
    serves its waiters in no order)."""
    if not req.leave_running:
        return
    if (final := flights.final_of(key(req.target), req.checkpoint_id)) is not None:
        raise PermanentError(
            f"the final checkpoint of {req.target} ({final.request_id}), asked for "
            "meanwhile, takes this one's place; nothing was dumped for it",
            code="taken-over", hint="the final checkpoint is the workload's state; nothing "
            "to do")


async def wait(flight: Flight, req: CkptRequested,
               progress: Progress) -> tuple[Generation, bool] | None:
    """What ``req`` (a final request) gets from ``flight``: the generation of
    the dump it took over, or None where it must dump itself."""
    if flight.phase in ("frozen", "taken"):
        # Taken: held for a final of this container already (this one, or
        # another id of it): its outcome is the answer, as when frozen.
        progress.update("taking-over", taking_over=flight.request_id)
        log.info("final checkpoint %s of %s takes over dump %s in flight (%s): "
                 "one dump", req.request_id, req.target, flight.request_id, flight.phase)
        got = await asyncio.shield(flight.outcome)
        if got is None:
            log.warning("final checkpoint %s: the dump it took over (%s) was not stored; "
                        "%s runs on and is dumped again", req.request_id,
                        flight.request_id, req.target)
        return got
    if flight.phase == "before":
        log.info("final checkpoint %s of %s: dump %s steps aside before its freeze; "
                 "one dump", req.request_id, req.target, flight.request_id)
    else:
        log.warning("final checkpoint %s of %s: dump %s in flight lets it run on (%s); a "
                    "second dump, the final one, follows it", req.request_id, req.target,
                    flight.request_id, flight.phase)
    return None


def marker(work: Path) -> Path:
    # Beside the work directory, whose whole content is uploaded.
    return work.with_name(work.name + SUFFIX)


def hold_for(work: Path, dumped: CkptRequested, final: CkptRequested) -> None:
    """Record, durably, that ``final`` took over the dump of ``dumped`` in ``work``."""
    write_durably(marker(work), orjson.dumps({"request": dumped.to_dict(),
                                              "final": final.to_dict()}))


def _read(path: Path) -> tuple[CkptRequested, CkptRequested] | None:
    try:
        doc = orjson.loads(path.read_bytes())
        return CkptRequested.from_dict(doc["request"]), CkptRequested.from_dict(doc["final"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, or torn by a crash before it was durable: not taken over


def taken_by(work: Path) -> CkptRequested | None:
    """The final request that took over the dump in ``work``, if one did."""
    got = _read(marker(work))
    return got[1] if got else None


def naming(work_dir: Path, final_id: str) -> list[CkptRequested]:
    """The leave-running requests whose dumps ``final_id`` took over, left here."""
    found = []
    for path in work_dir.glob(f"*{SUFFIX}"):
        if (got := _read(path)) and got[1].request_id == final_id:
            found.append(got[0])
    return found


def as_final(meta: dict[str, Any], final: CkptRequested) -> None:
    """``meta`` (a taken-over dump's manifest-to-be) recorded as ``final``'s."""
    meta.update(reason=final.reason, leave_running=False, final_request_id=final.request_id)
    if isinstance(meta.get("sockets"), dict):
        # What the leave-running dump did: connections neither dumped nor locked.
        meta["sockets"]["tcp"] = "close"
