"""The storage service over a real nats-server: queries by request/reply,
retention applied on ckpt.done, garbage collection on its timer."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.storage import layout
from services.storage.local import LocalBackend
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from smr import metrics
from smr.bus import QUERY_CHECKPOINTS, QUERY_GENERATIONS, QUERY_LATEST, Bus, BusConfig
from smr.contract.messages import CkptDone, StorageQuery, StorageReply, Target, epoch
from tests import nats_auth
from tests.test_bus import dlq_messages

NS = layout.LOCAL_NAMESPACE


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(LocalBackend(tmp_path / "store"))


@pytest.fixture
def bus(admin_bus: Bus) -> Bus:
    """NATS as deployed, with the shipped users (tests/nats_auth.py): the
    storage service logs in as smr-storage, the test (asking it, publishing
    results as the agents would) as smr-admin."""
    return admin_bus


@pytest.fixture
async def service(nats_users: nats_auth.SecuredNats, bus: Bus, bus_config: BusConfig,
                  store: CheckpointStore) -> AsyncIterator[StorageService]:
    storage_bus = await nats_users.connect("smr-storage", bus_config, buckets=())
    # A grace of 0 would take the tests' own commits in flight for dead
    # writers (ClaimLost, seen under load); the GC test lowers it itself.
    svc = StorageService(storage_bus, store, keep=2, gc_grace_s=600, gc_interval_s=0.3)
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 10)
    yield svc
    svc.stop()
    await asyncio.wait_for(task, 10)
    await storage_bus.close()


async def commit(store: CheckpointStore, tmp_path: Path, ckpt: str, n: int,
                 namespace: str = NS) -> None:
    src = tmp_path / f"src-{ckpt}"
    (src / "images").mkdir(parents=True, exist_ok=True)
    (src / "images" / "pages-1.img").write_bytes(os.urandom(2048))
    for i in range(n):
        await store.commit(namespace, ckpt, src, {
            "request_id": f"{ckpt}-{i}", "node": "n1", "reason": "api",
            "target": Target.job(ckpt).to_dict(), "versions": {"criu": "4.1.1"}})


async def test_latest_and_generations_queries(
    bus: Bus, service: StorageService, store: CheckpointStore, tmp_path: Path
) -> None:
    ckpt = f"q-{uuid.uuid4().hex[:6]}"
    empty = await bus.query(QUERY_LATEST, StorageQuery(checkpoint_id=ckpt))
    assert empty.generations == [] and empty.error is None
    await commit(store, tmp_path, ckpt, 3)
    latest = await bus.query(QUERY_LATEST, StorageQuery(checkpoint_id=ckpt))
    assert [g["generation"] for g in latest.generations] == [3]
    assert latest.generations[0]["request_id"] == f"{ckpt}-2"
    assert latest.generations[0]["size_bytes"] == 2048
    every = await bus.query(QUERY_GENERATIONS, StorageQuery(checkpoint_id=ckpt))
    assert [g["generation"] for g in every.generations] == [1, 2, 3]


async def test_checkpoints_query_lists_the_latest_of_each_with_the_count(
    bus: Bus, service: StorageService, store: CheckpointStore, tmp_path: Path
) -> None:
    a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    await commit(store, tmp_path, a, 2)
    await commit(store, tmp_path, b, 1)
    reply = await bus.query(QUERY_CHECKPOINTS, StorageQuery())
    assert reply.error is None
    got = {g["checkpoint_id"]: g for g in reply.generations}
    assert got[a]["generation"] == 2 and got[a]["stored_generations"] == 2
    assert got[a]["request_id"] == f"{a}-1" and got[a]["namespace"] == NS
    assert got[b]["generation"] == 1 and got[b]["stored_generations"] == 1
    other = await bus.query(QUERY_CHECKPOINTS, StorageQuery(namespace="elsewhere"))
    assert other.generations == [] and other.error is None
    # latest/generations still need a checkpoint id: an error and a dead letter.
    bad = await bus.query(QUERY_LATEST, StorageQuery())
    assert bad.error and bad.error["code"] == "invalid-message"
    assert "checkpoint_id" in bad.error["message"]


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_storage_metrics_follow_what_storage_holds(
    bus: Bus, service: StorageService, store: CheckpointStore, tmp_path: Path, node: str
) -> None:
    ckpt = f"m-{uuid.uuid4().hex[:6]}"
    await commit(store, tmp_path, ckpt, 4)
    retired = sample("smr_storage_gc_actions_total", action="generation_retired")
    # A ckpt.done applies retention (keep=2) and makes the service read storage again.
    await bus.publish(CkptDone(request_id=f"{ckpt}-3", checkpoint_id=ckpt,
                               target=Target.job(ckpt), node=node, status="succeeded",
                               generation=4))
    every = await store.inventory()
    for _ in range(100):
        every = await store.inventory()
        if (len(every.get((NS, ckpt), [])) == 2
                and sample("smr_storage_generations") == sum(map(len, every.values()))):
            break
        await asyncio.sleep(0.1)
    kept = every[NS, ckpt]
    assert [g.number for g in kept] == [3, 4]
    assert sample("smr_storage_gc_actions_total", action="generation_retired") - retired == 2
    assert sample("smr_storage_stored_bytes") == sum(
        g.manifest["stored_bytes"] for gens in every.values() for g in gens)
    newest = sample("smr_latest_checkpoint_timestamp_seconds", checkpoint_namespace=NS,
                    checkpoint_id=ckpt)
    assert abs(newest - epoch(kept[-1].manifest["created_at"])) < 0.01
    # A checkpoint deleted from storage stops being reported at the next scan.
    await store.delete_checkpoint(NS, ckpt)
    await service.scan()
    assert metrics.REGISTRY.get_sample_value(
        "smr_latest_checkpoint_timestamp_seconds",
        {"checkpoint_namespace": NS, "checkpoint_id": ckpt}) is None


async def test_malformed_query_gets_an_error_and_a_dead_letter(
    bus: Bus, service: StorageService
) -> None:
    subj = f"{QUERY_LATEST}.local"
    r = await bus.nc.request(subj, b'{"checkpoint_id": "../etc"}', timeout=5)
    assert b'"error"' in r.data and b"schema_version" in r.data
    letters = await dlq_messages(bus, subj)
    assert letters and letters[-1].service == "storage"
    # ... and the service still answers.
    ok = await bus.query(QUERY_LATEST, StorageQuery(checkpoint_id="still-here"))
    assert ok.error is None


async def test_a_query_of_another_namespace_than_its_subject_is_refused(
    bus: Bus, service: StorageService, store: CheckpointStore, tmp_path: Path
) -> None:
    """The subject's namespace is what a tenant's NATS user may ask on; the
    query inside must not name another one."""
    await commit(store, tmp_path, "secret-ckpt", 1, namespace="team-b")
    q = StorageQuery(checkpoint_id="secret-ckpt", namespace="team-b")
    r = StorageReply.from_payload((await bus.nc.request(
        f"{QUERY_LATEST}.team-a", q.to_payload(), timeout=5)).data)
    assert r.error and r.error["code"] == "wrong-namespace" and not r.generations
    listing = StorageReply.from_payload((await bus.nc.request(
        f"{QUERY_CHECKPOINTS}.team-a", StorageQuery(namespace="team-b").to_payload(),
        timeout=5)).data)
    assert listing.error and listing.error["code"] == "wrong-namespace"
    mine = await bus.query(QUERY_LATEST, q)  # on storage.latest.team-b
    assert mine.error is None and [g["generation"] for g in mine.generations] == [1]


async def test_retention_runs_on_ckpt_done(
    bus: Bus, service: StorageService, store: CheckpointStore, tmp_path: Path, node: str
) -> None:
    ckpt = f"r-{uuid.uuid4().hex[:6]}"
    await commit(store, tmp_path, ckpt, 4)
    await bus.publish(CkptDone(request_id=f"{ckpt}-3", checkpoint_id=ckpt,
                               target=Target.job(ckpt), node=node, status="succeeded",
                               generation=4))
    for _ in range(100):
        if [g.number for g in await store.generations(NS, ckpt)] == [3, 4]:
            break
        await asyncio.sleep(0.1)
    assert [g.number for g in await store.generations(NS, ckpt)] == [3, 4]


async def test_gc_timer_removes_what_a_dead_writer_left(
    service: StorageService, store: CheckpointStore
) -> None:
    service.gc_grace_s = 0  # whatever is unfinished is a dead writer's here
    await store.backend.put_bytes(layout.claim_key(NS, "dead", 1), b"{}")
    up = store.backend.start_upload(layout.file_key(NS, "dead", 1, "images/pages-1.img"))
    await up.put_part(1, 0, b"half a dump")
    for _ in range(50):
        if not await store.backend.list("") and not await store.backend.pending_uploads(""):
            break
        await asyncio.sleep(0.1)
    assert await store.backend.list("") == []
    assert await store.backend.pending_uploads("") == []
    assert sample("smr_storage_gc_actions_total", action="upload_aborted") >= 1
    assert sample("smr_storage_gc_actions_total", action="generation_removed") >= 1
