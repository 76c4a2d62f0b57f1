"""What the watcher does for each way Kubernetes ends a pod, told apart as
the real control plane marks them (the pod's ``DisruptionTarget`` condition
and its reason), against the FAKE API server, which sets them as the real
eviction API, scheduler, pod GC and kubelet do, and holds the watcher to the
shipped RBAC (tests/test_watcher.py's ``api`` fixture)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
from kubernetes_asyncio import client

from services.storage.store import CheckpointStore
from smr.bus import KV_STEPS, Bus
from smr.contract.messages import CkptDone, CkptRequested, epoch
from tests import test_watcher
from tests.fake_apiserver import PRESSURE, SHUTDOWN, FakeApiServer, pod
from tests.fake_apiserver import node as a_node
from tests.test_watcher import Watchers, ckpts, stored

# test_watcher's fixtures, shared (not copied).
kube, api, admin = test_watcher.kube, test_watcher.api, test_watcher.admin
watch_settings, watchers = test_watcher.watch_settings, test_watcher.watchers
bus, watcher_bus, storage = test_watcher.bus, test_watcher.watcher_bus, test_watcher.storage

OPTED = {"smr.dev/node-restore": "true"}


async def answer(bus: Bus, storage: CheckpointStore, tmp_path: Path,
                 reqs: list[CkptRequested]) -> None:
    """The node agent's part: images stored, the step done, ckpt.done published."""
    for req in reqs:
        gen = await stored(storage, tmp_path, req.target.namespace, req.checkpoint_id,
                           reason=req.reason)
        done = CkptDone.for_request(req, status="succeeded", generation=gen)
        await bus.kv(KV_STEPS).put(req.request_id, orjson.dumps(
            {"state": "done", "result": done.to_dict()}))
        await bus.publish(done)


async def outcome(kube: FakeApiServer, name: str, old_uid: str, seconds: float = 8) -> str:
    """What became of pod ``name`` within ``seconds``: "recreated" as soon as
    a pod of that name with another uid exists, else "gone" or its phase."""
    end = time.monotonic() + seconds
    seen = "?"
    while time.monotonic() < end:
        p = kube.get("pods", name, "default")
        if p is not None and p["metadata"]["uid"] != old_uid:
            return "recreated"
        seen = "gone" if p is None else (p.get("status") or {}).get("phase", "?")
        await asyncio.sleep(0.1)
    return seen


def shutting_down(kube: FakeApiServer, name: str) -> None:
    """The kubelet's graceful node shutdown, as its node status shows it."""
    n = kube.get("nodes", name)
    assert n is not None
    n["status"]["conditions"] = [{"type": "Ready", "status": "False",
                                  "reason": "KubeletNotReady", "message": "node is shutting down"}]
    kube.put("nodes", n)


async def test_a_bare_pod_failed_by_graceful_node_shutdown_is_recreated(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        tmp_path: Path, node: str) -> None:
    """GKE Spot: the kubelet stops the pods itself and leaves them Failed.
    Once its final checkpoint is stored, the watcher, as its own service
    account, deletes the Failed bare pod and creates it again."""
    n1, n2 = node, f"{node}-b"
    kube.put("nodes", a_node(n1))
    kube.put("nodes", a_node(n2))
    kube.put("pods", pod("spot", n1, labels=OPTED))
    old = kube.get("pods", "spot", "default")["metadata"]["uid"]  # type: ignore[index]
    await watchers.start()
    async with ckpts(bus, n1) as c:
        shutting_down(kube, n1)
        [req] = await c.wait(1, settle=0.2)
        assert req.reason == "preemption" and not req.leave_running
        await answer(bus, storage, tmp_path, [req])
    kube.kubelet_stopped("spot", "default", why=SHUTDOWN)
    assert await outcome(kube, "spot", old) == "recreated"
    assert not kube.denied


async def disrupted_on_a_healthy_node(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        tmp_path: Path, node: str, disrupt: Callable[[], Awaitable[object]]) -> CkptRequested:
    """A bare opted-in pod on a node that stays, ended by ``disrupt``: its
    final checkpoint is asked for and stored, and the pod comes back."""
    kube.put("nodes", a_node(node))
    kube.put("pods", pod("victim", node, labels=OPTED))
    old = kube.get("pods", "victim", "default")["metadata"]["uid"]  # type: ignore[index]
    await watchers.start()
    async with ckpts(bus, node) as c:
        await disrupt()
        [req] = await c.wait(1, settle=0.5)
        assert not req.leave_running, "the kubelet is stopping it: a final checkpoint"
        assert req.target.pod_uid == old
        await answer(bus, storage, tmp_path, [req])
    assert await outcome(kube, "victim", old) == "recreated"
    new = kube.get("pods", "victim", "default")
    assert new is not None and "nodeName" not in new["spec"]
    return req


