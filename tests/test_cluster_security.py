"""Attacks on the cluster's bus, against a real nats-server running the users
and permissions that deploy/kustomize ships (tests/nats_auth.py renders them
from the dev overlay), with the storage service on moto's S3 over HTTP.

Each attack is refused by the server itself: the client is told `Permissions
Violation`, and nothing of it reaches a stream, a bucket or a service. Each
user's own work goes through beside it, so no refusal here is vacuous.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.storage.codec import Codec
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from services.watcher.__main__ import BUCKETS as WATCHER_BUCKETS
from smr import config
from smr.bus import (
    KV_BEATS,
    KV_JOBS,
    KV_LOCKS,
    KV_STEPS,
    KV_TIMINGS,
    QUERY_CHECKPOINTS,
    QUERY_GENERATIONS,
    QUERY_LATEST,
    STREAM_EVENTS,
    STREAM_REQUESTS,
    Bus,
    Worker,
    subject,
)
from smr.contract.messages import (
    CkptRequested,
    NodeDraining,
    RestoreRequested,
    StorageQuery,
    Target,
)
from tests import nats_auth
from tests.helpers.steplocks import node_locks
from tests.test_bus import CountingStep

NODE, OTHER_NODE = "node-1", "node-2"
TENANTS = {"team-a": "pw-team-a", "team-b": "pw-team-b"}
AGENTS = {NODE: "pw-node-1", OTHER_NODE: "pw-node-2"}
VIOLATION = "permissions violation"  # as nats-py reports the server's -ERR


@pytest.fixture(scope="module")
def secured(kustomize: str, tmp_path_factory: pytest.TempPathFactory,
            settings: config.Settings) -> Iterator[nats_auth.SecuredNats]:
    ship = nats_auth.shipped(kustomize)
    srv = nats_auth.start(settings.nats_server_binary(), tmp_path_factory.mktemp("nats-auth"),
                          ship, tenants=TENANTS, agents=AGENTS,
                          nodes={NODE: "pw-local-node-1"})
    yield srv
    srv.stop()


class Client:
    """A raw NATS client as a user: what a tenant or a stolen password has."""

    def __init__(self, nc: NATS, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream(timeout=2)

    async def refused(self, what: str, kind: str = "publish") -> None:
        """The server answered ``what`` with a permissions violation (``kind``:
        publish or subscription)."""
        for _ in range(40):
            if any(f'{VIOLATION} for {kind} to "{what.lower()}"' in e.lower()
                   for e in self.errors):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no permissions violation for {what!r}: {self.errors}")

    async def publish_refused(self, subj: str, payload: bytes = b"{}",
                              headers: dict[str, str] | None = None) -> None:
        """A JetStream publish the server drops: no ack comes, and it says why."""
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await self.js.publish(subj, payload, headers=headers, timeout=1)
        await self.refused(subj)

    async def request_refused(self, subj: str, payload: bytes = b"{}") -> None:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await self.nc.request(subj, payload, timeout=1)
        await self.refused(subj)


@contextlib.asynccontextmanager
async def login(srv: nats_auth.SecuredNats, user: str) -> AsyncIterator[Client]:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(srv.url, user=user, password=srv.passwords[user],
                            inbox_prefix=f"_INBOX.{user}", error_cb=on_error,
                            allow_reconnect=False)
    try:
        yield Client(nc, errors)
    finally:
        await nc.close()


@pytest.fixture
async def admin(secured: nats_auth.SecuredNats) -> AsyncIterator[Bus]:
    # The storage service's user creates the streams and buckets (SMR_NATS_SETUP).
    storage = await Bus.connect(secured.url, config=secured.config("smr-storage"), buckets=())
    await storage.close()
    bus = await Bus.connect(secured.url, config=secured.config("smr-admin"))
    yield bus
    await bus.close()


@pytest.fixture
async def agent(secured: nats_auth.SecuredNats, admin: Bus
                ) -> AsyncIterator[tuple[Bus, CountingStep, Worker]]:
    """Node 1's worker, logged in as that node's agent user."""
    bus = await Bus.connect(secured.url, config=secured.config(f"smr-agent-{NODE}"),
                            buckets=(KV_LOCKS, KV_STEPS, KV_TIMINGS))
    step = CountingStep()
    # Its durables, as the watcher makes them (its user may create none).
    await admin.make_node_consumers(NODE, {step.kind: 1})
    w = Worker(bus, step, NODE, service="agent", locks=node_locks(NODE))
    task = asyncio.create_task(w.run())
    await asyncio.wait_for(w.idle.wait(), 15)
    try:
        yield bus, step, w
    finally:
        w.stop()
        await asyncio.wait_for(task, 30)
        await bus.close()


def pod(namespace: str) -> Target:
    return Target(kind="pod", namespace=namespace, pod="trainer-0", container="main")


async def stored(admin: Bus, stream: str, subj: str) -> int:
    info = await admin.js.stream_info(stream, subjects_filter=subj)
    return int((info.state.subjects or {}).get(subj, 0))


async def test_a_tenant_cannot_ask_for_another_namespaces_checkpoint_or_restore(
        secured: nats_auth.SecuredNats, admin: Bus,
        agent: tuple[Bus, CountingStep, Worker]) -> None:
    _, step, _ = agent
    run = uuid.uuid4().hex[:6]
    theirs = [CkptRequested(request_id=f"steal-{run}", checkpoint_id="trainer-0.main",
                            target=pod("team-b"), node=NODE, leave_running=True),
              RestoreRequested(request_id=f"overwrite-{run}", checkpoint_id="trainer-0.main",
                               target=pod("team-b"), node=NODE)]
    mine = CkptRequested(request_id=f"mine-{run}", checkpoint_id="trainer-0.main",
                         target=pod("team-a"), node=NODE, leave_running=True)
    # On its own subject, naming a pod of team-b: NATS lets it by; the agent not.
    crafted = CkptRequested(request_id=f"crafted-{run}", checkpoint_id="trainer-0.main",
                            target=pod("team-b"), node=NODE)
    async with login(secured, "tenant-team-a") as a:
        results: list[bytes] = []

        async def got(m: Any) -> None:
            results.append(m.data)
        await a.nc.subscribe("ckpt.done.*.team-a", cb=got)
        for req in theirs:
            subj = subject(req.SCHEMA, NODE, "team-b")
            await a.publish_refused(subj, req.to_payload())
            assert await stored(admin, STREAM_REQUESTS, subj) == 0
        # Its own namespace's request goes through, and its result comes back.
        ack = await a.js.publish(subject("ckpt.requested", NODE, "team-a"), mine.to_payload())
        assert ack.stream == STREAM_REQUESTS
        await a.js.publish(subject("ckpt.requested", NODE, "team-a"), crafted.to_payload())
        for _ in range(200):
            if results:
                break
            await asyncio.sleep(0.05)
        assert [orjson.loads(r)["request_id"] for r in results] == [mine.request_id]
    await asyncio.sleep(1.0)  # the crafted one had its time too
    assert step.seen == [mine.request_id]
    for req in (*theirs, crafted):
        assert (await admin.step_state(req.request_id))[0] is None, req.request_id


@pytest.fixture
async def storage(secured: nats_auth.SecuredNats, admin: Bus, s3_endpoint: str
                  ) -> AsyncIterator[CheckpointStore]:
    """The storage service as its own user, on a bucket of moto's S3 server."""
    from services.storage.s3 import S3Backend

    bucket = f"smr-{uuid.uuid4().hex[:6]}"
    backend = S3Backend(bucket, prefix="ckpt", path_style=True, endpoint_url=s3_endpoint)
    async with backend._client() as c:
        await c.create_bucket(Bucket=bucket)
    store = CheckpointStore(backend, Codec(level=1))
    bus = await Bus.connect(secured.url, config=secured.config("smr-storage"), buckets=())
    svc = StorageService(bus, store)
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 15)
    try:
        yield store
    finally:
        svc.stop()
        await asyncio.wait_for(task, 15)
        await bus.close()
        await store.close()


