"""A container start waits for the copy it replaces: one copy of a lineage at a time.

A ReplicaSet, and a Job with the default ``podReplacementPolicy``
(TerminatingOrFailed), create the replacement of an evicted pod the moment
the old one gets its ``deletionTimestamp``, while the old one still runs in
its preStop hook, waiting for its final checkpoint. Were the replacement's
container answered at once, it would restore what is latest then (an older
checkpoint, or none: a fresh start) beside the copy still running, and the
final checkpoint, stored a moment later, would be orphaned.

So before a container that resumes from checkpoint id X is answered, every
other pod of its namespace that also resumes from X and is terminating (a
``deletionTimestamp``, not yet Succeeded or Failed) is waited for, until it
is gone, has ended, or its grace has run out (its node may be dead: its
kubelet then never reports). The wait is in an Event on the new pod, and so
is its outcome: the final checkpoint stored while the old pod ended, or none
(the final failed or was never asked for), in which case the latest before it
is restored, or the container starts fresh when there is none.

The old pod is found from the API, not from a record the watcher keeps:
the controller creates the replacement only after the API server has the old
pod's deletionTimestamp, so it is always seen, whichever event reaches the
watcher first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from kubernetes_asyncio.client.exceptions import ApiException

from services.containers.pods import Pods
from services.policy import policy_for
from smr.config import Settings
from smr.contract.errors import TemporaryError
from smr.contract.messages import derive_request_id

log = logging.getLogger("smr.agent")

COMPONENT = "smr-agent"
POLL_S = 0.5
# After the old pod's grace: the kubelet's own minimum after a preStop hook
# (2 s), its report and its delete.
SLACK_S = 10.0


@dataclass(frozen=True)
class Predecessor:
    name: str
    uid: str
    node: str
    grace: float  # its deletionGracePeriodSeconds


@dataclass(frozen=True)
class Waited:
    predecessors: tuple[Predecessor, ...]
    seconds: float
    timed_out: bool  # a predecessor still ran when its grace was over


def _ended(pod: dict[str, Any] | None, uid: str) -> bool:
    """Gone, replaced by another pod of its name, or no container of it runs."""
    if pod is None or pod["metadata"].get("uid") != uid:
        return True
    st = pod.get("status") or {}
    if st.get("phase") in ("Succeeded", "Failed"):
        return True
    statuses = st.get("containerStatuses") or []
    return bool(statuses) and all("running" not in (c.get("state") or {}) for c in statuses)


class Lineage:
    def __init__(self, pods: Pods, settings: Settings) -> None:
        self.pods = pods
        self.core = pods.core
        self.s = settings

    async def predecessors(self, pod: dict[str, Any], checkpoint_id: str
                           ) -> list[Predecessor]:
        """The other pods of ``pod``'s namespace still terminating that resume
        from ``checkpoint_id`` too."""
        meta = pod["metadata"]
        try:
            resp = await self.core.list_namespaced_pod(meta["namespace"],
                                                       _preload_content=False,
                                                       _request_timeout=10)
        except ApiException as e:
            raise TemporaryError(f"cannot list the pods of namespace {meta['namespace']} "
                                 f"to find a copy of checkpoint {checkpoint_id} still "
                                 f"ending: {e.reason}", code="kube-api") from None
        out = []
        for other in orjson.loads(await resp.read())["items"]:
            m = other["metadata"]
            if m.get("uid") == meta.get("uid") or not m.get("deletionTimestamp") \
                    or _ended(other, m.get("uid", "")):
                continue
            if any(c.checkpoint_id == checkpoint_id
                   for c in policy_for(other, self.s).restorable()):
                grace = m.get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = (other.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                out.append(Predecessor(m["name"], m["uid"],
                                       (other.get("spec") or {}).get("nodeName") or "?",
                                       float(grace)))
        return out

    async def wait(self, pod: dict[str, Any], container: str, checkpoint_id: str,
                   found: list[Predecessor]) -> Waited:
        """Until every one of ``found`` has ended, each at most its grace (from now)."""
        meta = pod["metadata"]
        names = ", ".join(f"{p.name} (node {p.node})" for p in found)
        longest = max(p.grace for p in found) + SLACK_S
        await self.event(pod, "WaitingForFinalCheckpoint", container, checkpoint_id,
                         f"container {container}: pod {names}, which resumes from "
                         f"checkpoint {checkpoint_id} too, is ending and may be taking its "
                         f"final checkpoint; waiting for it to end (at most {longest:.0f} s) "
                         "before restoring, so that two copies never run")
        log.info("pod %s/%s container %s: waiting for pod %s to end before restoring %s",
                 meta["namespace"], meta["name"], container, names, checkpoint_id)
        t0 = time.monotonic()
        pending = {p.uid: (p, t0 + p.grace + SLACK_S) for p in found}
        timed_out = False
        while pending:
            now = time.monotonic()
            for uid, (p, until) in list(pending.items()):
                if _ended(await self.pods.read(meta["namespace"], p.name), uid):
                    del pending[uid]
                elif now > until:
                    log.warning("pod %s/%s still runs %.0f s after its grace began (its node "
                                "%s may be gone); container %s of pod %s goes on without it",
                                meta["namespace"], p.name, p.grace, p.node, container,
                                meta["name"])
                    timed_out = True
                    del pending[uid]
            if pending:
                await asyncio.sleep(POLL_S)
        return Waited(tuple(found), time.monotonic() - t0, timed_out)

    async def event(self, pod: dict[str, Any], reason: str, container: str, key: str,
                    message: str, *, warning: bool = False) -> None:
        """An Event on ``pod``, once per pod, container and ``key`` (a second
        answer to the same start posts none: its name is taken)."""
        meta = pod["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"metadata": {"name": f"{meta['name'][:200]}.smr-" + derive_request_id(
                    reason, meta.get("uid", ""), container, key)[:16],
                             "namespace": meta["namespace"]},
                "involvedObject": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta.get("uid")},
                "reason": reason, "message": message[:1024],
                "type": "Warning" if warning else "Normal",
                "source": {"component": COMPONENT, "host": self.s.node},
                "reportingComponent": COMPONENT, "firstTimestamp": now, "lastTimestamp": now,
                "count": 1}
        try:
            await self.core.create_namespaced_event(meta["namespace"], body,
                                                    _request_timeout=10)
        except ApiException as e:  # the Event only explains; the restore goes on
            if e.status != 409:
                log.warning("cannot post the %s Event on pod %s/%s: %s", reason,
                            meta["namespace"], meta["name"], e.reason)
