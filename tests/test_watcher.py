"""The watcher against the FAKE Kubernetes API server (tests/fake_apiserver.py,
driven by the real kubernetes-asyncio client over HTTP) and a real nats-server.

Requests are judged by what lands in JetStream: after its dedupe, exactly
the requests a user expects, never one twice, none for pods that did not opt in.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from kubernetes_asyncio import client

from services.checkpointer.admission import LOOK_AHEAD
from services.kubeapi import api_client
from services.storage.local import LocalBackend
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from services.watcher import durables
from services.watcher.__main__ import BUCKETS as WATCHER_BUCKETS
from services.watcher.heartbeats import HeartbeatSchedule
from services.watcher.kube import Informer
from services.watcher.service import Watcher
from smr import config, metrics
from smr.aio import wait_event
from smr.bus import (
    KV_BEATS,
    KV_JOBS,
    KV_LOCKS,
    KV_STEPS,
    STREAM_EVENTS,
    STREAM_REQUESTS,
    Bus,
    BusConfig,
    Worker,
    node_token,
)
from smr.contract.messages import CkptDone, CkptRequested, NodeDraining, RestoreDone, Target
from tests import nats_auth
from tests.fake_apiserver import FakeApiServer, disruption_condition, pod, with_condition
from tests.fake_apiserver import node as a_node
from tests.helpers.steplocks import node_locks
from tests.test_bus import CountingStep, dlq_messages, request


@pytest.fixture
async def kube() -> AsyncIterator[FakeApiServer]:
    srv = await FakeApiServer(bookmark_interval=0.5).start()
    yield srv
    await srv.stop()


@pytest.fixture
async def api(kube: FakeApiServer) -> AsyncIterator[client.ApiClient]:
    """The watcher's client: its service account, held to the shipped RBAC.
    Every call it was refused fails the test at its end."""
    a = await api_client(kube.url, token=kube.token("smr-watcher"))
    yield a
    await a.close()
    assert not kube.denied, ("a call the shipped RBAC does not grant "
                             f"(deploy/kustomize/base): {kube.denied}")


@pytest.fixture
async def admin(kube: FakeApiServer) -> AsyncIterator[client.ApiClient]:
    """The operator's client (kubectl, as a cluster admin)."""
    a = await api_client(kube.url, token=kube.admin_token)
    yield a
    await a.close()


@pytest.fixture
def bus(admin_bus: Bus) -> Bus:
    """NATS as deployed, with the shipped users (tests/nats_auth.py): the
    watcher logs in as smr-watcher (``watcher_bus``), the storage service as
    smr-storage, and the test, playing the agents and operators, as smr-admin."""
    return admin_bus


@pytest.fixture
async def watcher_bus(nats_users: nats_auth.SecuredNats, bus: Bus, bus_config: BusConfig
                      ) -> AsyncIterator[Bus]:
    b = await nats_users.connect("smr-watcher", bus_config, buckets=WATCHER_BUCKETS)
    yield b
    await b.close()


@pytest.fixture
def watch_settings() -> config.Settings:
    return config.load({}).replace(
        heartbeat_min=1, lease_duration=3, lease_renew_deadline=2, lease_retry=1,
        lease_name=f"smr-watcher-{uuid.uuid4().hex[:6]}", lease_namespace="smr-system")


class Watchers:
    """Starts watcher replicas and stops them at the end of the test."""

    def __init__(self, bus: Bus, api: client.ApiClient, settings: config.Settings) -> None:
        self.bus, self.api, self.settings = bus, api, settings
        # The durable consumers' names the shipped permissions give smr-watcher
        # (each test has a NATS of its own).
        self.prefix = "watcher"
        self.running: list[tuple[Watcher, asyncio.Task[None]]] = []

    async def start(self, **overrides: Any) -> Watcher:
        w = Watcher(self.bus, self.api, self.settings.replace(**overrides),
                    durable_prefix=self.prefix)
        task = asyncio.create_task(w.run())
        await asyncio.wait_for(w.ready.wait(), 20)
        self.running.append((w, task))
        return w

    async def stop(self, w: Watcher) -> None:
        for i, (x, task) in enumerate(self.running):
            if x is w:
                w.stop()
                await asyncio.wait_for(task, 20)
                del self.running[i]
                return

    async def stop_all(self) -> None:
        for w, _ in list(self.running):
            await self.stop(w)


@pytest.fixture
async def watchers(watcher_bus: Bus, api: client.ApiClient, watch_settings: config.Settings
                   ) -> AsyncIterator[Watchers]:
    ws = Watchers(watcher_bus, api, watch_settings)
    yield ws
    await ws.stop_all()