async def commit(store: CheckpointStore, tmp_path: Path, namespace: str, ckpt: str) -> None:
    src = tmp_path / f"src-{namespace}"
    (src / "images").mkdir(parents=True, exist_ok=True)
    (src / "images" / "pages-1.img").write_bytes(b"secret of " + namespace.encode())
    await store.commit(namespace, ckpt, src, {
        "request_id": f"{namespace}-1", "node": NODE, "reason": "api",
        "target": pod(namespace).to_dict(), "versions": {"criu": "4.2"}})


async def test_a_tenant_cannot_list_or_read_another_namespaces_checkpoints(
        secured: nats_auth.SecuredNats, storage: CheckpointStore, tmp_path: Path) -> None:
    await commit(storage, tmp_path, "team-a", "ours")
    await commit(storage, tmp_path, "team-b", "theirs")
    q = StorageQuery(checkpoint_id="theirs", namespace="team-b").to_payload()
    async with login(secured, "tenant-team-a") as a:
        await a.request_refused(f"{QUERY_LATEST}.team-b", q)
        await a.request_refused(f"{QUERY_CHECKPOINTS}.team-b",
                                StorageQuery(namespace="team-b").to_payload())
        await a.request_refused(QUERY_CHECKPOINTS, StorageQuery().to_payload())  # all of them
        # Results and step state of another namespace, read directly:
        await a.nc.subscribe("ckpt.done.*.team-b")
        await a.refused("ckpt.done.*.team-b", "subscription")
        await a.nc.subscribe(f"$KV.{KV_STEPS}.>")
        await a.refused(f"$KV.{KV_STEPS}.>", "subscription")
        await a.request_refused(f"$JS.API.DIRECT.GET.KV_{KV_STEPS}.$KV.{KV_STEPS}.x")
        await a.request_refused(f"$JS.API.CONSUMER.CREATE.{STREAM_EVENTS}")
        # Its own namespace's listing: its checkpoint, not team-b's.
        r = orjson.loads((await a.nc.request(
            f"{QUERY_CHECKPOINTS}.team-a", StorageQuery(namespace="team-a").to_payload(),
            timeout=10)).data)
        assert [(g["namespace"], g["checkpoint_id"]) for g in r["generations"]] == [
            ("team-a", "ours")]


