"""Warm-start templates: a pod labelled ``<prefix>/snapshot-when-ready:
"<name>"`` gets one leave-running checkpoint of each of its containers,
stored as template ``<name>`` (``layout.template_id``), once it first
reports Ready (its readiness probe passed: it is warm). docs/warm-start.md.

Taken once: a template that storage already holds is not taken again (a
restarted container, a second replica of the same Deployment, a restarted
watcher), until it is deleted. The request id comes from the pod's uid and
the container's restart count, so the watcher's replicas and a repeated
event publish it once (JetStream drops the duplicates).
"""

from __future__ import annotations

from typing import Any

from services.policy import PodPolicy
from services.storage.layout import template_id
from smr.messages import CkptRequested, Target, derive_request_id


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