class Collector:
    """Every message on a subject, from the stream (after JetStream's dedupe)."""

    def __init__(self, bus: Bus, subject: str, stream: str, parse: Callable[[bytes], Any]):
        self.bus, self.subject, self.stream, self.parse = bus, subject, stream, parse
        self.items: list[Any] = []
        self.arrived: list[float] = []

    async def __aenter__(self) -> Collector:
        async def got(m: Any) -> None:
            self.items.append(self.parse(m.data))
            self.arrived.append(time.monotonic())

        self.sub = await self.bus.js.subscribe(self.subject, stream=self.stream,
                                               ordered_consumer=True, cb=got)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.unsubscribe()

    async def wait(self, n: int, timeout: float = 15, settle: float = 1.0) -> list[Any]:
        """At least ``n`` arrive, then nothing more for ``settle`` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.items) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.items)} of {n} on {self.subject}: "
                                     f"{self.items}")
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle)
        return self.items


async def until(cond: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def ckpts(bus: Bus, node_name: str) -> Collector:
    return Collector(bus, f"ckpt.requested.{node_token(node_name)}.*", STREAM_REQUESTS,
                     CkptRequested.from_payload)


def drains(bus: Bus, node_name: str) -> Collector:
    return Collector(bus, f"node.draining.{node_token(node_name)}", STREAM_EVENTS,
                     NodeDraining.from_payload)


def cordon(kube: FakeApiServer, name: str) -> None:
    """What `kubectl cordon` does: a patch of spec.unschedulable."""
    n = kube.get("nodes", name)
    assert n is not None
    n["spec"]["unschedulable"] = True
    kube.put("nodes", n)


def targets(reqs: list[CkptRequested]) -> list[tuple[str, str]]:
    return sorted((r.target.pod or "", r.target.container or "") for r in reqs)


def a_cluster(kube: FakeApiServer, n1: str, n2: str) -> None:
    """Two nodes; on n1 pods opted in every supported way, and some that are not."""
    kube.put("nodes", a_node(n1))
    kube.put("nodes", a_node(n2))
    kube.put("pods", pod("restore-me", n1, labels={"smr.dev/node-restore": "true"},
                         containers=("main", "sidecar")))
    kube.put("pods", pod("alias-label", n1, labels={"cedana.ai/node-restore": "true"}))
    kube.put("pods", pod("job-pod", n1, env={"CEDANA_CHECKPOINT": "job-ckpt-1"},
                         owner="train", containers=("trainer", "logger")))
    kube.put("pods", pod("smr-env", n1, env={"SMR_CHECKPOINT": "smr-ckpt-1"}))
    kube.put("pods", pod("plain", n1))
    kube.put("pods", pod("opted-out", n1, labels={"smr.dev/node-restore": "false"}))
    kube.put("pods", pod("elsewhere", n2, labels={"smr.dev/node-restore": "true"}))
    kube.put("pods", pod("done-already", n1, labels={"smr.dev/node-restore": "true"},
                         phase="Succeeded"))


EXPECTED_ON_N1 = [("alias-label", "main"), ("job-pod", "trainer"), ("restore-me", "main"),
                  ("restore-me", "sidecar"), ("smr-env", "main")]


async def test_cordon_checkpoints_each_opted_in_container_once(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    w = await watchers.start()
    async with ckpts(bus, n1) as c, drains(bus, n1) as d, ckpts(bus, n2) as other:
        cordon(kube, n1)
        reqs = await c.wait(len(EXPECTED_ON_N1))
        assert targets(reqs) == EXPECTED_ON_N1
        assert all(r.reason == "cordon" and r.leave_running and r.node == n1 for r in reqs)
        ids = {(r.target.pod, r.target.container): r.checkpoint_id for r in reqs}
        assert ids[("job-pod", "trainer")] == "job-ckpt-1"
        assert ids[("smr-env", "main")] == "smr-ckpt-1"
        assert ids[("restore-me", "sidecar")] == "restore-me.sidecar"
        assert len({r.request_id for r in reqs}) == len(reqs)
        assert [x.reason for x in await d.wait(1, settle=0)] == ["cordon"]
        # The node's status keeps changing while it is cordoned: nothing new.
        for i in range(3):
            n = kube.get("nodes", n1)
            assert n is not None
            n["status"]["conditions"].append({"type": f"Probe{i}", "status": "False"})
            kube.put("nodes", n)
        await asyncio.sleep(1.0)
        assert len(c.items) == len(EXPECTED_ON_N1) and len(d.items) == 1
        assert other.items == []
    assert w.stats["duplicates"] == 0


async def test_second_replica_and_restart_only_make_duplicates(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    a = await watchers.start()
    b = await watchers.start()
    async with ckpts(bus, n1) as c, drains(bus, n1) as d:
        cordon(kube, n1)
        await c.wait(len(EXPECTED_ON_N1), settle=1.5)
        await watchers.stop(a)
        await watchers.start()  # lists the cordoned node afresh
        await asyncio.sleep(1.5)
        assert targets(c.items) == EXPECTED_ON_N1
        assert len(d.items) == 1
    # Both replicas published every request; JetStream dropped one copy of each.
    assert a.stats["duplicates"] + b.stats["duplicates"] == len(EXPECTED_ON_N1) + 1


async def test_cut_watch_streams_miss_nothing_and_repeat_nothing(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    w = await watchers.start()
    await kube.watching(2)
    async with ckpts(bus, n1) as c, drains(bus, n1) as d:
        kube.pause_watches()
        assert kube.cut_watches(mid_line=True) == 2
        # While the watcher reconnects: a new opted-in pod, then the cordon.
        kube.put("pods", pod("late-arrival", n1, labels={"smr.dev/node-restore": "true"}))
        cordon(kube, n1)
        kube.resume_watches()
        reqs = await c.wait(len(EXPECTED_ON_N1) + 1)
        assert targets(reqs) == sorted([*EXPECTED_ON_N1, ("late-arrival", "main")])
        assert len(d.items) == 1
    assert w.nodes.stats["broken"] >= 1 and w.pods.stats["broken"] >= 1
    assert w.stats["duplicates"] == 0, "a resumed watch must not replay events"
    assert w.nodes.stats["lists"] == 1, "a broken stream resumes; it does not re-list"


async def test_a_request_two_handlers_derive_at_once_is_sent_once(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """A node's cordon and a pod of it arriving in one resumed watch derive the
    same drain request in two handlers at once: it is published once, and both
    handlers return only once it is in JetStream."""
    a_cluster(kube, node, f"{node}-b")
    w = await watchers.start()
    req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id="both", node=node,
                        reason="cordon", leave_running=True,
                        target=Target(kind="pod", namespace="default", pod="both",
                                      container="main"))
    async with ckpts(bus, node) as c:
        await asyncio.gather(w._publish_all([req]), w._publish_all([req]))
        assert [r.request_id for r in await c.wait(1, settle=0.5)] == [req.request_id]
    assert (w.stats["published"], w.stats["duplicates"]) == (1, 0)


async def test_410_gone_relists_and_publishes_only_what_changed(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    w = await watchers.start()
    await kube.watching(2)
    async with ckpts(bus, n1) as c, drains(bus, n1) as d:
        kube.pause_watches()
        assert kube.cut_watches(mid_line=False) == 2
        kube.put("pods", pod("late-arrival", n1, labels={"smr.dev/node-restore": "true"}))
        kube.remove("pods", "plain", "default")
        cordon(kube, n1)
        kube.compact()  # the versions the watcher holds are gone: 410
        kube.resume_watches()
        reqs = await c.wait(len(EXPECTED_ON_N1) + 1)
        assert targets(reqs) == sorted([*EXPECTED_ON_N1, ("late-arrival", "main")])
        assert len(d.items) == 1
    assert w.nodes.stats["expired"] >= 1 and w.pods.stats["expired"] >= 1
    assert w.nodes.stats["lists"] == 2 and w.pods.stats["lists"] == 2
    assert "default/plain" not in w.pods.cache, "the re-list must drop what was deleted"
    assert w.stats["duplicates"] == 0, "a re-list must not replay what was handled"


@pytest.mark.parametrize("reason,change", [
    ("preemption", lambda n: n["spec"]["taints"].append(
        {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"})),
    ("preemption", lambda n: n["spec"]["taints"].append(
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000",
         "effect": "NoSchedule"})),
    ("preemption", lambda n: n["status"]["conditions"].append(
        {"type": "PreemptScheduled", "status": "True"})),
    ("preemption", lambda n: n["spec"]["taints"].append(
        {"key": "remediator.kubernetes.azure.com/unschedulable", "effect": "NoSchedule"})),
    ("preemption", lambda n: n["status"]["conditions"].append(
        {"type": "VMEventScheduled", "status": "True",
         "message": "VM is scheduled for Preempt at 2026-11-23T21:00:00Z"})),
])
async def test_preemption_signals_checkpoint_and_leave_the_pods_running(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str, reason: str,
        change: Callable[[dict[str, Any]], None]) -> None:
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    await watchers.start()
    async with ckpts(bus, n1) as c, drains(bus, n1) as d:
        n = kube.get("nodes", n1)
        assert n is not None
        change(n)
        kube.put("nodes", n)
        reqs = await c.wait(len(EXPECTED_ON_N1))
        assert targets(reqs) == EXPECTED_ON_N1
        # Undoable, or ahead of the eviction: the workload stops only through
        # the eviction or the kubelet, never smr's own kill.
        assert all(r.reason == reason and r.leave_running for r in reqs)
        [drain] = await d.wait(1, settle=0)
        assert drain.reason == reason and drain.detail


async def test_an_aks_freeze_is_no_signal(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    a_cluster(kube, node, f"{node}-b")
    await watchers.start()
    async with ckpts(bus, node) as c:
        n = kube.get("nodes", node)
        assert n is not None
        n["status"]["conditions"].append({"type": "VMEventScheduled", "status": "True",
                                          "message": "VM is scheduled for Freeze"})
        kube.put("nodes", n)
        await asyncio.sleep(1.5)
        assert c.items == []


async def test_graceful_node_shutdown_takes_the_final_checkpoints(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """The kubelet stops the pods itself (no deletion): its Ready=False
    "node is shutting down" is the signal, and the checkpoint is final."""
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    await watchers.start()
    async with ckpts(bus, n1) as c, drains(bus, n1) as d:
        n = kube.get("nodes", n1)
        assert n is not None
        n["status"]["conditions"] = [{"type": "Ready", "status": "False",
                                      "reason": "KubeletNotReady",
                                      "message": "node is shutting down"}]
        kube.put("nodes", n)
        reqs = await c.wait(len(EXPECTED_ON_N1))
        assert targets(reqs) == EXPECTED_ON_N1
        assert all(r.reason == "preemption" and not r.leave_running for r in reqs)
        [drain] = await d.wait(1, settle=0)
        assert "graceful node shutdown" in drain.detail


async def test_node_deletion_checkpoints_its_pods(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    await watchers.start()
    async with ckpts(bus, n1) as c, drains(bus, n1) as d:
        kube.remove("nodes", n1)  # the pod GC then deletes its pods
        reqs = await c.wait(len(EXPECTED_ON_N1))
        assert targets(reqs) == EXPECTED_ON_N1
        assert {r.reason for r in reqs} == {"node-deleted"}
        assert [x.reason for x in await d.wait(1, settle=0)] == ["node-deleted"]


async def test_a_pod_terminating_before_the_cordon_is_seen_gets_its_final_checkpoint(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """Node and pod watches have no order between them: the watcher can see
    an evicted pod terminate before it sees its node cordoned."""
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    await watchers.start()
    async with ckpts(bus, n1) as c:
        evicted = kube.get("pods", "job-pod", "default")
        assert evicted is not None
        # What the eviction API writes: the DisruptionTarget condition, then
        # the deletionTimestamp.
        evicted["status"] = with_condition(evicted["status"], disruption_condition(
            "EvictionByEvictionAPI", "Eviction API: evicting"))
        evicted["metadata"]["deletionTimestamp"] = "2026-11-23T00:00:00Z"
        kube.put("pods", evicted)
        await asyncio.sleep(0.5)  # the pod's event first
        cordon(kube, n1)
        reqs = await c.wait(len(EXPECTED_ON_N1))
        final = [r for r in reqs if r.reason == "drain"]
        assert targets(final) == [("job-pod", "trainer")]
        assert not final[0].leave_running
        assert reqs[0] is final[0], "the final request goes ahead of the cordon ones"
        assert targets(reqs) == EXPECTED_ON_N1, "a terminating pod gets no cordon request"


async def test_drain_evictions_and_uncordon(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        node: str) -> None:
    """kubectl drain: cordon (the pods keep running) then evictions (a final
    checkpoint of each opted-in pod as it terminates). An uncordon ends the
    episode: a later cordon checkpoints again."""
    n1, n2 = node, f"{node}-b"
    a_cluster(kube, n1, n2)
    await watchers.start()
    core = client.CoreV1Api(admin)
    async with ckpts(bus, n1) as c:
        await core.patch_node(n1, {"spec": {"unschedulable": True}})
        await c.wait(len(EXPECTED_ON_N1), settle=0.2)
        await core.create_namespaced_pod_eviction(
            "job-pod", "default", {"metadata": {"name": "job-pod", "namespace": "default"}})
        await core.create_namespaced_pod_eviction(
            "plain", "default", {"metadata": {"name": "plain", "namespace": "default"}})
        reqs = await c.wait(len(EXPECTED_ON_N1) + 1)
        final = [r for r in reqs if r.reason == "drain"]
        assert targets(final) == [("job-pod", "trainer")]
        assert not final[0].leave_running

        await core.patch_node(n1, {"spec": {"unschedulable": False}},
                              _content_type="application/merge-patch+json")
        await asyncio.sleep(0.5)
        await core.patch_node(n1, {"spec": {"unschedulable": True}})
        again = await c.wait(len(reqs) + 4)  # the 4 opted-in containers still there
        assert len({r.request_id for r in again}) == len(again)


async def test_policy_values_and_aliases(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    n1 = node
    kube.put("nodes", a_node(n1))
    kube.put("pods", pod("beat-abc", n1, labels={"smr.dev/heartbeat-checkpoint": "abc"}))
    kube.put("pods", pod("beat-neg", n1, labels={"cedana.ai/heartbeat-checkpoint": "-5"}))
    kube.put("pods", pod("beat-huge", n1,
                         labels={"smr.dev/heartbeat-checkpoint": "99999999999"}))
    kube.put("pods", pod("restore-maybe", n1, labels={"smr.dev/node-restore": "yes"}))
    kube.put("pods", pod("bad-id", n1, env={"SMR_CHECKPOINT": "../etc/passwd"}))
    w = await watchers.start()
    await asyncio.sleep(1.0)
    events = {e["involvedObject"]["name"]: e for e in kube.list("events", "default")
              if e["reason"] == "InvalidSmrPolicy"}
    assert set(events) == {"beat-abc", "beat-neg", "beat-huge", "restore-maybe", "bad-id"}
    assert all(e["type"] == "Warning" for e in events.values())
    assert "not a whole number of seconds" in events["beat-abc"]["message"]
    assert "cedana.ai/heartbeat-checkpoint" in events["beat-neg"]["message"]
    assert "outside" in events["beat-huge"]["message"]
    assert '"true" or "false"' in events["restore-maybe"]["message"]
    assert "checkpoint id" in events["bad-id"]["message"]
    assert w.schedule.entries == {}  # none of them got a heartbeat
    # Updates of the same pods do not repeat the Events; the watcher still works.
    p = kube.get("pods", "beat-abc", "default")
    assert p is not None
    p["metadata"]["annotations"]["touched"] = "1"
    kube.put("pods", p)
    async with ckpts(bus, n1) as c:
        cordon(kube, n1)
        await asyncio.sleep(1.0)
        assert c.items == []  # nothing there opted in validly
    assert len([e for e in kube.list("events", "default")
                if e["reason"] == "InvalidSmrPolicy"]) == 5


async def test_outcome_events_on_pods_once(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    await watchers.start()
    from smr.contract.messages import Target

    t = Target(kind="pod", namespace="ml", pod="trainer-0", container="main")
    ok = CkptDone(request_id="r-ok-" + node, checkpoint_id="trainer-0.main", target=t,
                  node=node, reason="heartbeat", status="succeeded", generation=3,
                  size_bytes=64 << 20, durations={"total": 2.5})
    bad = RestoreDone(request_id="r-bad-" + node, checkpoint_id="trainer-0.main", target=t,
                      node=node, reason="cordon", status="failed",
                      error={"code": "checkpoint-corrupt", "message": "pages-1.img is corrupt",
                             "hint": "restore another generation"})
    # A heartbeat that gave way to the pod's final checkpoint failed nothing:
    # the final's own Event tells (no Warning on every drained pod).
    await bus.publish(CkptDone(
        request_id="r-aside-" + node, checkpoint_id="trainer-0.main", target=t, node=node,
        reason="heartbeat", status="failed",
        error={"code": "taken-over", "message": "the final checkpoint takes this one's place"}))
    await bus.publish(ok)
    await bus.publish_raw(f"ckpt.done.{node_token(node)}.ml", ok.to_payload(),
                          msg_id="another-copy")  # the same result, delivered twice
    await bus.publish(bad)
    await bus.publish_raw(f"ckpt.done.{node_token(node)}.ml", b'{"status": "maybe"}')
    await until(lambda: len(kube.list("events", "ml")) >= 2)
    await asyncio.sleep(0.5)
    events = sorted(kube.list("events", "ml"), key=lambda e: e["reason"])
    assert [(e["reason"], e["type"]) for e in events] == [
        ("Checkpointed", "Normal"), ("RestoreFailed", "Warning")]
    assert "generation 3" in events[0]["message"] and "64 MiB" in events[0]["message"]
    assert "pages-1.img is corrupt" in events[1]["message"]
    assert events[0]["involvedObject"]["name"] == "trainer-0"
    letters = await dlq_messages(bus, f"ckpt.done.{node_token(node)}.ml")
    assert any(lt.service == "watcher" for lt in letters)


# -- heartbeats ----------------------------------------------------------------------

def stamp(r: CkptRequested) -> float:
    """When a request says it was asked (a beat's: its slot)."""
    return datetime.fromisoformat(r.requested_at.replace("Z", "+00:00")).timestamp()


def beat_slots(reqs: list[CkptRequested], pod_name: str) -> list[float]:
    return sorted(stamp(r) for r in reqs if r.target.pod == pod_name and r.reason == "heartbeat")


def assert_every_slot_once(slots: list[float], interval: float) -> None:
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(slots)]
    assert all(g == interval for g in gaps), f"missed or doubled beats: gaps {gaps}"


