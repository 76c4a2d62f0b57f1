"""smr on a 3-server NATS JetStream cluster (tests/nats_cluster.py): every
stream and KV bucket has the replicas SMR_NATS_REPLICAS asks for, and a
request published while its stream's leader is SIGKILLed runs exactly once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from services.agent.__main__ import BUCKETS as AGENT_BUCKETS
from services.checkpointer.admission import LOOK_AHEAD, CheckpointAdmission
from services.storage.local import LocalBackend
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from smr import config
from smr.bus import (
    QUERY_LATEST,
    STREAM_EVENTS,
    STREAM_REQUESTS,
    Bus,
    BusConfig,
    Progress,
    Worker,
    consume_events,
    node_filter,
    subject,
    topology,
)
from smr.contract.errors import SmrError
from smr.contract.messages import CkptDone, CkptRequested, StorageQuery, Target
from smr.natsserver import NatsServer
from smr.retry import NATS_TRANSIENT, retry_nats
from tests import nats_auth
from tests.helpers.steplocks import node_locks
from tests.nats_cluster import NatsCluster
from tests.test_bus import CountingStep, request, run_worker, stop, stored, zero_estimate
from tests.test_storage_service import NS, commit

EVERY_STREAM = [s.name for s in topology.streams(BusConfig())] + [
    f"KV_{bucket}" for bucket, _, _ in topology.BUCKETS]


R3 = BusConfig(replicas=3, max_deliver=4, ack_wait=2.0, nak_base_delay=0.2, nak_max_delay=1.0)


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory,
          shipped_nats_users: nats_auth.Shipped) -> nats_auth.Rendered:
    return nats_auth.render(tmp_path_factory.mktemp("nats-users"), shipped_nats_users)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, settings: config.Settings,
            users: nats_auth.Rendered) -> Iterator[NatsCluster]:
    """As deployed: every server with the shipped users and permissions; the
    test logs in as smr-admin, the services it runs as their own users. At the
    end, the servers must have refused none of them anything."""
    c = NatsCluster(settings.nats_server_binary(), tmp_path_factory.mktemp("nats-cluster"),
                    users=users)
    c.start()
    yield c
    c.stop()
    refused = c.violations()
    assert not refused, ("the servers refused a permission the shipped NATS users lack "
                         f"(deploy/kustomize/components/nats-auth): {refused[:5]}")


async def login(cluster: NatsCluster, users: nats_auth.Rendered, user: str,
                base: BusConfig = R3, buckets: tuple[str, ...] | None = None) -> Bus:
    cfg = nats_auth.config(user, users.passwords[user])
    return await Bus.connect(cluster.url, name=user, buckets=buckets, config=replace(
        base, user=cfg.user, password=cfg.password, setup=cfg.setup))


@pytest.fixture
async def r3_bus(cluster: NatsCluster, users: nats_auth.Rendered) -> AsyncIterator[Bus]:
    b = await login(cluster, users, "smr-admin")
    yield b
    await b.close()


@pytest.fixture
async def agent_bus(cluster: NatsCluster, users: nats_auth.Rendered, r3_bus: Bus
                    ) -> AsyncIterator[Bus]:
    """The agent's user, for its Worker."""
    b = await login(cluster, users, "smr-agent", buckets=AGENT_BUCKETS)
    yield b
    await b.close()


async def replicas(bus: Bus) -> dict[str, tuple[int, int]]:
    """Each stream's configured replicas and the peers it has (leader + followers)."""
    out = {}
    for name in EVERY_STREAM:
        for _ in range(300):
            info = await bus.js.stream_info(name)
            assert info.cluster is not None
            if info.cluster.leader:  # none for a moment after a scale-up
                break
            await asyncio.sleep(0.1)
        peers = {info.cluster.leader, *(p.name for p in info.cluster.replicas or [])}
        out[name] = (info.config.num_replicas or 1, len(peers))
    return out


