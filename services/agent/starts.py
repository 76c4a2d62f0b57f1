"""Container starts on this node: every smr-init that waits gets its answer.

    smr-init waits (PID 1, nothing else running)
    → its container in the pod's status (container ID) → the pod's policy
    → not opted in, or no checkpoint stored: "fresh"
    → labelled start-from, no checkpoint of its own: restore the template
      (docs/warm-start.md); it fails like any restore when the template is
      missing or corrupt
    → otherwise "restoring", and a restore.requested for this node whose
      request_id comes from the container ID: one restore per container start,
      whatever is repeated. The restore step answers "restored <pid>"; a
      refused or failed restore answers "fresh", or "fail" when the pod's
      policy (label <prefix>/restore-failure: fail) forbids starting over.

A container no pod of this node claims yet (the kubelet has not reported its
ID) is looked for again while its smr-init waits: every scan at first, then
every RECHECK_S (another node's, on a host shared by two nodes, is never
claimed). Without an answer, smr-init's own timeout applies the pod's policy
(SMR_RESTORE_FAILURE, which the webhook sets): a fresh start, or exit 70.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any, get_args

from opentelemetry import trace

from services.agent import unanswered
from services.agent.alive import StartsTurn
from services.agent.lineage import Lineage, Waited
from services.containers import host
from services.containers.confined import UnsafePath
from services.containers.host import Shim
from services.containers.pods import Pods, runtime_id
from services.policy import policy_for
from services.storage.layout import template_id
from services.storage.store import CheckpointStore
from smr import tracing
from smr.aio import wait_event
from smr.bus import QUERY_LATEST, Bus
from smr.config import Settings
from smr.contract.errors import SmrError, TemporaryError
from smr.contract.messages import Reason, RestoreRequested, StorageQuery, Target, derive_request_id
from smr.jobs import proc_start_ticks

log = logging.getLogger("smr.agent")

SCAN_S = 0.25
UNKNOWN_FOR_S = 20.0  # a shim no pod of this node claimed for this long: looked for less often
RECHECK_S = 2.0
RESTORE_WAIT_S = 3600.0


class StartRestores:
    def __init__(self, bus: Bus, pods: Pods, settings: Settings,
                 store: CheckpointStore) -> None:
        self.bus = bus
        self.pods = pods
        self.store = store  # the manifests a StartedWithoutAgent Event looks at
        self.s = settings
        self.node = settings.node
        self.lineage = Lineage(pods, settings)
        self._seen: dict[tuple[int, int], float] = {}  # shim (pid, start) → first seen
        self._busy: set[tuple[int, int]] = set()
        self._done: set[tuple[int, int]] = set()
        self._checked: set[tuple[int, int]] = set()  # running: looked for `unanswered`
        self._tasks: set[asyncio.Task[None]] = set()
        self._listed_at = -math.inf
        self.answering = False  # holds the node's starts lock

    async def run(self, stop: asyncio.Event) -> None:
        # One agent of the node answers starts (the old one of a rollout,
        # until it ends): services/agent/alive.py.
        turn = StartsTurn(self.s.step_lock_path)
        try:
            if not await turn.take(stop):
                return
            self.answering = True
            while not stop.is_set():
                await self.scan()
                await wait_event(stop, SCAN_S)
        finally:
            for t in self._tasks:
                t.cancel()
            turn.release()
            self.answering = False

    async def scan(self) -> None:
        waiting, alive, fresh = [], set(), []
        # Off the event loop: /proc and the status file of each container not
        # answered yet. One answered, or refused once, is not read again.
        for key, shim, st in await asyncio.to_thread(_statuses, self._done | self._busy):
            alive.add(key)
            if key in self._done or key in self._busy:
                continue
            if isinstance(st, UnsafePath):
                log.warning("container of pid %s: %s", shim.pid, st.message)
                self._done.add(key)  # not answered: smr-init's own timeout applies
                continue
            if st and st[0] == "running" and key not in self._checked:
                # Started fresh by smr-init's own timeout (no agent answered
                # in time): said once, in a Warning Event (unanswered.py).
                self._checked.add(key)
                if await asyncio.to_thread(shim.unanswered):
                    fresh.append(shim)
                continue
            if not st or st[0] != "waiting":
                continue
            self._seen.setdefault(key, time.monotonic())
            waiting.append((key, shim))
        # Forget containers that are gone (their keys never come back).
        self._done &= alive
        self._checked &= alive
        self._seen = {k: v for k, v in self._seen.items() if k in alive}
        now = time.monotonic()
        if not fresh and (not waiting or (
                now - self._listed_at < RECHECK_S
                and all(now - self._seen[k] > UNKNOWN_FOR_S for k, _ in waiting))):
            return
        self._listed_at = now
        try:
            pods = await self.pods.on_node()
        except SmrError as e:
            log.warning("cannot list this node's pods: %s", e.message)
            return
        for shim in fresh:
            if found := _claim(pods, host.container_id_of(shim.pid) or ""):
                self._spawn(unanswered.report(self, *found))
        for key, shim in waiting:
            found = _claim(pods, host.container_id_of(shim.pid) or "")
            if found is None:
                continue  # looked for again while smr-init waits
            self._busy.add(key)
            self._spawn(self._answer(key, shim, *found))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, key: tuple[int, int], shim: Shim, pod: dict[str, Any],
                      status: dict[str, Any]) -> None:
        meta, name = pod["metadata"], status["name"]
        try:
            with tracing.tracer.start_as_current_span(
                    "container start", attributes={"k8s.pod.name": meta["name"],
                                                   "k8s.container.name": name}):
                decision = await self._decision(pod, status, shim)
                await asyncio.to_thread(shim.decide, decision)
            self._done.add(key)
        except SmrError as e:
            log.warning("pod %s/%s container %s: %s; asked again shortly", meta["namespace"],
                        meta["name"], name, e.message)
        except Exception:
            log.exception("pod %s/%s container %s: answering smr-init failed",
                          meta["namespace"], meta["name"], name)
        finally:
            self._busy.discard(key)

    async def _decision(self, pod: dict[str, Any], status: dict[str, Any], shim: Shim) -> str:
        meta, name = pod["metadata"], status["name"]
        policy = policy_for(pod, self.s)
        mine = next((c for c in policy.restorable() if c.name == name), None)
        # A replica starts from its template only while it has no checkpoint
        # of its own (docs/warm-start.md): a replica that was drained or
        # heartbeated resumes its own state, never the template's again.
        template = template_id(policy.start_from, name) if policy.start_from else None
        if mine is None and template is None:
            return "fresh"
        if policy.restore_failure == "fail":
            # Whatever follows (storage down, this agent restarting), smr-init
            # must not time out into the fresh start the policy forbids.
            await asyncio.to_thread(shim.decide, "restoring")
        gen: dict[str, Any] | None = None
        if mine is not None:
            # A copy of this lineage still ending (its controller replaced it
            # at its deletionTimestamp) is waited for: its final checkpoint is
            # what this container resumes from (services/agent/lineage.py).
            found = await self.lineage.predecessors(pod, mine.checkpoint_id)
            waited: Waited | None = None
            before: dict[str, Any] | None = None
            if found:
                # smr-init must not time out into a fresh start meanwhile.
                await asyncio.to_thread(shim.decide, "restoring")
                before = await self._latest(mine.checkpoint_id, meta["namespace"])
                waited = await self.lineage.wait(pod, name, mine.checkpoint_id, found)
            gen = await self._latest(mine.checkpoint_id, meta["namespace"])
            if waited is not None:
                await self._waited(pod, name, mine.checkpoint_id, waited, before, gen)
        if gen is not None:
            assert mine is not None
            ckpt = mine.checkpoint_id
            reason = gen.get("reason") if gen.get("reason") in get_args(Reason) else "api"
        elif template is not None:
            # Its latest generation, picked by the restore step: a template
            # that is missing or unreadable fails there, and that failure is
            # a RestoreFailed Event and the pod's restore-failure policy.
            ckpt, reason, gen = template, "template", {}
        else:
            return "fresh"
        req = RestoreRequested(
            request_id=derive_request_id("restore", meta["uid"], name,
                                         runtime_id(status["containerID"])),
            checkpoint_id=ckpt, node=self.node, generation=gen.get("generation"),
            reason=reason,  # type: ignore[arg-type]
            # The uid: the restore is of this pod's container alone, and its
            # Restored Event names this pod, not every pod of its name.
            target=Target(kind="pod", namespace=meta["namespace"], pod=meta["name"],
                          container=name, pod_uid=meta.get("uid") or None))
        log.info("pod %s/%s container %s starts: restoring %s generation %s",
                 meta["namespace"], meta["name"], name, ckpt, req.generation or "latest")
        # smr-init waits without its start timeout from here on.
        await asyncio.to_thread(shim.decide, "restoring")
        # The restore joins the trace of the checkpoint it restores (a cordon's,
        # a heartbeat's), linked to this container's start.
        here = trace.get_current_span().get_span_context()
        with tracing.tracer.start_as_current_span(
                "resume from checkpoint", context=tracing.continuing(gen.get("traceparent")),
                links=[trace.Link(here)] if here.is_valid else None,
                attributes={"k8s.pod.name": meta["name"], "k8s.container.name": name,
                            "smr.checkpoint_id": ckpt,
                            "smr.generation": gen.get("generation") or 0}):
            result = await self.bus.request(req, timeout=RESTORE_WAIT_S)
        if result.status == "succeeded":
            return f"restored {result.pid}"
        error = result.error or {}
        message = f"{error.get('code', 'failed')}: {error.get('message', '')}"
        if policy.restore_failure == "fail":
            return f"fail restore of {ckpt} failed ({message}); the pod's " \
                   f"policy {self.s.label_prefix}/restore-failure=fail forbids a fresh start"
        log.warning("pod %s/%s container %s starts fresh: restore failed (%s)",
                    meta["namespace"], meta["name"], name, message)
        return "fresh"


    async def _latest(self, ckpt: str, namespace: str) -> dict[str, Any] | None:
        reply = await self.bus.query(QUERY_LATEST, StorageQuery(
            checkpoint_id=ckpt, namespace=namespace), timeout=10)
        if reply.error:
            # Not "no checkpoint": a fresh start now would become the latest
            # checkpoint over the real one. Asked again shortly.
            raise TemporaryError(f"cannot ask storage for checkpoint {ckpt}: "
                                 f"{reply.error.get('message', reply.error)}",
                                 code="storage-query-failed")
        return reply.generations[0] if reply.generations else None

    async def _waited(self, pod: dict[str, Any], container: str, ckpt: str, waited: Waited,
                      before: dict[str, Any] | None, gen: dict[str, Any] | None) -> None:
        """What the wait for the copies still ending came to, in an Event."""
        names = ", ".join(p.name for p in waited.predecessors)
        ended = f"pod {names} {'ran on past its grace' if waited.timed_out else 'ended'} " \
                f"after {waited.seconds:.1f} s"
        number = (gen or {}).get("generation")
        if gen is not None and number != (before or {}).get("generation"):
            await self.lineage.event(
                pod, "FinalCheckpointReady", container, ckpt,
                f"container {container}: {ended}; restoring checkpoint {ckpt} generation "
                f"{number} ({gen.get('reason')}), stored while it ended")
            return
        why = (f"no checkpoint of {ckpt} was stored while it ended (its final checkpoint "
               "failed or was not asked for)")
        await self.lineage.event(
            pod, "FinalCheckpointMissing", container, ckpt,
            f"container {container}: {ended}; {why}: " + (
                f"restoring generation {number} ({gen.get('reason')}), the latest before it"
                if gen is not None else "no checkpoint exists, so it starts fresh"),
            warning=True)


def _statuses(skip: set[tuple[int, int]]
              ) -> list[tuple[tuple[int, int], Shim, list[str] | UnsafePath | None]]:
    """Every shim of the host by (pid, start): its status, or why it was
    refused; None for those in ``skip`` (not read)."""
    out: list[tuple[tuple[int, int], Shim, list[str] | UnsafePath | None]] = []
    for shim in host.shims(max_age=host.SCAN_MAX_AGE_S):
        key = (shim.pid, proc_start_ticks(shim.pid) or 0)
        if key in skip:
            out.append((key, shim, None))
            continue
        try:
            out.append((key, shim, shim.status()))
        except UnsafePath as e:
            out.append((key, shim, e))
    return out


def _claim(pods: list[dict[str, Any]], container_id: str
           ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The pod and container status whose container ID is ``container_id``."""
    for pod in pods:
        for st in (pod.get("status") or {}).get("containerStatuses") or []:
            if st.get("containerID") and runtime_id(st["containerID"]) == container_id:
                return pod, st
    return None
