"""Controller-owned pods evicted while their controller replaces them early.

A ReplicaSet, and a Job with the default podReplacementPolicy, create the
replacement of an evicted pod the moment it gets its deletionTimestamp,
while the old pod still runs its preStop hook, waiting for its final
checkpoint; a StatefulSet waits until the old pod is gone. The controllers
and the scheduler are FAKES that act when the real ones do
(tests/fake_controllers.py); containerd, runc, CRIU, smr-init, the webhook,
the watcher and the agents are real (tests/agent/cluster.py).

Each test drains the pod's node three times in a row (cordon, then the
Eviction API), the pod going back and forth between the two nodes, and
samples both copies every 0.1 s: one copy at a time, each replacement
restores the final checkpoint, and no step of the counter is done twice.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.checkpointer.pod import PodCheckpointStep
from tests.agent.cluster import Cluster, assert_continues, steps
from tests.agent.test_injection import plain_pod
from tests.fake_controllers import FakeControllers, job, replicaset, statefulset

# A counter with about 20 MiB of memory: its dump takes long enough for a
# replacement created at the eviction to be answered before it is stored.
COMMAND = ["/bin/sh", "-c", "x=$(busybox seq 1 3000000); . /bin/counter"]
RUNS = 3


def template(ckpt: str) -> dict[str, Any]:
    p = plain_pod("x", None, env={"SMR_CHECKPOINT": ckpt}, command=COMMAND,
                  labels={"app": ckpt})
    return {"metadata": {"labels": p["metadata"]["labels"]}, "spec": p["spec"]}


async def running(cluster: Cluster, ctl: FakeControllers, seen: set[str],
                  timeout: float = 60) -> tuple[str, str, str]:
    """The next pod the controller made (its uid not in ``seen``), once bound:
    (name, uid, node)."""
    deadline = time.monotonic() + timeout
    while True:
        for name in ctl.created:
            p = cluster.kube.get("pods", name, "default")
            if p and p["metadata"]["uid"] not in seen and p["spec"].get("nodeName"):
                return name, p["metadata"]["uid"], p["spec"]["nodeName"]
        assert time.monotonic() < deadline, f"no new pod; made so far: {ctl.created}"
        await asyncio.sleep(0.1)


async def restored_event(cluster: Cluster, uid: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not (got := [e["message"] for e in cluster.events("Restored")
                       if e["involvedObject"].get("uid") == uid]):
        assert time.monotonic() < deadline, "no Restored Event on the replacement"
        await asyncio.sleep(0.1)
    return got[0]


def final_held_until_replacement_waits(cluster: Cluster, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """The eviction's final checkpoint is stored only once the replacement's
    start is waiting for it (at most 60 s), as on a node whose dump takes
    longer than the replacement takes to start. Without the hold a loaded
    machine may store it first, and the wait goes untested; with it, an
    agent that does not wait restores the cordon's checkpoint, and the
    steps between the two are done twice."""
    real = PodCheckpointStep._commit

    async def held(self: PodCheckpointStep, req: Any, *a: Any, **kw: Any) -> Any:
        deadline = time.monotonic() + 60
        while req.reason == "drain" and time.monotonic() < deadline:
            if any(f"pod {req.target.pod} (node" in e["message"]
                   for e in cluster.events("WaitingForFinalCheckpoint")):
                break
            await asyncio.sleep(0.1)
        return await real(self, req, *a, **kw)

    monkeypatch.setattr(PodCheckpointStep, "_commit", held)


async def drain_three_times(cluster: Cluster, ctl: FakeControllers, ckpt: str) -> None:
    nodes = list(cluster.kubelets)
    name, uid, node = await running(cluster, ctl, set())
    await cluster.until_steps(name, node, 5, timeout=90)
    seen = {uid}
    for run in range(RUNS):
        other = next(n for n in nodes if n != node)
        await cluster.core.patch_node(other, {"spec": {"unschedulable": False}})
        # kubectl drain: the cordon (a leave-running checkpoint), then the eviction.
        await cluster.core.patch_node(node, {"spec": {"unschedulable": True}})
        await cluster.core.create_namespaced_pod_eviction(
            name, "default", {"metadata": {"name": name, "namespace": "default"}})
        new, new_uid, new_node = await running(cluster, ctl, seen)
        assert new_node == other, f"run {run}: {new} was bound to the cordoned node"
        # Both copies sampled every 0.1 s until the old one is gone and the new one runs.
        def old_log(node: str = node, uid: str = uid) -> list[tuple[int, int, str]]:
            return steps(cluster.kubelets[node].log_of(uid))

        def new_log(node: str = other, uid: str = new_uid) -> list[tuple[int, int, str]]:
            return steps(cluster.kubelets[node].log_of(uid))

        overlap, last = [], (len(old_log()), 0)
        t0 = time.monotonic()
        while True:
            now = (len(old_log()), len(new_log()))
            if now[0] > last[0] and now[1] > last[1]:
                overlap.append(round(time.monotonic() - t0, 2))
            last = now
            gone = (p := cluster.kube.get("pods", name, "default")) is None \
                or p["metadata"]["uid"] != uid
            if gone and now[1] >= 5:
                break
            assert time.monotonic() - t0 < 120, f"run {run}: {new} did not run on {other}"
            await asyncio.sleep(0.1)
        before, after = old_log(), new_log()
        assert not overlap, (f"run {run}: {name} and {new} both ran at t={overlap} s; "
                             f"{name} to step {before[-1][0]}, {new} from step {after[0][0]}")
        assert_continues(before, after, before[-1][0])
        assert after[0][0] == before[-1][0] + 1, (
            f"run {run}: {name} ran to step {before[-1][0]}, {new} resumed at step "
            f"{after[0][0]}: {'steps done twice' if after[0][0] <= before[-1][0] else 'lost'}")
        final = await cluster.store.latest("default", ckpt)
        assert final is not None and final.manifest["reason"] == "drain" \
            and final.manifest["target"]["pod"] == name, final and final.manifest
        message = await restored_event(cluster, new_uid)
        assert f"generation {final.number} (drain" in message, message
        seen.add(new_uid)
        name, uid, node = new, new_uid, other


async def test_deployment_replaced_at_eviction_resumes_from_the_final_checkpoint(
        cluster: Cluster, controllers: FakeControllers, monkeypatch: pytest.MonkeyPatch
) -> None:
    final_held_until_replacement_waits(cluster, monkeypatch)
    cluster.kube.put("replicasets", replicaset("web", template("web-1"), deployment="web"))
    await drain_three_times(cluster, controllers, "web-1")
    waits = cluster.events("WaitingForFinalCheckpoint")
    assert len(waits) == RUNS, [e["message"] for e in waits]


async def test_job_with_the_default_replacement_policy_resumes_from_the_final_checkpoint(
        cluster: Cluster, controllers: FakeControllers) -> None:
    cluster.kube.put("jobs", job("train", template("train-1")))
    await drain_three_times(cluster, controllers, "train-1")


async def test_statefulset_replacement_resumes_from_the_final_checkpoint(
        cluster: Cluster, controllers: FakeControllers) -> None:
    cluster.kube.put("statefulsets", statefulset("db", template("db-1")))
    await drain_three_times(cluster, controllers, "db-1")


async def test_a_replacement_whose_predecessor_took_no_final_checkpoint_restores_the_latest(
        cluster: Cluster, controllers: FakeControllers) -> None:
    """A plain delete asks for no final checkpoint: the ReplicaSet's replacement
    still waits for the old pod to end (a workload that ignores SIGTERM, so it
    runs until the delete's grace of 10 s is over), then restores the latest
    checkpoint (the cordon's) and says in a Warning Event that no final one came."""
    a, b = list(cluster.kubelets)
    stubborn = template("web-2")
    stubborn["spec"]["containers"][0]["command"] = [
        "/bin/sh", "-c", "trap '' TERM; x=$(busybox seq 1 3000000); . /bin/counter"]
    cluster.kube.put("replicasets", replicaset("web", stubborn, deployment="web"))
    name, uid, node = await running(cluster, controllers, set())
    assert node == a
    await cluster.until_steps(name, a, 5, timeout=90)
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    cordon = await cluster.latest("web-2", timeout=90)
    assert cordon["reason"] == "cordon"
    # kubectl delete pod --grace-period=10
    await cluster.core.delete_namespaced_pod(name, "default", grace_period_seconds=10)
    new, new_uid, new_node = await running(cluster, controllers, {uid})
    assert new_node == b
    overlap, last = [], (0, 0)
    t0 = time.monotonic()
    while True:
        now = (len(steps(cluster.kubelets[a].log_of(uid))),
               len(steps(cluster.kubelets[b].log_of(new_uid))))
        if now[0] > last[0] and now[1] > last[1]:
            overlap.append(round(time.monotonic() - t0, 2))
        last = now
        if cluster.kube.get("pods", name, "default") is None and now[1] >= 5:
            break
        assert time.monotonic() - t0 < 120, f"{new} did not run on {b}"
        await asyncio.sleep(0.1)
    assert not overlap, f"{name} and {new} both ran at t={overlap} s"
    before = steps(cluster.kubelets[a].log_of(uid))
    after = steps(cluster.kubelets[b].log_of(new_uid))
    assert_continues(before, after, before[-1][0])
    message = await restored_event(cluster, new_uid)
    assert f"generation {cordon['generation']} (cordon" in message, message
    missing = [e for e in cluster.events("FinalCheckpointMissing")
               if e["involvedObject"].get("uid") == new_uid]
    assert missing and missing[0]["type"] == "Warning", cluster.events("FinalCheckpointReady")
    assert f"restoring generation {cordon['generation']} (cordon)" in missing[0]["message"], \
        missing[0]["message"]
