"""What a real kubelet does to an opted-in pod (tests/fake_kubelet.py copies it):
preStop hooks, SIGTERM, SIGKILL after the grace period, graceful node
shutdown, liveness probes; and PodDisruptionBudgets in the eviction API.
Each workload here exits at once on SIGTERM (the counter's shell has no trap)."""

from __future__ import annotations

import asyncio

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
