"""RBAC for the FAKE API server (tests/fake_apiserver.py), from the shipped
manifests: who a request is (its bearer token, as a real API server maps a
service account's token to ``system:serviceaccount:NS:NAME``) and whether
the Roles and ClusterRoles bound to it grant the call, with the rules'
semantics of the RBAC authorizer (apiGroups, resources and ``res/sub``
subresources, verbs, resourceNames, ``*``; a Role only in its namespace).

The rules come from deploy/kustomize as it is applied (the dev overlay with
components/nats-callout, which binds the callout's account), rendered once
per test session. ``ADMIN`` is the cluster's operator (group
system:masters, which the real authorizer lets do anything): tests that
play kubectl or a controller use it."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from smr.config import REPO_TOOLS

KUSTOMIZE_ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kustomize"
ADMIN = "kubernetes-admin"
MASTERS = "system:masters"
# Built-in ClusterRoles the manifests bind (kube-apiserver's bootstrap policy).
BUILTIN: dict[str, list[dict[str, Any]]] = {
    "system:auth-delegator": [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
         "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
         "verbs": ["create"]}],
}
# Built-in ClusterRoles made by aggregation (the bootstrap policy's aggregationRule):
# each holds the rules of every ClusterRole with its label. Their own rules
# (pods, services…) are left out: no test asks for them.
AGGREGATED = {"view": "rbac.authorization.k8s.io/aggregate-to-view",
              "edit": "rbac.authorization.k8s.io/aggregate-to-edit",
              "admin": "rbac.authorization.k8s.io/aggregate-to-admin"}


@dataclass(frozen=True)
class Request:
    """An API request as the authorizer sees it."""

    verb: str  # get list watch create update patch delete deletecollection
    group: str  # "" for the core group
    resource: str
    subresource: str | None
    namespace: str | None  # None: cluster-scoped, or across all namespaces
    name: str | None

    def __str__(self) -> str:
        res = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        where = f"ns={self.namespace}" if self.namespace else "cluster"
        return f"{self.verb} {self.group or 'core'}/{res} {where}"


@dataclass(frozen=True)
class Grant:
    rule: dict[str, Any]
    namespace: str | None  # a Role's namespace; None: a ClusterRole bound cluster-wide
    source: str  # "ClusterRole/smr-watcher"

    def allows(self, r: Request) -> bool:
        if self.namespace is not None and r.namespace != self.namespace:
            return False
        rule = self.rule
        res = f"{r.resource}/{r.subresource}" if r.subresource else r.resource
        names = rule.get("resourceNames") or []
        return (_has(rule.get("apiGroups"), r.group) and _has(rule.get("resources"), res)
                and _has(rule.get("verbs"), r.verb)
                # resourceNames never match a request without a name (create, list).
                and (not names or (r.name is not None and r.name in names)))


def _has(values: list[str] | None, want: str) -> bool:
    return bool(values) and ("*" in values or want in values)  # type: ignore[operator]


@dataclass
class Rbac:
    """Grants per user (``system:serviceaccount:NS:NAME``)."""

    grants: dict[str, list[Grant]] = field(default_factory=dict)

    @classmethod
    def from_docs(cls, docs: list[dict[str, Any]]) -> Rbac:
        roles: dict[tuple[str, str, str | None], list[dict[str, Any]]] = {
            ("ClusterRole", n, None): rules for n, rules in BUILTIN.items()}
        selectors = {name: [{"matchLabels": {label: "true"}}]
                     for name, label in AGGREGATED.items()}
        for d in docs:
            if d["kind"] == "ClusterRole" and d.get("aggregationRule"):
                selectors[d["metadata"]["name"]] = \
                    d["aggregationRule"].get("clusterRoleSelectors") or []
            elif d["kind"] == "ClusterRole":
                roles[("ClusterRole", d["metadata"]["name"], None)] = d.get("rules") or []
            elif d["kind"] == "Role":
                roles[("Role", d["metadata"]["name"], d["metadata"]["namespace"])] = \
                    d.get("rules") or []
        for name, sels in selectors.items():
            # The aggregation controller's union (matchLabels selectors only).
            roles[("ClusterRole", name, None)] = [
                rule for d in docs if d["kind"] == "ClusterRole" and not d.get("aggregationRule")
                and any(all((d["metadata"].get("labels") or {}).get(k) == v
                            for k, v in (sel.get("matchLabels") or {}).items())
                        for sel in sels)
                for rule in d.get("rules") or []]
        out = cls()
        for d in docs:
            if d["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            ref = d["roleRef"]
            # A RoleBinding grants its role (a Role, or a ClusterRole) in its namespace only.
            ns = d["metadata"]["namespace"] if d["kind"] == "RoleBinding" else None
            rules = roles.get((ref["kind"], ref["name"], ns if ref["kind"] == "Role" else None))
            assert rules is not None, f"{d['kind']} {d['metadata']['name']} binds a missing " \
                f"{ref['kind']} {ref['name']}"
            for s in d.get("subjects") or []:
                if s["kind"] == "ServiceAccount":
                    user = f"system:serviceaccount:{s['namespace']}:{s['name']}"
                else:  # a User by name; a Group's grants are kept under "group:NAME"
                    user = s["name"] if s["kind"] == "User" else f"group:{s['name']}"
                out.grants.setdefault(user, []).extend(
                    Grant(r, ns, f"{ref['kind']}/{ref['name']}") for r in rules)
        return out

    def grant_for(self, user: str, groups: tuple[str, ...], r: Request) -> str | None:
        """What grants ``r`` ("system:masters", "ClusterRole/NAME"), or None."""
        if MASTERS in groups:
            return MASTERS
        held = [*self.grants.get(user, []),
                *(g for group in groups for g in self.grants.get(f"group:{group}", []))]
        return next((g.source for g in held if g.allows(r)), None)


def find_kustomize() -> str:
    found = REPO_TOOLS / "kustomize"
    if found.exists():
        return str(found)
    if path := shutil.which("kustomize"):
        return path
    raise RuntimeError("kustomize is not installed: `make setup` installs it (the fake API "
                       "server reads its RBAC rules from deploy/kustomize)")


def shipped() -> Rbac:
    """The RBAC of deploy/kustomize, rendered once per test session."""
    return _shipped()


@functools.cache
def _shipped() -> Rbac:
    return Rbac.from_docs(shipped_docs())


@functools.cache
def shipped_docs() -> tuple[dict[str, Any], ...]:
    """deploy/kustomize as applied (see the module's docstring), rendered once."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [{os.path.relpath(KUSTOMIZE_ROOT / 'overlays' / 'dev', tmp)}]\n"
            "components: ["
            f"{os.path.relpath(KUSTOMIZE_ROOT / 'components' / 'nats-callout', tmp)}]\n")
        out = subprocess.run([find_kustomize(), "build", "--load-restrictor",
                              "LoadRestrictionsNone", tmp], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"kustomize build (for the fake's RBAC): {out.stderr}")
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)
