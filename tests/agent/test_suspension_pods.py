"""A batch queue preempting an Indexed Job (Kueue sets ``spec.suspend``; the
Job controller deletes its pods with their grace) and admitting it again on
other nodes: each index resumes its own state. Real containerd, runc and
CRIU on two nodes; the FAKE API server and kubelets (tests/agent/cluster.py);
the test plays Kueue and the Job controller's suspend semantics."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from tests.agent.cluster import Cluster, assert_continues, steps, workload

INDEX = "batch.kubernetes.io/job-completion-index"
JOB = "train"


def job() -> dict[str, Any]:
    return {"metadata": {"name": JOB, "namespace": "default",
                         "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, JOB))},
            "spec": {"suspend": False, "completionMode": "Indexed", "completions": 2,
                     "parallelism": 2}}


def index_pod(index: int, turn: int, node: str) -> dict[str, Any]:
    """Index ``index``'s pod of admission ``turn``, as the Job controller
    makes it (owner, completion index), bound to ``node``."""
    p = workload(f"{JOB}-{index}-t{turn}", node, env={"SMR_CHECKPOINT": JOB}, owner=JOB,
                 final_wait=80, grace=90)
    p["metadata"]["annotations"][INDEX] = str(index)
    p["metadata"]["labels"][INDEX] = str(index)
    return p


async def gone(cluster: Cluster, name: str, timeout: float = 150) -> None:
    for _ in range(int(timeout * 10)):
        if cluster.kube.get("pods", name, "default") is None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"pod {name} was not stopped within {timeout}s")


async def test_an_indexed_job_preempted_by_the_queue_resumes_each_index_on_other_nodes(
        cluster: Cluster) -> None:
    """Three preemptions: each suspension takes a final checkpoint of both
    indices; each admission lands on the other node (the old one cordoned),
    and index i goes on from index i's last step, its memory intact."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("jobs", job())
    on, last = a, {0: [], 1: []}  # type: ignore[var-annotated]
    for turn in range(4):
        for i in (0, 1):
            cluster.kube.put("pods", index_pod(i, turn, on))
        for i in (0, 1):
            after = await cluster.until_steps(f"{JOB}-{i}-t{turn}", on, 5, timeout=90)
            if turn:
                before = last[i]
                assert_continues(before, after, before[-1][0])
                assert after[0][0] == before[-1][0] + 1, (
                    f"index {i}, admission {turn}: steps lost or done twice "
                    f"(stopped at {before[-1][0]}, went on at {after[0][0]})")
                assert after[0][2] == before[0][2], f"index {i} resumed another index's state"
        if turn == 3:
            break
        # Kueue preempts: the Job suspended first, then its controller
        # deletes the active pods with their grace (a plain delete).
        cluster.kube.put("jobs", {**job(), "spec": {**job()["spec"], "suspend": True}})
        for i in (0, 1):
            await cluster.core.delete_namespaced_pod(f"{JOB}-{i}-t{turn}", "default")
        for i in (0, 1):
            await gone(cluster, f"{JOB}-{i}-t{turn}")
            last[i] = steps(cluster.log(f"{JOB}-{i}-t{turn}", on))
        for i in (0, 1):
            latest = await cluster.store.latest("default", f"{JOB}-{i}")
            assert latest is not None and latest.manifest["reason"] == "suspended", (
                f"index {i}: no final checkpoint at the suspension: {latest and latest.manifest}")
            assert latest.manifest["leave_running"] is False
        # Admitted again on the other node.
        await cluster.core.patch_node(on, {"spec": {"unschedulable": True}})
        other = b if on == a else a
        await cluster.core.patch_node(other, {"spec": {"unschedulable": False}})
        cluster.kube.put("jobs", job())
        on = other
    assert len(cluster.events("job-suspended")) == 6
