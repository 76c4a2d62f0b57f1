"""Recovery never goes back in time and never trusts a dump a crash may have torn.

A checkpoint whose worker died between its dump and its commit is stored by
its recovery. A later checkpoint of the same job may have been committed
first: ``latest`` stays on the later dump, the recovered one is kept as a
generation and answered ``superseded``, and retention keeps the later one.
A recovery takes the job's lock again and beats for its request, so that a
later checkpoint waits for it. A finished dump from an earlier boot that was
never fsynced is refused, ``latest`` left where it was.

Real CRIU, a real nats-server and the real embedded node throughout; a
worker's death is a cancel injected right after the dump, a host crash a
page image cut short and a dump stamped with another boot id.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from services.checkpointer.step import CheckpointStep
from services.storage.layout import LOCAL_NAMESPACE
from smr.bus import KV_LOCKS, KV_STEPS, Progress
from smr.contract.messages import CkptDone, CkptRequested, Target
from smr.identity import booted_at
from smr.jobs import Job
from smr.process import netlock
from tests import nats_auth
from tests.test_local_smr import Harness, assert_continues, running

pytestmark = pytest.mark.criu


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       commit_deadline=20.0) as harness:
        yield harness


def ckpt_step(h: Harness) -> CheckpointStep:
    step = h.node.workers[0].step
    assert isinstance(step, CheckpointStep)
    return step


def request(h: Harness, job: Job, **kw: Any) -> CkptRequested:
    return CkptRequested(request_id=f"dumped-{uuid.uuid4().hex[:8]}", checkpoint_id=job.id,
                         target=Target.job(job.id), node=h.settings.node, **kw)


async def dump_then_die(step: CheckpointStep, req: CkptRequested) -> None:
    """``req`` runs until its dump has finished, then its worker dies (OOM,
    a rollout) before anything of it is stored: its dump stays on disk."""
    real = step.store.commit

    async def die_after_dump(ns: str, ckpt: str, src: Path, meta: dict[str, Any], *,
                             writer: Awaitable[Any] | None = None,
                             on_bytes: Callable[[int], None] | None = None) -> Any:
        if meta["request_id"] == req.request_id:
            assert writer is not None
            await writer
            raise asyncio.CancelledError
        return await real(ns, ckpt, src, meta, writer=writer, on_bytes=on_bytes)

    step.store.commit = die_after_dump  # type: ignore[method-assign]
    try:
        with pytest.raises(asyncio.CancelledError):
            await step.run(req, Progress())
    finally:
        step.store.commit = real  # type: ignore[method-assign]


async def test_a_recovered_dump_older_than_latest_is_kept_but_never_made_latest(
        h: Harness) -> None:
    """A's dump is taken, its worker dies; a later final checkpoint B of the
    same job is committed; then A's recovery stores A. ``latest`` stays on
    B, A is a generation of its own answered superseded, retention with
    one generation to keep keeps B, and a restore resumes at B's state."""
    step = ckpt_step(h)
    job = await h.start(16)
    a = request(h, job, leave_running=True)
    await dump_then_die(step, a)
    at_a = int(h.lines(job)[-1]["step"])
    await h.wait_step(job, at_a + 20)  # the job moves on well past A's state

    b = await h.checkpoint(job.id)  # final: the job ends
    assert b.status == "succeeded" and b.generation == 1, b.error
    at_b = int(h.lines(job)[-1]["step"])
    assert at_b >= at_a + 20

    recovered = await step.recover(a, {"state": "running", "heartbeat": 0})
    assert recovered is not None
    latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None
    assert (recovered.status, latest.number) == ("superseded", 1), \
        f"A answered {recovered.status} as generation {recovered.generation}; latest is " \
        f"generation {latest.number} ({latest.manifest['request_id']}), not B's"
    assert recovered.generation == 2 and recovered.error
    assert recovered.error["code"] == "superseded"
    stored = {g.number: g.manifest for g in await step.store.generations(LOCAL_NAMESPACE,
                                                                         job.id)}
    assert stored[2]["request_id"] == a.request_id  # kept as a generation
    assert stored[2]["dump"]["seq"] < stored[1]["dump"]["seq"]
    record, _ = await h.jobs.get(job.id)
    assert record.generation == 1  # the job's record names B

    # Retention keeping one generation never drops B because of A.
    assert await step.store.prune(LOCAL_NAMESPACE, job.id, keep=1) == [2]
    assert [g.number for g in await step.store.generations(LOCAL_NAMESPACE, job.id)] == [1]

    restored = await h.restore(job.id)
    assert restored.status == "succeeded" and restored.generation == 1, restored.error
    await h.wait_step(job, at_b + 2)
    assert_continues(h.lines(job), at_b, 16)