async def test_a_tenant_cannot_delete_checkpoints_or_state(
        secured: nats_auth.SecuredNats, admin: Bus) -> None:
    rid = f"victim-{uuid.uuid4().hex[:6]}"
    await admin.kv(KV_STEPS).put(rid, orjson.dumps({"state": "done", "result": {}}))
    async with login(secured, "tenant-team-a") as a:
        # A KV delete and purge are publishes with a header (nats-py's kv.delete).
        await a.publish_refused(f"$KV.{KV_STEPS}.{rid}", b"", headers={"KV-Operation": "DEL"})
        await a.publish_refused(f"$KV.{KV_JOBS}.{rid}", b"", headers={"KV-Operation": "PURGE"})
        for api in (f"STREAM.PURGE.{STREAM_REQUESTS}", f"STREAM.DELETE.KV_{KV_STEPS}",
                    f"STREAM.DELETE.{STREAM_EVENTS}",
                    f"CONSUMER.DELETE.{STREAM_REQUESTS}.ckpt-requested-{NODE}"):
            await a.request_refused(f"$JS.API.{api}")
    state, _ = await admin.step_state(rid)
    assert state == {"state": "done", "result": {}}
    assert (await admin.js.stream_info(STREAM_EVENTS)).config.name == STREAM_EVENTS


