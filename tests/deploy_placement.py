"""Where rendered manifests put smr's pieces on a cluster of nodes: which node
runs which agent DaemonSet (node selectors, node affinity, taints and
tolerations, as the DaemonSet controller decides), which runtime handlers the
agent installs there (services/agent/install.py: `smr` where runc is,
`smr-nvidia` where the NVIDIA runtime is), the labels it then sets
(services/agent/nodelabel.py), and where a pod given an smr RuntimeClass can be
scheduled (the class's scheduling.nodeSelector; the pod is assumed to tolerate
every taint, the worst case)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.agent import nodelabel
from smr import config

# What the DaemonSet controller adds to every DaemonSet pod.
DAEMONSET_TOLERATIONS = [
    {"key": k, "operator": "Exists", "effect": e} for k, e in (
        ("node.kubernetes.io/not-ready", "NoExecute"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
        ("node.kubernetes.io/disk-pressure", "NoSchedule"),
        ("node.kubernetes.io/memory-pressure", "NoSchedule"),
        ("node.kubernetes.io/pid-pressure", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"))]


@dataclass
class Node:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    gpus: bool = False  # NVIDIA GPUs, and the NVIDIA container runtime


def taint(key: str, value: str = "", effect: str = "NoSchedule") -> dict[str, str]:
    return {"key": key, "value": value, "effect": effect}


# The kubelet labels every node with its OS.
LINUX = {"kubernetes.io/os": "linux"}
GPU = {**LINUX, "nvidia.com/gpu.present": "true"}
MIXED_CLUSTER = [
    Node("cpu-1", dict(LINUX)), Node("cpu-2", dict(LINUX)),
    Node("cpu-dedicated", dict(LINUX), [taint("dedicated", "batch")]),   # a user's own taint
    Node("cpu-cordoned", dict(LINUX), [taint("node.kubernetes.io/unschedulable")]),
    Node("gpu-1", dict(GPU), [taint("nvidia.com/gpu")], gpus=True),  # the GPU operator's taint
    Node("gpu-2", dict(GPU), [taint("nvidia.com/gpu", "present")], gpus=True),
    Node("gpu-untainted", dict(GPU), gpus=True),
]
# A Windows node of a mixed cluster, with the taint such pools usually carry.
WINDOWS = Node("win-1", {"kubernetes.io/os": "windows"}, [taint("os", "windows")])


def tolerated(t: dict[str, str], tolerations: list[dict[str, Any]]) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != t["effect"]:
            continue
        if tol.get("operator") == "Exists":
            if not tol.get("key") or tol["key"] == t["key"]:
                return True
        elif tol.get("key") == t["key"] and tol.get("value", "") == t.get("value", ""):
            return True
    return False


def _expression(e: dict[str, Any], labels: dict[str, str]) -> bool:
    op, key, values = e["operator"], e["key"], e.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise ValueError(f"operator {op} not simulated")


def pod_fits(spec: dict[str, Any], node: Node, extra_tolerations: list[dict[str, Any]]) -> bool:
    if any(node.labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if required and not any(all(_expression(e, node.labels) for e in term.get(
            "matchExpressions") or []) for term in required["nodeSelectorTerms"]):
        return False
    tolerations = (spec.get("tolerations") or []) + extra_tolerations
    return all(tolerated(t, tolerations) for t in node.taints
               if t["effect"] in ("NoSchedule", "NoExecute"))


def agent_daemonsets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "DaemonSet" and any(
        c.get("args") == ["agent"] for c in d["spec"]["template"]["spec"]["containers"])]


def handlers_installed(node: Node) -> list[str]:
    """What install.py installs on a node: `smr` (runc is everywhere here),
    `smr-nvidia` where the NVIDIA runtime is."""
    return ["smr", "smr-nvidia"] if node.gpus else ["smr"]


@dataclass
class Placement:
    agents: dict[str, list[str]]          # node → agent DaemonSets running there
    handlers: dict[str, list[str]]        # node → handlers installed
    classes: dict[str, dict[str, Any]]    # RuntimeClass name → object
    given: list[str]                      # classes the webhook can give a pod
    allowed: dict[str, list[str]]         # class → nodes its scheduling allows


def place(docs: list[dict[str, Any]], nodes: list[Node]) -> Placement:
    agents: dict[str, list[str]] = {n.name: [] for n in nodes}
    for ds in agent_daemonsets(docs):
        spec = ds["spec"]["template"]["spec"]
        for n in nodes:
            if pod_fits(spec, n, DAEMONSET_TOLERATIONS):
                agents[n.name].append(ds["metadata"]["name"])
    handlers = {n.name: handlers_installed(n) if agents[n.name] else [] for n in nodes}
    labelled = {n.name: {**n.labels, **{k: v for k, v in nodelabel.labels_for(
        handlers[n.name]).items() if v is not None}} for n in nodes}
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "smr-config")
    s = config.load({k: str(v) for k, v in (cm.get("data") or {}).items()
                     if k.startswith(config.PREFIX)})
    given = [s.runtime_class, *s.runtime_class_map.values()]
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "RuntimeClass"}
    allowed = {}
    for name, rc in classes.items():
        selector = (rc.get("scheduling") or {}).get("nodeSelector") or {}
        allowed[name] = [n.name for n in nodes
                         if all(labelled[n.name].get(k) == v for k, v in selector.items())]
    return Placement(agents, handlers, classes, given, allowed)


def problems(p: Placement, nodes: list[Node]) -> list[str]:
    """Every way an opted-in pod could fail to start, or wait for ever."""
    out = []
    for name in p.given:
        rc = p.classes.get(name)
        if rc is None:
            out.append(f"the webhook gives RuntimeClass {name}, which does not exist "
                       "(the API server rejects the pod)")
            continue
        handler = rc["handler"]
        for node in p.allowed[name]:
            if handler not in p.handlers[node]:
                out.append(f"RuntimeClass {name} allows node {node}, which has no {handler} "
                           f"handler (agents there: {p.agents[node] or 'none'})")
        for node, hs in p.handlers.items():
            if handler in hs and node not in p.allowed[name]:
                out.append(f"node {node} has the {handler} handler, but RuntimeClass {name} "
                           "never places a pod there")
    for n in nodes:
        ran = p.agents[n.name]
        if len(ran) > 1:
            out.append(f"node {n.name} runs {len(ran)} agents: {ran}")
    return out