async def test_a_recovery_holds_the_job_lock_and_beats_for_its_request(
        h: Harness) -> None:
    """A request whose worker died is recovered by its redelivery: while the
    recovery works, the job's lock names the request and its step state is
    running with a fresh heartbeat, so a later checkpoint waits for it
    instead of taking the lock over from a holder that looks dead."""
    step = ckpt_step(h)
    job = await h.start(16)
    a = request(h, job, leave_running=True)
    await dump_then_die(step, a)
    kv = h.bus.kv(KV_STEPS)
    # What the dead worker left: its claim, stale.
    await kv.put(a.request_id, orjson.dumps({
        "state": "running", "owner": "dead-worker", "claim": "c0", "heartbeat": 0.0,
        "attempt": 1, "subject": "", "phase": "dump", "checkpoint_id": job.id}))
    entered, go_on = asyncio.Event(), asyncio.Event()
    real = step.recover

    async def held_open(req: CkptRequested, state: dict[str, Any]) -> Any:
        entered.set()
        await go_on.wait()
        return await real(req, state)

    step.recover = held_open  # type: ignore[method-assign]
    try:
        await h.bus.publish(a)
        await asyncio.wait_for(entered.wait(), 60)
        await asyncio.sleep(3 * h.node_bus.config.keepalive)  # beats would have come
        state = orjson.loads((await kv.get(a.request_id)).value)
        live = await h.lock._holder_active(a.request_id)
        beat_ago = time.time() - float(state.get("heartbeat", 0))
        assert state["state"] == "running" and live, \
            f"the recovered step looks dead: last heartbeat {beat_ago:.0f}s ago ({state})"
        assert state["owner"] != "dead-worker"
        go_on.set()
        done = await h.bus.wait_result(a.request_id, "ckpt.requested", timeout=120)
    finally:
        step.recover = real  # type: ignore[method-assign]
        go_on.set()
    assert done.status == "succeeded", done.error
    assert await h.lock.holder(job.id) is None  # released once answered


async def test_a_recovery_holds_the_lock_while_it_stores(h: Harness) -> None:
    """The recovery itself takes the job's lock back before it stores the dump."""
    step = ckpt_step(h)
    job = await h.start(16)
    a = request(h, job, leave_running=True)
    await dump_then_die(step, a)
    holders: list[str | None] = []
    real = step.store.commit

    async def watching(*args: Any, **kw: Any) -> Any:
        holders.append(await h.lock.holder(job.id))
        return await real(*args, **kw)

    step.store.commit = watching  # type: ignore[method-assign]
    try:
        done = await step.recover(a, {"state": "running", "heartbeat": 0})
    finally:
        step.store.commit = real  # type: ignore[method-assign]
    assert done is not None and done.status == "succeeded", done and done.error
    assert holders == [a.request_id], f"the job's lock was held by {holders} while storing"
    assert await h.lock.holder(job.id) is None


def crash_before_sync(step: CheckpointStep, req: CkptRequested, cut: int) -> Path:
    """The host crashed after ``req``'s dump, before its images were on
    disk, and came back: the largest page image lost its last ``cut``
    bytes, and the dump is from another boot, never said to be synced."""
    images = step.work_dir / req.request_id / "images"
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with pages.open("r+b") as f:
        f.truncate(pages.stat().st_size - cut)
    facts_file = step.work_dir / f"{req.request_id}.facts.json"
    facts = orjson.loads(facts_file.read_bytes())
    facts.pop("synced", None)
    facts["dump"] = {**facts.get("dump", {}), "boot_id": "an-earlier-boot"}
    facts_file.write_bytes(orjson.dumps(facts))
    return pages


async def with_a_good_generation(h: Harness) -> tuple[CheckpointStep, Job]:
    """A local checkpoint step and a job whose generation 1 is stored."""
    step = ckpt_step(h)
    job = await h.start(16)
    good = await h.checkpoint(job.id, leave_running=True)
    assert good.status == "succeeded" and good.generation == 1, good.error
    return step, job