async def test_an_agent_cannot_consume_or_publish_for_another_node(
        secured: nats_auth.SecuredNats, admin: Bus) -> None:
    # Node 2's consumer exists (its agent made it), with a request waiting.
    theirs = await admin.ensure_consumer("ckpt.requested", OTHER_NODE)
    req = CkptRequested(request_id=f"n2-{uuid.uuid4().hex[:6]}", checkpoint_id="c",
                        target=pod("team-a"), node=OTHER_NODE)
    await admin.publish(req)
    async with login(secured, f"smr-agent-{NODE}") as a:
        await a.request_refused(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM_REQUESTS}.{theirs}",
                                b'{"batch": 1}')
        filt = f"ckpt.requested.{OTHER_NODE}.*"
        await a.request_refused(
            f"$JS.API.CONSUMER.CREATE.{STREAM_REQUESTS}.{theirs}.{filt}")
        # Not even its own durable: the watcher makes it
        # (test_a_node_cannot_create_its_request_durables).
        mine = f"ckpt-requested-{NODE}"
        await a.request_refused(
            f"$JS.API.CONSUMER.CREATE.{STREAM_REQUESTS}.{mine}.ckpt.requested.{NODE}.*")
        for subj in (subject("ckpt.requested", OTHER_NODE, "team-a"),
                     subject("ckpt.done", OTHER_NODE, "team-a"),  # a forged result
                     subject("restore.done", OTHER_NODE, "team-a")):
            await a.publish_refused(subj, req.to_payload())
        await a.request_refused(f"$JS.API.CONSUMER.CREATE.{STREAM_REQUESTS}")  # ephemeral
        assert (await admin.js.consumer_info(STREAM_REQUESTS, theirs)).num_pending >= 1


async def test_the_watcher_publishes_requests_but_writes_no_state_and_reads_no_checkpoint(
        secured: nats_auth.SecuredNats, admin: Bus, storage: CheckpointStore,
        tmp_path: Path) -> None:
    await commit(storage, tmp_path, "team-a", "ours")
    rid = f"w-{uuid.uuid4().hex[:6]}"
    await admin.kv(KV_STEPS).put(rid, orjson.dumps({"state": "done", "result": {}}))
    # Its own work: its buckets, a node event and a checkpoint request.
    bus = await Bus.connect(secured.url, config=secured.config("smr-watcher"),
                            buckets=WATCHER_BUCKETS)
    try:
        await bus.kv(KV_BEATS).put("pod-uid", b"1")
        await bus.publish(NodeDraining(request_id=rid, node=NODE, reason="cordon"))
        ack = await bus.publish(CkptRequested(request_id=rid, checkpoint_id="c",
                                              target=pod("team-a"), node=NODE))
        assert ack.stream == STREAM_REQUESTS
        assert (await bus.step_state(rid))[0] == {"state": "done", "result": {}}
        # Whether a warm-start template exists: the latest generation, answered.
        latest = await bus.query(QUERY_LATEST, StorageQuery(checkpoint_id="ours",
                                                            namespace="team-a"))
        assert latest.error is None and latest.generations
    finally:
        await bus.close()
    async with login(secured, "smr-watcher") as w:
        # It may read a step's state (to recreate a drained pod after its
        # checkpoint), never write one: no forged or deleted result.
        await w.publish_refused(f"$KV.{KV_STEPS}.{rid}", b'{"state": "failed"}')
        await w.publish_refused(f"$KV.{KV_STEPS}.{rid}", b"", headers={"KV-Operation": "DEL"})
        await w.request_refused(f"$JS.API.STREAM.INFO.KV_{KV_JOBS}")
        await w.request_refused(f"$JS.API.DIRECT.GET.KV_{KV_JOBS}.$KV.{KV_JOBS}.x")
        await w.request_refused(f"$JS.API.STREAM.MSG.GET.KV_{KV_TIMINGS}")
        await w.nc.subscribe(f"$KV.{KV_JOBS}.>")
        await w.refused(f"$KV.{KV_JOBS}.>", "subscription")
        # It asks whether a warm-start template exists (storage.latest), and
        # lists nothing.
        await w.request_refused(f"{QUERY_GENERATIONS}.team-a",
                                StorageQuery(checkpoint_id="ours", namespace="team-a")
                                .to_payload())
        await w.request_refused(QUERY_CHECKPOINTS, StorageQuery().to_payload())
        await w.request_refused(f"$JS.API.CONSUMER.CREATE.{STREAM_REQUESTS}")
        await w.publish_refused(subject("ckpt.done", NODE, "team-a"))  # no forged result
        await w.publish_refused(subject("restore.requested", NODE, "team-a"))