async def test_scheduler_preemption_takes_a_final_checkpoint_and_recreates_a_bare_pod(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        tmp_path: Path, node: str) -> None:
    """A higher-priority pod preempts an opted-in one (DisruptionTarget
    PreemptionByScheduler); its node is not going away."""
    async def preempt() -> None:
        kube.preempt("victim")

    req = await disrupted_on_a_healthy_node(kube, bus, watchers, storage, tmp_path, node,
                                            preempt)
    assert req.reason == "preemption"


async def test_an_eviction_api_eviction_takes_a_final_checkpoint_and_recreates_a_bare_pod(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        storage: CheckpointStore, tmp_path: Path, node: str) -> None:
    """The descheduler or the VPA updater evicts through the Eviction API
    (DisruptionTarget EvictionByEvictionAPI), with no cordon."""
    async def evict() -> object:
        return await client.CoreV1Api(admin).create_namespaced_pod_eviction(
            "victim", "default", {"metadata": {"name": "victim", "namespace": "default"}})

    asked = time.time()
    req = await disrupted_on_a_healthy_node(kube, bus, watchers, storage, tmp_path, node,
                                            evict)
    assert req.reason == "drain"
    # The deletionTimestamp is when the pod goes (the eviction plus its grace,
    # 30 s): a final request means nothing after it.
    assert req.deadline is not None
    late = epoch(req.deadline) - (asked + 30)
    assert -2 < late < 2, f"the final request expires {late:.0f} s after its pod is deleted"


async def test_a_plain_delete_on_a_cordoned_node_takes_no_final_and_is_not_undone(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        storage: CheckpointStore, tmp_path: Path, node: str) -> None:
    """`kubectl delete pod` (no DisruptionTarget) is the user's decision, on a
    cordoned node too: no final checkpoint, and the pod stays deleted."""
    n1, n2 = node, f"{node}-b"
    kube.put("nodes", a_node(n1))
    kube.put("nodes", a_node(n2))
    kube.put("pods", pod("deleted", n1, labels=OPTED))
    old = kube.get("pods", "deleted", "default")["metadata"]["uid"]  # type: ignore[index]
    await watchers.start()
    core = client.CoreV1Api(admin)
    async with ckpts(bus, n1) as c:
        await core.patch_node(n1, {"spec": {"unschedulable": True}})
        [cordon] = await c.wait(1, settle=0.2)
        assert cordon.leave_running
        await answer(bus, storage, tmp_path, [cordon])
        await core.delete_namespaced_pod("deleted", "default", _preload_content=False)
        await asyncio.sleep(1.5)
        assert [r.reason for r in c.items] == ["cordon"], "a final checkpoint was asked for"
    assert await outcome(kube, "deleted", old, seconds=3) == "gone"


async def test_a_node_pressure_eviction_leaves_the_pod_as_kubernetes_does(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """The kubelet evicts for memory pressure (Failed, Evicted, DisruptionTarget
    TerminationByKubelet as for graceful shutdown, but its node stays): smr
    neither deletes the Failed pod (it would never come back) nor asks for a
    checkpoint (a hard eviction gives no grace)."""
    kube.put("nodes", a_node(node))
    kube.put("pods", pod("pressed", node, labels=OPTED))
    old = kube.get("pods", "pressed", "default")["metadata"]["uid"]  # type: ignore[index]
    await watchers.start()
    async with ckpts(bus, node) as c:
        kube.kubelet_stopped("pressed", "default", why=PRESSURE)
        assert await outcome(kube, "pressed", old, seconds=3) == "Failed"
        assert c.items == []


async def test_a_bare_pod_the_pod_gc_deleted_with_its_node_is_recreated(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        tmp_path: Path, node: str) -> None:
    """Its Node deleted, the pod garbage collector deletes the pod
    (DisruptionTarget DeletionByPodGC): the pod comes back elsewhere."""
    kube.put("nodes", a_node(node))
    kube.put("pods", pod("orphan", node, labels=OPTED))
    old = kube.get("pods", "orphan", "default")["metadata"]["uid"]  # type: ignore[index]
    await watchers.start()
    async with ckpts(bus, node) as c:
        kube.remove("nodes", node)
        reqs = await c.wait(1, settle=0.2)
        assert {r.reason for r in reqs} == {"node-deleted"}
        await answer(bus, storage, tmp_path, reqs)
    assert await outcome(kube, "orphan", old) == "recreated"
