"""What in a Node object means smr should checkpoint the pods on it.

Supported signals (README "Watcher" lists them for users; docs/kubernetes.md
says what each provider sends):

- ``cordon``: ``spec.unschedulable`` is true (``kubectl cordon`` / ``drain``);
- ``preemption``: one of the taints in ``PREEMPTION_TAINTS`` (or
  SMR_PREEMPTION_TAINTS), a condition in ``PREEMPTION_CONDITIONS`` with
  status True, or AKS's ``VMEventScheduled`` naming an event that takes the
  VM away (``VM_EVENTS``; a Freeze is a pause, not that);
- ``shutdown``: graceful node shutdown: the kubelet reports ``Ready=False``
  "node is shutting down" and stops every pod itself (no deletion, no
  ``deletionTimestamp``; GKE Spot's preemption is this);
- ``node-deleted``: the Node has a deletionTimestamp, or is gone.

Pod signals: who ends a pod, as the control plane marks it (since
Kubernetes 1.26 every disruption first sets the pod's ``DisruptionTarget``
condition, its reason naming who; a plain ``DELETE`` sets none):

- ``drain``: ``EvictionByEvictionAPI`` (``kubectl drain``, the descheduler,
  the VPA updater, cluster-autoscaler, Karpenter) or
  ``DeletionByTaintManager`` (a NoExecute taint), on any node;
- ``preempted``: ``PreemptionByScheduler``, priority preemption;
- ``suspended``: a pod deleted with no ``DisruptionTarget`` whose Job has
  ``spec.suspend: true`` (Kueue preempting its Workload, or anyone suspending
  the Job): the Job controller's plain delete, read from the Job itself
  (services/suspension); the Job's new pods resume from it when it runs again;
- any other pod deleted with no ``DisruptionTarget`` is the user's own decision
  (``kubectl delete``, a controller scaling down): nothing, wherever it runs;
- ``TerminationByKubelet`` on a Failed pod: graceful node shutdown (status
  reason ``Terminated``; the node's ``shutdown``) or a node-pressure eviction
  (``Evicted``: grace 0 past a hard threshold, so nothing can be saved, and
  the pod is left as Kubernetes leaves it).

Only ``FINAL`` reasons take a final checkpoint (the workload ends with it):
those where the kubelet is already stopping the pod, which waits in its
preStop hook for the checkpoint. Every other signal can be undone or comes
before the eviction (cluster-autoscaler removes its taint when a drain
fails, Karpenter can cancel, AWS's rebalance recommendation is a warning):
a leave-running checkpoint, and the workload stops only through the
eviction or the kubelet's SIGTERM, never smr's own kill.
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
    "remediator.kubernetes.azure.com/unschedulable": "AKS is draining the node (auto-repair "
                                                     "or a scheduled event)",
}
# node-problem-detector conditions (AKS scheduled events).
PREEMPTION_CONDITIONS: dict[str, str] = {
    "PreemptScheduled": "a spot preemption is scheduled",
    "TerminateScheduled": "a termination is scheduled",
}
# AKS node-problem-detector: VMEventScheduled, its message names the event.
VM_EVENTS = ("Preempt", "Terminate", "Reboot", "Redeploy")
SHUTTING_DOWN = "node is shutting down"  # the kubelet's Ready=False message
# Reasons whose checkpoint is final (the module's docstring says why only these).
FINAL = frozenset({"drain", "shutdown", "preempted", "suspended"})
# The reason a message carries (its schema's enum): shutdown is a preemption.
MESSAGE_REASON = {"shutdown": "preemption", "preempted": "preemption"}  # others: their name
# DisruptionTarget reasons of a graceful deletion (the kubelet runs the pod's
# preStop hook, which waits for the final checkpoint), and the pod signal each is.
FINAL_DISRUPTIONS = {"EvictionByEvictionAPI": "drain", "DeletionByTaintManager": "drain",
                     "PreemptionByScheduler": "preempted"}
KUBELET = "TerminationByKubelet"
SHUTDOWN_STATUS = "Terminated"  # the kubelet's status reason after graceful node shutdown


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
        kind, status, message = c.get("type"), c.get("status"), str(c.get("message") or "")
        if kind in PREEMPTION_CONDITIONS and status == "True":
            out.setdefault("preemption", f"condition {kind}: {PREEMPTION_CONDITIONS[kind]}")
        elif kind == "VMEventScheduled" and status == "True" \
                and any(e in message for e in VM_EVENTS):
            out.setdefault("preemption", f"condition VMEventScheduled: {message[:200]}")
        elif kind == "Ready" and status == "False" and SHUTTING_DOWN in message:
            out["shutdown"] = "Ready=False: node is shutting down (graceful node shutdown)"
    if spec.get("unschedulable"):
        out["cordon"] = "spec.unschedulable is true"
    return out



def disruption(pod: dict[str, Any]) -> str | None:
    """The reason of the pod's DisruptionTarget condition: who is ending it
    (None: nobody, or a plain delete)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return str(c.get("reason") or "")
    return None


def shut_down_by_kubelet(pod: dict[str, Any]) -> bool:
    """Failed by graceful node shutdown (not by a node-pressure eviction,
    which carries the same DisruptionTarget reason with status ``Evicted``)."""
    status = pod.get("status") or {}
    return status.get("phase") == "Failed" and disruption(pod) == KUBELET \
        and status.get("reason") == SHUTDOWN_STATUS


def pod_reasons(pod: dict[str, Any], of_node: list[str], *, suspended: bool = False
                ) -> list[str]:
    """The checkpoints a pod gets (``of_node``: its node's reasons;
    ``suspended``: its Job has ``spec.suspend: true``). A pod being deleted
    by a disruption (the kubelet stops it once its preStop hook has seen the
    final checkpoint): that one final checkpoint, on any node, instead of
    leave-running ones, which would only spend its budget; deleted by its
    suspended Job: the final ``suspended``; deleted with no disruption (the
    user's delete): none. Otherwise the node's reasons; on a node shutting
    down, the final ``shutdown`` alone."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        by = disruption(pod)
        if by is None:
            return ["suspended"] if suspended else []
        if by in FINAL_DISRUPTIONS:
            return [FINAL_DISRUPTIONS[by]]
    final = [r for r in of_node if r in FINAL]
    return final[:1] or of_node  # one final checkpoint: a second finds no workload


def final_expected(pod: dict[str, Any], node: dict[str, Any] | None,
                   extra_taints: tuple[str, ...] = (), *, suspended: bool = False) -> bool:
    """Does the watcher ask for a final checkpoint of ``pod``, on ``node``
    (None: deleted)? As ``pod_reasons`` says."""
    reasons = ["node-deleted"] if node is None else list(node_reasons(node, extra_taints))
    return any(r in FINAL for r in pod_reasons(pod, reasons, suspended=suspended))