async def test_replica_setting_reaches_every_stream_and_bucket(
        cluster: NatsCluster, users: nats_auth.Rendered) -> None:
    # First as a single-replica smr made them, then with SMR_NATS_REPLICAS=3:
    # the existing streams and buckets are updated in place (by smr-storage,
    # the one service that may).
    one = await login(cluster, users, "smr-storage", BusConfig(replicas=1))
    try:
        assert await replicas(one) == {name: (1, 1) for name in EVERY_STREAM}
    finally:
        await one.close()
    three = await login(cluster, users, "smr-storage", BusConfig.from_settings(
        config.load({"SMR_NATS_REPLICAS": "3"})))
    try:
        assert await replicas(three) == {name: (3, 3) for name in EVERY_STREAM}
    finally:
        await three.close()


async def _server_of(cluster: NatsCluster, bus: Bus) -> NatsServer:
    url = bus.nc.connected_url
    assert url is not None
    return next(s for s in cluster.servers if s.port == url.port)


async def _leader(bus: Bus, stream: str) -> str:
    info = await bus.js.stream_info(stream)
    assert info.cluster is not None and info.cluster.leader
    return info.cluster.leader


async def _lead_from(cluster: NatsCluster, bus: Bus, stream: str, server: NatsServer) -> None:
    """Step the stream's leader down until ``server`` leads it (each stepdown
    elects one of the followers)."""
    for _ in range(30):
        leader = await _leader(bus, stream)
        if cluster.server_named(leader) is server:
            return
        await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        for _ in range(100):  # until a new leader is elected
            await asyncio.sleep(0.1)
            try:
                if await _leader(bus, stream) != leader:
                    break
            except AssertionError:
                continue
    pytest.fail(f"{server.url} never became the leader of {stream}")


async def test_request_published_as_its_streams_leader_dies_runs_once(
        cluster: NatsCluster, r3_bus: Bus, agent_bus: Bus) -> None:
    bus = r3_bus
    node = f"node-{uuid.uuid4().hex[:8]}"
    step = CountingStep()
    # Its consumers, as the watcher makes them (the agent's user may create none).
    await bus.make_node_consumers(node, {step.kind: 1})
    w, task = await run_worker(agent_bus, step, node)
    # The server this client is connected to leads the requests stream: its
    # death takes the leader and the connection at once.
    victim = await _server_of(cluster, bus)
    await _lead_from(cluster, bus, STREAM_REQUESTS, victim)
    try:
        cluster.kill(victim)
        await _publish_after_a_kill(bus, request(node, "r-killed"))
        result = await bus.wait_result("r-killed", "ckpt.requested", timeout=60)
        assert result.status == "succeeded"
        assert step.seen == ["r-killed"]
        assert (await _server_of(cluster, bus)) is not victim
        assert bus.nc.stats["reconnects"] >= 1
        assert cluster.server_named(await _leader(bus, STREAM_REQUESTS)) is not victim
        # Its result is recorded once on the events stream.
        done = await _results(bus, node)
        assert [d.request_id for d in done] == ["r-killed"]
    finally:
        await stop(w, task)
        cluster.restart(victim)


async def _publish_after_a_kill(bus: Bus, msg: Any, within: float = 90) -> None:
    """The test's own publish right after a server was killed: on this loaded
    machine the new stream leader has taken longer than one publish's ~21 s of
    retries to be elected. Published again until ``within`` (Nats-Msg-Id
    drops a repeat of one that landed)."""
    deadline = time.monotonic() + within
    while True:
        try:
            await bus.publish(msg)
            return
        except NATS_TRANSIENT:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


async def _results(bus: Bus, node: str) -> list[CkptDone]:
    # Just after the kill the events stream may still be electing its leader.
    async for attempt in retry_nats():
        with attempt:
            return await stored(bus, subject("ckpt.done", node, "local"), STREAM_EVENTS, CkptDone,
                                wait=2)
    raise AssertionError("unreachable: retry_nats reraises")


