"""Warm-start templates: a pod labelled ``<prefix>/snapshot-when-ready:
"<name>"`` gets one leave-running checkpoint of each of its containers,
stored as template ``<name>`` (``layout.template_id``), once it first
reports Ready (its readiness probe passed: it is warm). docs/warm-start.md.

Taken once: a template that storage already holds is not taken again (a
restarted container, a second replica of the same Deployment, a restarted
watcher), until it is deleted. The request id comes from the pod's uid and
the container's restart count, so the watcher's replicas and a repeated
event publish it once (JetStream drops the duplicates). Replicas that turn
Ready together would each pass the storage check before either template is
stored: only the first of them to turn Ready takes it (``takes_template``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from services.policy import PodPolicy
from services.storage.layout import template_id
from smr.contract.messages import CkptRequested, Target, derive_request_id, epoch


def is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (every container passed its
    readiness probe), and it is not on its way out."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or [])


def template_requests(pod: dict[str, Any], policy: PodPolicy, deadline: str
                      ) -> list[CkptRequested]:
    """The template checkpoints a Ready pod labelled snapshot-when-ready asks
    for, one per running container (before the storage check)."""
    name = policy.snapshot_when_ready
    meta, node = pod["metadata"], (pod.get("spec") or {}).get("nodeName")
    if not name or not node or not is_ready(pod):
        return []
    out = []
    for st in (pod.get("status") or {}).get("containerStatuses") or []:
        if not st.get("ready") or "running" not in (st.get("state") or {}):
            continue
        ckpt = template_id(name, st["name"])
        out.append(CkptRequested(
            request_id=derive_request_id("template", meta["namespace"], ckpt, meta["uid"],
                                         str(st.get("restartCount", 0))),
            checkpoint_id=ckpt, node=node, reason="template", leave_running=True,
            deadline=deadline,
            target=Target(kind="pod", namespace=meta["namespace"], pod=meta["name"],
                          container=st["name"], pod_uid=meta["uid"])))
    return out


def ready_since(pod: dict[str, Any]) -> float:
    """When the pod turned Ready, as its kubelet recorded it (whole seconds);
    its creation where no transition is recorded."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("lastTransitionTime"):
            return _epoch_or_zero(c["lastTransitionTime"])
    return _epoch_or_zero((pod.get("metadata") or {}).get("creationTimestamp") or "")


def _epoch_or_zero(ts: str) -> float:
    try:
        return epoch(ts)
    except ValueError:
        return 0.0


def takes_template(pod: dict[str, Any], pods: Iterable[dict[str, Any]],
                   template_of: Callable[[dict[str, Any]], str | None], *,
                   now: float, turn_s: float, failed: Collection[str] = ()) -> bool:
    """Whether ``pod`` is the one of its namespace's Ready pods labelled for
    the same template that takes it: the first to have turned Ready (then
    the first created, then the least uid: the same answer on every watcher
    replica), among those that turned Ready within ``turn_s`` (the time a
    template request may take), or among all if none did.

    The first Ready, not the first created: its event comes first, so it
    may already be taking the template when an older replica turns Ready
    (which must not take another). Within ``turn_s`` only: a replica Ready
    for longer had its turn (found the template stored, or took it), and
    one restarted after the template was deleted takes it again. The others
    are skipped, not marked done: the watcher reconsiders them when the one
    taking it goes, stops being Ready, or its request fails (``Watcher``).
    A pod whose template request failed (uids in ``failed``) is out."""
    meta = pod["metadata"]
    name = template_of(pod)
    if meta.get("uid") in failed:
        return False

    def order(p: dict[str, Any]) -> tuple[float, str, str]:
        m = p["metadata"]
        return (ready_since(p), m.get("creationTimestamp") or "", m.get("uid") or "")

    ready = [p for p in pods
             if p["metadata"].get("namespace") == meta.get("namespace") and is_ready(p)
             and template_of(p) == name and p["metadata"].get("uid") != meta.get("uid")
             and p["metadata"].get("uid") not in failed]
    ready.append(pod)
    pool = [p for p in ready if ready_since(p) >= now - turn_s] or ready
    first = min(pool, key=order)
    return first["metadata"].get("uid") == meta.get("uid")
