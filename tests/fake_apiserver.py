"""FAKE Kubernetes API server — a protocol-faithful stand-in for kube-apiserver.

No kube-apiserver binary can be installed on these machines, so the watcher's
tests run the real kubernetes-asyncio client against this server over HTTP.
It implements the part of the API smr uses, with the semantics clients rely on:

- one cluster-wide resourceVersion counter; every write bumps it;
- list (``metadata.resourceVersion`` of the list) and watch from a
  resourceVersion: every change after it, in order, as JSON lines; a version
  older than the retained history gets an ``ERROR`` event with a 410 Status,
  as the real server sends it; ``allowWatchBookmarks`` bookmarks;
  ``timeoutSeconds``; label selectors (``=``, ``!=``, ``in``, ``notin``,
  exists, ``!``) and field selectors (``metadata.name``,
  ``metadata.namespace``, ``spec.nodeName``);
- get, create (409 AlreadyExists; ``dryRun=All``: admitted, mutating
  webhooks called with ``dryRun`` true, refused where a matching one may
  have side effects, nothing stored: no resourceVersion, no watch event),
  replace (409 Conflict on a stale resourceVersion), patch (JSON merge,
  strategic merge with the merge keys of node taints, conditions and pod
  containers, JSON patch), delete;
- pod eviction through PodDisruptionBudgets (policy/v1; 429 while a budget
  forbids it, as the eviction API answers); the ``DisruptionTarget``
  condition each disruption sets first, with the real reasons: the eviction
  API ``EvictionByEvictionAPI``, scheduler preemption (``preempt``: the
  condition, then a delete with the victim's grace) ``PreemptionByScheduler``,
  the pod GC ``DeletionByPodGC``, the kubelet ``TerminationByKubelet``
  (``kubelet_stopped``, where no fake kubelet runs: graceful node shutdown or
  a node-pressure eviction, told apart by the status reason as the real
  kubelet reports them); a plain delete sets none; graceful deletion: an evicted
  or deleted pod gets a deletionTimestamp (the planned deletion: now plus its
  grace, as the real one) and goes after its grace, or, with
  ``kubelets=True``, when the node's kubelet has stopped its containers and
  deletes it with grace 0 (tests/fake_kubelet.py), as in a real cluster; a
  pod not bound to a node goes at once; the pod garbage collector (pods bound
  to a deleted node are deleted);
- ``watch_jitter``: each watch connection delivers its events after a random
  delay, in order within the connection and in no order between them (a node
  event and a pod event reach a client in either order, as they do from a
  real API server);
- Events (core/v1) and Leases (coordination.k8s.io/v1);
- authentication and RBAC (tests/fake_rbac.py): each request names its user
  by a bearer token (``token(account)`` hands out a service account's, as
  the real server maps a projected token to ``system:serviceaccount:NS:NAME``;
  ``admin_token`` is the operator's, group system:masters); no or an unknown
  token gets 401, and a call the shipped Roles do not grant the 403 Status a
  real server sends (kept in ``denied``); ``granted`` maps each call made to
  the rule that allowed it.

Test controls (``cut_watches``, ``compact``, ``pause_watches``) break the
connection the way networks and etcd compaction do.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import random
import re
import socket
import ssl
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tests.fake_rbac import ADMIN, MASTERS, Rbac, Request, shipped

# plural -> (kind, namespaced, api prefix)
RESOURCES: dict[str, tuple[str, bool, str]] = {
    "nodes": ("Node", False, "/api/v1"),
    "pods": ("Pod", True, "/api/v1"),
    "events": ("Event", True, "/api/v1"),
    "leases": ("Lease", True, "/apis/coordination.k8s.io/v1"),
    "secrets": ("Secret", True, "/api/v1"),
    "mutatingwebhookconfigurations": ("MutatingWebhookConfiguration", False,
                                      "/apis/admissionregistration.k8s.io/v1"),
    "runtimeclasses": ("RuntimeClass", False, "/apis/node.k8s.io/v1"),
    "poddisruptionbudgets": ("PodDisruptionBudget", True, "/apis/policy/v1"),
    "jobs": ("Job", True, "/apis/batch/v1"),
    # Kueue's custom resource, served as its CRD makes a real server serve it.
    "workloads": ("Workload", True, "/apis/kueue.x-k8s.io/v1beta1"),
    "customresourcedefinitions": ("CustomResourceDefinition", False,
                                  "/apis/apiextensions.k8s.io/v1"),
    # What deploy/kustomize's overlays hold (tests/test_overlays.py applies them).
    "namespaces": ("Namespace", False, "/api/v1"),
    "configmaps": ("ConfigMap", True, "/api/v1"),
    "services": ("Service", True, "/api/v1"),
    "serviceaccounts": ("ServiceAccount", True, "/api/v1"),
    "deployments": ("Deployment", True, "/apis/apps/v1"),
    "daemonsets": ("DaemonSet", True, "/apis/apps/v1"),
    "statefulsets": ("StatefulSet", True, "/apis/apps/v1"),
    "networkpolicies": ("NetworkPolicy", True, "/apis/networking.k8s.io/v1"),
    "roles": ("Role", True, "/apis/rbac.authorization.k8s.io/v1"),
    "rolebindings": ("RoleBinding", True, "/apis/rbac.authorization.k8s.io/v1"),
    "clusterroles": ("ClusterRole", False, "/apis/rbac.authorization.k8s.io/v1"),
    "clusterrolebindings": ("ClusterRoleBinding", False, "/apis/rbac.authorization.k8s.io/v1"),
    "priorityclasses": ("PriorityClass", False, "/apis/scheduling.k8s.io/v1"),
    # The workload controllers' objects (tests/fake_controllers.py acts on them).
    "replicasets": ("ReplicaSet", True, "/apis/apps/v1"),
}
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
API_VERSION = {"/api/v1": "v1", "/apis/coordination.k8s.io/v1": "coordination.k8s.io/v1",
               "/apis/admissionregistration.k8s.io/v1": "admissionregistration.k8s.io/v1",
               "/apis/node.k8s.io/v1": "node.k8s.io/v1", "/apis/policy/v1": "policy/v1",
               "/apis/batch/v1": "batch/v1",
               "/apis/kueue.x-k8s.io/v1beta1": "kueue.x-k8s.io/v1beta1",
               "/apis/apiextensions.k8s.io/v1": "apiextensions.k8s.io/v1",
               "/apis/apps/v1": "apps/v1", "/apis/networking.k8s.io/v1": "networking.k8s.io/v1",
               "/apis/rbac.authorization.k8s.io/v1": "rbac.authorization.k8s.io/v1",
               "/apis/scheduling.k8s.io/v1": "scheduling.k8s.io/v1"}
GROUPS = {prefix: "" if prefix == "/api/v1" else prefix.split("/")[2] for prefix in API_VERSION}
VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}
MERGE_KEYS = {"taints": "key", "conditions": "type", "containers": "name", "env": "name",
              "ownerReferences": "uid"}


def _now(later: float = 0) -> str:
    return datetime.fromtimestamp(time.time() + later, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _truthy(v: str | None) -> bool:
    """Go's strconv.ParseBool, as the API server parses query flags."""
    return v in ("1", "t", "T", "TRUE", "true", "True")