async def test_heartbeats_fire_once_with_two_replicas(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    kube.put("nodes", a_node(node))
    kube.put("pods", pod("beat-1", node, labels={"smr.dev/heartbeat-checkpoint": "1"}))
    kube.put("pods", pod("beat-2", node, labels={"cedana.ai/heartbeat-checkpoint": "2"},
                         containers=("a", "b")))
    late = metrics.REGISTRY.get_sample_value("smr_heartbeat_lateness_seconds_count") or 0
    async with ckpts(bus, node) as c:
        a = await watchers.start()
        b = await watchers.start()
        await asyncio.sleep(7)
        reqs = list(c.items)
    leaders = [w for w in (a, b) if w.leadership.leading.is_set()]
    assert len(leaders) == 1
    follower = b if leaders[0] is a else a
    assert follower.schedule.fired == 0 and follower.stats["published"] == 0
    # Each beat's lateness was observed (its value: the fake-clock test below).
    observed = metrics.REGISTRY.get_sample_value("smr_heartbeat_lateness_seconds_count") - late
    assert observed >= leaders[0].schedule.fired >= 4
    s1 = beat_slots(reqs, "beat-1")
    assert len(s1) >= 4
    assert_every_slot_once(s1, 1.0)
    s2a = beat_slots([r for r in reqs if r.target.container == "a"], "beat-2")
    assert len(s2a) >= 2
    assert_every_slot_once(s2a, 2.0)
    assert all(r.leave_running for r in reqs)
    assert len({r.request_id for r in reqs}) == len(reqs)


async def test_heartbeat_schedule_survives_restart_and_stops_with_the_pod(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    kube.put("nodes", a_node(node))
    kube.put("pods", pod("beat", node, labels={"smr.dev/heartbeat-checkpoint": "2"}))
    async with ckpts(bus, node) as c:
        first = await watchers.start()
        await asyncio.sleep(4.5)
        await watchers.stop(first)  # hands the Lease back
        second = await watchers.start()
        await asyncio.sleep(5)
        slots = beat_slots(c.items, "beat")
        assert first.schedule.fired >= 1 and second.schedule.fired >= 1
        assert len(slots) >= 4
        assert_every_slot_once(slots, 2.0)
        kube.remove("pods", "beat", "default")
        deadline = time.monotonic() + 10
        while second.schedule.entries:  # the watch shows the deletion (late under load)
            assert time.monotonic() < deadline, "the deleted pod stayed scheduled"
            await asyncio.sleep(0.05)
        gone = time.time()
        await asyncio.sleep(3)
        # By when each was asked, not when it arrived: one already on its way counts not.
        late = [r for r in c.items if stamp(r) > gone]
        assert late == [], "beats went on for a deleted pod"
    assert second.schedule.entries == {}


async def test_heartbeat_lateness_is_measured_from_the_slot_it_fires(watcher_bus: Bus,
                                                                      node: str) -> None:
    """On a clock the test sets: 23.5 s after a 10 s beat fell due, two beats
    were missed and the latest slot is 3.5 s old."""
    now = [1_000_000.0]
    sent: list[CkptRequested] = []

    async def publish(reqs: list[CkptRequested]) -> None:
        sent.extend(reqs)

    schedule = HeartbeatSchedule(watcher_bus.kv(KV_BEATS), publish, clock=lambda: now[0],
                                 keys=lambda: watcher_bus.kv_keys(KV_BEATS))
    uid = f"uid-{uuid.uuid4().hex[:8]}"
    await schedule.upsert(uid, "default", "late", node, 10, [["main", "late-ckpt"]])
    now[0] = schedule.entries[uid][0].next_due + 23.5

    def sample(name: str) -> float:
        return metrics.REGISTRY.get_sample_value(name) or 0.0

    before = {n: sample(n) for n in ("smr_heartbeats_missed_total",
                                     "smr_heartbeat_lateness_seconds_count",
                                     "smr_heartbeat_lateness_seconds_sum")}
    task = asyncio.create_task(schedule.run())
    try:
        for _ in range(100):
            if sent:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await schedule.remove(uid)
    assert len(sent) == 1
    assert sample("smr_heartbeats_missed_total") - before["smr_heartbeats_missed_total"] == 2
    assert sample("smr_heartbeat_lateness_seconds_count") - before[
        "smr_heartbeat_lateness_seconds_count"] == 1
    assert sample("smr_heartbeat_lateness_seconds_sum") - before[
        "smr_heartbeat_lateness_seconds_sum"] == pytest.approx(3.5)


async def test_beats_missed_while_no_leader_ran_are_counted_and_fired_once(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    kube.put("nodes", a_node(node))
    kube.put("pods", pod("beat", node, labels={"smr.dev/heartbeat-checkpoint": "1"}))
    async with ckpts(bus, node) as c:
        first = await watchers.start()
        await asyncio.sleep(2.5)
        await watchers.stop(first)
        # Counted from here: a first beat sent late as the first leader started
        # (a loaded machine) is a missed beat too, but not one of these.
        stopped_at = time.time()
        missed = metrics.REGISTRY.get_sample_value("smr_heartbeats_missed_total") or 0
        await asyncio.sleep(3.5)  # three beats fall due with no watcher at all
        await watchers.start()
        await asyncio.sleep(2.5)
        slots = beat_slots(c.items, "beat")
    before = [s for s in slots if s <= stopped_at]
    after = slots[len(before):]
    assert before and after, slots
    gap = after[0] - before[-1]
    assert gap >= 3, f"the missed beats were fired one by one: {slots}"
    # Each beat the second leader did not send is counted once: those of the
    # leaderless gap, and any it sent late itself.
    unsent = sum(round(b - a) - 1 for a, b in itertools.pairwise([before[-1], *after]))
    counted = metrics.REGISTRY.get_sample_value("smr_heartbeats_missed_total") - missed
    assert counted == unsent >= round(gap) - 1, (counted, slots)


# -- restores ------------------------------------------------------------------------

@pytest.fixture
async def storage(nats_users: nats_auth.SecuredNats, bus: Bus, bus_config: BusConfig,
                  tmp_path: Path) -> AsyncIterator[CheckpointStore]:
    store = CheckpointStore(LocalBackend(tmp_path / "store"))
    storage_bus = await nats_users.connect("smr-storage", bus_config, buckets=())
    svc = StorageService(storage_bus, store)
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 10)
    yield store
    svc.stop()
    await asyncio.wait_for(task, 10)
    await storage_bus.close()


async def stored(store: CheckpointStore, tmp_path: Path, namespace: str, ckpt_id: str,
                 reason: str = "cordon") -> int:
    src = tmp_path / f"img-{uuid.uuid4().hex[:6]}"
    (src / "images").mkdir(parents=True)
    (src / "images" / "pages-1.img").write_bytes(b"state" * 100)
    gen = await store.commit(namespace, ckpt_id, src, {
        "request_id": uuid.uuid4().hex, "node": "old-node", "reason": reason,
        "versions": {"smr": "test"},
        "target": {"kind": "pod", "namespace": namespace, "pod": "p", "container": "c"}})
    return gen.number


async def test_bare_node_restore_pod_is_recreated_after_its_checkpoint(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        storage: CheckpointStore, tmp_path: Path, node: str) -> None:
    n1, n2 = node, f"{node}-b"
    kube.put("nodes", a_node(n1))
    kube.put("nodes", a_node(n2))
    kube.put("pods", pod("bare", n1, labels={"smr.dev/node-restore": "true"}))
    kube.put("pods", pod("job-owned", n1, labels={"smr.dev/node-restore": "true"},
                         owner="some-job"))
    old_uid = kube.get("pods", "bare", "default")["metadata"]["uid"]  # type: ignore[index]
    await watchers.start()
    core = client.CoreV1Api(admin)
    async with ckpts(bus, n1) as c:
        await core.patch_node(n1, {"spec": {"unschedulable": True}})
        async def agent_answers(reqs: list[CkptRequested]) -> None:
            """The node agent's part, played here as its Worker records a
            result: images stored, step state done, then the ckpt.done event."""
            for req in reqs:
                gen = await stored(storage, tmp_path, "default", req.checkpoint_id)
                done = CkptDone.for_request(req, status="succeeded", generation=gen)
                await bus.kv(KV_STEPS).put(req.request_id, orjson.dumps(
                    {"state": "done", "result": done.to_dict()}))
                await bus.publish(done)

        await agent_answers(await c.wait(2, settle=0.2))
        for name in ("bare", "job-owned"):
            await core.create_namespaced_pod_eviction(
                name, "default", {"metadata": {"name": name, "namespace": "default"}})
        final = (await c.wait(4, settle=0.2))[2:]
        assert {r.reason for r in final} == {"drain"}
        await asyncio.sleep(0.5)
        assert kube.get("pods", "bare", "default") is None, "recreated before its checkpoint"
        await agent_answers(final)
        deadline = time.monotonic() + 10
        new = None
        while time.monotonic() < deadline:
            new = kube.get("pods", "bare", "default")
            if new and new["metadata"]["uid"] != old_uid:
                break
            await asyncio.sleep(0.1)
        assert new and new["metadata"]["uid"] != old_uid, "the bare pod was not recreated"
        assert "nodeName" not in new["spec"], "placing it is the scheduler's job"
        assert new["metadata"]["annotations"]["smr.dev/recreated-from-node"] == n1
        assert kube.get("pods", "job-owned", "default") is None, "its Job recreates that one"

    def recreated() -> list[dict[str, Any]]:
        return [e for e in kube.list("events", "default") if e["reason"] == "Recreated"]

    await until(lambda: bool(recreated()))  # posted just after the pod is created
    await asyncio.sleep(0.5)
    assert len(recreated()) == 1


async def test_leader_lease_moves_when_the_leader_stops(
        kube: FakeApiServer, watchers: Watchers, watch_settings: config.Settings) -> None:
    a = await watchers.start()
    b = await watchers.start()
    await asyncio.sleep(2.5)
    first = a if a.leadership.leading.is_set() else b
    other = b if first is a else a
    assert first.leadership.leading.is_set() and not other.leadership.leading.is_set()
    await watchers.stop(first)
    await wait_event(other.leadership.leading, 6)
    assert other.leadership.leading.is_set()
    lease = kube.get("leases", watch_settings.lease_name, "smr-system")
    assert lease and lease["spec"]["holderIdentity"] == other.identity


async def test_taint_added_by_strategic_merge_patch_is_a_preemption(
        kube: FakeApiServer, admin: client.ApiClient, bus: Bus, watchers: Watchers,
        node: str) -> None:
    """Karpenter and cluster-autoscaler add their taint with a patch; a
    strategic merge keeps the node's other taints (merged by key)."""
    kube.put("nodes", a_node(node, taints=[{"key": "gpu", "value": "true",
                                            "effect": "NoSchedule"}]))
    kube.put("pods", pod("trainer", node, labels={"smr.dev/node-restore": "true"}))
    await watchers.start()
    async with ckpts(bus, node) as c:
        await client.CoreV1Api(admin).patch_node(node, {"spec": {"taints": [
            {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}})
        [req] = await c.wait(1)
        assert req.reason == "preemption" and req.leave_running
    n = kube.get("nodes", node)
    assert n is not None
    assert [t["key"] for t in n["spec"]["taints"]] == ["gpu", "karpenter.sh/disrupted"]


def test_heartbeat_jitter_spreads_a_thousand_pods() -> None:
    from services.watcher.heartbeats import jitter

    phases = [jitter(str(uuid.uuid4())) for _ in range(1000)]
    assert all(0 <= p < 1 for p in phases)
    buckets = [0] * 10  # each tenth of the interval holds about 100 pods
    for p in phases:
        buckets[int(p * 10)] += 1
    assert max(buckets) < 160 and min(buckets) > 50, buckets
    assert jitter("same-uid") == jitter("same-uid"), "a pod's phase must survive restarts"


async def test_a_stale_view_of_a_node_does_not_end_its_drain_episode(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """Replica B lists the node a moment before replica A sees it cordoned:
    B's healthy view must not close A's episode, or every pod would be
    checkpointed again under new ids."""
    kube.put("nodes", a_node(node))
    healthy = kube.get("nodes", node)
    kube.put("pods", pod("trainer", node, labels={"smr.dev/node-restore": "true"}))
    a = await watchers.start()
    b = await watchers.start()
    async with ckpts(bus, node) as c:
        cordon(kube, node)
        await c.wait(1)
        assert healthy is not None
        await b._close_episode(node, healthy)  # the stale view arrives late
        cordoned = kube.get("nodes", node)
        assert cordoned is not None
        await b._on_node("MODIFIED", cordoned, healthy)
        await a._on_node("MODIFIED", cordoned, healthy)
        await asyncio.sleep(1.0)
        assert len(c.items) == 1


async def test_a_failed_handler_is_retried_without_a_new_event(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """A handler that fails (NATS away, say) is called again with backoff:
    a Node may not change again for minutes in a real cluster."""
    calls: list[str] = []

    async def flaky(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        calls.append(obj["metadata"]["name"])
        if len(calls) < 3:
            raise ConnectionError("the bus is away")

    kube.put("nodes", a_node("quiet"))
    informer = Informer("nodes", client.CoreV1Api(api).list_node, flaky)
    task = asyncio.create_task(informer.run())
    try:
        await until(lambda: len(calls) >= 3, timeout=10)
        await asyncio.sleep(1)
        assert calls == ["quiet"] * 3, "retried until it succeeded, then no more"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_slow_node_does_not_hold_the_others_back(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """A reclaim wave cordons 50 nodes in a second: each node's handling (its
    drain episode in KV, its pods' requests) must not wait for the nodes
    cordoned before it. One node's handler stuck (its NATS server away, say)
    must not delay another node's checkpoints; one node's own events are
    still handled in order."""
    calls: list[tuple[str, bool]] = []
    release = asyncio.Event()

    async def handler(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        name, cordoned = obj["metadata"]["name"], bool(obj["spec"].get("unschedulable"))
        calls.append((name, cordoned))
        if name == "stuck" and cordoned:
            await release.wait()

    kube.put("nodes", a_node("stuck"))
    kube.put("nodes", a_node("other"))
    informer = Informer("nodes", client.CoreV1Api(api).list_node, handler)
    task = asyncio.create_task(informer.run())
    try:
        await until(lambda: len(calls) == 2, timeout=10)
        cordon(kube, "stuck")
        await until(lambda: ("stuck", True) in calls, timeout=10)
        n = kube.get("nodes", "stuck")
        assert n is not None
        n["spec"]["unschedulable"] = False  # uncordoned while its cordon is handled
        kube.put("nodes", n)
        cordon(kube, "other")
        await until(lambda: ("other", True) in calls, timeout=10)
        assert calls.count(("stuck", False)) == 1, "the uncordon waits for the cordon"
        release.set()
        await until(lambda: calls.count(("stuck", False)) == 2, timeout=10)
        assert [c for c in calls if c[0] == "stuck"] == [
            ("stuck", False), ("stuck", True), ("stuck", False)]
    finally:
        release.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_final_checkpoint_is_expected_of_a_disrupted_pod_or_one_on_a_node_going_away(
        ) -> None:
    """What the agent asks before it releases a waiting preStop hook
    (services/agent/prestop): the watcher's own rule."""
    from services.triggers import final_expected

    def deleted(by: str | None) -> dict[str, Any]:
        p = pod("p", "n")
        p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        if by:
            p["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                          "reason": by}]
        return p

    cordoned = a_node("n", unschedulable=True)
    for node in (a_node("n"), cordoned, None):
        assert not final_expected(deleted(None), node), "a plain delete gets none"
        for by in ("EvictionByEvictionAPI", "PreemptionByScheduler"):
            assert final_expected(deleted(by), node), f"{by} gets one on any node"
    assert final_expected(deleted("DeletionByTaintManager"), a_node("n", taints=[
        {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]))
    shutting = a_node("n")
    shutting["status"]["conditions"] = [{"type": "Ready", "status": "False",
                                         "message": "node is shutting down"}]
    assert final_expected(pod("p", "n"), shutting), "graceful shutdown: no deletion, a final"
    assert not final_expected(pod("p", "n"), cordoned), \
        "a cordon alone takes a leave-running checkpoint"


async def test_replicas_ready_together_take_one_template(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        node: str) -> None:
    """Two replicas of a Deployment labelled snapshot-when-ready turn Ready at
    once, before any template is stored: one template checkpoint, of the
    replica created first, not one per replica (each replica took one:
    `[('template_tpl.main', 'web-0'), ('template_tpl.main', 'web-1')]`)."""
    kube.put("nodes", a_node(node))
    labels = {"smr.dev/snapshot-when-ready": "tpl"}
    for name in ("web-0", "web-1"):
        p = pod(name, node, labels=labels, owner="web")
        p["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        for st in p["status"]["containerStatuses"]:
            st["ready"] = False
        kube.put("pods", p)
    await watchers.start()
    async with ckpts(bus, node) as c:
        await asyncio.sleep(0.5)
        # Ready together, in one second, as the kubelet records the transition
        # (without it the Ready time is the creation's, before the watcher started)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for name in ("web-0", "web-1"):
            p = kube.get("pods", name, "default")
            assert p is not None
            p["status"]["conditions"] = [{"type": "Ready", "status": "True",
                                          "lastTransitionTime": now}]
            for st in p["status"]["containerStatuses"]:
                st["ready"] = True
            kube.put("pods", p)
        await c.wait(1, settle=2.0)
        # Created and Ready in the same second (the API server's and the
        # kubelet's resolution): the least uid, not always web-0 (the test
        # asserted web-0 and failed one run in four).
        def created(name: str) -> tuple[str, str]:
            m = (kube.get("pods", name, "default") or {})["metadata"]
            return m["creationTimestamp"], m["uid"]

        first = min(("web-0", "web-1"), key=created)
        assert [(r.checkpoint_id, r.target.pod) for r in c.items] == \
            [("template_tpl.main", first)]


def ago(seconds: float) -> str:
    return datetime.fromtimestamp(time.time() - seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def replica(name: str, node_name: str, *, created: str, ready_at: str | None) -> dict[str, Any]:
    """A replica of Deployment web labelled snapshot-when-ready "tpl", Ready
    since ``ready_at`` (as its kubelet records it), or not Ready yet."""
    p = pod(name, node_name, labels={"smr.dev/snapshot-when-ready": "tpl"}, owner="web")
    p["metadata"]["creationTimestamp"] = created
    set_ready(p, ready_at)
    return p


def set_ready(p: dict[str, Any], ready_at: str | None) -> None:
    p["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready_at else "False",
                                  "lastTransitionTime": ready_at or p["metadata"].get(
                                      "creationTimestamp") or ago(0)}]
    for st in p["status"]["containerStatuses"]:
        st["ready"] = ready_at is not None


async def test_a_replica_ready_after_the_one_taking_the_template_takes_none(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        node: str) -> None:
    """The replica created second turns Ready first and takes the template;
    the one created first turns Ready a moment later, its template still being
    taken: one template, not two (ordered by creation alone, the first
    created took a second one)."""
    kube.put("nodes", a_node(node))
    kube.put("pods", replica("web-0", node, created=ago(60), ready_at=None))
    kube.put("pods", replica("web-1", node, created=ago(30), ready_at=None))
    await watchers.start()
    async with ckpts(bus, node) as c:
        await asyncio.sleep(0.5)
        p1 = kube.get("pods", "web-1", "default")
        assert p1 is not None
        set_ready(p1, ago(2))
        kube.put("pods", p1)
        await c.wait(1, settle=0.5)
        p0 = kube.get("pods", "web-0", "default")
        assert p0 is not None
        set_ready(p0, ago(0))
        kube.put("pods", p0)
        await c.wait(1, settle=3.0)
        assert [(r.checkpoint_id, r.target.pod) for r in c.items] == \
            [("template_tpl.main", "web-1")]


async def test_a_template_deleted_from_storage_is_taken_by_a_restarted_replica(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        node: str, tmp_path: Path) -> None:
    """docs/warm-start.md: to take a template again, delete it from storage
    and restart a labelled pod. The replicas Ready for an hour had their turn;
    the restarted one, Ready now, takes it (before, the one created first, long
    done with its turn, stood in its way for ever)."""
    kube.put("nodes", a_node(node))
    await stored(storage, tmp_path, "default", "template_tpl.main", reason="template")
    for name in ("web-0", "web-1"):
        kube.put("pods", replica(name, node, created=ago(3600), ready_at=ago(3500)))
    await watchers.start()
    async with ckpts(bus, node) as c:
        await asyncio.sleep(1.0)
        assert c.items == [], "the template is stored: none taken"
        assert await storage.delete_checkpoint("default", "template_tpl.main")
        kube.remove("pods", "web-1", "default")  # `kubectl delete pod web-1`
        kube.put("pods", replica("web-2", node, created=ago(20), ready_at=ago(1)))
        await c.wait(1, settle=1.0)
        assert [(r.checkpoint_id, r.target.pod) for r in c.items] == \
            [("template_tpl.main", "web-2")]


async def test_the_next_replica_takes_the_template_when_the_one_taking_it_goes(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        node: str) -> None:
    """The replica taking the template is deleted before it is stored: the
    other Ready one takes it, without a change of its own (before, the watcher
    waited for one, which a Ready pod left alone may never have)."""
    kube.put("nodes", a_node(node))
    kube.put("pods", replica("web-0", node, created=ago(60), ready_at=ago(5)))
    kube.put("pods", replica("web-1", node, created=ago(30), ready_at=ago(4)))
    await watchers.start()
    async with ckpts(bus, node) as c:
        await c.wait(1, settle=1.0)
        assert [r.target.pod for r in c.items] == ["web-0"]
        kube.remove("pods", "web-0", "default")
        await c.wait(2, settle=1.0)
        assert [(r.checkpoint_id, r.target.pod) for r in c.items] == \
            [("template_tpl.main", "web-0"), ("template_tpl.main", "web-1")]


async def test_the_next_replica_takes_the_template_when_the_takers_request_fails(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        node: str) -> None:
    """The template request of the replica taking it fails (its node's agent
    answers with an error, as for a workload CRIU refuses): the other Ready
    replica takes it (before, it was left to the failed one, which never asks
    again)."""
    kube.put("nodes", a_node(node))
    kube.put("pods", replica("web-0", node, created=ago(60), ready_at=ago(5)))
    kube.put("pods", replica("web-1", node, created=ago(30), ready_at=ago(4)))
    await watchers.start()
    async with ckpts(bus, node) as c:
        (req,) = await c.wait(1, settle=1.0)
        assert req.target.pod == "web-0"
        failed = CkptDone.for_request(req, status="failed", error={
            "code": "external-unix-socket", "message": "a test's refusal"})
        await bus.kv(KV_STEPS).put(req.request_id, orjson.dumps(
            {"state": "failed", "result": failed.to_dict()}))
        await c.wait(2, settle=1.0)
        assert [(r.checkpoint_id, r.target.pod) for r in c.items] == \
            [("template_tpl.main", "web-0"), ("template_tpl.main", "web-1")]


async def test_a_template_request_whose_publish_failed_is_published_on_the_retry(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, storage: CheckpointStore,
        node: str) -> None:
    """NATS refuses the template request's publish once (away past the
    client's retries): the informer calls the handler again, and the request
    goes out then (it was marked looked at before its publish, so the retry
    skipped it and the template was never taken)."""
    kube.put("nodes", a_node(node))
    kube.put("pods", replica("web-0", node, created=ago(60), ready_at=ago(5)))
    # On the class: the watcher publishes through a bus of its own (its own
    # NATS user), not the test's.
    real = Bus.publish
    refused: list[str] = []

    async def publish_once_refused(self: Bus, msg: Any, *a: Any, **kw: Any) -> Any:
        if isinstance(msg, CkptRequested) and msg.reason == "template" and not refused:
            refused.append(msg.request_id)
            raise ConnectionError("nats: the bus is away (a test's fault)")
        return await real(self, msg, *a, **kw)

    Bus.publish = publish_once_refused  # type: ignore[method-assign]
    try:
        await watchers.start()
        async with ckpts(bus, node) as c:
            await c.wait(1, settle=1.0)
            assert refused, "the fault never fired"
            assert [(r.checkpoint_id, r.target.pod) for r in c.items] == \
                [("template_tpl.main", "web-0")]
    finally:
        Bus.publish = real  # type: ignore[method-assign]


@pytest.mark.parametrize("how", ["cancelled", "returned"])
async def test_a_watcher_loop_that_ends_unasked_ends_the_watcher_by_name(
        watchers: Watchers, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The watcher's loops end only on a stop. Leader election ending on its
    own, or cancelled by a library, ends the watcher with an error that names
    it (its Deployment starts it again); before, a cancelled loop raised its
    CancelledError out of run(), as if the watcher had been cancelled, and a
    loop that returned ended the watcher silently."""
    from services.watcher.leader import Leadership

    async def ends(self: Leadership) -> None:
        await asyncio.sleep(0.5)
        if how == "cancelled":
            raise asyncio.CancelledError

    monkeypatch.setattr(Leadership, "run", ends)
    w = await watchers.start()
    [(_, task)] = watchers.running
    said = "cancelled" if how == "cancelled" else "on its own"
    with pytest.raises(RuntimeError, match=f"its leader election ended {said}"):
        await asyncio.wait_for(task, 20)
    watchers.running.clear()
    assert not w._stop.is_set()


async def test_the_watcher_makes_each_nodes_request_consumers_and_makes_them_again(
        watchers: Watchers, kube: FakeApiServer, bus: Bus, nats_users: nats_auth.SecuredNats,
        bus_config: BusConfig, watch_settings: config.Settings, node: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's user may create no consumer (docs/security.md): its worker
    waits for its durables; the watcher makes them for each Node, with the
    agent's windows, and again once one was deleted, and the node is served."""
    monkeypatch.setattr(durables, "RECONCILE_S", 0.5)
    user = nats_users.node_user(node)
    agent_bus = await nats_users.connect(user, bus_config, buckets=(KV_JOBS, KV_LOCKS, KV_STEPS))
    step = CountingStep()
    w = Worker(agent_bus, step, node, service="agent", locks=node_locks(node),
               concurrency=watch_settings.checkpoints_per_node, ahead=LOOK_AHEAD)
    task = asyncio.create_task(w.run())
    name = f"ckpt-requested-{node_token(node)}"
    try:
        kube.put("nodes", a_node(node))
        await watchers.start()
        await asyncio.wait_for(w.idle.wait(), 20)  # it waited for them until now
        info = await bus.js.consumer_info(STREAM_REQUESTS, name)
        assert info.config.max_ack_pending == w.concurrency + w.ahead
        assert (await bus.js.consumer_info("SMR_EXHAUSTED", f"exhausted-{name}")).config
        await bus.publish(request(node, f"a-{uuid.uuid4().hex[:6]}"))
        await until(lambda: len(step.seen) == 1, 20)
        await bus.js.delete_consumer(STREAM_REQUESTS, name)
        await bus.publish(request(node, f"b-{uuid.uuid4().hex[:6]}"))
        await until(lambda: len(step.seen) == 2, 30)
        assert len(step.seen) == 2 and not task.done(), "never served again"
    finally:
        w.stop()
        await asyncio.wait_for(task, 30)
        await agent_bus.close()


async def test_one_nodes_durable_that_cannot_be_updated_leaves_the_others_made(
        bus: Bus, node: str) -> None:
    """A durable of one node that the watcher cannot bring to its settings
    (made by hand with another deliver policy: JetStream refuses the update)
    must not keep every other Node's durables from being made: their agents
    would wait, not ready, for ever."""
    from dataclasses import replace

    from nats.js import api as js_api

    from smr.bus.topology import request_consumer

    odd, fine = f"{node}-a", f"{node}-b"
    cfg = request_consumer("ckpt.requested", odd, bus.config, 1)
    await bus.js.add_consumer(STREAM_REQUESTS, replace(
        cfg, deliver_policy=js_api.DeliverPolicy.NEW))
    nc = durables.NodeConsumers(bus, lambda: [odd, fine], {"ckpt.requested": 2})
    with contextlib.suppress(Exception):
        await nc.reconcile()
    have = await bus.consumer_names(STREAM_REQUESTS)
    assert request_consumer("ckpt.requested", fine, bus.config).durable_name in have, \
        "one node's durable that cannot be updated left another node's never made"
