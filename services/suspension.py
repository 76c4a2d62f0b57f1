"""Is a pod being deleted because its Job was suspended (by Kueue, a person or
a script)? Then the deletion is a preemption by the queue, and the pod gets a
final checkpoint, as an eviction does.

The Job controller deletes a suspended Job's pods with a plain DELETE: no
``DisruptionTarget`` condition says why (services/triggers). So the answer is
read from the owner Job itself, fresh from the API server, not from a watch:
the Job's ``spec.suspend`` is written before the controller deletes the pods,
so a read made after the pod's deletion is seen always shows it, where a Job
watch could still be behind the pod watch.

Kueue suspends a Job when it evicts its Workload (found by the label
``kueue.x-k8s.io/job-uid``); the Workload's ``Evicted`` and ``Preempted``
conditions say why, and that goes into the checkpoint's Event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from smr.contract.errors import SmrError

log = logging.getLogger("smr.suspension")

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta1", "v1beta2")  # v1beta2 from Kueue 0.14; either may be served
KUEUE_JOB_UID = "kueue.x-k8s.io/job-uid"
# Workload conditions Kueue sets when it takes a Workload's admission back.
KUEUE_CONDITIONS = ("Preempted", "Evicted")


@dataclass(frozen=True)
class Suspension:
    """The pod's Job is suspended: ``by`` is ``queue`` (a Kueue Workload was
    evicted) or ``job`` (spec.suspend set by someone else); ``detail`` is
    what the Workload's condition or the Job says."""

    job: str
    by: str
    detail: str

    @property
    def event_reason(self) -> str:
        return "preempted-by-queue" if self.by == "queue" else "job-suspended"


def owner_job(pod: dict[str, Any]) -> str | None:
    """The name of the Job that controls ``pod`` (None: not a Job's pod)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Job" and str(ref.get("apiVersion", "")).startswith("batch/") \
                and ref.get("controller"):
            return str(ref.get("name") or "") or None
    return None


async def suspension_of(api: client.ApiClient, pod: dict[str, Any]) -> Suspension | None:
    """Why ``pod``'s Job suspended it (None: it has no Job, or the Job runs).

    Raises SmrError (code ``kube-api``) when the Job cannot be read: the
    caller asks again rather than deciding that no checkpoint is due."""
    name = owner_job(pod)
    if name is None:
        return None
    ns = pod["metadata"]["namespace"]
    try:
        resp = await client.BatchV1Api(api).read_namespaced_job(
            name, ns, _preload_content=False, _request_timeout=10)
    except ApiException as e:
        if e.status == 404:
            return None  # the Job is gone (deleted with its pods): no resumption
        raise SmrError(f"cannot read Job {ns}/{name} of pod {pod['metadata'].get('name')}: "
                       f"{e.status} {e.reason}", code="kube-api",
                       hint="the agent and the watcher need get on batch/jobs "
                            "(deploy/kustomize/base)") from None
    job = orjson.loads(await resp.read())
    if not (job.get("spec") or {}).get("suspend"):
        return None
    why = await _workload_eviction(api, ns, str(job["metadata"].get("uid", "")))
    if why is not None:
        return Suspension(name, "queue", why)
    return Suspension(name, "job", f"Job {ns}/{name} has spec.suspend: true")


async def _workload_eviction(api: client.ApiClient, ns: str, job_uid: str) -> str | None:
    """What Kueue's Workload of the Job says about its eviction (None: no
    Kueue here, no Workload, or none evicted). Best effort: a read that fails
    leaves the reason generic, never the checkpoint undone."""
    custom = client.CustomObjectsApi(api)
    for version in KUEUE_VERSIONS:
        try:
            found = await custom.list_namespaced_custom_object(
                KUEUE_GROUP, version, ns, "workloads",
                label_selector=f"{KUEUE_JOB_UID}={job_uid}", _request_timeout=10)
        except ApiException as e:
            if e.status in (403, 404):
                continue  # Kueue (or this version) is not installed, or not ours to read
            log.warning("cannot list Kueue Workloads in %s: %s %s", ns, e.status, e.reason)
            return None
        for wl in found.get("items") or []:
            conditions = {c.get("type"): c for c in (wl.get("status") or {}).get("conditions")
                          or [] if c.get("status") == "True"}
            for kind in KUEUE_CONDITIONS:
                if c := conditions.get(kind):
                    return (f"Kueue Workload {wl['metadata'].get('name')}: {kind} "
                            f"({c.get('reason', '')}): {str(c.get('message', ''))[:300]}")
        return None
    return None
