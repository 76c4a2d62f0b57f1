"""Pods that share one checkpoint lineage though their states differ: those of
a NonIndexed Job running more than one pod at a time (``parallelism > 1``),
each named by the one ``SMR_CHECKPOINT``. Their checkpoints go into one
lineage, the latest of which is whichever pod's was stored last: after a
suspension or a migration every new pod resumes that one state (its work
then runs twice), and the other pods' progress is lost. Nothing tells which
pod's state is whose, so smr cannot choose for them; the fix is the Job's: an
Indexed Job gives index i the lineage ``<id>-<i>`` (services/policy).

The watcher says so on the Job (a Warning Event ``SharedCheckpointLineage``)
when it first sees such a pod running: the Job is read fresh from the API
server, once per pod seen, only for a Job's pods whose lineage comes from
the env and which have no completion index.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.policy import COMPLETION_INDEX, PodPolicy
from services.suspension import owner_job
from services.watcher.events import EventRecorder

log = logging.getLogger("smr.watcher.lineages")

SHARED_LINEAGE = "SharedCheckpointLineage"


def _shares(pod: dict[str, Any], policy: PodPolicy) -> bool:
    """Could ``pod`` share its lineage with its Job's other pods?"""
    meta = pod.get("metadata") or {}
    indexed = COMPLETION_INDEX in (meta.get("annotations") or {}) \
        or COMPLETION_INDEX in (meta.get("labels") or {})
    return not indexed and any(c.from_env for c in policy.containers) \
        and owner_job(pod) is not None


class SharedLineages:
    """Warns on each Job whose pods share one lineage: once per pod seen."""

    def __init__(self, api: client.ApiClient, events: EventRecorder) -> None:
        self.batch = client.BatchV1Api(api)
        self.events = events
        self.seen: set[str] = set()  # uids of pods whose Job was looked at

    def wants(self, pod: dict[str, Any], policy: PodPolicy) -> bool:
        uid = (pod.get("metadata") or {}).get("uid", "")
        return bool(uid) and uid not in self.seen and _shares(pod, policy)

    def forget(self, uid: str) -> None:
        self.seen.discard(uid)

    async def check(self, pod: dict[str, Any], policy: PodPolicy) -> None:
        meta = pod["metadata"]
        self.seen.add(meta["uid"])
        ns, name = meta["namespace"], owner_job(pod)
        assert name is not None
        try:
            resp = await self.batch.read_namespaced_job(name, ns, _preload_content=False,
                                                        _request_timeout=10)
            job = orjson.loads(await resp.read())
        except ApiException as e:
            if e.status != 404:  # a Job gone has no more pods to warn about
                log.warning("cannot read Job %s/%s of pod %s: %s %s (the watcher needs get "
                            "on batch/jobs, deploy/kustomize/base)", ns, name, meta.get("name"),
                            e.status, e.reason)
                self.seen.discard(meta["uid"])  # looked at again when the pod changes
            return
        spec = job.get("spec") or {}
        parallelism = spec.get("parallelism")
        parallelism = 1 if parallelism is None else int(parallelism)
        if spec.get("completionMode") == "Indexed" or parallelism <= 1:
            return
        ids = sorted({c.checkpoint_id for c in policy.containers if c.from_env})
        lineages = ", ".join(f'"{i}"' for i in ids)
        message = (f"Job {ns}/{name} is NonIndexed with parallelism {parallelism}: its pods "
                   f"share the checkpoint lineage {lineages} (SMR_CHECKPOINT), so their "
                   "states cannot be told apart: after a suspension or a migration each new "
                   "pod resumes the one state stored last, and the other pods' progress is "
                   "lost. Make the Job Indexed (spec.completionMode: Indexed): index i then "
                   f"resumes its own lineage {ids[0]}-<i>")
        uid = str(job["metadata"].get("uid", ""))
        try:
            await self.events.event({"kind": "Job", "apiVersion": "batch/v1", "namespace": ns,
                                     "name": name}, reason=SHARED_LINEAGE, message=message,
                                    key=f"{uid}:{parallelism}:{lineages}", warning=True,
                                    uid=uid or None)
        except ApiException as e:
            log.warning("cannot post Event %s on Job %s/%s: %s", SHARED_LINEAGE, ns, name,
                        e.reason)
