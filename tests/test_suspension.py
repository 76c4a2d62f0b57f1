"""A Job suspended by a batch queue (Kueue evicting its Workload) or by hand:
its pods, deleted by the Job controller with a plain DELETE, get a final
checkpoint each, and each completion index of an Indexed Job keeps a lineage
of its own. Against the FAKE API server (RBAC of the shipped manifests
enforced) with a real nats-server: the watcher as it runs in a cluster."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from kubernetes_asyncio import client

from services.policy import pod_policy
from services.suspension import suspension_of
from smr.bus import Bus
from tests import test_watcher
from tests.fake_apiserver import FakeApiServer, pod
from tests.fake_apiserver import node as a_node
from tests.test_watcher import Watchers, ckpts

kube, api, admin = test_watcher.kube, test_watcher.api, test_watcher.admin
watch_settings, watchers = test_watcher.watch_settings, test_watcher.watchers
bus, watcher_bus, storage = test_watcher.bus, test_watcher.watcher_bus, test_watcher.storage

INDEX = "batch.kubernetes.io/job-completion-index"


def job(name: str, *, suspend: bool = False, completions: int = 2) -> dict[str, Any]:
    uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, name))  # as tests.fake_apiserver.pod's owner
    return {"metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"suspend": suspend, "completionMode": "Indexed", "parallelism": completions,
                     "completions": completions, "template": {"spec": {"containers": [
                         {"name": "main", "image": "busybox",
                          "env": [{"name": "SMR_CHECKPOINT", "value": name}]}]}}}}


def job_pods(kube: FakeApiServer, name: str, node: str, n: int = 2) -> list[str]:
    """The Indexed Job's pods as its controller makes them (owner, index)."""
    names = []
    for i in range(n):
        p = pod(f"{name}-{i}-x{i}", node, env={"SMR_CHECKPOINT": name}, owner=name,
                annotations={INDEX: str(i)}, labels={INDEX: str(i)})
        kube.put("pods", p)
        names.append(p["metadata"]["name"])
    return names


def workload(job_name: str, evicted: bool) -> dict[str, Any]:
    """Kueue's Workload of the Job, as Kueue writes it when it preempts it."""
    conditions = [{"type": "Admitted", "status": "False", "reason": "NoReservation"}]
    if evicted:
        conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted",
                           "message": "Preempted to accommodate a workload (UID: 1234) "
                                      "due to prioritization in the ClusterQueue"})
    return {"metadata": {"name": f"job-{job_name}-3f2a1", "namespace": "default",
                         "labels": {"kueue.x-k8s.io/job-uid":
                                    str(uuid.uuid5(uuid.NAMESPACE_DNS, job_name))}},
            "spec": {"queueName": "user-queue"}, "status": {"conditions": conditions}}


async def suspend_as_the_job_controller(kube: FakeApiServer, admin: client.ApiClient,
                                        name: str, pods: list[str]) -> None:
    """``spec.suspend: true`` written first, then each active pod deleted with
    its grace (no DisruptionTarget), as the Job controller does."""
    await client.BatchV1Api(admin).patch_namespaced_job(name, "default",
                                                        {"spec": {"suspend": True}})
    core = client.CoreV1Api(admin)
    for p in pods:
        await core.delete_namespaced_pod(p, "default", grace_period_seconds=60,
                                         _preload_content=False)


async def test_a_job_suspended_by_kueue_gets_a_final_checkpoint_per_index(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        node: str) -> None:
    kube.put("nodes", a_node(node))
    kube.put("jobs", job("train"))
    kube.put("workloads", workload("train", evicted=True))
    pods = job_pods(kube, "train", node)
    await watchers.start()
    async with ckpts(bus, node) as c:
        await asyncio.sleep(0.5)
        assert c.items == [], "a running Job's pods got a checkpoint"
        await suspend_as_the_job_controller(kube, admin, "train", pods)
        reqs = await c.wait(2, settle=1.0)
    assert sorted((r.checkpoint_id, r.reason, r.leave_running) for r in reqs) == [
        ("train-0", "suspended", False), ("train-1", "suspended", False)]
    assert {r.target.pod for r in reqs} == set(pods)
    events = [e for e in kube.list("events", "default")
              if e.get("reason") == "preempted-by-queue"]
    assert {e["involvedObject"]["name"] for e in events} == set(pods), events
    assert all("Evicted (Preempted)" in e["message"] for e in events), events
    assert not kube.denied