# What the real kubelet reports for a pod it stopped itself (the node shutdown
# manager's and the eviction manager's status reasons and messages).
SHUTDOWN = ("Terminated", "Pod was terminated in response to imminent node shutdown.")
PRESSURE = ("Evicted", "The node was low on resource: memory. Threshold quantity: 100Mi, "
                       "available: 80Mi. ")


def wants_table(request: web.Request) -> bool:
    """Does the request accept a meta.k8s.io/v1 Table (kubectl get's
    ``application/json;as=Table;v=v1;g=meta.k8s.io``)?"""
    for kind in request.headers.get("Accept", "").split(","):
        params = {p.strip() for p in kind.split(";")[1:]}
        if {"as=Table", "v=v1", "g=meta.k8s.io"} <= params:
            return True
    return False


def _cell(column: dict[str, Any], obj: dict[str, Any]) -> Any:
    """A printer column's cell: its JSONPath (a plain ``.a.b`` path here) in
    ``obj``; None where missing (kubectl prints <none>)."""
    path = column["jsonPath"]
    assert re.fullmatch(r"(\.[A-Za-z0-9_]+)+", path), f"JSONPath {path} is not supported"
    value: Any = obj
    for part in path.split(".")[1:]:
        value = value.get(part) if isinstance(value, dict) else None
    if column["type"] == "date" and isinstance(value, str) and value:
        return human_duration(datetime.now(UTC) - datetime.fromisoformat(
            value.replace("Z", "+00:00")))
    return value


def human_duration(d: timedelta) -> str:
    """kube's duration.HumanDuration, as kubectl shows an age."""
    s = int(d.total_seconds())
    if s < 0:
        return "<invalid>"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    days = h // 24
    if h < 24 * 8:
        return f"{days}d{h % 24}h" if h % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    return f"{days // 365}y{days % 365}d" if days < 365 * 8 else f"{days // 365}y"


def disruption_condition(reason: str, message: str) -> dict[str, Any]:
    return {"type": "DisruptionTarget", "status": "True", "reason": reason,
            "message": message, "lastTransitionTime": _now()}


def with_condition(pod_status: dict[str, Any], cond: dict[str, Any]) -> dict[str, Any]:
    """``pod_status`` with ``cond`` in place of any of its type."""
    return {**pod_status, "conditions": [
        *[c for c in pod_status.get("conditions") or [] if c["type"] != cond["type"]], cond]}


def kubelet_failed(pod_status: dict[str, Any], why: tuple[str, str]) -> dict[str, Any]:
    """The terminal status the kubelet writes for a pod it stopped itself
    (``why``: SHUTDOWN or PRESSURE): Failed, whatever the exit codes."""
    reason, message = why
    return with_condition({**pod_status, "phase": "Failed", "reason": reason,
                           "message": message},
                          disruption_condition("TerminationByKubelet", message))


def status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
    return web.Response(status=code, body=orjson.dumps(body), content_type="application/json")


@dataclass
class Change:
    rv: int
    plural: str
    type: str  # ADDED MODIFIED DELETED
    obj: dict[str, Any]


@dataclass
class Watch:
    plural: str
    namespace: str | None
    labels: str
    fields: str
    queue: asyncio.Queue[Change | None] = field(default_factory=asyncio.Queue)
    response: web.StreamResponse | None = None


# -- selectors ------------------------------------------------------------------------

_SET = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(sel: str) -> Iterator[str]:
    depth, cur = 0, ""
    for ch in sel:
        if ch == "," and depth == 0:
            yield cur
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        yield cur


def label_match(sel: str, labels: dict[str, str]) -> bool:
    for term in _split_selector(sel or ""):
        term = term.strip()
        if m := _SET.match(term):
            key, op, vals = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (op == "in") != (labels.get(key) in vals):
                return False
        elif "!=" in term:
            k, v = (s.strip() for s in term.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip()) != v.lstrip("=").strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term and term not in labels:
            return False
    return True