# nats-server does not hold a push consumer's deliver subject to its creator's
# publish permissions (nats-io/nats-server#8274): a node user that could create
# a consumer on a bucket it writes could have its own value delivered onto any
# subject with a plain subscriber: a tenant's core subscription to its results
# would take it for one (nats-server 2.10.27 delivers it to plain subscribers
# only; SMR_REQUESTS / SMR_EVENTS did not store it, so the assertion below says
# how many they hold too).
HIJACKS = [  # (node's user, bucket, the subject it aims at, who listens there)
    (f"smr-agent-{NODE}", KV_STEPS, subject("restore.requested", OTHER_NODE, "team-a"),
     "smr-admin"),
    (f"smr-agent-{NODE}", KV_STEPS, subject("ckpt.done", OTHER_NODE, "team-a"),
     "tenant-team-a"),
    (f"smr-node-{NODE}", KV_STEPS, subject("restore.requested", OTHER_NODE, "team-a"),
     "smr-admin"),
    (f"smr-node-{NODE}", KV_JOBS, subject("ckpt.done", OTHER_NODE, "team-a"),
     "tenant-team-a"),
    # The watcher's heartbeat schedule: a stolen watcher password, its own beat
    # record delivered onto a tenant's results (it lists the keys with
    # STREAM.INFO, Bus.kv_keys).
    ("smr-watcher", KV_BEATS, subject("ckpt.done", OTHER_NODE, "team-a"), "tenant-team-a"),
    ("smr-watcher", KV_BEATS, subject("restore.requested", OTHER_NODE, "team-a"),
     "smr-admin"),
]


@pytest.mark.parametrize(("user", "bucket", "target", "listener"), HIJACKS)
async def test_a_node_cannot_deliver_its_bucket_values_onto_another_nodes_subjects(
        secured: nats_auth.SecuredNats, admin: Bus, user: str, bucket: str, target: str,
        listener: str) -> None:
    admin.kv(bucket)  # the bucket exists (the storage service made it)
    stream = STREAM_REQUESTS if target.startswith("restore.requested") else STREAM_EVENTS
    before = await stored(admin, stream, target)
    key = f"forged-{uuid.uuid4().hex[:6]}"
    forged = RestoreRequested(request_id=key, checkpoint_id="c", target=pod("team-a"),
                              node=OTHER_NODE).to_payload()
    got: list[bytes] = []
    async with login(secured, listener) as ear, login(secured, user) as a:
        async def heard(m: Msg) -> None:
            got.append(m.data)

        sub = await ear.nc.subscribe(target, cb=heard)
        await ear.nc.flush()
        await a.js.publish(f"$KV.{bucket}.{key}", forged)  # its own key: allowed
        config = {"deliver_subject": target, "filter_subject": f"$KV.{bucket}.{key}",
                  "deliver_policy": "last_per_subject", "ack_policy": "none"}
        for create in (f"$JS.API.CONSUMER.CREATE.KV_{bucket}",
                       f"$JS.API.CONSUMER.CREATE.KV_{bucket}.evil.$KV.{bucket}.{key}"):
            name = {"name": "evil"} if create.endswith(key) else {}
            body = orjson.dumps({"stream_name": f"KV_{bucket}", "config": {**config, **name}})
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                r = await a.nc.request(create, body, timeout=1)
                # the server made it: what it delivers is what a listener sees
                await until_heard(got, 2.0)
                raise AssertionError(f"{user} made a push consumer on KV_{bucket} "
                                     f"delivering to {target}: {r.data[:200]!r}; "
                                     f"{target} got {got[:1]!r}, "
                                     f"{stream} stores {await stored(admin, stream, target)}"
                                     f" (was {before})")
            await a.refused(create)
        # The listener hears the subject (a real message reaches it), and what
        # reached it and the stream is that message only.
        await admin.nc.publish(target, b"real")
        await until_heard(got, 5.0)
        await sub.unsubscribe()
    assert got == [b"real"]
    assert forged not in got


