"""Sequences on the checkpoint data path that must neither lose, corrupt nor
double a checkpoint, nor answer a stored one failed. Real containerd, runc,
CRIU, nats-server and moto; the kubelet and API server are the repo's fakes."""

from __future__ import annotations

import asyncio
import uuid

from smr.contract.messages import CkptDone, CkptRequested, Target
from tests.agent.cluster import Cluster, workload


def final(ckpt: str, node: str, pod: str) -> CkptRequested:
    """A final checkpoint request of ``pod``'s container, under its own id (the
    watcher derives one per reason: an eviction and the node's shutdown, or
    the preStop hook retried, each ask for the same container's final)."""
    return CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=node,
                         reason="drain", target=Target(kind="pod", namespace="default",
                                                       pod=pod, container="main"))


def outcomes(results: list[CkptDone]) -> list[tuple[str, int | None, str | None]]:
    return [(r.status, r.generation, (r.error or {}).get("code")) for r in results]


async def running(cluster: Cluster, name: str) -> tuple[str, str]:
    """Pod ``name`` on node a, counting; its node and checkpoint id."""
    a, _ = list(cluster.kubelets)
    ckpt = f"{name}-{uuid.uuid4().hex[:6]}"
    cluster.kube.put("pods", workload(name, a, env={"SMR_CHECKPOINT": ckpt}, owner=ckpt,
                                      restart="Never"))
    await cluster.until_steps(name, a, 3)
    return a, ckpt


async def test_final_checkpoints_asked_for_together_are_all_answered_with_the_one_stored(
        cluster: Cluster) -> None:
    """Three final requests of one container under different ids, sent at
    once: one dumps and ends the workload; the others are answered with that
    same generation, not failed (the final state is stored), and no second
    generation is made."""
    a, ckpt = await running(cluster, "finals")
    results = await asyncio.gather(*(cluster.bus.request(final(ckpt, a, "finals"), timeout=120)
                                     for _ in range(3)))
    gens = await cluster.store.generations("default", ckpt)
    assert outcomes(results) == [("succeeded", 1, None)] * 3, outcomes(results)
    assert [g.number for g in gens] == [1], [g.manifest for g in gens]


async def test_a_final_checkpoint_asked_for_again_after_it_ended_the_workload_is_answered_with_it(
        cluster: Cluster) -> None:
    """A second final request of a container whose final checkpoint is stored
    and whose workload it ended (its smr-init gone, the container exited)
    is answered with that generation, not failed for want of a workload."""
    a, ckpt = await running(cluster, "again")
    first = await cluster.bus.request(final(ckpt, a, "again"), timeout=120)
    assert first.status == "succeeded", first
    second = await cluster.bus.request(final(ckpt, a, "again"), timeout=120)
    assert outcomes([second]) == [("succeeded", first.generation, None)], second
    assert [g.number for g in await cluster.store.generations("default", ckpt)] == \
        [first.generation]