def field_match(sel: str, obj: dict[str, Any]) -> bool:
    for term in _split_selector(sel or ""):
        neg = "!=" in term
        k, v = term.split("!=" if neg else "=", 1)
        k, v = k.strip().rstrip("="), v.strip().lstrip("=")
        cur: Any = obj
        for part in k.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if (str(cur or "") == v) == neg:
            return False
    return True


# -- patches ---------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any, merge_keys: dict[str, str] | None = None,
                key: str | None = None) -> Any:
    """RFC 7386 merge patch. With ``merge_keys`` (field → key), a strategic
    merge patch: those lists merge item by item on the key (and honour
    ``$patch: delete`` entries), as the API server does for built-in types."""
    if merge_keys and key in merge_keys and isinstance(patch, list) \
            and isinstance(target, list):
        mk = merge_keys[key]
        out = [copy.deepcopy(x) for x in target]
        for item in patch:
            idx = next((i for i, x in enumerate(out) if x.get(mk) == item.get(mk)), None)
            if item.get("$patch") == "delete":
                if idx is not None:
                    out.pop(idx)
            elif idx is None:
                out.append(copy.deepcopy(item))
            else:
                out[idx] = merge_patch(out[idx], item, merge_keys)
        return out
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v, merge_keys, k)
    return out


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902: add, remove, replace, test."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            i = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(i, op["value"])
            elif kind == "remove":
                parent.pop(i)
            elif kind == "replace":
                parent[i] = op["value"]
            elif kind == "test" and parent[i] != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            if kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    raise KeyError(op["path"])
                parent[last] = op["value"]
            elif kind == "remove":
                del parent[last]
            elif kind == "test" and parent.get(last) != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
    return doc


# -- the server -----------------------------------------------------------------------

