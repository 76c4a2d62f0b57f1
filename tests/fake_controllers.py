"""FAKE workload controllers and scheduler, for the FAKE API server
(tests/fake_apiserver.py): no kube-controller-manager can run here.

They replace pods when the real controllers do, because smr's final
checkpoint depends on it (pkg/controller in kubernetes/kubernetes):

- ReplicaSet (a Deployment's): counts only active pods, and a pod with a
  ``deletionTimestamp`` is not active, so the replacement of an evicted pod
  is created the moment the eviction lands, while the old pod still runs its
  preStop hook. Extra active pods are deleted (with their grace).
- Job: ``podReplacementPolicy`` ``TerminatingOrFailed`` (the default) replaces
  a terminating pod at once, as the ReplicaSet does; ``Failed`` (the default
  once a ``podFailurePolicy`` is set) only once it has failed or is gone.
  ``spec.suspend`` true deletes the active pods with their grace; false
  again creates new ones. Indexed Jobs: one pod per completion index, named
  ``<job>-<index>-<random>``, with the ``batch.kubernetes.io/job-completion-index``
  annotation and label and ``JOB_COMPLETION_INDEX`` (a literal here: the fake
  kubelet has no downward API). Failures count against ``backoffLimit``,
  except those a ``podFailurePolicy`` Ignore rule matches (by pod condition).
  Finished pods: ``status.succeeded``/``failed``, the Complete condition.
- StatefulSet: pod N is ``<set>-N`` and is created again only once the old
  pod N is gone from the API (one pod of a name at a time); a Failed or
  Succeeded pod N is deleted first. OrderedReady: N is created once N-1
  runs and is Ready; ``Parallel``: all at once.

Replacement pods carry what the real ones do: the template's labels, env
(SMR_CHECKPOINT included) and spec, ``ownerReferences`` to their controller
(``controller: true``, ``blockOwnerDeletion: true``), ``generateName`` (the
API server picks the name) and the controllers' own labels. They are created
through the API over HTTP, as the operator, so admission (smr's webhook)
runs on them.

The scheduler binds each pod a controller made (and no other: the tests bind
their own pods) to the first Ready, schedulable node by name without a
NoSchedule or NoExecute taint, as ``status.phase: Pending``.

They are driven by the fake API server's changes (``listeners``, an
in-process informer), each controller kind reconciled in one loop, so a pod
is never created twice for one gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
from typing import Any

import aiohttp

from smr.aio import wait_event
from tests.fake_apiserver import Change, FakeApiServer

INDEX = "batch.kubernetes.io/job-completion-index"
KINDS = {"replicasets": ("ReplicaSet", "apps/v1"), "jobs": ("Job", "batch/v1"),
         "statefulsets": ("StatefulSet", "apps/v1")}
RESYNC_S = 0.5


def _terminal(p: dict[str, Any]) -> bool:
    return (p.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _terminating(p: dict[str, Any]) -> bool:
    return bool(p["metadata"].get("deletionTimestamp")) and not _terminal(p)


def _active(p: dict[str, Any]) -> bool:
    """As controller.IsPodActive: not terminal, not being deleted."""
    return not p["metadata"].get("deletionTimestamp") and not _terminal(p)


def _ready(p: dict[str, Any]) -> bool:
    st = p.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def controller_of(p: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in p["metadata"].get("ownerReferences") or [] if r.get("controller")),
                None)


def replicaset(name: str, template: dict[str, Any], replicas: int = 1, *,
               deployment: str | None = None, namespace: str = "default") -> dict[str, Any]:
    """A ReplicaSet as a Deployment makes it: ``<deployment>-<hash>``, with the
    ``pod-template-hash`` label on itself, its selector and its pods."""
    h = hashlib.sha256(repr(template).encode()).hexdigest()[:10]
    template = copy.deepcopy(template)
    labels = {**(template.setdefault("metadata", {}).get("labels") or {}),
              "pod-template-hash": h}
    template["metadata"]["labels"] = labels
    meta: dict[str, Any] = {"name": f"{deployment}-{h}" if deployment else name,
                            "namespace": namespace, "labels": labels}
    if deployment:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment",
                                    "name": deployment, "uid": f"deployment-{deployment}",
                                    "controller": True, "blockOwnerDeletion": True}]
    return {"metadata": meta, "spec": {"replicas": replicas, "template": template,
                                       "selector": {"matchLabels": labels}}}


def job(name: str, template: dict[str, Any], *, namespace: str = "default",
        **spec: Any) -> dict[str, Any]:
    """A Job; ``spec``: parallelism, completions, completionMode, suspend,
    podReplacementPolicy, podFailurePolicy, backoffLimit."""
    template = copy.deepcopy(template)
    template.setdefault("spec", {}).setdefault("restartPolicy", "Never")
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"template": template, **spec}}


def statefulset(name: str, template: dict[str, Any], replicas: int = 1, *,
                namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas, "template": copy.deepcopy(template),
                     "serviceName": name, **spec}}


class FakeControllers:
    """``await FakeControllers(kube).start()``; ``stop()`` at the end."""

    def __init__(self, kube: FakeApiServer) -> None:
        self.kube = kube
        self.created: list[str] = []  # pod names, in the order created
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._failed: dict[str, set[str]] = {}  # Job uid → uids of pods counted failed
        self._succeeded: dict[str, set[str]] = {}  # Job uid → uids counted succeeded
        self._indexes_done: dict[str, set[int]] = {}  # Indexed Job uid → indexes done

    async def start(self) -> FakeControllers:
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.kube.admin_token}"})
        self.kube.listeners.append(self._changed)
        self._tasks.append(asyncio.create_task(self._loop()))
        return self

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.kube.listeners.remove(self._changed)
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session:
            await self._session.close()

    def _changed(self, ch: Change) -> None:
        if ch.plural in ("pods", "nodes", *KINDS):
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                for rs in self.kube.list("replicasets"):
                    await self._replicaset(rs)
                for j in self.kube.list("jobs"):
                    await self._job(j)
                for ss in self.kube.list("statefulsets"):
                    await self._statefulset(ss)
                self._schedule()
            except Exception as e:  # a test harness: say it, keep going
                print(f"fake controllers: {e!r}")
            await wait_event(self._wake, RESYNC_S)

    # -- what they share ------------------------------------------------------------

    def _owned(self, owner: dict[str, Any]) -> list[dict[str, Any]]:
        uid = owner["metadata"]["uid"]
        return [p for p in self.kube.list("pods", owner["metadata"]["namespace"])
                if (controller_of(p) or {}).get("uid") == uid]

    async def _create(self, owner: dict[str, Any], plural: str, *, name: str | None = None,
                      generate: str | None = None, labels: dict[str, str] | None = None,
                      annotations: dict[str, str] | None = None,
                      env: dict[str, str] | None = None) -> None:
        meta = owner["metadata"]
        kind, api = KINDS[plural]
        tmpl = copy.deepcopy(owner["spec"]["template"])
        pm = tmpl.get("metadata") or {}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "namespace": meta["namespace"],
            "labels": {**(pm.get("labels") or {}), **(labels or {})},
            "annotations": {**(pm.get("annotations") or {}), **(annotations or {})},
            "ownerReferences": [{"apiVersion": api, "kind": kind, "name": meta["name"],
                                 "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}]},
            "spec": tmpl["spec"]}
        if name:
            body["metadata"]["name"] = name
        else:
            body["metadata"]["generateName"] = generate or f"{meta['name']}-"
        for c in body["spec"].get("containers") or []:
            c["env"] = [*(c.get("env") or []),
                        *({"name": k, "value": v} for k, v in (env or {}).items())]
        assert self._session is not None
        async with self._session.post(
                f"{self.kube.url}/api/v1/namespaces/{meta['namespace']}/pods",
                json=body) as resp:
            made = await resp.json()
            if resp.status != 201:
                raise RuntimeError(f"{kind} {meta['name']}: pod not created: {made}")
        self.created.append(made["metadata"]["name"])

    async def _delete(self, p: dict[str, Any]) -> None:
        """A delete with the pod's own grace (no gracePeriodSeconds given)."""
        assert self._session is not None
        m = p["metadata"]
        async with self._session.delete(
                f"{self.kube.url}/api/v1/namespaces/{m['namespace']}/pods/{m['name']}"):
            pass

    def _schedule(self) -> None:
        nodes = sorted((n for n in self.kube.list("nodes")
                        if not n["spec"].get("unschedulable")
                        and not any(t.get("effect") in ("NoSchedule", "NoExecute")
                                    for t in n["spec"].get("taints") or [])
                        and any(c["type"] == "Ready" and c["status"] == "True"
                                for c in n["status"].get("conditions") or [])),
                       key=lambda n: n["metadata"]["name"])
        for p in self.kube.list("pods"):
            if p["spec"].get("nodeName") or p["metadata"].get("deletionTimestamp") \
                    or p["metadata"]["name"] not in self.created or not nodes:
                continue
            p["spec"]["nodeName"] = nodes[0]["metadata"]["name"]
            p["status"] = {"phase": "Pending"}
            self.kube.put("pods", p)

    # -- ReplicaSet -----------------------------------------------------------------

    async def _replicaset(self, rs: dict[str, Any]) -> None:
        active = [p for p in self._owned(rs) if _active(p)]
        want = int(rs["spec"].get("replicas", 1))
        for _ in range(want - len(active)):
            await self._create(rs, "replicasets")
        for p in sorted(active, key=lambda p: p["metadata"]["creationTimestamp"],
                        reverse=True)[:max(0, len(active) - want)]:
            await self._delete(p)
        self._status(rs, {"replicas": len(active), "readyReplicas": sum(map(_ready, active))})

    def _status(self, obj: dict[str, Any], status: dict[str, Any]) -> None:
        plural = {"ReplicaSet": "replicasets", "Job": "jobs",
                  "StatefulSet": "statefulsets"}[obj["kind"]]
        cur = self.kube.get(plural, obj["metadata"]["name"], obj["metadata"]["namespace"])
        if cur is not None and {**(cur.get("status") or {}), **status} != cur.get("status"):
            cur["status"] = {**(cur.get("status") or {}), **status}
            self.kube.put(plural, cur)

    # -- Job ------------------------------------------------------------------------

    def _ignored(self, j: dict[str, Any], p: dict[str, Any]) -> bool:
        """A podFailurePolicy Ignore rule matches the failed pod's conditions."""
        conds = {c.get("type") for c in (p.get("status") or {}).get("conditions") or []
                 if c.get("status") == "True"}
        for rule in (j["spec"].get("podFailurePolicy") or {}).get("rules") or []:
            if any(c.get("type") in conds for c in rule.get("onPodConditions") or []):
                return bool(rule.get("action") == "Ignore")
        return False

    async def _job(self, j: dict[str, Any]) -> None:
        spec, uid = j["spec"], j["metadata"]["uid"]
        if any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in (j.get("status") or {}).get("conditions") or []):
            return
        pods = self._owned(j)
        indexed = spec.get("completionMode") == "Indexed"
        failed, succeeded = self._failed.setdefault(uid, set()), \
            self._succeeded.setdefault(uid, set())
        done = self._indexes_done.setdefault(uid, set())
        for p in pods:
            phase, puid = (p.get("status") or {}).get("phase"), p["metadata"]["uid"]
            if phase == "Succeeded" and puid not in succeeded:
                succeeded.add(puid)
                if indexed:
                    done.add(int(p["metadata"]["annotations"][INDEX]))
            elif phase == "Failed" and puid not in failed and not self._ignored(j, p):
                failed.add(puid)
        replacement = spec.get("podReplacementPolicy") or (
            "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed")
        active = [p for p in pods if _active(p)]
        terminating = [p for p in pods if _terminating(p)]
        parallelism = int(spec.get("parallelism", 1))
        completions = spec.get("completions")
        self._status(j, {"active": len(active), "succeeded": len(succeeded),
                         "failed": len(failed), "terminating": len(terminating)})
        if (completions is not None and len(succeeded) >= int(completions)) or \
                (completions is None and succeeded and not active):
            self._status(j, {"conditions": [{"type": "Complete", "status": "True"}]})
            return
        if len(failed) > int(spec.get("backoffLimit", 6)):
            for p in active:
                await self._delete(p)
            self._status(j, {"conditions": [{"type": "Failed", "status": "True",
                                             "reason": "BackoffLimitExceeded"}]})
            return
        if spec.get("suspend"):
            for p in active:  # each with its grace: its preStop hook runs
                await self._delete(p)
            self._status(j, {"conditions": [{"type": "Suspended", "status": "True"}]})
            return
        self._status(j, {"conditions": [{"type": "Suspended", "status": "False"}]})
        # With Failed, a pod still terminating holds its place: no replacement yet.
        busy = active + (terminating if replacement == "Failed" else [])
        labels = {"batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                  "batch.kubernetes.io/job-name": j["metadata"]["name"],
                  "job-name": j["metadata"]["name"]}
        if indexed:
            taken = {int(p["metadata"]["annotations"][INDEX]) for p in busy}
            free = [i for i in range(int(completions or 1)) if i not in taken | done]
            for i in free[:max(0, parallelism - len(busy))]:
                await self._create(j, "jobs", generate=f"{j['metadata']['name']}-{i}-",
                                   labels={**labels, INDEX: str(i)},
                                   annotations={INDEX: str(i)},
                                   env={"JOB_COMPLETION_INDEX": str(i)})
            return
        left = parallelism if completions is None else \
            min(parallelism, int(completions) - len(succeeded))
        for _ in range(left - len(busy)):
            await self._create(j, "jobs", labels=labels)

    # -- StatefulSet ----------------------------------------------------------------

    async def _statefulset(self, ss: dict[str, Any]) -> None:
        name, ns = ss["metadata"]["name"], ss["metadata"]["namespace"]
        ordered = ss["spec"].get("podManagementPolicy", "OrderedReady") == "OrderedReady"
        for n in range(int(ss["spec"].get("replicas", 1))):
            p = self.kube.get("pods", f"{name}-{n}", ns)
            if p is None:
                await self._create(ss, "statefulsets", name=f"{name}-{n}", labels={
                    "statefulset.kubernetes.io/pod-name": f"{name}-{n}",
                    "apps.kubernetes.io/pod-index": str(n)})
                if ordered:
                    return
            elif _terminal(p) and not p["metadata"].get("deletionTimestamp"):
                await self._delete(p)  # created again once it is gone
                if ordered:
                    return
            elif ordered and not _ready(p):
                return  # pod N+1 waits for N