async def until_heard(got: list[bytes], within: float) -> None:
    """Until a listener's ``got`` has a message, for ``within`` seconds at
    most (what reached it is asserted by the caller)."""
    for _ in range(int(within / 0.05)):
        if got:
            return
        await asyncio.sleep(0.05)


# A node's own durables on SMR_REQUESTS (and SMR_EXHAUSTED): while one did
# not exist yet, its node's user, which could create it (filter pinned in the
# create subject), could make it a push consumer delivering its own requests
# (whose bodies it writes) onto a tenant's results. Now a privileged party
# makes them (the watcher, the operator) and a node's user may create none.
DURABLE_HIJACKS = [(user, kind) for user in (f"smr-agent-{NODE}", f"smr-node-{NODE}", "smr-agent")
                   for kind in ("ckpt.requested", "restore.requested")]


@pytest.mark.parametrize(("user", "kind"), DURABLE_HIJACKS)
async def test_a_node_cannot_create_its_request_durables(
        secured: nats_auth.SecuredNats, admin: Bus, user: str, kind: str) -> None:
    mine = f"{kind.replace('.', '-')}-{NODE}"
    for stream, name in ((STREAM_REQUESTS, mine), ("SMR_EXHAUSTED", f"exhausted-{mine}")):
        with contextlib.suppress(nats.js.errors.NotFoundError):  # not made yet
            await admin.js.delete_consumer(stream, name)
    target = subject("ckpt.done", OTHER_NODE, "team-a")  # team-a's results
    own = f"{kind}.{NODE}.*"
    key = f"forged-{uuid.uuid4().hex[:6]}"
    forged = orjson.dumps({"forged": key})
    got: list[bytes] = []
    async with login(secured, "tenant-team-a") as ear, login(secured, user) as a:
        async def heard(m: Msg) -> None:
            got.append(m.data)

        sub = await ear.nc.subscribe(target, cb=heard)
        await ear.nc.flush()
        # A request of its own node (allowed): its body is the node's.
        await a.js.publish(subject(kind, NODE, "team-a"), forged, headers={"Nats-Msg-Id": key})
        ex_filter = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{STREAM_REQUESTS}.{mine}"
        for stream, name, filt, deliver in (
                (STREAM_REQUESTS, mine, own, target),  # push, onto team-a's results
                (STREAM_REQUESTS, mine, own, None),  # its pull durable
                ("SMR_EXHAUSTED", f"exhausted-{mine}", ex_filter, target)):
            create = f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{filt}"
            body = orjson.dumps({"stream_name": stream, "config": {
                "name": name, "durable_name": name, "filter_subject": filt,
                "deliver_policy": "last", "ack_policy": "none",
                **({"deliver_subject": deliver} if deliver else {})}})
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                r = await a.nc.request(create, body, timeout=1)
                await until_heard(got, 2.0)
                raise AssertionError(f"{user} made {name} on {stream} (deliver subject "
                                     f"{deliver}): {r.data[:200]!r}; {target} got {got[:1]!r}")
            await a.refused(create)
        # The listener hears the subject: a real message reaches it, and only that.
        await admin.nc.publish(target, b"real")
        await until_heard(got, 5.0)
        await sub.unsubscribe()
    assert got == [b"real"]
    for stream, name in ((STREAM_REQUESTS, mine), ("SMR_EXHAUSTED", f"exhausted-{mine}")):
        with pytest.raises(nats.js.errors.NotFoundError):
            await admin.js.consumer_info(stream, name)