async def test_event_consumer_lives_through_its_leader_dying(
        cluster: NatsCluster, r3_bus: Bus) -> None:
    # The watcher and the storage service consume events so; before, a fetch
    # answered 503 during the election ended the loop, and the service died.
    bus = r3_bus
    node = f"node-{uuid.uuid4().hex[:8]}"
    durable = f"test-{uuid.uuid4().hex[:8]}"
    seen: set[str] = set()
    stop_consuming = asyncio.Event()

    async def handle(event: CkptDone) -> None:
        seen.add(event.request_id)

    consuming = asyncio.create_task(consume_events(
        bus,         durable, "ckpt.done", handle, service="test", stop=stop_consuming))
    before = CkptDone.for_request(request(node, "before"), status="succeeded", generation=1)
    after = CkptDone.for_request(request(node, "after"), status="succeeded", generation=2)
    try:
        await bus.publish(before)
        await _until(lambda: "before" in seen or consuming.done())
        info = await bus.js.consumer_info(STREAM_EVENTS, durable)
        assert info.cluster is not None and info.cluster.leader
        victim = cluster.server_named(info.cluster.leader)
        cluster.kill(victim)
        await _publish_after_a_kill(bus, after)
        await _until(lambda: "after" in seen or consuming.done())
        if consuming.done():
            consuming.result()  # its exception, if it died
        assert {"before", "after"} <= seen
    finally:
        stop_consuming.set()
        await asyncio.wait_for(asyncio.gather(consuming, return_exceptions=True), 10)
        if not cluster.running(victim):
            cluster.restart(victim)


