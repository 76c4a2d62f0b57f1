"""A batch queue preempting an Indexed Job and admitting it again on other
nodes: each index resumes its own state. Real containerd, runc, CRIU,
smr-init, the webhook, the watcher and the agents on two nodes; the FAKE API
server, kubelets, Job controller and scheduler (tests/fake_controllers.py:
the Job controller deletes a suspended Job's pods with their grace and makes
new ones when it is unsuspended, as the real one does); the test plays Kueue
(``spec.suspend`` and the Workload's ``Evicted`` condition)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kubernetes_asyncio import client

from tests.agent.cluster import Cluster, assert_continues, steps
from tests.agent.test_injection import plain_pod
from tests.fake_controllers import INDEX, FakeControllers, job

JOB = "train"
COMMAND = ["/bin/sh", "-c", ". /bin/counter"]
TURNS = 3


def workload(job_uid: str, evicted: bool) -> dict[str, Any]:
    """Kueue's Workload of the Job, as Kueue writes it."""
    conditions = [{"type": "Admitted", "status": "False" if evicted else "True",
                   "reason": "NoReservation" if evicted else "Admitted"}]
    if evicted:
        conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted",
                           "message": "Preempted to accommodate a higher priority workload"})
    return {"metadata": {"name": f"job-{JOB}-3f2a1", "namespace": "default",
                         "labels": {"kueue.x-k8s.io/job-uid": job_uid}},
            "spec": {"queueName": "user-queue"}, "status": {"conditions": conditions}}


async def index_pods(cluster: Cluster, ctl: FakeControllers, seen: set[str],
                     timeout: float = 90, n: int = 2) -> dict[int, tuple[str, str]]:
    """index → (pod name, node) of the Job's ``n`` new pods (uids not in
    ``seen``), once all are bound."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[int, tuple[str, str]] = {}
        for name in ctl.created:
            p = cluster.kube.get("pods", name, "default")
            if p and p["metadata"]["uid"] not in seen and p["spec"].get("nodeName"):
                found[int(p["metadata"]["annotations"][INDEX])] = (name, p["spec"]["nodeName"])
        if len(found) == n:
            for name, _ in found.values():
                seen.add(cluster.kube.get("pods", name, "default")["metadata"]["uid"])  # type: ignore[index]
            return found
        assert time.monotonic() < deadline, f"the Job's pods did not come: {ctl.created}"
        await asyncio.sleep(0.1)


async def gone(cluster: Cluster, name: str, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while cluster.kube.get("pods", name, "default") is not None:
        assert time.monotonic() < deadline, f"pod {name} was not stopped within {timeout}s"
        await asyncio.sleep(0.1)


async def indexed_job(cluster: Cluster) -> str:
    """The Indexed Job JOB of two counters (120 s of grace each, for their
    final checkpoints), created with only the first node schedulable; its uid."""
    await cluster.core.patch_node(list(cluster.kubelets)[1], {"spec": {"unschedulable": True}})
    p = plain_pod("x", None, env={"SMR_CHECKPOINT": JOB}, command=COMMAND)
    p["spec"]["terminationGracePeriodSeconds"] = 120
    cluster.kube.put("jobs", job(JOB, {"metadata": {"labels": {"app": JOB}}, "spec": p["spec"]},
                                 completionMode="Indexed", completions=2, parallelism=2))
    made = cluster.kube.get("jobs", JOB, "default")
    assert made is not None, f"the Job {JOB} was not created"
    return str(made["metadata"]["uid"])


async def test_an_indexed_job_preempted_by_the_queue_resumes_each_index_on_other_nodes(
        cluster: Cluster, controllers: FakeControllers) -> None:
    """Three preemptions: each suspension takes a final checkpoint of both
    indices; each admission lands on the other node (the old one cordoned),
    and index i goes on from index i's last step, its memory intact."""
    a, b = list(cluster.kubelets)
    jobs = client.BatchV1Api(cluster.core.api_client)
    uid = await indexed_job(cluster)
    seen: set[str] = set()
    last: dict[int, list[tuple[int, int, str]]] = {}
    for turn in range(TURNS + 1):
        pods = await index_pods(cluster, controllers, seen)
        for i, (name, node) in pods.items():
            after = await cluster.until_steps(name, node, 5, timeout=90)
            if turn:
                before = last[i]
                assert_continues(before, after, before[-1][0])
                assert after[0][0] == before[-1][0] + 1, (
                    f"index {i}, admission {turn}: steps lost or done twice "
                    f"(stopped at {before[-1][0]}, went on at {after[0][0]})")
        if turn == TURNS:
            break
        # Kueue preempts: the Workload evicted, the Job suspended; the Job
        # controller deletes both pods with their grace.
        cluster.kube.put("workloads", workload(uid, evicted=True))
        await jobs.patch_namespaced_job(JOB, "default", {"spec": {"suspend": True}})
        for i, (name, node) in pods.items():
            await gone(cluster, name)
            last[i] = steps(cluster.log(name, node))
        for i in pods:
            latest = await cluster.store.latest("default", f"{JOB}-{i}")
            assert latest is not None and latest.manifest["reason"] == "suspended", (
                f"index {i}: no final checkpoint at the suspension: {latest and latest.manifest}")
            assert latest.manifest["leave_running"] is False
        # Admitted again, on the other node.
        was = pods[0][1]
        other = b if was == a else a
        await cluster.core.patch_node(other, {"spec": {"unschedulable": False}})
        await cluster.core.patch_node(was, {"spec": {"unschedulable": True}})
        cluster.kube.put("workloads", workload(uid, evicted=False))
        await jobs.patch_namespaced_job(JOB, "default", {"spec": {"suspend": False}})
    assert len(cluster.events("preempted-by-queue")) == 2 * TURNS
