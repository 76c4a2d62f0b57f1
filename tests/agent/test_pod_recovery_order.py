"""A pod checkpoint recovered after a later one was committed never moves
``latest`` back: real containerd, runc, CRIU and S3 (moto); the harness is
tests/agent/cluster.py."""

from __future__ import annotations

import asyncio
import gc
import uuid
from pathlib import Path
from typing import Any

import pytest

from services.checkpointer.pod import PodCheckpointStep
from smr.bus import Progress
from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import Cluster, workload


def steps_of(node: str) -> list[PodCheckpointStep]:
    return [o for o in gc.get_objects()
            if isinstance(o, PodCheckpointStep) and o.node == node]


async def test_a_recovered_pod_dump_older_than_latest_is_superseded(cluster: Cluster) -> None:
    """Heartbeat A of a pod dumps, its agent dies before storing it; a later
    heartbeat B is committed; A's recovery then stores A as a generation of
    its own, answered superseded, and ``latest`` stays on B."""
    a_node = next(iter(cluster.kubelets))
    cluster.kube.put("pods", workload("ord-1", a_node, owner="ord", restart="Never"))
    await cluster.until_steps("ord-1", a_node, 5, timeout=60)
    [step] = steps_of(a_node)
    target = Target(kind="pod", namespace="default", pod="ord-1", container="main")
    a = CkptRequested(request_id=f"dumped-{uuid.uuid4().hex[:8]}", checkpoint_id="ord",
                      node=a_node, target=target, leave_running=True)
    real = step.store.commit

    async def die_after_dump(ns: str, ckpt: str, src: Path, meta: dict[str, Any], *,
                             writer: Any = None, on_bytes: Any = None) -> Any:
        if meta["request_id"] == a.request_id:
            await writer
            raise asyncio.CancelledError  # the agent dies here (OOM, a rollout)
        return await real(ns, ckpt, src, meta, writer=writer, on_bytes=on_bytes)

    step.store.commit = die_after_dump  # type: ignore[method-assign]
    try:
        with pytest.raises(asyncio.CancelledError):
            await step.run(a, Progress())
    finally:
        step.store.commit = real  # type: ignore[method-assign]

    b = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="ord", node=a_node, target=target,
        leave_running=True), timeout=120)
    assert b.status == "succeeded" and b.generation == 1, b.error

    done = await step.recover(a, {"state": "running", "heartbeat": 0})
    latest = await cluster.store.latest("default", "ord")
    assert done is not None and latest is not None
    assert (done.status, latest.number) == ("superseded", 1), \
        f"A answered {done.status} as generation {done.generation}; latest -> {latest.number}"
    stored = {g.number: g.manifest for g in await cluster.store.generations("default", "ord")}
    assert stored[2]["request_id"] == a.request_id
    assert stored[2]["dump"]["seq"] < stored[1]["dump"]["seq"]
    uid = cluster.kube.get("pods", "ord-1", "default")["metadata"]["uid"]  # type: ignore[index]
    assert await step.lock.holder(f"pod.{uid}.main") is None  # the recovery let it go
