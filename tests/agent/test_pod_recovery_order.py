"""A pod checkpoint recovered after a later one was committed never moves
``latest`` back, and a pod dump found on disk cut short is never stored:
real containerd, runc, CRIU and S3 (moto); the harness is
tests/agent/cluster.py."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from services.checkpointer.pod import PodCheckpointStep
from smr.bus import Progress
from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import Cluster, steps, workload
from tests.helpers.live import live


def steps_of(node: str) -> list[PodCheckpointStep]:
    return [o for o in live(PodCheckpointStep) if o.node == node]


def dying_after_dump(step: PodCheckpointStep, request_id: str) -> Any:
    """The step's store, whose commit of ``request_id``'s dump waits for the
    dump to finish and then dies with its agent (a cancel): the dump stays
    on disk, nothing of it stored. Put in place as ``step.store.commit``."""
    real = step.store.commit

    async def die_after_dump(ns: str, ckpt: str, src: Path, meta: dict[str, Any], *,
                             writer: Any = None, on_bytes: Any = None) -> Any:
        if meta["request_id"] == request_id:
            await writer
            raise asyncio.CancelledError
        return await real(ns, ckpt, src, meta, writer=writer, on_bytes=on_bytes)

    return die_after_dump


async def dump_then_die(step: PodCheckpointStep, req: CkptRequested) -> None:
    """``req`` runs until its dump has finished, then its agent dies (OOM, a
    rollout) before anything of it is stored: its dump stays on disk."""
    real = step.store.commit
    step.store.commit = dying_after_dump(step, req.request_id)  # type: ignore[method-assign]
    try:
        with pytest.raises(asyncio.CancelledError):
            await step.run(req, Progress())
    finally:
        step.store.commit = real  # type: ignore[method-assign]


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
    await dump_then_die(step, a)

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


async def test_a_pod_dump_cut_short_is_not_stored_and_latest_kept(cluster: Cluster) -> None:
    """Heartbeat A of a pod dumps, its agent dies before storing it, and
    A's largest page image loses its tail (a crash before writeback; same
    boot, marked synced). A's recovery stores nothing: answered
    dump-unverified naming the page image, the dump dropped, ``latest``
    still the good generation, and the workload runs on."""
    a_node = next(iter(cluster.kubelets))
    cluster.kube.put("pods", workload("cut-1", a_node, owner="cut", restart="Never"))
    await cluster.until_steps("cut-1", a_node, 5, timeout=60)
    [step] = steps_of(a_node)
    target = Target(kind="pod", namespace="default", pod="cut-1", container="main")
    good = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="cut", node=a_node, target=target,
        leave_running=True), timeout=120)
    assert good.status == "succeeded" and good.generation == 1, good.error
    a = CkptRequested(request_id=f"dumped-{uuid.uuid4().hex[:8]}", checkpoint_id="cut",
                      node=a_node, target=target, leave_running=True)
    await dump_then_die(step, a)
    images = step.work(a.request_id) / "images"
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with pages.open("r+b") as f:
        f.truncate(pages.stat().st_size - 4096)

    done = await step.recover(a, {"state": "running", "heartbeat": 0})
    latest = await cluster.store.latest("default", "cut")
    assert done is not None and latest is not None
    assert (done.status, latest.number) == ("failed", 1), \
        f"A answered {done.status} as generation {done.generation}; latest -> {latest.number}"
    assert done.error and done.error["code"] == "dump-unverified", done.error
    assert pages.name in done.error["message"], done.error
    assert [g.number for g in await cluster.store.generations("default", "cut")] == [1]
    assert not step.work(a.request_id).exists()
    ran = len(steps(cluster.log("cut-1", a_node)))
    await cluster.until_steps("cut-1", a_node, ran + 3, timeout=30)  # it runs on
