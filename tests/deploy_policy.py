"""Policy checks on rendered manifests: what smr's manifests must never grant
or leave open. Each returns a list of violations, one line each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# CRIU needs it (the agent, and its GPU nodes' twin); nothing else does.
PRIVILEGED_ALLOWED = {("DaemonSet", "smr-agent"), ("DaemonSet", "smr-agent-gpu")}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod", "ReplicaSet"}


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    kind = doc.get("kind")
    if kind == "Pod":
        return doc.get("spec") or {}
    if kind == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]  # type: ignore[no-any-return]
    if kind in WORKLOADS:
        return doc["spec"]["template"]["spec"]  # type: ignore[no-any-return]
    return None


def containers(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = _pod_spec(doc)
    for key in ("initContainers", "containers"):
        for c in (spec or {}).get(key) or []:
            yield f"{doc['kind']}/{doc['metadata']['name']} container {c['name']}", c


def image_tags(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        for where, c in containers(doc):
            image = c.get("image", "")
            if "@sha256:" in image:
                continue
            last = image.rsplit("/", 1)[-1]
            tag = last.split(":", 1)[1] if ":" in last else ""
            if not tag:
                out.append(f"{where}: image {image!r} has no tag")
            elif tag == "latest":
                out.append(f"{where}: image {image!r} is tagged latest")
    return out


def resource_limits(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        for where, c in containers(doc):
            limits = (c.get("resources") or {}).get("limits") or {}
            missing = [r for r in ("cpu", "memory") if r not in limits]
            if missing:
                out.append(f"{where}: no {' or '.join(missing)} limit")
    return out


def rbac_wildcards(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        if doc.get("kind") not in ("ClusterRole", "Role"):
            continue
        for rule in doc.get("rules") or []:
            for field in ("verbs", "resources", "apiGroups"):
                if "*" in (rule.get(field) or []):
                    out.append(f"{doc['kind']}/{doc['metadata']['name']}: '*' in {field}")
    return out


def privileged(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        if (doc.get("kind"), doc.get("metadata", {}).get("name")) in PRIVILEGED_ALLOWED:
            continue
        spec = _pod_spec(doc) or {}
        if spec.get("hostPID") or spec.get("hostNetwork"):
            out.append(f"{doc['kind']}/{doc['metadata']['name']}: host namespaces")
        for where, c in containers(doc):
            if (c.get("securityContext") or {}).get("privileged"):
                out.append(f"{where}: privileged")
    return out


# Ports any source may reach: metrics (Prometheus runs wherever its owner put
# it), and the webhook's HTTPS port where no overlay narrowed it to the
# control plane (the API server is no pod a selector names: webhook.yaml).
OPEN_PORTS = {9464: None, 8443: "smr-webhook"}
ANY = "any"


def admitted(docs: list[dict[str, Any]], doc: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(port, sources) each NetworkPolicy rule lets reach ``doc``'s pods: ANY
    for every port or every source. [(ANY, ANY)] where no policy isolates them."""
    labels = ((doc["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {}
    ns = doc["metadata"].get("namespace")
    out: list[tuple[Any, Any]] = []
    isolated = False
    for np in docs:
        if np.get("kind") != "NetworkPolicy" or np["metadata"].get("namespace") != ns:
            continue
        spec = np["spec"]
        sel = spec.get("podSelector") or {}
        if sel.get("matchExpressions"):
            raise NotImplementedError(f"NetworkPolicy/{np['metadata']['name']}: matchExpressions")
        if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
            continue
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
            continue
        isolated = True
        for rule in spec.get("ingress") or []:
            sources = rule.get("from") or ANY
            for port in [p.get("port", ANY) for p in rule.get("ports") or []] or [ANY]:
                out.append((port, sources))
    return out if isolated else [(ANY, ANY)]


def open_ingress(docs: list[dict[str, Any]]) -> list[str]:
    """smr's pods take connections from any source on OPEN_PORTS only."""
    out = []
    for doc in docs:
        if _pod_spec(doc) is None or doc["kind"] == "Pod":
            continue
        name = doc["metadata"]["name"]
        for port, sources in admitted(docs, doc):
            if port == ANY:
                out.append(f"{doc['kind']}/{name}: every port admitted "
                           f"from {'any source' if sources == ANY else sources}")
            elif sources == ANY and (port not in OPEN_PORTS
                                     or OPEN_PORTS[port] not in (None, name)):
                out.append(f"{doc['kind']}/{name}: port {port} admitted from any source")
    return out


CHECKS = [image_tags, resource_limits, rbac_wildcards, privileged, open_ingress]


def violations(docs: list[dict[str, Any]]) -> list[str]:
    return [v for check in CHECKS for v in check(docs)]
