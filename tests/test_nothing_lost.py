"""Nothing lost below the retries: storage failing after the dump,
crashes between commit steps, GPU state left suspended by a dead worker,
lock contention, lock release races, exhausted advisories for live steps,
and what the bus keeps for ever.

Real CRIU, a real nats-server and the real embedded node throughout. Faults
are injected at the storage backend, beneath every retry the client makes, as
an S3 server that keeps failing would look. The GPU cases use a **stand-in**
CUDA driver (``StandInDriver``): it keeps each process's checkpoint state in
memory, as the real driver reports it, so the recovery paths that must bring
a job's GPU back to running can be checked on a machine without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from services.checkpointer.step import CheckpointStep
from services.restorer.step import IDENTITY, RestoreStep
from services.storage.backend import StorageError
from services.storage.layout import LOCAL_NAMESPACE
from smr.bus import KV_LOCKS, KV_STEPS, STREAM_EVENTS, STREAM_REQUESTS, Bus, Progress, Worker
from smr.bus.exhausted import Exhausted
from smr.contract.messages import CkptDone, CkptRequested, RestoreRequested, Target
from smr.gpu import gpuinfo
from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.gpu.driver import CudaError, CudaState
from smr.identity import ProcessIdentity
from smr.jobs import JobLock
from tests import nats_auth
from tests.helpers.steplocks import hold_lock, node_locks
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


def restore_step(h: Harness) -> RestoreStep:
    step = h.node.workers[1].step
    assert isinstance(step, RestoreStep)
    return step


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, T...), or 'gone'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


class FailingPuts:
    """Makes the storage backend's ``put_bytes`` fail for keys that contain
    ``part``, ``times`` times (or always), as a store that answers with errors
    after the client's own retries would; ``seen`` records the job's state at
    each failure."""

    def __init__(self, backend: Any, part: str, times: int | None, watch: int = 0) -> None:
        self.backend, self.part, self.left, self.watch = backend, part, times, watch
        self.real = backend.put_bytes
        self.seen: list[str] = []
        backend.put_bytes = self.put_bytes

    async def put_bytes(self, key: str, data: bytes, **kw: Any) -> str:
        if self.part in key and (self.left is None or self.left > 0):
            if self.left is not None:
                self.left -= 1
            if self.watch:
                self.seen.append(proc_state(self.watch))
            raise StorageError(f"injected: S3 500 on {key}", hint="a test fault")
        return await self.real(key, data, **kw)

    def restore(self) -> None:
        self.backend.put_bytes = self.real


# -- 2. a storage error after the dump -------------------------------------------------

@pytest.mark.parametrize("where", ["/claim", "manifest.json", "/latest"])
async def test_a_final_checkpoint_outlives_a_storage_outage_after_its_dump(
        h: Harness, where: str) -> None:
    """The store fails (past its retries) after CRIU has dumped the job: the
    checkpoint is committed from the finished dump once the store is back,
    never started over; the job is kept stopped, not killed, until then."""
    job = await h.start(32)
    fault = FailingPuts(ckpt_step(h).store.backend, where, times=3, watch=job.pid)
    try:
        done = await h.checkpoint(job.id)
    finally:
        fault.restore()
    assert done.status == "succeeded", done.error
    assert fault.seen and fault.left == 0, "the fault never fired"
    if where != "/claim":  # the claim is taken while CRIU still dumps
        assert set(fault.seen) == {"T"}, f"the job must be held stopped: {fault.seen}"
    assert proc_state(job.pid) == "gone"  # killed once the checkpoint was durable
    latest = await ckpt_step(h).store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None and latest.number == done.generation
    frozen = int(h.lines(job)[-1]["step"])
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 32)
    assert not (ckpt_step(h).work_dir / done.request_id).exists()


async def test_a_final_checkpoint_that_cannot_be_stored_leaves_the_job_running(
        h: Harness) -> None:
    """The store stays down past the commit deadline: the request fails and
    says why, and the job, held stopped meanwhile, runs on where it was."""
    job = await h.start(32)
    fault = FailingPuts(ckpt_step(h).store.backend, "manifest.json", times=None,
                        watch=job.pid)
    try:
        done = await h.checkpoint(job.id)
    finally:
        fault.restore()
    assert done.status == "failed" and done.error
    assert done.error["code"] == "storage-unavailable", done.error
    assert "keeps running" in done.error["message"]
    assert "T" in fault.seen
    record, _ = await h.jobs.get(job.id)
    assert record.alive() and proc_state(job.pid) in ("R", "S")
    at = int(h.lines(job)[-1]["step"])
    await h.wait_step(job, at + 2)  # it goes on counting
    assert not (ckpt_step(h).work_dir / done.request_id).exists()
    assert await ckpt_step(h).store.latest(LOCAL_NAMESPACE, job.id) is None


# -- 5. recovery after the manifest, before latest ------------------------------------

async def test_recovery_of_a_commit_that_stopped_before_latest_moves_latest(
        h: Harness) -> None:
    step = ckpt_step(h)
    job = await h.start(32)
    first = await h.checkpoint(job.id, leave_running=True)
    assert first.status == "succeeded" and first.generation == 1
    req = CkptRequested(request_id=f"crashed-{job.id}", checkpoint_id=job.id,
                        target=Target.job(job.id), node=h.settings.node)
    # The worker dies right after the manifest of generation 2: latest stays at 1.
    work = step.work_dir / req.request_id
    await step.criu.dump(job.pid, work / "images")
    real = step.store._advance_latest

    async def crash(*a: Any) -> None:
        raise asyncio.CancelledError

    step.store._advance_latest = crash  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await step.store.commit(LOCAL_NAMESPACE, job.id, work, {
            "request_id": req.request_id, "node": h.settings.node, "reason": "api",
            "target": req.target.to_dict(), "leave_running": False, "pre_dump": False,
            "versions": {}, "gpu": None, "job": {"cmd": job.cmd, "cwd": job.cwd,
                                                 "log": job.log, "tcp": job.tcp}})
    step.store._advance_latest = real  # type: ignore[method-assign]
    assert (await step.store.latest(LOCAL_NAMESPACE, job.id)).number == 1  # type: ignore[union-attr]

    result = await step.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded" and result.generation == 2
    assert (await step.store.latest(LOCAL_NAMESPACE, job.id)).number == 2  # type: ignore[union-attr]
    record, _ = await h.jobs.get(job.id)
    assert record.generation == 2 and record.state == "checkpointed"
    assert not work.exists()
    frozen = int(h.lines(job)[-1]["step"])
    restored = await h.restore(job.id)  # the latest: generation 2, not 1
    assert restored.status == "succeeded" and restored.generation == 2
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 32)


# -- 6, 7. CUDA state through recovery (a stand-in driver) -----------------------------

class StandInDriver:
    """A **stand-in** for the CUDA driver's checkpoint API (smr.gpu.cuda_checkpoint.
    Driver): per-process states with the real state machine (RUNNING →
    LOCKED → CHECKPOINTED → LOCKED → RUNNING), for processes registered as
    holding a CUDA context. No GPU is touched. ``restored_onto`` records
    each restore's pid and the GPU pairs it was given (None: none, the
    checkpointed GPUs)."""

    def __init__(self) -> None:
        self.states: dict[int, CudaState] = {}
        self.restored_onto: list[tuple[int, list[tuple[str, str]] | None]] = []

    def state(self, pid: int) -> CudaState | None:
        return self.states.get(pid)

    def _move(self, pid: int, frm: CudaState, to: CudaState) -> None:
        assert self.states.get(pid) is frm, f"{pid}: {self.states.get(pid)} is not {frm}"
        self.states[pid] = to

    def lock(self, pid: int, timeout_s: float) -> None:
        self._move(pid, CudaState.RUNNING, CudaState.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._move(pid, CudaState.LOCKED, CudaState.CHECKPOINTED)

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        self._move(pid, CudaState.CHECKPOINTED, CudaState.LOCKED)
        self.restored_onto.append((pid, gpu_pairs))

    def unlock(self, pid: int) -> None:
        self._move(pid, CudaState.LOCKED, CudaState.RUNNING)

    def restore_tid(self, pid: int) -> int | None:
        """The thread the driver restores through (the main one, as driver
        580's); a process not registered has no CUDA context."""
        if pid not in self.states:
            raise CudaError(f"cuCheckpointProcessGetRestoreThreadId({pid}) failed: no CUDA "
                            "context (stand-in driver)")
        return pid


def with_stand_in_gpu(step: Any) -> StandInDriver:
    drv = StandInDriver()
    step.cuda = CudaCheckpoint(drv)  # type: ignore[arg-type]
    return drv


async def test_recovery_of_a_heartbeat_brings_the_gpu_back_to_running(h: Harness) -> None:
    """The worker died after suspending the job's GPU, while CRIU finished a
    leave-running dump: recovery commits it and resumes the GPU."""
    step = ckpt_step(h)
    drv = with_stand_in_gpu(step)
    job = await h.start(32)
    drv.states[job.pid] = CudaState.RUNNING
    req = CkptRequested(request_id=f"hb-{job.id}", checkpoint_id=job.id,
                        target=Target.job(job.id), node=h.settings.node, leave_running=True)
    # As run() leaves things when its worker is SIGKILLed after the dump:
    await step._prepare(req, await h.jobs.find(job.id), step._work(req))  # type: ignore[arg-type]
    await step.cuda.suspend_all([job.pid])  # type: ignore[union-attr]
    await step.criu.dump(job.pid, step._work(req) / "images", leave_running=True)
    assert drv.states[job.pid] is CudaState.CHECKPOINTED

    result = await step.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded", result
    assert drv.states[job.pid] is CudaState.RUNNING, "left suspended: it would hang"
    gen = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert gen is not None and gen.manifest["gpu"] is not None  # the facts survived


async def stopped_mid_commit(step: CheckpointStep, req: CkptRequested) -> None:
    """Run ``req`` until its images are uploaded and its manifest is on its
    way, then cancel it there, as `smr up` stopping does."""
    started = asyncio.Event()
    real = step.store.backend.put_bytes

    async def hang(key: str, data: bytes, **kw: Any) -> str:
        if key.endswith("manifest.json"):
            started.set()
            await asyncio.sleep(3600)
        return await real(key, data, **kw)

    step.store.backend.put_bytes = hang  # type: ignore[method-assign]
    task = asyncio.create_task(step.run(req, Progress()))
    try:
        await asyncio.wait_for(started.wait(), 60)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        step.store.backend.put_bytes = real  # type: ignore[method-assign]


async def test_a_cancelled_commit_keeps_the_facts_for_its_recovery(h: Harness) -> None:
    """``smr up`` stopped mid-upload of a GPU checkpoint: the commit that
    recovery makes later still records the GPU (else its restore would skip
    the GPU checks and the driver's restore)."""
    step = ckpt_step(h)
    drv = with_stand_in_gpu(step)
    job = await h.start(32)
    drv.states[job.pid] = CudaState.RUNNING
    req = CkptRequested(request_id=f"stop-{job.id}", checkpoint_id=job.id,
                        target=Target.job(job.id), node=h.settings.node)
    await stopped_mid_commit(step, req)
    assert step._facts_file(req).is_file()
    result = await step.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded", result
    gen = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert gen is not None and gen.manifest["gpu"] is not None
    assert proc_state(job.pid) == "gone"  # a final checkpoint: stopped for good once stored
    assert not step._facts_file(req).exists()


async def restored_by_criu_alone(h: Harness, ck: Any, rs: Any, gen: Any,
                                 job: Any) -> tuple[str, int]:
    """A restore's request id and the process CRIU brought back for it from
    ``gen``, as a worker that died right after CRIU leaves it."""
    rid = uuid.uuid4().hex
    work = rs.work_dir / rid
    await ck.store.fetch(gen, work)
    await rs.criu.restore(work / "images", pidfile=work / "restored.pid",
                          inherit={job.log: os.open(job.log, os.O_WRONLY | os.O_APPEND)})
    pid = int((work / "restored.pid").read_text())
    h.pids.append(pid)
    ident = ProcessIdentity.of(pid)  # what the restore writes the moment CRIU returns
    assert ident is not None
    ident.write(work / IDENTITY)
    return rid, pid



async def test_recovery_of_a_restore_brings_the_gpu_back_to_running(h: Harness) -> None:
    """The worker died after CRIU restored a GPU job, before the driver's
    restore: recovery finds the process and brings its GPU state back."""
    ck, rs = ckpt_step(h), restore_step(h)
    drv = with_stand_in_gpu(ck)
    rs.cuda = ck.cuda
    job = await h.start(32)
    drv.states[job.pid] = CudaState.RUNNING
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    gen = await ck.store.latest(LOCAL_NAMESPACE, job.id)
    assert gen is not None and gen.manifest["gpu"] is not None
    # CRIU brings the process back CHECKPOINTED; the worker dies there.
    rid, pid = await restored_by_criu_alone(h, ck, rs, gen, job)
    drv.states[pid] = CudaState.CHECKPOINTED
    req = RestoreRequested(request_id=rid, checkpoint_id=job.id, target=Target.job(job.id),
                           node=h.settings.node)

    result = await rs.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded" and result.pid == pid
    assert drv.states[pid] is CudaState.RUNNING, "left checkpointed: it would hang"


# -- 6b. which GPU a restore puts GPU state onto (stand-in driver) ------------------------

MIB = 1 << 20
H200 = "NVIDIA H200"
GPU_UUIDS = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-00000000000{i}" for i in range(2)]


def a_gpu(i: int, model: str = H200) -> dict[str, Any]:
    return {"index": i, "uuid": GPU_UUIDS[i], "model": model, "minor": i,
            "memory_total": 1 << 40, "memory_free": 1 << 39, "processes": {}}


async def restore_after_gpu_checkpoint(h: Harness, monkeypatch: pytest.MonkeyPatch,
                                       here: list[dict[str, Any]], **kw: Any
                                       ) -> tuple[Any, Any, StandInDriver, list[Path], int]:
    """A job whose (stand-in) GPU state was on GPU 0, checkpointed, then
    restored on a node whose GPUs are ``here`` (real CRIU; the process comes
    back CHECKPOINTED, as the driver's checkpoint left it)."""
    ck, rs = ckpt_step(h), restore_step(h)
    drv = with_stand_in_gpu(ck)
    rs.cuda = ck.cuda
    record = {"model": H200, "count": 1, "used_bytes": 64 * MIB, "devices": [
        {"uuid": GPU_UUIDS[0], "model": H200, "memory_total": 1 << 40,
         "used_bytes": 64 * MIB}]}
    monkeypatch.setattr(gpuinfo, "job_gpus", lambda pids: record if pids else None)
    job = await h.start(32)
    drv.states[job.pid] = CudaState.RUNNING
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    frozen = int(h.lines(job)[-1]["step"])
    criu_ran: list[Path] = []
    real = rs.criu.restore

    async def criu_restore(images: Path, *, pidfile: Path, **kw: Any) -> Any:
        criu_ran.append(pidfile)
        run = await real(images, pidfile=pidfile, **kw)
        drv.states[int(pidfile.read_text())] = CudaState.CHECKPOINTED
        return run

    monkeypatch.setattr(rs.criu, "restore", criu_restore)
    monkeypatch.setattr(gpuinfo, "devices", lambda: here)
    restored = await h.restore(job.id, **kw)
    return job, restored, drv, criu_ran, frozen


@pytest.mark.parametrize("how", ["same", "node", "--gpus"])
async def test_a_restore_passes_the_driver_pairs_only_onto_another_gpu(
        h: Harness, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``same``: the node has the GPU it was checkpointed on: no pairs, the
    driver's call as before pairs; ``node``: this node lacks that GPU;
    ``--gpus``: it has it, and the user names the other."""
    here, kw, pairs = {
        "same": ([a_gpu(0), a_gpu(1)], {}, None),
        "node": ([a_gpu(1)], {}, [(GPU_UUIDS[0], GPU_UUIDS[1])]),
        "--gpus": ([a_gpu(0), a_gpu(1)], {"gpus": [GPU_UUIDS[1]]},
                   [(GPU_UUIDS[0], GPU_UUIDS[1])]),
    }[how]
    job, restored, drv, _, frozen = await restore_after_gpu_checkpoint(h, monkeypatch, here,
                                                                       **kw)
    assert restored.status == "succeeded", restored.error
    # A dump attempt that failed and was retried (CRIU's transient errors
    # are) gave the original its GPU state back where it was: no pairs.
    assert restored.pid != job.pid
    back = [(pid, given) for pid, given in drv.restored_onto if pid == job.pid]
    assert all(given is None for _, given in back), back
    assert [r for r in drv.restored_onto if r[0] != job.pid] == [(restored.pid, pairs)]
    assert drv.states[restored.pid] is CudaState.RUNNING
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 32)


@pytest.mark.parametrize("how", ["model", "--gpus"])
async def test_a_gpu_mismatch_is_refused_before_criu_runs(
        h: Harness, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``model``: the node's GPU is another model; ``--gpus``: names a GPU
    this node lacks. Refused before CRIU restores anything; nothing runs."""
    here, kw = ([a_gpu(1, model="NVIDIA H100 80GB HBM3")], {}) if how == "model" else (
        [a_gpu(0)], {"gpus": [GPU_UUIDS[1]]})
    job, restored, drv, criu_ran, _ = await restore_after_gpu_checkpoint(h, monkeypatch,
                                                                         here, **kw)
    assert restored.status == "failed"
    assert restored.error and restored.error["code"] == (
        "gpu-mismatch" if how == "model" else "invalid-gpu"), restored.error
    assert GPU_UUIDS[1] in restored.error["message"], restored.error
    assert criu_ran == [] and drv.restored_onto == []
    record = await h.jobs.find(job.id)
    assert record is not None and not record.alive()
    assert not (restore_step(h).work_dir / restored.request_id).exists()


async def test_recovery_of_a_restore_whose_gpu_state_is_back_keeps_the_process(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker died after the driver put the GPU state back (the process
    RUNNING, holding its GPU memory), before the job was recorded (`smr up`
    stopped there): recovery records that process. The GPU's free memory
    it holds itself is room for it, not a reason to refuse: refused, it was
    killed and restored a second time from the checkpoint."""
    ck, rs = ckpt_step(h), restore_step(h)
    drv = with_stand_in_gpu(ck)
    rs.cuda = ck.cuda
    used = 64 * MIB  # of a GPU of 80 MiB: too much for the 16 MiB it leaves free
    record = {"model": H200, "count": 1, "used_bytes": used, "devices": [
        {"uuid": GPU_UUIDS[0], "model": H200, "memory_total": 80 * MIB, "used_bytes": used}]}
    monkeypatch.setattr(gpuinfo, "job_gpus", lambda pids: record if pids else None)
    job = await h.start(32)
    drv.states[job.pid] = CudaState.RUNNING
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    gen = await ck.store.latest(LOCAL_NAMESPACE, job.id)
    assert gen is not None and gen.manifest["gpu"]["devices"][0]["uuid"] == GPU_UUIDS[0]
    rid, pid = await restored_by_criu_alone(h, ck, rs, gen, job)
    drv.states[pid] = CudaState.RUNNING  # the driver's restore and unlock were done
    # The node's one GPU, as NVML shows it now: the restored process holds its memory.
    gpu = {**a_gpu(0), "memory_total": 80 * MIB, "memory_free": 16 * MIB,
           "processes": {pid: used}}
    monkeypatch.setattr(gpuinfo, "devices", lambda: [gpu])
    req = RestoreRequested(request_id=rid, checkpoint_id=job.id, target=Target.job(job.id),
                           node=h.settings.node)

    result = await rs.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded" and result.pid == pid, result
    assert proc_state(pid) not in ("gone", "Z"), "the restored process was killed"
    assert drv.restored_onto == []  # nothing restored twice
    record_now = await h.jobs.find(job.id)
    assert record_now is not None and record_now.pid == pid


# -- 10. a restore during a long checkpoint --------------------------------------------

async def test_a_restore_waits_for_a_long_step_on_its_job_without_blocking_others(
        h: Harness) -> None:
    busy = await h.start(16)
    other = await h.start(16)
    for j in (busy, other):
        assert (await h.checkpoint(j.id)).status == "succeeded"
    stop = asyncio.Event()
    holder = asyncio.create_task(hold_lock(h.bus, busy.id, "long-ckpt", stop))
    try:
        waiting = asyncio.create_task(h.restore(busy.id))
        await asyncio.sleep(1.0)
        # Another job's restore on the same node goes through meanwhile.
        quick = await asyncio.wait_for(h.restore(other.id), 60)
        assert quick.status == "succeeded", quick.error
        await asyncio.sleep(20)  # longer than every retry of a job-busy request
        assert not waiting.done(), f"gave up on a busy job: {waiting.result()}"
    finally:
        stop.set()
        await holder
    restored = await asyncio.wait_for(waiting, 60)
    assert restored.status == "succeeded", restored.error


# -- 12. lock release races ------------------------------------------------------------

async def test_a_lock_release_that_loses_a_race_is_not_an_error(bus: Bus) -> None:
    """Between release's read and its delete another request takes the lock
    over: nats-server answers the delete with 10071 (wrong last sequence),
    which nats-py raises as BadRequestError. Nothing failed: no error."""
    lock = JobLock(bus.kv(KV_LOCKS), bus.kv(KV_STEPS))
    job = f"job-{uuid.uuid4().hex[:6]}"
    await lock.acquire(job, "mine")
    kv = bus.kv(KV_LOCKS)
    real_get = kv.get

    async def get_then_taken_over(key: str, *a: Any, **kw: Any) -> Any:
        entry = await real_get(key, *a, **kw)
        await kv.put(key, orjson.dumps({"request_id": "theirs", "at": time.time()}))
        return entry

    kv.get = get_then_taken_over  # type: ignore[method-assign]
    try:
        await lock.release(job, "mine")
    finally:
        kv.get = real_get  # type: ignore[method-assign]
    assert await lock.holder(job) == "theirs"  # their lock stands


# -- 13. exhausted advisories and two consumers ----------------------------------------

async def test_an_exhausted_advisory_never_fails_a_step_that_is_alive(
        bus: Bus, node: str) -> None:
    rid = f"alive-{uuid.uuid4().hex[:6]}"
    req = CkptRequested(request_id=rid, checkpoint_id="ck", target=Target.job("j"), node=node)
    ack = await bus.publish(req)
    await bus.kv(KV_STEPS).put(rid, orjson.dumps(
        {"state": "running", "owner": "another", "heartbeat": time.time(),
         "subject": f"ckpt.requested.{node}", "checkpoint_id": "ck"}))
    recorded: list[Any] = []

    async def record(result: Any, **kw: Any) -> None:
        recorded.append(result)

    acted: list[str] = []
    advisory = SimpleNamespace(
        data=orjson.dumps({"stream_seq": ack.seq, "deliveries": 5}),
        ack=lambda: _note(acted, "ack"), nak=lambda delay=None: _note(acted, "nak"))
    await Exhausted(bus, "ckpt.requested", "test", node, record,  # no lock held: by heartbeat
                    node_locks(node))._answer_one(advisory)  # type: ignore[arg-type]
    assert recorded == [], "a live step was answered as failed"
    state, _ = await bus.step_state(rid)
    assert state and state["state"] == "running"
    assert acted == ["nak"], "the advisory is looked at again later, not dropped"


async def _note(acted: list[str], what: str) -> None:
    acted.append(what)


async def test_an_answer_stored_but_not_published_on_the_last_delivery_is_published(
        bus: Bus, node: str) -> None:
    """A worker stores its answer, then publishes it. Dying between the two on
    the request's last delivery, it leaves the answer unannounced: no
    redelivery comes to publish it again, and the consumers of results (a
    drain's wait, the retention, a requester's subscription) never see it.
    The handler of what JetStream gave up on finds the answer stored: it must
    publish it, not only drop the advisory."""
    rid = f"unannounced-{uuid.uuid4().hex[:6]}"
    req = CkptRequested(request_id=rid, checkpoint_id="ck", target=Target.job("j"), node=node)
    ack = await bus.publish(req)
    done = CkptDone.for_request(req, status="succeeded", generation=2)
    await bus.kv(KV_STEPS).put(rid, orjson.dumps(
        {"state": "done", "kind": "ckpt.requested", "result": done.to_dict(),
         "finished": time.time()}))
    subj = f"ckpt.done.{node}.local"
    before = await _count(bus, subj)
    acted: list[str] = []
    advisory = SimpleNamespace(
        data=orjson.dumps({"stream_seq": ack.seq, "deliveries": 5}),
        ack=lambda: _note(acted, "ack"), nak=lambda delay=None: _note(acted, "nak"))

    async def record(result: Any, **kw: Any) -> None:
        raise AssertionError("an answered request was answered again")

    await Exhausted(bus, "ckpt.requested", "test", node, record,
                    node_locks(node))._answer_one(advisory)  # type: ignore[arg-type]
    assert await _count(bus, subj) == before + 1, "the stored answer was never published"
    assert acted == ["ack"]


async def test_a_real_result_after_a_failed_one_is_still_published(bus: Bus, node: str) -> None:
    rid = f"late-{uuid.uuid4().hex[:6]}"
    req = CkptRequested(request_id=rid, checkpoint_id="ck", target=Target.job("j"), node=node)
    subj = f"ckpt.done.{node}.local"
    before = await _count(bus, subj)
    await bus.publish(CkptDone.for_request(req, status="failed", error={
        "code": "deliveries-exhausted", "message": "gave up"}))
    await bus.publish(CkptDone.for_request(req, status="succeeded", generation=3))
    assert await _count(bus, subj) == before + 2


async def _count(bus: Bus, subj: str) -> int:
    info = await bus.js.stream_info(STREAM_EVENTS, subjects_filter=subj)
    return int((info.state.subjects or {}).get(subj, 0))


class Slow:
    kind = "ckpt.requested"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = asyncio.Event()

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.started.set()
        await asyncio.sleep(self.seconds)
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


async def test_a_keepalive_never_overwrites_another_owners_claim(bus: Bus, node: str) -> None:
    step = Slow(4 * bus.config.keepalive + 1)
    w = Worker(bus, step, node, service="test", locks=node_locks(node))
    task = asyncio.create_task(w.run())
    rid = f"owned-{uuid.uuid4().hex[:6]}"
    try:
        await bus.publish(CkptRequested(request_id=rid, checkpoint_id="ck",
                                        target=Target.job("j"), node=node))
        await asyncio.wait_for(step.started.wait(), 10)
        theirs = {"state": "running", "owner": "another-worker", "heartbeat": time.time(),
                  "subject": f"ckpt.requested.{node}", "checkpoint_id": "ck"}
        await bus.kv(KV_STEPS).put(rid, orjson.dumps(theirs))
        await asyncio.sleep(3 * bus.config.keepalive)
        state, _ = await bus.step_state(rid)
        assert state and state["owner"] == "another-worker", state
    finally:
        w.stop()
        await asyncio.wait_for(task, 30)


# -- 14. what the bus and the disk keep ------------------------------------------------

async def test_step_states_expire_like_the_requests_they_answer(bus: Bus) -> None:
    steps = await bus.js.stream_info(f"KV_{KV_STEPS}")
    requests = await bus.js.stream_info(STREAM_REQUESTS)
    assert steps.config.max_age and steps.config.max_age >= (requests.config.max_age or 0)


async def test_failed_steps_leave_no_work_directory(h: Harness) -> None:
    job = await h.start(16)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded"
    gen_dir = h.settings.storage_root / LOCAL_NAMESPACE / job.id / f"{done.generation:08d}"
    for f in (gen_dir / "files" / "images").glob("core-*.img"):
        f.write_bytes(b"\0" * f.stat().st_size)  # corrupt: the restore fails
    restored = await h.restore(job.id)
    assert restored.status == "failed"
    assert not (restore_step(h).work_dir / restored.request_id).exists()