async def test_a_job_suspended_by_hand_gets_its_final_checkpoints_without_kueue(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        node: str) -> None:
    kube.put("nodes", a_node(node))
    kube.put("jobs", job("batch"))
    pods = job_pods(kube, "batch", node)
    await watchers.start()
    async with ckpts(bus, node) as c:
        await suspend_as_the_job_controller(kube, admin, "batch", pods)
        reqs = await c.wait(2, settle=1.0)
    assert {r.reason for r in reqs} == {"suspended"}
    events = [e for e in kube.list("events", "default") if e.get("reason") == "job-suspended"]
    assert len(events) == 2
    assert not kube.denied


async def test_a_running_jobs_pod_deleted_gets_no_final_checkpoint(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        node: str) -> None:
    """A pod of a Job that is not suspended, deleted by a person or its
    controller (a scale-down, a failed pod replaced): not a preemption."""
    kube.put("nodes", a_node(node))
    kube.put("jobs", job("steady"))
    kube.put("workloads", workload("steady", evicted=False))
    pods = job_pods(kube, "steady", node)
    await watchers.start()
    async with ckpts(bus, node) as c:
        await client.CoreV1Api(admin).delete_namespaced_pod(pods[0], "default",
                                                            _preload_content=False)
        await asyncio.sleep(1.5)
        assert c.items == [], "a plain delete of a running Job's pod took a checkpoint"
    assert not kube.denied


async def test_the_reason_is_read_fresh_from_the_job_and_its_workload(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """``suspension_of`` as the watcher's account: nothing for a bare pod or a
    running Job; the queue's reason for an evicted Workload; the Job's own
    for a suspension without Kueue."""
    kube.put("jobs", job("q", suspend=True))
    kube.put("workloads", workload("q", evicted=True))
    kube.put("jobs", job("h", suspend=True))
    kube.put("jobs", job("r"))
    assert await suspension_of(api, pod("bare", "n")) is None
    assert await suspension_of(api, pod("r-0", "n", owner="r")) is None
    q = await suspension_of(api, pod("q-0", "n", owner="q"))
    assert q is not None and q.by == "queue" and q.event_reason == "preempted-by-queue"
    h = await suspension_of(api, pod("h-0", "n", owner="h"))
    assert h is not None and (h.by, h.event_reason) == ("job", "job-suspended")
    assert await suspension_of(api, pod("gone-0", "n", owner="gone")) is None
    assert not kube.denied


def test_each_completion_index_has_its_own_lineage() -> None:
    def ids(p: dict[str, Any]) -> list[str]:
        pol = pod_policy(p, prefix="smr.dev", heartbeat_min=10, heartbeat_max=86400)
        assert not pol.problems, pol.problems
        return [c.checkpoint_id for c in pol.containers]

    assert ids(pod("t-0", "n", env={"SMR_CHECKPOINT": "t"}, owner="t",
                   annotations={INDEX: "0"})) == ["t-0"]
    assert ids(pod("t-3", "n", env={"SMR_CHECKPOINT": "t"}, owner="t",
                   labels={INDEX: "3"})) == ["t-3"]
    assert ids(pod("plain", "n", env={"SMR_CHECKPOINT": "t"})) == ["t"]
    bad = pod_policy(pod("t-x", "n", env={"SMR_CHECKPOINT": "t"}, annotations={INDEX: "x/y"}),
                     prefix="smr.dev", heartbeat_min=10, heartbeat_max=86400)
    assert bad.containers == () and "completion index" in bad.problems[0]