async def refused_and_latest_kept(step: CheckpointStep, job: Job,
                                  req: CkptRequested) -> CkptDone:
    """Recovers ``req``'s dump found on disk; asserts it was refused
    (dump-unverified), dropped with CRIU's lock table of it (the job is gone:
    nothing takes its connections back), and ``latest`` left on generation 1."""
    table = netlock.table_of(step.work_dir / req.request_id / "images" / "dump.log")
    recovered = await step.recover(req, {"state": "running", "heartbeat": 0})
    latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None
    assert recovered is not None and (recovered.status, latest.number) == ("failed", 1), \
        f"recovered: {recovered and recovered.status} generation " \
        f"{recovered and recovered.generation}; latest -> {latest.number}"
    assert recovered.error and recovered.error["code"] == "dump-unverified", recovered.error
    assert not (step.work_dir / req.request_id).exists()
    assert [g.number for g in await step.store.generations(LOCAL_NAMESPACE, job.id)] == [1]
    if table is not None:  # the dump locked connections (the job kept any)
        listed = await asyncio.to_thread(subprocess.run, ["nft", "list", "table", "inet", table],
                                         capture_output=True)
        assert listed.returncode != 0, f"the refused dump's lock table {table} stays"
    return recovered


async def test_a_dump_torn_by_a_host_crash_is_refused_and_latest_kept(h: Harness) -> None:
    """A final dump finished, the host crashed before it was stored or on
    disk, its page image cut short: its recovery refuses it (dump-unverified)
    and ``latest`` stays on the good generation, which restores."""
    step, job = await with_a_good_generation(h)
    a = request(h, job)  # final
    await dump_then_die(step, a)
    h.cleanup()  # the host went down with the job
    await asyncio.sleep(0.5)
    crash_before_sync(step, a, 1 << 20)

    await refused_and_latest_kept(step, job, a)
    restored = await h.restore(job.id)
    assert restored.status == "succeeded" and restored.generation == 1, restored.error


def cut_page_image(step: CheckpointStep, req: CkptRequested, cut: int) -> Path:
    """``req``'s largest page image lost its last ``cut`` bytes (a crash
    before writeback; its stamp says this boot, and the facts say synced:
    neither vouches for the bytes)."""
    images = step.work_dir / req.request_id / "images"
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with pages.open("r+b") as f:
        f.truncate(pages.stat().st_size - cut)
    return pages


async def test_a_page_image_cut_short_is_refused_in_the_same_boot(h: Harness) -> None:
    """A final dump finished (its log says so), its worker died and the
    job is gone, and its page image lost its last MiB, with no reboot
    between and the dump marked synced: its recovery still refuses it
    (dump-unverified, naming the page image), drops it, and ``latest``
    stays on the good generation, which restores."""
    step, job = await with_a_good_generation(h)
    a = request(h, job)  # final
    await dump_then_die(step, a)
    h.cleanup()
    await asyncio.sleep(0.5)
    pages = cut_page_image(step, a, 1 << 20)

    recovered = await refused_and_latest_kept(step, job, a)
    assert pages.name in recovered.error["message"] and "not whole" in \
        recovered.error["message"], recovered.error
    assert "latest stored generation is kept" in recovered.error["hint"], recovered.error
    assert not (step.work_dir / f"{a.request_id}.facts.json").exists()
    restored = await h.restore(job.id)
    assert restored.status == "succeeded" and restored.generation == 1, restored.error


async def test_a_cut_dump_of_a_running_job_is_dropped_and_dumped_again(h: Harness) -> None:
    """A heartbeat's dump finished and its worker died; the job runs on.
    Its page image cut short, the recovery stores nothing and hands the
    request back to be dumped again (None); run again, it dumps the running
    job afresh, and that whole dump becomes ``latest``."""
    step, job = await with_a_good_generation(h)
    a = request(h, job, leave_running=True)
    await dump_then_die(step, a)
    cut_page_image(step, a, 4096)

    recovered = await step.recover(a, {"state": "running", "heartbeat": 0})
    latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None
    assert recovered is None and latest.number == 1, \
        f"recovered: {recovered and recovered.status} generation " \
        f"{recovered and recovered.generation}; latest -> {latest.number}"
    assert not (step.work_dir / a.request_id).exists()
    assert job.alive()
    at = int(h.lines(job)[-1]["step"])
    await h.wait_step(job, at + 2)  # running, not left stopped

    again = await step.run(a, Progress())
    assert again.status == "succeeded" and again.generation == 2, again.error
    latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None and latest.number == 2