class FakeApiServer:
    """Start with ``await FakeApiServer().start()``; ``url`` is its address."""

    def __init__(self, *, history: int = 10_000, bookmark_interval: float = 1.0,
                 eviction_delay: float = 0.3, podgc_delay: float = 1.0,
                 kubelets: bool = False, watch_jitter: float = 0.0,
                 rbac: Rbac | None = None, namespaces: bool = False) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        # True: a namespaced object is created only in a Namespace that exists
        # (the real server's NamespaceLifecycle admission), and the cluster
        # starts with default, kube-system and kube-public. False: any namespace.
        self.namespaces = namespaces
        # What it serves: the built-in resources, and each CRD's once it is created.
        self.resources = dict(RESOURCES)
        self.api_versions = dict(API_VERSION)
        self.groups = dict(GROUPS)
        self.printer_columns: dict[str, list[dict[str, Any]]] = {}  # plural → a CRD's
        self.rv = 0
        self.history: list[Change] = []
        self.max_history = history
        self.oldest_rv = 0  # a watch from a version below this gets 410
        self.bookmark_interval = bookmark_interval
        self.eviction_delay = eviction_delay
        self.podgc_delay = podgc_delay
        # True: a kubelet (tests/fake_kubelet.py) ends each terminating pod it runs.
        self.kubelets = kubelets
        self.watch_jitter = watch_jitter
        self.watches: list[Watch] = []
        # In-process informers (tests/fake_controllers.py): told of every change.
        self.listeners: list[Callable[[Change], None]] = []
        self.requests: list[tuple[str, str]] = []  # (method, path) log, for assertions
        # What cluster DNS would resolve: (namespace, service) → (host, port).
        self.services: dict[tuple[str, str], tuple[str, int]] = {}
        self.admission_log: list[str] = []  # what each webhook call came to
        self.dry_runs: list[dict[str, Any]] = []  # what each dry-run create answered (unstored)
        # TokenReview: token → (user info as the API server returns it, audiences).
        self.tokens: dict[str, tuple[dict[str, Any], list[str]]] = {}
        # Authentication: bearer token → (user, groups); RBAC from deploy/kustomize.
        self.rbac = rbac or shipped()
        self.admin_token = f"admin-{uuid.uuid4().hex}"
        self.identities: dict[str, tuple[str, tuple[str, ...]]] = {
            self.admin_token: (ADMIN, (MASTERS, "system:authenticated"))}
        self.denied: list[str] = []  # "USER: CALL", each refused call
        self.granted: dict[tuple[str, str], str] = {}  # (user, call) → the granting role
        self._paused = asyncio.Event()
        self._paused.set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""
        if namespaces:
            for ns in ("default", "kube-system", "kube-public"):
                self.put("namespaces", {"metadata": {"name": ns}})

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        for w in list(self.watches):
            w.queue.put_nowait(None)
        for t in list(self._tasks):
            t.cancel()
        if self._runner:
            await self._runner.cleanup()

    # -- test controls ---------------------------------------------------------------

    def cut_watches(self, *, mid_line: bool = True, plural: str | None = None) -> int:
        """Drop every open watch connection (of ``plural`` only, if given: a
        client's connections break one at a time too), as a network fault
        would: with ``mid_line`` half of a JSON line is sent first. Returns
        how many."""
        n = 0
        for w in list(self.watches):
            if plural is not None and w.plural != plural:
                continue
            if w.response is not None and w.response._payload_writer is not None:
                transport = w.response._payload_writer.transport
                if transport is not None:
                    if mid_line:  # one HTTP chunk holding half an event
                        half = b'{"type":"MODIFIED","object":{"kind":'
                        transport.write(b"%x\r\n%s\r\n" % (len(half), half))
                    # A hard close (no orderly shutdown), as a dropped connection.
                    sock = transport.get_extra_info("socket")
                    if sock is not None:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    transport.abort()
                    n += 1
            w.queue.put_nowait(None)
        return n

    def compact(self) -> None:
        """Forget the change history, as etcd compaction does: a watch from
        any earlier resourceVersion now gets 410 Gone."""
        self.history.clear()
        self.oldest_rv = self.rv

    def pause_watches(self) -> None:
        """New watch requests hang until ``resume_watches`` (an unreachable server)."""
        self._paused.clear()

    def resume_watches(self) -> None:
        self._paused.set()

    async def watching(self, n: int, timeout: float = 10) -> None:
        """Wait until ``n`` watch connections are open."""
        deadline = time.monotonic() + timeout
        while len([w for w in self.watches if w.response is not None]) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.watches)} of {n} watches open")
            await asyncio.sleep(0.02)

    def token(self, account: str, namespace: str = "smr-system") -> str:
        """A bearer token of service account ``account`` (what its pod's
        projected token is to a real API server)."""
        tok = f"sa-{namespace}-{account}-{uuid.uuid4().hex[:8]}"
        self.identities[tok] = (f"system:serviceaccount:{namespace}:{account}",
                                ("system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                                 "system:authenticated"))
        return tok

    def user_token(self, user: str, groups: tuple[str, ...] = ()) -> str:
        """A bearer token of a person (what an OIDC or client-certificate
        user is to a real API server), bound to Roles by ``kind: User``."""
        tok = f"user-{user}-{uuid.uuid4().hex[:8]}"
        self.identities[tok] = (user, (*groups, "system:authenticated"))
        return tok

    def preempt(self, name: str, namespace: str = "default") -> None:
        """The scheduler preempts the pod to place a higher-priority one: the
        DisruptionTarget condition first, then a delete with its own grace."""
        key = ("pods", namespace, name)
        self._disrupt(key, "PreemptionByScheduler",
                      "default-scheduler: preempting to accommodate a higher priority pod")
        self._terminate(key, None)

    def kubelet_stopped(self, name: str, namespace: str = "default", *,
                        why: tuple[str, str] = SHUTDOWN) -> None:
        """The node's kubelet stopped the pod itself and reports it Failed
        (``why``: SHUTDOWN, graceful node shutdown; PRESSURE, a node-pressure
        eviction), for tests with no fake kubelet on the node."""
        pod = self.objects[("pods", namespace, name)]
        self.put("pods", {**pod, "status": kubelet_failed(pod.get("status") or {}, why)})

    # -- direct access (what a controller or kubectl would do) -----------------------

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object without HTTP."""
        ns = obj["metadata"].get("namespace", "") if self.resources[plural][1] else ""
        key = (plural, ns, obj["metadata"]["name"])
        return self._write(plural, key, copy.deepcopy(obj), "MODIFIED" if key in self.objects
                           else "ADDED")

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((plural, namespace, name)))

    def list(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (p, ns, _), o in self.objects.items()
                if p == plural and (namespace is None or ns == namespace)]

    def remove(self, plural: str, name: str, namespace: str = "", *,
               disruption: str | None = None) -> None:
        """Gone at once; ``disruption``: a pod's DisruptionTarget reason set
        first (what an eviction leaves on the pod it ends)."""
        key = (plural, namespace, name)
        if key in self.objects:
            if disruption:
                self._disrupt(key, disruption, f"{disruption} (test)")
            self._delete(key)

    # -- storage ---------------------------------------------------------------------

    def _write(self, plural: str, key: tuple[str, str, str], obj: dict[str, Any],
               type_: str) -> dict[str, Any]:
        self.rv += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        if self.resources[plural][1]:
            meta["namespace"] = key[1]
        kind, _, prefix = self.resources[plural]
        obj["kind"], obj["apiVersion"] = kind, self.api_versions[prefix]
        self.objects[key] = obj
        if plural == "customresourcedefinitions":
            self._serve(obj)
        self._record(Change(self.rv, plural, type_, copy.deepcopy(obj)))
        return copy.deepcopy(obj)

    def _serve(self, crd: dict[str, Any]) -> None:
        """Serve a CRD's resources, as the real server does once it is
        Established: its group/version's routes, its scope, its printer
        columns (the served version's; Age where it names none)."""
        spec, names = crd["spec"], crd["spec"]["names"]
        version = next(v for v in spec["versions"] if v.get("served") and v.get("storage"))
        prefix = f"/apis/{spec['group']}/{version['name']}"
        self.api_versions[prefix] = f"{spec['group']}/{version['name']}"
        self.groups[prefix] = spec["group"]
        self.resources[names["plural"]] = (names["kind"], spec["scope"] == "Namespaced", prefix)
        self.printer_columns[names["plural"]] = version.get("additionalPrinterColumns") or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]

    def _table(self, plural: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        """A meta.k8s.io/v1 Table of ``items``, as the real server builds it for a
        custom resource (kubectl get asks for one): a Name column, then each
        printer column, its cell read by its JSONPath; a date as a duration
        (kube's HumanDuration); the rows' objects as metadata only."""
        cols = self.printer_columns.get(plural) or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        defs = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                 "description": "Name must be unique within a namespace."}] + [
            {"name": c["name"], "type": c["type"], "format": c.get("format", ""),
             "description": c.get("description", ""), "priority": c.get("priority", 0)}
            for c in cols]
        rows = [{"cells": [o["metadata"]["name"], *(_cell(c, o) for c in cols)],
                 "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                            "metadata": o["metadata"]}} for o in items]
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "columnDefinitions": defs, "rows": rows}

    def _delete(self, key: tuple[str, str, str]) -> dict[str, Any]:
        obj = self.objects.pop(key)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record(Change(self.rv, key[0], "DELETED", copy.deepcopy(obj)))
        if key[0] == "nodes":
            self._later(self.podgc_delay, self._collect_pods(key[2]))
        return obj

    def _later(self, delay: float, work: Any) -> None:
        async def run() -> None:
            await asyncio.sleep(delay)
            work()

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _collect_pods(self, node_name: str) -> Any:
        """The pod garbage collector: pods bound to a node that is gone."""
        def collect() -> None:
            if ("nodes", "", node_name) in self.objects:
                return  # it came back
            for k, o in list(self.objects.items()):
                if k[0] == "pods" and o.get("spec", {}).get("nodeName") == node_name:
                    self._disrupt(k, "DeletionByPodGC", "PodGC: node no longer exists")
                    self._delete(k)
        return collect

    def _record(self, ch: Change) -> None:
        self.history.append(ch)
        if len(self.history) > self.max_history:
            drop = len(self.history) - self.max_history
            self.oldest_rv = self.history[drop - 1].rv
            del self.history[:drop]
        for w in self.watches:
            if self._matches(w, ch.plural, ch.obj):
                w.queue.put_nowait(ch)
        for listener in self.listeners:
            listener(ch)

    @staticmethod
    def _matches(w: Watch, plural: str, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return (plural == w.plural
                and (w.namespace is None or meta.get("namespace") == w.namespace)
                and label_match(w.labels, meta.get("labels") or {})
                and field_match(w.fields, obj))

    # -- HTTP --------------------------------------------------------------------------

    def _route(self, path: str) -> tuple[str, str | None, str | None, str | None] | None:
        """(plural, namespace, name, subresource) of an API path."""
        for prefix in self.api_versions:
            if not path.startswith(prefix + "/"):
                continue
            parts = path[len(prefix) + 1:].strip("/").split("/")
            ns = None
            if parts[0] == "namespaces" and len(parts) >= 3:
                ns, parts = parts[1], parts[2:]
            plural = parts[0]
            if plural not in self.resources or self.resources[plural][2] != prefix:
                return None
            name = parts[1] if len(parts) > 1 else None
            sub = parts[2] if len(parts) > 2 else None
            return plural, ns, name, sub
        return None

    def _authorize(self, request: web.Request,
                   route: tuple[str, str | None, str | None, str | None] | None
                   ) -> web.Response | None:
        """None if the request's user may make it; else the real server's
        401 (no or an unknown token) or 403 (RBAC grants it not)."""
        auth = request.headers.get("Authorization", "")
        who = self.identities.get(auth.removeprefix("Bearer ")) if auth.startswith(
            "Bearer ") else None
        if who is None:
            return status(401, "Unauthorized", "Unauthorized")
        m = request.method
        if route is None:  # the TokenReview API
            r = Request(VERBS.get(m, m.lower()), "authentication.k8s.io", "tokenreviews",
                        None, None, None)
        else:
            plural, ns, name, sub = route
            if m == "GET":
                verb = "get" if name else "watch" if _truthy(request.query.get("watch")) \
                    else "list"
            elif m == "DELETE":
                verb = "delete" if name else "deletecollection"
            else:
                verb = VERBS.get(m, m.lower())
            r = Request(verb, self.groups[self.resources[plural][2]], plural, sub, ns, name)
        user, groups = who
        grant = self.rbac.grant_for(user, groups, r)
        if grant is not None:
            self.granted.setdefault((user, str(r)), grant)
            return None
        self.denied.append(f"{user}: {r}")
        res = f"{r.resource}/{r.subresource}" if r.subresource else r.resource
        what = f'{res} "{r.name}"' if r.name else res
        where = f'in the namespace "{r.namespace}"' if r.namespace else "at the cluster scope"
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f'{what} is forbidden: User "{user}" cannot {r.verb} resource '
                           f'"{res}" in API group "{r.group}" {where}',
                "reason": "Forbidden", "details": {"name": r.name or "", "kind": r.resource,
                                                   **({"group": r.group} if r.group else {})},
                "code": 403}
        return web.Response(status=403, body=orjson.dumps(body),
                            content_type="application/json")

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        route = self._route(request.path)
        if route is not None or request.path == TOKEN_REVIEWS:
            if refused := self._authorize(request, route):
                return refused
        if request.path == TOKEN_REVIEWS and request.method == "POST":
            return await self._token_review(request)
        if route is None:
            return status(404, "NotFound", f"the server could not find {request.path}")
        plural, ns, name, sub = route
        namespaced = self.resources[plural][1]
        if namespaced and name is not None and ns is None:
            return status(404, "NotFound", f"{plural} are namespaced")
        key = (plural, ns or "", name or "")
        m = request.method
        if name is None:
            if m == "GET":
                if _truthy(request.query.get("watch")):
                    return await self._watch(request, plural, ns)
                return self._list(request, plural, ns)
            if m == "POST":
                return await self._create(request, plural, ns or "")
        elif sub == "eviction" and plural == "pods" and m == "POST":
            return self._evict(key)
        elif sub is None:
            if m == "GET":
                obj = self.objects.get(key)
                if obj is None:
                    return status(404, "NotFound", f'{plural} "{name}" not found')
                if wants_table(request):
                    return self._json(self._table(plural, [obj]))
                return web.json_response(obj, dumps=lambda o: orjson.dumps(o).decode())
            if m == "PUT":
                return await self._replace(request, key)
            if m == "PATCH":
                return await self._patch(request, key)
            if m == "DELETE":
                return await self._delete_http(request, key)
        return status(405, "MethodNotAllowed", f"{m} {request.path} is not supported")

    async def _token_review(self, request: web.Request) -> web.Response:
        """As the real one answers: 201 with the TokenReview's status; a token it
        does not know, or not for one of the asked audiences, is not
        authenticated (with an error), never a failed request."""
        token_review = orjson.loads(await request.read())
        spec = token_review.get("spec") or {}
        user, audiences = self.tokens.get(spec.get("token", ""), ({}, []))
        asked = spec.get("audiences") or audiences
        if user and set(asked) & set(audiences):
            st: dict[str, Any] = {"authenticated": True, "user": user,
                                  "audiences": sorted(set(asked) & set(audiences))}
        else:
            st = {"user": {}, "error": "[invalid bearer token, token lookup failed]"}
        return self._json({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                           "metadata": {"creationTimestamp": None}, "spec": spec,
                           "status": st}, 201)

    @staticmethod
    def _json(obj: dict[str, Any], code: int = 200) -> web.Response:
        return web.Response(status=code, body=orjson.dumps(obj), content_type="application/json")

    def _list(self, request: web.Request, plural: str, ns: str | None) -> web.Response:
        labels = request.query.get("labelSelector", "")
        fields = request.query.get("fieldSelector", "")
        items = [o for (p, _, _), o in self.objects.items()
                 if p == plural and self._matches(Watch(plural, ns, labels, fields), plural, o)]
        if wants_table(request):
            return self._json(self._table(plural, items))
        kind, _, prefix = self.resources[plural]
        return self._json({"kind": f"{kind}List", "apiVersion": self.api_versions[prefix],
                           "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, plural: str,
                     ns: str | None) -> web.StreamResponse:
        await self._paused.wait()
        q = request.query
        w = Watch(plural, ns, q.get("labelSelector", ""), q.get("fieldSelector", ""))
        timeout = float(q.get("timeoutSeconds") or 0) or None
        bookmarks = _truthy(q.get("allowWatchBookmarks"))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        w.response = resp
        since = q.get("resourceVersion", "")
        self.watches.append(w)
        try:
            if since in ("", "0"):
                for (p, _, _), o in list(self.objects.items()):
                    if p == plural and self._matches(w, plural, o):
                        w.queue.put_nowait(Change(self.rv, plural, "ADDED", copy.deepcopy(o)))
            elif int(since) < self.oldest_rv:
                err = {"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": f"too old resource version: {since} ({self.oldest_rv})",
                    "reason": "Expired", "code": 410}}
                await resp.write(orjson.dumps(err) + b"\n")
                return resp
            else:
                for ch in self.history:
                    if ch.rv > int(since) and self._matches(w, ch.plural, ch.obj):
                        w.queue.put_nowait(ch)
            deadline = None if timeout is None else time.monotonic() + timeout
            kind = self.resources[plural][0]
            while True:
                wait = self.bookmark_interval if bookmarks else None
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait = left if wait is None else min(wait, left)
                try:
                    ch = await asyncio.wait_for(w.queue.get(), wait)
                except TimeoutError:
                    if bookmarks:
                        bm = {"type": "BOOKMARK", "object": {
                            "kind": kind,
                            "apiVersion": self.api_versions[self.resources[plural][2]],
                            "metadata": {"resourceVersion": str(self.rv)}}}
                        await resp.write(orjson.dumps(bm) + b"\n")
                    continue
                if ch is None:
                    break
                if self.watch_jitter:
                    await asyncio.sleep(random.uniform(0, self.watch_jitter))
                await resp.write(orjson.dumps({"type": ch.type, "object": ch.obj}) + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.watches.remove(w)
        return resp

    async def _create(self, request: web.Request, plural: str, ns: str) -> web.Response:
        obj = await request.json()
        # dryRun=All: every admission step runs, nothing is stored (as the real one)
        dry_run = request.query.getall("dryRun", [])
        if any(d != "All" for d in dry_run):
            return status(400, "BadRequest", f'dryRun: Unsupported value: "{dry_run[0]}": '
                          'supported values: "All"')
        if plural == "pods":
            admitted = await self._admit(obj, ns, dry_run=bool(dry_run))
            if isinstance(admitted, web.Response):
                return admitted
            obj = admitted
        name = obj.get("metadata", {}).get("name")
        if not name and obj.get("metadata", {}).get("generateName"):
            name = obj["metadata"]["generateName"] + uuid.uuid4().hex[:5]
            obj["metadata"]["name"] = name
        if not name:
            return status(422, "Invalid", "metadata.name: Required value")
        kind, namespaced, prefix = self.resources[plural]
        if obj.get("kind", kind) != kind or obj.get("apiVersion",
                                                   self.api_versions[prefix]) != \
                self.api_versions[prefix]:
            return status(400, "BadRequest", f"the body is a {obj.get('apiVersion')} "
                          f"{obj.get('kind')}, not a {self.api_versions[prefix]} {kind}")
        if namespaced and obj["metadata"].get("namespace", ns) != ns:
            return status(400, "BadRequest", "the namespace of the provided object does not "
                          "match the namespace sent on the request")
        if namespaced and self.namespaces and ("namespaces", "", ns) not in self.objects:
            return status(404, "NotFound", f'namespaces "{ns}" not found')
        key = (plural, ns, name)
        if key in self.objects:
            return status(409, "AlreadyExists", f'{plural} "{name}" already exists')
        obj["metadata"].pop("resourceVersion", None)
        obj["metadata"].pop("uid", None)
        if dry_run:
            obj["metadata"]["uid"] = str(uuid.uuid4())
            obj["metadata"]["creationTimestamp"] = _now()
            self.dry_runs.append(obj)
            return self._json(obj, 201)
        return self._json(self._write(plural, key, obj, "ADDED"), 201)

    # -- admission: mutating webhooks, called as kube-apiserver calls them -----------

    async def _admit(self, pod: dict[str, Any], ns: str, *, dry_run: bool = False
                     ) -> dict[str, Any] | web.Response:
        """Run every matching mutating webhook on a pod being created: an
        AdmissionReview v1 over HTTPS (verified with ``caBundle`` against the
        Service's DNS name), its JSONPatch applied; a failed call is ignored or
        refuses the pod, by the webhook's failurePolicy. A dry run is refused
        when a matching webhook may have side effects (sideEffects other than
        None or NoneOnDryRun), as the real server refuses it."""
        hooks = [h for cfg in self.list("mutatingwebhookconfigurations")
                 for h in cfg.get("webhooks") or []]
        for hook in hooks:
            if dry_run and self._hook_matches(hook, pod, ns) and \
                    hook.get("sideEffects") not in ("None", "NoneOnDryRun"):
                return status(400, "BadRequest", f'admission webhook "{hook["name"]}" '
                              "does not support dry run")
        for hook in hooks:
            if not self._hook_matches(hook, pod, ns):
                continue
            try:
                pod = await self._call(hook, pod, ns, dry_run=dry_run)
            except Exception as e:
                self.admission_log.append(f"{hook['name']}: failed: {e!r}")
                if hook.get("failurePolicy", "Fail") == "Fail":
                    return status(500, "InternalError", f'failed calling webhook '
                                  f'"{hook["name"]}": {e}')
        return pod

    @staticmethod
    def _selects(sel: dict[str, Any] | None, labels: dict[str, str]) -> bool:
        if not sel:
            return True
        if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
            return False
        for e in sel.get("matchExpressions") or []:
            has, value = e["key"] in labels, labels.get(e["key"])
            ok = {"In": has and value in e.get("values", []),
                  "NotIn": not has or value not in e.get("values", []),
                  "Exists": has, "DoesNotExist": not has}[e["operator"]]
            if not ok:
                return False
        return True

    def _hook_matches(self, hook: dict[str, Any], pod: dict[str, Any], ns: str) -> bool:
        rules = hook.get("rules") or []
        if not any(("CREATE" in r.get("operations", []) or "*" in r.get("operations", []))
                   and "pods" in r.get("resources", []) for r in rules):
            return False
        return (self._selects(hook.get("namespaceSelector"), {"kubernetes.io/metadata.name": ns})
                and self._selects(hook.get("objectSelector"),
                                  (pod.get("metadata") or {}).get("labels") or {}))

    async def _call(self, hook: dict[str, Any], pod: dict[str, Any], ns: str, *,
                    dry_run: bool = False) -> dict[str, Any]:
        cc = hook["clientConfig"]
        svc = cc["service"]
        host, port = self.services[(svc["namespace"], svc["name"])]
        ctx = ssl.create_default_context(
            cadata=base64.b64decode(cc.get("caBundle") or "").decode() or None)
        uid = str(uuid.uuid4())
        admission_review = {
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": ns, "operation": "CREATE", "object": pod, "dryRun": dry_run,
            "userInfo": {"username": "test"}}}
        timeout = aiohttp.ClientTimeout(total=hook.get("timeoutSeconds", 10))
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                f"https://{host}:{port}{svc.get('path', '/')}", json=admission_review, ssl=ctx,
                server_hostname=f"{svc['name']}.{svc['namespace']}.svc") as resp:
            answer = await resp.json()
        r = answer["response"]
        if r.get("uid") != uid:
            raise ValueError("the webhook answered for another request")
        if not r.get("allowed", False):
            raise PermissionError(r.get("status", {}).get("message", "denied"))
        if r.get("patch"):
            pod = json_patch(pod, orjson.loads(base64.b64decode(r["patch"])))
        self.admission_log.append(f"{hook['name']}: {len(r.get('patch') or '')} patch bytes, "
                                  f"warnings {r.get('warnings') or []}")
        return pod

    async def _replace(self, request: web.Request, key: tuple[str, str, str]) -> web.Response:
        cur = self.objects.get(key)
        if cur is None:
            return status(404, "NotFound", f'{key[0]} "{key[2]}" not found')
        obj = await request.json()
        want = obj.get("metadata", {}).get("resourceVersion")
        if want and want != cur["metadata"]["resourceVersion"]:
            return status(409, "Conflict", f'Operation cannot be fulfilled on {key[0]} '
                          f'"{key[2]}": the object has been modified; please apply your '
                          "changes to the latest version and try again")
        obj["metadata"]["uid"] = cur["metadata"]["uid"]
        obj["metadata"]["creationTimestamp"] = cur["metadata"]["creationTimestamp"]
        return self._json(self._write(key[0], key, obj, "MODIFIED"))

    async def _patch(self, request: web.Request, key: tuple[str, str, str]) -> web.Response:
        cur = self.objects.get(key)
        if cur is None:
            return status(404, "NotFound", f'{key[0]} "{key[2]}" not found')
        body = orjson.loads(await request.read())
        ctype = request.content_type
        try:
            if ctype == "application/json-patch+json":
                new = json_patch(cur, body)
            elif ctype == "application/merge-patch+json":
                new = merge_patch(cur, body)
            elif ctype == "application/strategic-merge-patch+json":
                new = merge_patch(cur, body, MERGE_KEYS)
            else:
                return status(415, "UnsupportedMediaType", f"patch type {ctype} not supported")
        except (KeyError, ValueError, IndexError, TypeError) as e:
            return status(422, "Invalid", f"the patch could not be applied: {e}")
        want = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) \
            else None
        if want and want != cur["metadata"]["resourceVersion"]:
            return status(409, "Conflict", "the object has been modified")
        new["metadata"]["uid"] = cur["metadata"]["uid"]
        return self._json(self._write(key[0], key, new, "MODIFIED"))

    async def _delete_http(self, request: web.Request,
                           key: tuple[str, str, str]) -> web.Response:
        if key not in self.objects:
            return status(404, "NotFound", f'{key[0]} "{key[2]}" not found')
        if key[0] == "pods":  # graceful deletion, as for an eviction
            grace = request.query.get("gracePeriodSeconds")
            if grace is None and request.can_read_body:
                with contextlib.suppress(ValueError):
                    grace = (orjson.loads(await request.read()) or {}).get(
                        "gracePeriodSeconds")
            return self._json(self._terminate(key, None if grace is None else int(grace)))
        return self._json(self._delete(key))

    def _evict(self, key: tuple[str, str, str]) -> web.Response:
        pod = self.objects.get(key)
        if pod is None:
            return status(404, "NotFound", f'pods "{key[2]}" not found')
        if not pod["metadata"].get("deletionTimestamp"):
            # A pod already terminating is not counted against a budget again.
            if blocking := self._blocking_budget(pod):
                return status(429, "TooManyRequests",
                              "Cannot evict pod as it would violate the pod's disruption "
                              f"budget. The disruption budget {blocking} needs more "
                              "healthy pods")
            self._disrupt(key, "EvictionByEvictionAPI", "Eviction API: evicting")
            self._terminate(key, None)
        return self._json({"kind": "Status", "apiVersion": "v1", "status": "Success",
                           "code": 201}, 201)

    def _blocking_budget(self, pod: dict[str, Any]) -> str | None:
        """The name of a PodDisruptionBudget that forbids evicting ``pod``, as
        the eviction API computes it: healthy pods (Running, Ready, not
        terminating) the budget selects, against minAvailable or maxUnavailable."""
        ns = pod["metadata"]["namespace"]
        labels = pod["metadata"].get("labels") or {}
        for pdb in self.list("poddisruptionbudgets", ns):
            sel = pdb.get("spec", {}).get("selector")
            if not self._selects(sel, labels):
                continue
            chosen = [p for p in self.list("pods", ns)
                      if self._selects(sel, p["metadata"].get("labels") or {})]
            healthy = sum(1 for p in chosen if not p["metadata"].get("deletionTimestamp")
                          and (p.get("status") or {}).get("phase") == "Running"
                          and all(c.get("ready") for c in
                                  (p.get("status") or {}).get("containerStatuses") or []))
            spec = pdb["spec"]
            if "minAvailable" in spec:
                allowed = healthy - int(spec["minAvailable"])
            else:
                allowed = int(spec.get("maxUnavailable", 0)) - (len(chosen) - healthy)
            if allowed <= 0:
                return str(pdb["metadata"]["name"])
        return None

    def _disrupt(self, key: tuple[str, str, str], reason: str, message: str) -> None:
        """The DisruptionTarget condition, written before the deletion (its own
        write, as the eviction API, the scheduler and the pod GC do)."""
        pod = copy.deepcopy(self.objects[key])
        pod["status"] = with_condition(pod.get("status") or {},
                                       disruption_condition(reason, message))
        self._write("pods", key, pod, "MODIFIED")

    def _terminate(self, key: tuple[str, str, str], grace: int | None) -> dict[str, Any]:
        """Graceful deletion: the deletionTimestamp and grace period; the pod
        goes when its kubelet has stopped it (or at once when not bound)."""
        pod = copy.deepcopy(self.objects[key])
        if grace is None:
            grace = int(pod.get("spec", {}).get("terminationGracePeriodSeconds", 30))
        if grace == 0 or not pod.get("spec", {}).get("nodeName") \
                or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return self._delete(key)  # nothing runs: gone at once, as the real server does
        if not pod["metadata"].get("deletionTimestamp"):
            # The planned deletion, as the real API server sets it: the
            # request's time plus the grace period.
            pod["metadata"]["deletionTimestamp"] = _now(grace)
            pod["metadata"]["deletionGracePeriodSeconds"] = grace
            pod = self._write("pods", key, pod, "MODIFIED")
            if not self.kubelets:
                # No kubelet here: the containers count as stopped at once.
                self._later(self.eviction_delay,
                            lambda: self._delete(key) if key in self.objects else None)
        return pod


