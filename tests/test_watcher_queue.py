"""The informer's per-object queues (services/watcher/kube.py) against
sequences that could lose, double or reorder a change: a full queue while a
watch expires, an object deleted and created again under its name while
unwatched, a superseded retry whose handler ignores its cancellation (as
nats-py can), a handler that raises CancelledError, an informer stopped with
changes queued. The FAKE Kubernetes API server (tests/fake_apiserver.py)
serves the real kubernetes-asyncio client over HTTP; the watcher's own tests
use a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

from kubernetes_asyncio import client
from nats.js.errors import KeyNotFoundError

from services.kubeapi import api_client
from services.watcher.kube import Informer
from services.watcher.service import Watcher
from smr.bus import KV_EPISODES, STREAM_EVENTS, STREAM_REQUESTS, Bus, node_token
from smr.contract.messages import CkptRequested, NodeDraining
from tests import test_watcher
from tests.fake_apiserver import FakeApiServer, pod
from tests.fake_apiserver import node as a_node
from tests.test_watcher import Collector, Watchers, ckpts, cordon, drains, until

# test_watcher's fixtures, shared (not copied).
kube, api = test_watcher.kube, test_watcher.api
watch_settings, watchers = test_watcher.watch_settings, test_watcher.watchers
bus, watcher_bus = test_watcher.bus, test_watcher.watcher_bus

Change = tuple[str, str, str, bool]  # kind, name, uid, cordoned


def uncordon(kube: FakeApiServer, name: str) -> None:
    n = kube.get("nodes", name)
    assert n is not None
    n["spec"]["unschedulable"] = False
    kube.put("nodes", n)


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def dropping_publish(gate: asyncio.Event) -> None:
    """A publish the way nats-py can do one: a cancellation that arrives while
    it waits on the connection is dropped (smr/aio.py stop_task says where),
    and the publish goes on; a second one ends it."""
    try:
        await gate.wait()
    except asyncio.CancelledError:
        await gate.wait()


async def test_a_full_queue_and_an_expired_watch_lose_and_reorder_nothing(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """A 50-node cordon wave with 8 slots: the watch waits while the slots are
    full; the watch then expires (410) and the informer lists again while
    changes are still queued. Each node's changes reach the handler in the
    order they happened, never two at once, and the last one handled is the
    node as it is now (cordoned, uncordoned or deleted)."""
    names = [f"n{i:02d}" for i in range(50)]
    for n in names:
        kube.put("nodes", a_node(n))
    seen: dict[str, list[tuple[str, int, bool]]] = {n: [] for n in names}
    busy: set[str] = set()
    overlaps: list[str] = []
    go = asyncio.Event()
    go.set()

    async def slow(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        name = obj["metadata"]["name"]
        if name in busy:
            overlaps.append(name)
        busy.add(name)
        try:
            await go.wait()
            await asyncio.sleep(random.uniform(0, 0.04))
            seen[name].append((kind, int(obj["metadata"]["resourceVersion"]),
                               bool(obj["spec"].get("unschedulable"))))
        finally:
            busy.discard(name)

    informer = Informer("nodes", client.CoreV1Api(api).list_node, slow, concurrency=8)
    task = asyncio.create_task(informer.run())
    try:
        await until(lambda: all(seen.values()), timeout=20)
        go.clear()  # the handlers hang: the slots fill, the watch waits
        for i, n in enumerate(names):  # a node's changes side by side in the queue
            cordon(kube, n)
            if i % 2 == 0:
                uncordon(kube, n)
        await until(lambda: informer._slots.locked(), timeout=10)
        kube.pause_watches()
        kube.cut_watches(mid_line=False)
        for n in names[::5]:
            cordon(kube, n)
        kube.remove("nodes", names[7])
        kube.compact()  # what the informer still holds is gone: 410, a new list
        kube.resume_watches()
        go.set()
        await until(lambda: informer.stats["expired"] >= 1, timeout=20)

        def current(n: str) -> bool:
            now = kube.get("nodes", n)
            if now is None:
                return seen[n][-1][0] == "DELETED"
            return seen[n][-1][2] == bool(now["spec"]["unschedulable"])

        # Idle queues alone could be a moment before the new list's changes
        # are queued: wait for every node's last handled change to be its
        # state now (the assertion below names any that never gets there).
        with contextlib.suppress(AssertionError):
            await until(lambda: all(current(n) for n in names)
                        and not informer._queues and not informer._handling, timeout=30)
    finally:
        await stop(task)
    assert overlaps == [], "one node's changes were handled at the same time"
    for n in names:
        rvs = [rv for _, rv, _ in seen[n]]
        assert rvs == sorted(rvs), f"{n}: handled out of order: {seen[n]}"
        assert len({(k, rv) for k, rv, _ in seen[n]}) == len(seen[n]), f"{n}: twice: {seen[n]}"
        assert current(n), f"{n} is {kube.get('nodes', n)}, last handled: {seen[n]}"
    assert informer._slots._value == 8, "a slot was lost"


async def test_an_object_recreated_while_unwatched_ends_the_old_one(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """A pod deleted and created again under its name while the watch was
    away (410, a new list): the handler hears the old pod's deletion, then the
    new pod, not a change of one pod into another (the old uid's heartbeats,
    its drain bookkeeping, its recreation hang on that deletion)."""
    kube.put("pods", pod("twin", "n1"))
    old_uid = kube.get("pods", "twin", "default")["metadata"]["uid"]  # type: ignore[index]
    got: list[tuple[str, str, str | None]] = []

    async def record(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        got.append((kind, obj["metadata"]["uid"], old and old["metadata"]["uid"]))

    informer = Informer("pods", client.CoreV1Api(api).list_pod_for_all_namespaces, record)
    task = asyncio.create_task(informer.run())
    try:
        await until(lambda: len(got) == 1, timeout=10)
        await kube.watching(1)
        kube.pause_watches()
        kube.cut_watches(mid_line=False)
        kube.remove("pods", "twin", "default")
        kube.put("pods", pod("twin", "n2"))
        new_uid = kube.get("pods", "twin", "default")["metadata"]["uid"]  # type: ignore[index]
        kube.compact()
        kube.resume_watches()
        await until(lambda: informer.stats["expired"] >= 1 and len(got) >= 2, timeout=10)
        await asyncio.sleep(0.5)
    finally:
        await stop(task)
    assert got[1:] == [("DELETED", old_uid, old_uid), ("ADDED", new_uid, None)], got


async def test_a_pod_recreated_while_unwatched_loses_its_old_heartbeats(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """The watcher's side of the above: the leader's heartbeat schedule must
    not keep beating the deleted pod's uid (its requests would go on to a pod
    that is gone, for as long as this replica leads)."""
    kube.put("nodes", a_node(node))
    labels = {"smr.dev/heartbeat-checkpoint": "60"}
    kube.put("pods", pod("beat", node, labels=labels))
    old_uid = kube.get("pods", "beat", "default")["metadata"]["uid"]  # type: ignore[index]
    w = await watchers.start()
    await asyncio.wait_for(w.leadership.leading.wait(), 20)
    await until(lambda: old_uid in w.schedule.entries, timeout=10)
    await kube.watching(2)
    kube.pause_watches()
    kube.cut_watches(mid_line=False)
    kube.remove("pods", "beat", "default")
    kube.put("pods", pod("beat", node, labels=labels))
    new_uid = kube.get("pods", "beat", "default")["metadata"]["uid"]  # type: ignore[index]
    kube.compact()
    kube.resume_watches()
    await until(lambda: w.pods.stats["expired"] >= 1 and new_uid in w.schedule.entries,
                timeout=20)
    await asyncio.sleep(0.5)
    assert set(w.schedule.entries) == {new_uid}, "the deleted pod's heartbeats go on"


async def test_a_superseded_retry_ends_before_the_newer_change(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """Cordon, its handler fails, its retry is inside a publish that drops
    the cancellation (nats-py); the node is uncordoned. The uncordon must be
    handled after the cordon's retry has ended, not beside it: else the
    retry's drain requests go out after the uncordon was handled."""
    kube.put("nodes", a_node("flap"))
    order: list[str] = []
    running: set[str] = set()
    overlaps: list[str] = []
    attempts = 0
    gate = asyncio.Event()

    async def handler(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        nonlocal attempts
        cordoned = bool(obj["spec"].get("unschedulable"))
        what = "cordon" if cordoned else "uncordon"
        if running:
            overlaps.append(f"{what} while {running}")
        running.add(what)
        try:
            if cordoned:
                attempts += 1
                if attempts == 1:
                    raise ConnectionError("the bus is away")
                await dropping_publish(gate)  # the retry's publish
            order.append(what)
        finally:
            running.discard(what)

    informer = Informer("nodes", client.CoreV1Api(api).list_node, handler,
                        max_backoff_s=0.2)
    task = asyncio.create_task(informer.run())
    try:
        await until(lambda: order == ["uncordon"], timeout=10)
        cordon(kube, "flap")
        await until(lambda: attempts == 2, timeout=10)  # the retry publishes
        uncordon(kube, "flap")
        await asyncio.sleep(0.5)
        gate.set()  # the publish the cancellation did not stop completes
        await until(lambda: len(order) == 3, timeout=10)
        await asyncio.sleep(0.3)
    finally:
        gate.set()
        await stop(task)
    assert overlaps == [], overlaps
    # The retry's publish completes, or a second cancel ends it: either way
    # before the uncordon is handled.
    assert order in (["uncordon", "cordon", "uncordon"], ["uncordon", "uncordon"]), order


async def test_a_stopped_informer_leaves_no_handler_running(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """A watcher that stops (a rolling update; it hands its Lease back) must
    not go on publishing: when its informer's run has ended, so have its
    handlers, even one inside a publish that drops a cancellation."""
    kube.put("nodes", a_node("busy"))
    state = {"started": 0, "ended": 0}
    gate = asyncio.Event()

    async def handler(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        state["started"] += 1
        try:
            await dropping_publish(gate)
        finally:
            state["ended"] += 1

    informer = Informer("nodes", client.CoreV1Api(api).list_node, handler)
    task = asyncio.create_task(informer.run())
    try:
        await until(lambda: state["started"] == 1, timeout=10)
        task.cancel()
        # Bounded here only so that the old code fails instead of hanging.
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 10)
        assert task.done()
        assert state["ended"] == 1, "a handler runs on after its informer stopped"
    finally:
        gate.set()
        await asyncio.sleep(0)
        await stop(task)


async def test_a_handler_raising_cancelled_error_loses_no_change(
        kube: FakeApiServer, api: client.ApiClient) -> None:
    """A CancelledError that is not the informer's own stop (an awaited
    future cancelled by its owner: nats-py cancels its pending futures when
    its connection closes) fails that change like any error: it is retried,
    and the object's changes queued behind it are still handled."""
    kube.put("nodes", a_node("n1"))
    calls: list[bool] = []
    hold = asyncio.Event()

    async def handler(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        cordoned = bool(obj["spec"].get("unschedulable"))
        calls.append(cordoned)
        if cordoned and calls.count(True) == 1:
            await hold.wait()  # the uncordon queues behind it
            fut = asyncio.get_running_loop().create_future()
            fut.cancel()
            await fut

    informer = Informer("nodes", client.CoreV1Api(api).list_node, handler,
                        max_backoff_s=0.2, concurrency=4)
    task = asyncio.create_task(informer.run())
    try:
        await until(lambda: calls == [False], timeout=10)
        cordon(kube, "n1")
        await until(lambda: calls == [False, True], timeout=10)
        uncordon(kube, "n1")
        await until(lambda: informer.stats["events"] == 3, timeout=10)
        hold.set()
        await until(lambda: len(calls) >= 3 and not informer._handling, timeout=10)
        await asyncio.sleep(1.0)
        assert calls[-1] is False, f"the uncordon queued behind was lost: {calls}"
        assert informer._slots._value == 4, "slots were lost"
    finally:
        hold.set()
        await stop(task)


async def test_a_node_flapping_ends_as_it_is_with_one_episode_per_cordon(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """Cordon, uncordon, cordon, uncordon at once (an operator's script, a
    controller flapping): each cordon is an episode of its own, its requests
    once; the node ends uncordoned, so no episode stays open (else every pod
    later stopped on it would get a final drain checkpoint)."""
    kube.put("nodes", a_node(node))
    kube.put("pods", pod("flapper", node, labels={"smr.dev/node-restore": "true"}))
    w = await watchers.start()
    async with ckpts(bus, node) as c, drains(bus, node) as d:
        for _ in range(2):
            cordon(kube, node)
            uncordon(kube, node)
        await d.wait(2, settle=1.0)
        assert len(d.items) == 2, "one node.draining per cordon"
        reqs = await c.wait(2, settle=0.5)
        assert len(reqs) == 2 and len({r.request_id for r in reqs}) == 2, reqs
    assert node not in w._episodes, "an episode stayed open after the last uncordon"
    with contextlib.suppress(KeyNotFoundError):
        e = await bus.kv(KV_EPISODES).get(f"node.{node_token(node)}")
        assert not e.value, f"the episode is still open in KV: {e.value!r}"


async def test_a_node_recreated_while_unwatched_does_not_stop_the_new_ones_pods(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """A Node deleted and registered again under its name (a cloud reusing
    the name, a kubelet registering again) while the watcher's node watch was
    away: its re-list hears the old Node's deletion. The pods then on that
    name run on the new one, which is not going away: no checkpoint, no
    node.draining for them."""
    kube.put("nodes", a_node(node))
    labels = {"smr.dev/node-restore": "true"}
    kube.put("pods", pod("before", node, labels=labels))
    w = await watchers.start()
    await kube.watching(2)
    async with ckpts(bus, node) as c, drains(bus, node) as d:
        kube.pause_watches()
        assert kube.cut_watches(mid_line=False, plural="nodes") == 1  # pods still watched
        kube.remove("nodes", node)  # the pod GC deletes "before"
        await until(lambda: "default/before" not in w.pods.cache, timeout=10)
        kube.put("nodes", a_node(node))
        kube.put("pods", pod("after", node, labels=labels))
        await until(lambda: "default/after" in w.pods.cache, timeout=10)
        kube.compact()
        kube.resume_watches()
        await until(lambda: w.nodes.stats["expired"] >= 1, timeout=10)
        await asyncio.sleep(1.5)
        asked = [(r.target.pod, r.reason) for r in c.items]
        assert asked == [], f"pods on the new Node were checkpointed: {asked}"
        assert d.items == [], f"the new Node was said to drain: {d.items}"


async def test_a_cordon_wave_with_pod_churn_and_full_queues_checkpoints_each_pod_once(
        kube: FakeApiServer, bus: Bus, watch_settings: Any, node: str) -> None:
    """The real watcher with 4 slots per informer (so the watches wait): 50
    nodes cordoned at once, an opted-in pod added on each meanwhile, pods
    that did not opt in created and deleted, and both watches cut and
    expired (410) in the middle. Each opted-in pod gets exactly one cordon
    checkpoint, each node one node.draining, the others nothing."""
    names = [f"{node}-{i:02d}" for i in range(50)]
    opted = {"smr.dev/node-restore": "true"}
    for n in names:
        kube.put("nodes", a_node(n))
        kube.put("pods", pod(f"{n}-a", n, labels=opted))
    a = await api_client(kube.url, token=kube.token("smr-watcher"))
    w = Watcher(bus, a, watch_settings, durable_prefix=f"w-{node}")
    w.nodes._slots = asyncio.Semaphore(4)
    w.pods._slots = asyncio.Semaphore(4)
    task = asyncio.create_task(w.run())
    ours = set(names)
    async with Collector(bus, "ckpt.requested.*.*", STREAM_REQUESTS,
                         CkptRequested.from_payload) as c, \
            Collector(bus, "node.draining.*", STREAM_EVENTS, NodeDraining.from_payload) as d:
        try:
            await asyncio.wait_for(w.ready.wait(), 30)
            await kube.watching(2)
            for i, n in enumerate(names):
                cordon(kube, n)
                kube.put("pods", pod(f"{n}-b", n, labels=opted))
                kube.put("pods", pod(f"{n}-plain", n))
                if i % 2:
                    kube.remove("pods", f"{n}-plain", "default")
                if i == 25:
                    kube.pause_watches()
                    kube.cut_watches(mid_line=True)
            kube.compact()
            kube.resume_watches()
            await until(lambda: w.nodes.stats["expired"] >= 1
                        and w.pods.stats["expired"] >= 1, timeout=30)
            await until(lambda: len([r for r in c.items if r.node in ours]) >= 100, timeout=60)
            await asyncio.sleep(1.5)
        finally:
            w.stop()
            await asyncio.wait_for(task, 30)
            await a.close()
        reqs = [r for r in c.items if r.node in ours]
        got = sorted((r.node, r.target.pod) for r in reqs)
        assert got == sorted((n, f"{n}-{x}") for n in names for x in "ab"), got
        assert all(r.reason == "cordon" and r.leave_running for r in reqs)
        assert sorted(x.node for x in d.items if x.node in ours) == names
