"""The per-job lock: one step at a time, never stuck after a crash."""

from __future__ import annotations

import time
import uuid

import orjson
import pytest

from smr.bus import KV_JOBS, KV_LOCKS, KV_STEPS, Bus
from smr.contract.errors import TemporaryError
from smr.jobs import Job, JobLock, JobRegistry


@pytest.fixture
def lock(bus: Bus) -> JobLock:
    return JobLock(bus.kv(KV_LOCKS), bus.kv(KV_STEPS), wait_s=1.0, poll_s=0.1)


async def test_second_request_waits_while_the_first_runs(bus: Bus, lock: JobLock, node: str
                                                         ) -> None:
    job = f"j-{node}"
    await bus.kv(KV_STEPS).put(f"a-{node}", orjson.dumps(
        {"state": "running", "heartbeat": time.time() + 60}))  # alive throughout
    await lock.acquire(job, f"a-{node}")
    told: list[str] = []
    with pytest.raises(TemporaryError) as e:
        await lock.acquire(job, f"b-{node}", told.append)  # waits wait_s, then gives up
    assert e.value.code == "job-busy" and told == [f"a-{node}"]
    await lock.acquire(job, f"a-{node}")  # the holder's own retry takes it again
    await lock.release(job, f"a-{node}")
    await lock.acquire(job, f"b-{node}")
    assert await lock.holder(job) == f"b-{node}"


async def test_lock_of_a_dead_step_is_taken_over(bus: Bus, lock: JobLock, node: str) -> None:
    job = f"j-{node}"
    await bus.kv(KV_STEPS).put(f"dead-{node}", orjson.dumps({"state": "failed"}))
    await lock.acquire(job, f"dead-{node}")  # its worker died without releasing
    await lock.acquire(job, f"next-{node}")
    assert await lock.holder(job) == f"next-{node}"
    await lock.release(job, f"dead-{node}")  # a late release by the old holder is a no-op
    assert await lock.holder(job) == f"next-{node}"


async def test_lock_of_a_step_whose_worker_stopped_beating_is_taken_over(
        bus: Bus, lock: JobLock, node: str) -> None:
    job = f"j-{node}"
    await bus.kv(KV_STEPS).put(f"silent-{node}", orjson.dumps(
        {"state": "running", "heartbeat": time.time() - 3600}))  # its worker died
    await lock.acquire(job, f"silent-{node}")
    await lock.acquire(job, f"next-{node}")
    assert await lock.holder(job) == f"next-{node}"


async def test_the_registry_lists_its_jobs_without_a_consumer_deleted_ones_left_out(
        bus: Bus) -> None:
    """`smr ps` as a node's user: the keys come from STREAM.INFO (a node's user
    may create no consumer on smr-jobs, docs/security.md); a deleted job's
    tombstone is listed as a key, and the registry leaves it out."""
    key = b"k" * 32
    reg = JobRegistry(bus.kv(KV_JOBS), key)
    tag = uuid.uuid4().hex[:6]
    ids = [f"ps-{tag}-{i}" for i in range(3)]
    for i in ids:
        await reg.put(Job(id=i, cmd=["true"], cwd="/", log="/dev/null", node="n"))
        await reg.put(Job(id=i, cmd=["true"], cwd="/", log="/dev/null", node="n"))  # history
    await reg.delete(ids[1])
    keys = await bus.kv_keys(KV_JOBS)
    assert set(ids) <= set(keys) and len(keys) == len(set(keys))
    assert [j.id for j in await reg.all(keys) if j.id.startswith(f"ps-{tag}")] == [
        ids[0], ids[2]]