async def test_a_local_nodes_retention_durable_cannot_reach_a_tenants_results(
        secured: nats_auth.SecuredNats, admin: Bus) -> None:
    """What a shared NATS's machine user may still create: the storage
    service's retention durable on SMR_EVENTS, where it writes its own
    results. Made before its storage service ran, as a push consumer onto a
    tenant's results, its own forged result would reach them: the server
    refuses a deliver subject its own stream captures (10081), and every
    subject a tenant listens on is SMR_EVENTS's."""
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await admin.js.delete_consumer(STREAM_EVENTS, "storage-retention")
    target = subject("ckpt.done", OTHER_NODE, "team-a")
    key = f"forged-{uuid.uuid4().hex[:6]}"
    got: list[bytes] = []
    async with login(secured, "tenant-team-a") as ear, login(secured, f"smr-node-{NODE}") as a:
        async def heard(m: Msg) -> None:
            got.append(m.data)

        sub = await ear.nc.subscribe(target, cb=heard)
        await ear.nc.flush()
        await a.js.publish(subject("ckpt.done", NODE, "team-a"), orjson.dumps({"forged": key}))
        body = orjson.dumps({"stream_name": STREAM_EVENTS, "config": {
            "name": "storage-retention", "durable_name": "storage-retention",
            "filter_subject": "ckpt.done.*.*", "deliver_subject": target,
            "deliver_policy": "last", "ack_policy": "none"}})
        r = await a.nc.request(
            f"$JS.API.CONSUMER.CREATE.{STREAM_EVENTS}.storage-retention.ckpt.done.*.*", body,
            timeout=5)
        assert orjson.loads(r.data).get("error", {}).get("err_code") == 10081, r.data
        await admin.nc.publish(target, b"real")
        await until_heard(got, 5.0)
        await sub.unsubscribe()
    assert got == [b"real"]


async def test_a_node_started_before_its_request_durables_waits_for_them_then_serves(
        secured: nats_auth.SecuredNats, admin: Bus, caplog: pytest.LogCaptureFixture) -> None:
    """The node's user may not make its request durables (the watcher or the
    operator does): a worker started before they exist waits for them, says
    so once however long it waits, and serves its node's requests once they
    are made."""
    mine = f"ckpt-requested-{NODE}"
    for stream, name in ((STREAM_REQUESTS, mine), ("SMR_EXHAUSTED", f"exhausted-{mine}")):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await admin.js.delete_consumer(stream, name)
    bus = await Bus.connect(secured.url, config=secured.config(f"smr-agent-{NODE}"),
                            buckets=(KV_LOCKS, KV_STEPS, KV_TIMINGS))
    step = CountingStep()
    w = Worker(bus, step, NODE, service="agent", locks=node_locks(NODE))
    task = asyncio.create_task(w.run())
    try:
        # Long enough for several looks, however they are spaced.
        await asyncio.sleep(2.5)
        assert not w.idle.is_set(), "the worker served without its durable"
        await admin.make_node_consumers(NODE, {step.kind: 1})
        await asyncio.wait_for(w.idle.wait(), 30)
        rid = f"late-{uuid.uuid4().hex[:6]}"
        await admin.publish(CkptRequested(request_id=rid, checkpoint_id="c",
                                          target=pod("team-a"), node=NODE))
        for _ in range(300):
            if rid in step.seen:
                break
            await asyncio.sleep(0.1)
        assert step.seen == [rid]
    finally:
        w.stop()
        await asyncio.wait_for(task, 30)
        await bus.close()
    waits = [r for r in caplog.records if f"consumer {mine} " in r.getMessage()
             and "does not exist yet" in r.getMessage()]
    assert len(waits) == 1, [r.getMessage() for r in waits]
