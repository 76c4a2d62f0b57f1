"""A queue preempts an Indexed Job while a heartbeat checkpoint of each index
is still being stored: the final checkpoint comes after the heartbeat, never
instead of it or not at all. The harness of test_suspension_pods.py (real
containerd, runc, CRIU, smr-init, webhook, watcher and agents on two nodes;
the FAKE API server, kubelets, Job controller and scheduler).

The heartbeat is caught in flight by a condition, not a sleep: the upload of
each heartbeat's images to the store (the real S3 server) is held from the
moment the agent commits it until both final checkpoints wait on the
container's lock (their step state says ``waiting``, for the heartbeat)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kubernetes_asyncio import client

from services.storage import layout
from smr.contract.messages import CkptDone, CkptRequested, Target
from smrctl.status import step_states
from tests.agent.cluster import Cluster, assert_continues, steps
from tests.agent.test_kubelet import hook_said
from tests.agent.test_suspension_pods import JOB, gone, index_pods, indexed_job, workload
from tests.fake_controllers import FakeControllers


class HeldUploads:
    """Writes to the store (the S3 server, as through a stalled link) of the
    checkpoints of the given lineages, held from their first (the claim of a
    generation, where a commit starts) until ``released``. The agents' stores
    share the test's backend, so this holds theirs."""

    def __init__(self, cluster: Cluster, ids: list[str]) -> None:
        self.backend = cluster.store.backend
        self.real = self.backend.put_bytes
        self.reached = {ckpt: asyncio.Event() for ckpt in ids}
        self.released = asyncio.Event()

    async def put_bytes(self, key: str, data: bytes, **kw: Any) -> Any:
        where = layout.parse(key)
        if where and where[0] == "default" and where[1] in self.reached:
            self.reached[where[1]].set()
            await self.released.wait()
        return await self.real(key, data, **kw)

    async def until_reached(self, answers: dict[str, asyncio.Task[CkptDone]],
                            timeout: float = 90) -> None:
        """Each heartbeat of ``answers`` (checkpoint id → its answer) at its upload."""
        for ckpt, answer in answers.items():
            reached = asyncio.create_task(self.reached[ckpt].wait())
            await asyncio.wait([reached, answer], timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            reached.cancel()
            if answer.done():
                raise AssertionError(f"the heartbeat of {ckpt} ended before its upload: "
                                     f"{answer.result()}")
            assert self.reached[ckpt].is_set(), f"the heartbeat of {ckpt} never got to its upload"


@contextlib.asynccontextmanager
async def held(cluster: Cluster, ids: list[str]) -> AsyncIterator[HeldUploads]:
    h = HeldUploads(cluster, ids)
    h.backend.put_bytes = h.put_bytes  # type: ignore[method-assign]
    try:
        yield h
    finally:
        h.released.set()
        del h.backend.put_bytes


async def finals_waiting(cluster: Cluster, beats: dict[str, str],
                         timeout: float = 90) -> dict[str, dict[str, Any]]:
    """checkpoint id → the step state of its final checkpoint, once each waits
    on its container's lock for that id's heartbeat (request id in ``beats``)."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, dict[str, Any]] = {}
        for key, state in (await step_states(cluster.bus)).items():
            ckpt = state.get("checkpoint_id")
            if ckpt in beats and key != beats[ckpt] and state.get("phase") == "waiting":
                assert state.get("waiting_for") == beats[ckpt], state
                found[ckpt] = state
        if len(found) == len(beats):
            return found
        assert time.monotonic() < deadline, (
            f"the final checkpoints did not wait for the heartbeats in flight: {found}")
        await asyncio.sleep(0.2)


async def test_a_job_suspended_while_its_heartbeats_are_stored_is_checkpointed_after_them(
        cluster: Cluster, controllers: FakeControllers) -> None:
    """Each index's heartbeat is dumped and held at its upload; the queue then
    suspends the Job. Each pod's preStop hook is still held while its final
    checkpoint waits for the heartbeat; once the heartbeats are stored, the
    finals are taken (a later generation, reason ``suspended``), the pods
    stop, and on the other node each index goes on from its last step + 1
    with its memory intact: no step lost, none done twice."""
    a, b = list(cluster.kubelets)
    jobs = client.BatchV1Api(cluster.core.api_client)
    uid = await indexed_job(cluster)
    seen: set[str] = set()
    pods = await index_pods(cluster, controllers, seen)
    for name, node in pods.values():
        await cluster.until_steps(name, node, 5, timeout=90)
    ids = {i: f"{JOB}-{i}" for i in pods}

    async with held(cluster, list(ids.values())) as uploads:
        # A heartbeat of each index, as the watcher's schedule publishes one.
        beats = {ids[i]: CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id=ids[i], node=node, reason="heartbeat",
            leave_running=True, target=Target(kind="pod", namespace="default", pod=name,
                                              container="main"))
            for i, (name, node) in pods.items()}
        answers = {ckpt: asyncio.create_task(cluster.bus.request(r, timeout=240))
                   for ckpt, r in beats.items()}
        await uploads.until_reached(answers)
        at_beat = {i: steps(cluster.log(name, node))[-1][0] for i, (name, node) in pods.items()}
        # The upload begins as the dump does: each heartbeat's dump over and
        # its workload running on first, so that the finals wait for the
        # heartbeats rather than take their dumps over while still frozen
        # (that path: test_drain_takeover.py).
        for name, node in pods.values():
            await cluster.until_steps(name, node, len(steps(cluster.log(name, node))) + 1,
                                      timeout=60)

        # Kueue preempts while both heartbeats are in flight.
        cluster.kube.put("workloads", workload(uid, evicted=True))
        await jobs.patch_namespaced_job(JOB, "default", {"spec": {"suspend": True}})
        await finals_waiting(cluster, {ckpt: r.request_id for ckpt, r in beats.items()})
        for name, node in pods.values():
            hooks = cluster.kubelets[node]
            assert hooks.did(name, "prestop") and not hooks.did(name, "TERM"), (
                f"pod {name} was stopped before its final checkpoint: {hooks.actions[-5:]}")
            assert cluster.kube.get("pods", name, "default") is not None
        uploads.released.set()
        done: dict[str, CkptDone] = {c: await t for c, t in answers.items()}

    for ckpt, d in done.items():
        assert d.status == "succeeded", f"the heartbeat of {ckpt} failed: {d.error}"
    last: dict[int, list[tuple[int, int, str]]] = {}
    for i, (name, node) in pods.items():
        await gone(cluster, name)
        last[i] = steps(cluster.log(name, node))
        # The hook ends once the final state is durable, not at the heartbeat's.
        said = hook_said(cluster, node, name)
        assert "final checkpoint done" in said, f"pod {name}: the preStop hook said {said}"
        assert not cluster.kubelets[node].did(name, "KILL"), f"{name} outlived its grace"
    for i in pods:
        latest = await cluster.store.latest("default", ids[i])
        assert latest is not None and latest.manifest["reason"] == "suspended", (
            f"index {i}: the final checkpoint was lost behind the heartbeat: "
            f"{latest and latest.manifest}")
        beat_gen = done[ids[i]].generation
        assert beat_gen is not None and latest.number > beat_gen, (
            f"index {i}: the final checkpoint ({latest.number}) is not after the "
            f"heartbeat ({beat_gen})")
        assert last[i][-1][0] > at_beat[i], (
            f"index {i}: the workload did not run on after its heartbeat: {last[i][-3:]}")

    # Admitted again, on the other node.
    await cluster.core.patch_node(b, {"spec": {"unschedulable": False}})
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    cluster.kube.put("workloads", workload(uid, evicted=False))
    await jobs.patch_namespaced_job(JOB, "default", {"spec": {"suspend": False}})
    resumed = await index_pods(cluster, controllers, seen)
    for i, (name, node) in resumed.items():
        assert node == b, f"index {i} landed on the cordoned node {node}"
        after = await cluster.until_steps(name, node, 5, timeout=90)
        before = last[i]
        assert_continues(before, after, before[-1][0])
        assert after[0][0] == before[-1][0] + 1, (
            f"index {i}: steps lost or done twice (stopped at {before[-1][0]}, "
            f"went on at {after[0][0]})")
        assert steps(cluster.log(pods[i][0], pods[i][1]))[-1][0] == before[-1][0], (
            f"index {i}: the preempted copy ran on after its final checkpoint")
    live = [x for x in cluster.kube.list("pods", "default")
            if not x["metadata"].get("deletionTimestamp")]
    assert sorted(x["metadata"]["name"] for x in live) == sorted(n for n, _ in resumed.values()), (
        f"more than one copy of an index runs: {[x['metadata']['name'] for x in live]}")
