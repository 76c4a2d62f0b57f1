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


CHECKS = [image_tags, resource_limits, rbac_wildcards, privileged]


def violations(docs: list[dict[str, Any]]) -> list[str]:
    return [v for check in CHECKS for v in check(docs)]
