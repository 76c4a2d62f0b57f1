"""What a real kubelet does to an opted-in pod (tests/fake_kubelet.py copies it):
preStop hooks, SIGTERM, SIGKILL after the grace period, graceful node
shutdown, liveness probes; and PodDisruptionBudgets in the eviction API.
Each workload here exits at once on SIGTERM (the counter's shell has no trap)."""

from __future__ import annotations

import asyncio

from kubernetes_asyncio.client.exceptions import ApiException

from tests.agent.cluster import Cluster, assert_continues, steps, workload

NODE_RESTORE = {"smr.dev/node-restore": "true"}


async def evict(cluster: Cluster, name: str) -> None:
    await cluster.core.create_namespaced_pod_eviction(
        name, "default", {"metadata": {"name": name, "namespace": "default"}})


async def test_drain_resumes_every_pod_from_its_final_checkpoint(cluster: Cluster) -> None:
    """kubectl drain: the cordon, then an eviction of each pod at once. The
    kubelet runs each pod's preStop hook, which waits for the final
    checkpoint; only then SIGTERM. No step is lost."""
    a, b = list(cluster.kubelets)
    names = ["drained-1", "drained-2", "drained-3"]
    for n in names:
        cluster.kube.put("pods", workload(n, a, labels=NODE_RESTORE, final_wait=25, grace=30))
    for n in names:
        await cluster.until_steps(n, a, 5)

    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await asyncio.gather(*(evict(cluster, n) for n in names))
    for n in names:
        await cluster.recreated(n, timeout=90)

    kubelet = cluster.kubelets[a]
    for n in names:
        hook = [x[3] for x in kubelet.actions if x[1] == n and x[3].startswith("prestop-done")]
        assert hook and "final checkpoint done" in hook[0], f"{n}: the hook said {hook}"
        assert not kubelet.did(n, "KILL"), f"{n} outlived its grace period"
        manifest = (await cluster.store.latest("default", f"{n}.main")).manifest  # type: ignore[union-attr]
        assert manifest["reason"] == "drain" and manifest["leave_running"] is False
        before = steps(cluster.log(n, a))
        cluster.schedule(n, b)
        after = await cluster.until_steps(n, b, 5)
        assert_continues(before, after, before[-1][0])
        assert after[0][0] == before[-1][0] + 1, f"{n}: steps lost after a final checkpoint"


def hook_said(cluster: Cluster, node: str, name: str) -> str:
    done = [x[3] for x in cluster.kubelets[node].actions
            if x[1] == name and x[3].startswith("prestop-done")]
    assert done, f"the preStop hook of {name} did not end"
    return done[0]


def seconds_between(cluster: Cluster, node: str, name: str, first: str, then: str) -> float:
    acts = cluster.kubelets[node].actions
    t0 = next(x[0] for x in acts if x[1] == name and x[3].startswith(first))
    t1 = next(x[0] for x in acts if x[1] == name and x[3].startswith(then))
    return t1 - t0


async def test_graceful_node_shutdown_takes_the_final_checkpoint(cluster: Cluster) -> None:
    """GKE Spot: the kubelet stops the pods itself within 15 s, with no
    deletion; the bare pod ends Failed and the watcher recreates it."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("spot", a, labels=NODE_RESTORE, final_wait=13, grace=43))
    await cluster.until_steps("spot", a, 5)

    await cluster.kubelets[a].shutdown(grace=15)
    print(f"\ngraceful shutdown: preStop hook ended after "
          f"{seconds_between(cluster, a, 'spot', 'prestop', 'prestop-done'):.2f}s")
    assert "final checkpoint done" in hook_said(cluster, a, "spot")
    assert not cluster.kubelets[a].did("spot", "KILL")
    await cluster.recreated("spot", timeout=60)
    manifest = (await cluster.store.latest("default", "spot.main")).manifest  # type: ignore[union-attr]
    assert manifest["reason"] == "preemption" and manifest["leave_running"] is False
    before = steps(cluster.log("spot", a))
    cluster.schedule("spot", b)
    after = await cluster.until_steps("spot", b, 5)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "steps lost after a final checkpoint"


async def test_a_budget_that_blocks_the_eviction_leaves_the_workload_running(
        cluster: Cluster) -> None:
    """Karpenter taints the node and evicts; the PodDisruptionBudget refuses
    (429). smr checkpoints but stops nothing: the workload runs on."""
    a, _ = list(cluster.kubelets)
    labels = {**NODE_RESTORE, "app": "guarded"}
    cluster.kube.put("pods", workload("guarded", a, labels=labels, final_wait=25, grace=30))
    cluster.kube.put("poddisruptionbudgets", {
        "metadata": {"name": "guarded", "namespace": "default"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}})
    await cluster.until_steps("guarded", a, 5)

    await cluster.core.patch_node(a, {"spec": {"taints": [
        {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}})
    try:
        await evict(cluster, "guarded")
        raise AssertionError("the eviction was allowed despite the budget")
    except ApiException as e:
        assert e.status == 429
    manifest = await cluster.latest("guarded.main")
    assert manifest["reason"] == "preemption" and manifest["leave_running"] is True
    ran = len(steps(cluster.log("guarded", a)))
    await cluster.until_steps("guarded", a, ran + 10)
    p = cluster.kube.get("pods", "guarded", "default")
    assert p is not None and not p["metadata"].get("deletionTimestamp")
    assert p["status"]["phase"] == "Running"
    assert not cluster.kubelets[a].did("guarded", "TERM"), "the kubelet stopped it"
    assert "exited" not in [x[3] for x in cluster.kubelets[a].actions if x[1] == "guarded"]
