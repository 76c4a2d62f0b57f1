"""What in a Node object means smr should checkpoint the pods on it.

Supported signals (README "Watcher" lists them for users):

- ``cordon``: ``spec.unschedulable`` is true (``kubectl cordon`` / ``drain``);
- ``preemption``: one of the taints in ``PREEMPTION_TAINTS`` (or
  SMR_PREEMPTION_TAINTS), or a condition in ``PREEMPTION_CONDITIONS`` with
  status True;
- ``node-deleted``: the Node has a deletionTimestamp, or is gone.

(``drain`` is a pod signal: an opted-in pod terminating on a node above.)
"""

from __future__ import annotations

from typing import Any

PREEMPTION_TAINTS: dict[str, str] = {
    "ToBeDeletedByClusterAutoscaler": "cluster-autoscaler is removing the node",
    "karpenter.sh/disrupted": "Karpenter is disrupting the node",
    "karpenter.sh/disruption": "Karpenter (before v1) is disrupting the node",
    "aws-node-termination-handler/spot-itn": "AWS spot interruption notice",
    "aws-node-termination-handler/asg-lifecycle-termination": "AWS ASG is terminating the node",
    "aws-node-termination-handler/scheduled-maintenance": "AWS scheduled maintenance",
    "aws-node-termination-handler/rebalance-recommendation": "AWS rebalance recommendation",
    "cloud.google.com/impending-node-termination": "GCE is terminating the node",
    "node.cloudprovider.kubernetes.io/shutdown": "the cloud provider shut the node down",
}
# node-problem-detector conditions (AKS scheduled events).
PREEMPTION_CONDITIONS: dict[str, str] = {
    "PreemptScheduled": "a spot preemption is scheduled",
    "TerminateScheduled": "a termination is scheduled",
}


def node_reasons(node: dict[str, Any], extra_taints: tuple[str, ...] = ()) -> dict[str, str]:
    """reason → what showed it, for a Node that is going away ({} when it is not)."""
    out: dict[str, str] = {}
    spec = node.get("spec") or {}
    if (node.get("metadata") or {}).get("deletionTimestamp"):
        out["node-deleted"] = "the Node is being deleted"
    for t in spec.get("taints") or []:
        key = t.get("key", "")
        if key in PREEMPTION_TAINTS or key in extra_taints:
            out.setdefault("preemption", f"taint {key}: "
                           f"{PREEMPTION_TAINTS.get(key, 'configured preemption taint')}")
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") in PREEMPTION_CONDITIONS and c.get("status") == "True":
            out.setdefault("preemption", f"condition {c['type']}: "
                           f"{PREEMPTION_CONDITIONS[c['type']]}")
    if spec.get("unschedulable"):
        out["cordon"] = "spec.unschedulable is true"
    return out