# -- object builders for tests ---------------------------------------------------------

def node(name: str, *, unschedulable: bool = False, taints: list[dict[str, Any]] | None = None,
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"unschedulable": unschedulable, "taints": taints or []},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def pod(name: str, node_name: str | None, *, namespace: str = "default",
        labels: dict[str, str] | None = None, env: dict[str, str] | None = None,
        containers: tuple[str, ...] = ("main",), owner: str | None = None,
        phase: str = "Running", annotations: dict[str, str] | None = None) -> dict[str, Any]:
    # ``env`` goes to the first container only.
    spec: dict[str, Any] = {"containers": [
        {"name": c, "image": "busybox", "env": [{"name": k, "value": v}
                                                for k, v in (env or {}).items()] if i == 0
         else []}
        for i, c in enumerate(containers)]}
    if node_name:
        spec["nodeName"] = node_name
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {},
                            "annotations": annotations or {}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": owner,
                                    "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, owner)),
                                    "controller": True}]
    return {"metadata": meta, "spec": spec, "status": {
        "phase": phase, "containerStatuses": [
            {"name": c, "restartCount": 0, "ready": phase == "Running",
             "state": {"running": {"startedAt": _now()}} if phase == "Running"
             else {"waiting": {"reason": "ContainerCreating"}}}
            for c in containers]}}