async def _until(cond: Any, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 (a condition on state callbacks change)
            await asyncio.sleep(0.05)


async def test_more_replicas_than_servers_is_refused_naming_the_setting(
        tmp_path: Path, settings: config.Settings) -> None:
    srv = NatsServer(settings.nats_server_binary(), tmp_path / "nats").start()
    try:
        with pytest.raises(SmrError) as e:
            await Bus.connect(srv.url, name="test", config=BusConfig(replicas=3))
        assert e.value.code == "nats-replicas" and "SMR_NATS_REPLICAS" in e.value.hint
    finally:
        srv.stop()


async def test_storage_service_retains_a_done_published_as_its_consumers_leader_dies(
        cluster: NatsCluster, users: nats_auth.Rendered, r3_bus: Bus, tmp_path: Path) -> None:
    """The storage service on the cluster: the ckpt.done published as the
    leader of its consumer is SIGKILLed is handled once (its retention
    applied), and the service answers queries through another server."""
    bus = r3_bus
    store = CheckpointStore(LocalBackend(tmp_path / "store"))
    storage_bus = await login(cluster, users, "smr-storage", buckets=())
    svc = StorageService(storage_bus, store, keep=1, gc_grace_s=600, gc_interval_s=60)
    handled: list[str] = []
    retain = svc._retain

    async def counted(done: CkptDone) -> None:
        handled.append(done.request_id)
        await retain(done)

    svc._retain = counted  # type: ignore[method-assign]
    task = asyncio.create_task(svc.run())
    ckpt = f"c-{uuid.uuid4().hex[:6]}"
    victim = None
    try:
        await asyncio.wait_for(svc.ready.wait(), 30)
        await commit(store, tmp_path, ckpt, 2)
        info = await bus.js.consumer_info(STREAM_EVENTS, svc.durable)
        assert info.cluster is not None and info.cluster.leader
        victim = cluster.server_named(info.cluster.leader)
        cluster.kill(victim)
        await _publish_after_a_kill(bus, CkptDone(
            request_id=f"{ckpt}-1", checkpoint_id=ckpt, target=Target.job(ckpt), node="n1",
            status="succeeded", generation=2))
        # Its own event: the module's earlier tests left events of their own
        # on the stream, which a new durable consumer gets first.
        await _until(lambda: any(r.startswith(ckpt) for r in handled) or task.done())
        if task.done():
            task.result()  # its exception, if it died
        await asyncio.sleep(bus.config.ack_wait + 1)  # a redelivery would have come by now
        # (The module's earlier tests left events of their own on the stream.)
        assert [r for r in handled if r.startswith(ckpt)] == [f"{ckpt}-1"]
        assert [g.number for g in await store.generations(NS, ckpt)] == [2]
        latest = await bus.query(QUERY_LATEST, StorageQuery(checkpoint_id=ckpt), timeout=30)
        assert [g["generation"] for g in latest.generations] == [2]
    finally:
        svc.stop()
        await asyncio.wait_for(task, 30)
        await storage_bus.close()
        if victim is not None and not cluster.running(victim):
            cluster.restart(victim)


class HeldFinal:
    """The agent's checkpointer in miniature: a final request runs until
    released; leave-running ones at once. Records every start. Like the
    real one, it finds a finished step in its storage when a redelivery asks
    (NATS away as the result was recorded): answered, not run again."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: dict[str, CkptDone] = {}
        self.release = asyncio.Event()

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.started.append(req.request_id)
        if not req.leave_running:
            await self.release.wait()
        done = CkptDone.for_request(req, status="succeeded", generation=1)
        self.finished[req.request_id] = done
        return done

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return self.finished.get(req.request_id)


async def test_requests_fetched_ahead_live_through_their_consumers_leader_dying(
        cluster: NatsCluster, r3_bus: Bus, agent_bus: Bus, tmp_path: Path) -> None:
    """The agent's checkpointer fetches requests ahead of a free slot and
    keeps them alive while they wait (services/agent/service.py: LOOK_AHEAD,
    CheckpointAdmission). Its consumer's leader SIGKILLed while a final
    runs and two leave-running requests wait, and a third is published:
    each runs once, each ckpt.done is recorded once."""
    bus = r3_bus
    node = f"node-{uuid.uuid4().hex[:8]}"
    step = HeldFinal()
    w = Worker(agent_bus, step, node, service="test", locks=node_locks(node), ahead=LOOK_AHEAD,
               admission=CheckpointAdmission(tmp_path, zero_estimate))
    # Its consumers, as the watcher makes them (the agent's user may create none).
    await bus.make_node_consumers(node, {step.kind: w.concurrency + w.ahead})
    task = asyncio.create_task(w.run())
    victim = None
    rids = ["final", "lr-1", "lr-2", "lr-3"]
    try:
        await asyncio.wait_for(w.idle.wait(), 30)
        await bus.publish(request(node, "final", leave_running=False))
        await _until(lambda: "final" in step.started)
        for rid in ["lr-1", "lr-2"]:
            await bus.publish(request(node, rid, leave_running=True))
        await asyncio.sleep(1)  # fetched ahead, waiting behind the final
        durable = (await bus.js.consumers_info(STREAM_REQUESTS))
        leader = next(c.cluster.leader for c in durable
                      if c.config.filter_subject == node_filter("ckpt.requested", node)
                      and c.cluster is not None)
        assert leader
        victim = cluster.server_named(leader)
        cluster.kill(victim)
        await _publish_after_a_kill(bus, request(node, "lr-3", leave_running=True))
        step.release.set()
        for rid in rids:
            assert (await bus.wait_result(rid, "ckpt.requested", timeout=60)).status == \
                "succeeded"
        await asyncio.sleep(bus.config.ack_wait + 1)  # a redelivery would have come by now
        assert sorted(step.started) == sorted(rids)
        assert sorted(d.request_id for d in await _results(bus, node)) == sorted(rids)
    finally:
        await stop(w, task)
        if victim is not None and not cluster.running(victim):
            cluster.restart(victim)