@pytest.mark.parametrize("stamped", [True, False], ids=["stamped", "older-smr-unstamped"])
async def test_a_whole_unsynced_dump_from_an_earlier_boot_is_refused(
        h: Harness, stamped: bool) -> None:
    """Sizes prove nothing across a reboot (the page cache may have held
    pages the disk never got, or the file system shows zeros): a dump
    whose images are whole but that was taken in another boot and never
    fsynced is refused and dropped, ``latest`` unchanged. A stamp with the
    boot id says so; facts written by an older smr, with no stamp, are
    judged by when CRIU wrote dump.log against the boot's start."""
    step, job = await with_a_good_generation(h)
    a = request(h, job)  # final
    await dump_then_die(step, a)
    h.cleanup()
    facts_file = step.work_dir / f"{a.request_id}.facts.json"
    facts = orjson.loads(facts_file.read_bytes())
    facts.pop("synced", None)
    if stamped:
        facts["dump"]["boot_id"] = "an-earlier-boot"
    else:
        del facts["dump"]
        log = step.work_dir / a.request_id / "images" / "dump.log"
        before = booted_at() - 3600
        os.utime(log, (before, before))
    facts_file.write_bytes(orjson.dumps(facts))

    recovered = await refused_and_latest_kept(step, job, a)
    assert "before the host restarted" in recovered.error["message"], recovered.error


async def test_a_synced_dump_from_an_earlier_boot_is_stored(h: Harness) -> None:
    """A dump whose images were fsynced before the host went down is on
    disk whole: its recovery after the restart stores it."""
    step = ckpt_step(h)
    job = await h.start(16)
    a = request(h, job)  # final
    await dump_then_die(step, a)
    h.cleanup()
    facts_file = step.work_dir / f"{a.request_id}.facts.json"
    facts = orjson.loads(facts_file.read_bytes())
    assert facts.get("synced") is True  # fsynced when the worker stopped
    facts["dump"]["boot_id"] = "an-earlier-boot"
    facts_file.write_bytes(orjson.dumps(facts))

    recovered = await step.recover(a, {"state": "running", "heartbeat": 0})
    assert recovered is not None and recovered.status == "succeeded", \
        recovered and recovered.error
    latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None and latest.number == recovered.generation


async def test_dumps_after_the_lock_bucket_is_made_again_are_later_than_its_old_ones(
        h: Harness, nats_users: nats_auth.SecuredNats) -> None:
    """NATS loses the lock bucket while the node runs, and a service that
    starts makes it again: its revisions start over. A final checkpoint
    taken after that is the job's latest state: answered succeeded, named
    by ``latest``, stamped with the new bucket, and the restore resumes
    from it, not from a checkpoint taken before."""
    job = await h.start(16)
    for n in (1, 2):  # the old bucket's sequences grow past the new one's first
        done = await h.checkpoint(job.id, leave_running=True)
        assert done.status == "succeeded" and done.generation == n, done.error
    store = ckpt_step(h).store
    old = (await store.get(LOCAL_NAMESPACE, job.id, 2)).manifest["dump"]

    await h.bus.js.delete_key_value(KV_LOCKS)
    await asyncio.sleep(1.1)  # a creation time of its own (whole seconds on some servers)
    remade = await nats_users.connect("smr-admin")  # it makes the missing bucket, as it starts
    await remade.close()

    final = await h.checkpoint(job.id)
    at_final = int(h.lines(job)[-1]["step"])
    latest = await store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None
    assert (final.status, latest.number) == ("succeeded", 3), \
        f"the final checkpoint after the bucket was made again: {final.status} " \
        f"({final.error and final.error['code']}) as generation {final.generation}; latest is " \
        f"generation {latest.number}, dumped at {latest.manifest['dump']} (the final one's " \
        f"stamp: {(await store.get(LOCAL_NAMESPACE, job.id, 3)).manifest['dump']})"
    assert latest.manifest["dump"]["lock_epoch"] != old["lock_epoch"]

    restored = await h.restore(job.id)
    assert restored.status == "succeeded" and restored.generation == 3, restored.error
    await h.wait_step(job, at_final + 2)
    assert_continues(h.lines(job), at_final, 16)
