"""GPU save, migrate and resume through the CUDA driver's checkpoint API.

Runs where a GPU with the checkpoint API and PyTorch are present (the H100
machine); skips cleanly elsewhere (CI). A PyTorch job holding
SMR_TEST_GPU_GIB (default 8) GiB on the GPU is checkpointed through NATS
and storage, and must go on from the next step with its tensors intact.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.storage.layout import LOCAL_NAMESPACE
from smr.contract.messages import CkptRequested, Target
from smr.gpu import cuda_checkpoint, gpuinfo
from smr.gpu.driver import CudaState
from smr.jobs import Job, launch, proc_start_ticks, wait_exit
from smrctl import demo_counter as counter
from tests import nats_auth
from tests.test_local_smr import Harness, assert_unlocked, flip_byte, running

GIB = float(os.environ.get("SMR_TEST_GPU_GIB", "8"))

pytestmark = [
    pytest.mark.gpu, pytest.mark.criu,
    pytest.mark.skipif(not cuda_checkpoint.available(),
                       reason="no NVIDIA driver with the CUDA checkpoint API"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch not installed"),
]


class GpuHarness(Harness):
    async def start_gpu(self, gib: float = GIB, *extra: str) -> Job:
        job_id = f"gpu-{uuid.uuid4().hex[:6]}"
        cmd = [sys.executable, "-m", "tests.workloads.gpu_counter", "--gib", str(gib), *extra]
        job = launch(job_id, cmd, log=self.tmp / f"{job_id}.log", cwd=self.tmp,
                     node=self.settings.node, own_pid_namespace=False)
        self.pids.append(job.pid)
        await self.jobs.put(job)
        for _ in range(1800):
            if len(lines(job)) >= 3:
                return job
            if proc_start_ticks(job.pid) != job.start_ticks:
                raise AssertionError(f"the GPU job died: {Path(job.log).read_text()[-2000:]}")
            await asyncio.sleep(0.1)
        raise AssertionError(f"the GPU job printed no 3 steps: {Path(job.log).read_text()[-2000:]}")


@pytest.fixture
async def g(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[GpuHarness]:
    # A long ack wait: dumping 8 GiB takes longer than the CPU tests' 5 s.
    async with running(GpuHarness, criu_binary, nats_users, tmp_path, node, 30.0) as harness:
        yield harness


def lines(job: Job) -> list[dict[str, str]]:
    return [counter.parse_line(ln) for ln in Path(job.log).read_text().splitlines()
            if ln.startswith("step=")]


async def assert_resumes(g: GpuHarness, job: Job, frozen: int, fp0: str) -> None:
    """The restored job goes on from step frozen+1, its counter tensor right
    (ok) and its random tensor unchanged (the first line's fingerprint)."""
    await g.wait_step(job, frozen + 2, timeout=120)
    after = [ln for ln in lines(job) if int(ln["step"]) > frozen]
    assert int(after[0]["step"]) == frozen + 1, f"restarted instead of resuming: {after[0]}"
    assert all(ln["ok"] == "True" and ln["fp"] == fp0 for ln in after), after[:3]


async def test_gpu_job_checkpoint_kill_restore_keeps_its_tensors(g: GpuHarness) -> None:
    job = await g.start_gpu()
    fp0 = lines(job)[0]["fp"]
    done = await g.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    assert proc_start_ticks(job.pid) != job.start_ticks, "the job still runs after its dump"
    gen = await g.node.store.get("local", job.id, done.generation)  # type: ignore[union-attr]
    assert gen.manifest["gpu"]["used_bytes"] >= GIB * 2**30 * 0.9
    assert "nvidia_driver" in gen.manifest["versions"]
    frozen = int(lines(job)[-1]["step"])
    print("checkpoint durations", done.durations)

    restored = await g.restore(job.id)
    assert restored.status == "succeeded", restored.error
    print("restore durations", restored.durations)
    await assert_resumes(g, job, frozen, fp0)


async def test_gpu_heartbeat_leaves_the_job_running_and_restores(g: GpuHarness) -> None:
    job = await g.start_gpu()
    fp0 = lines(job)[0]["fp"]
    done = await g.checkpoint(job.id, leave_running=True)
    assert done.status == "succeeded", done.error
    print("heartbeat durations", done.durations)
    assert done.durations.get("downtime", 0) > 0
    before = len(lines(job))
    await g.wait_step(job, int(lines(job)[-1]["step"]) + 2, timeout=60)
    assert all(ln["ok"] == "True" for ln in lines(job)[before:]), "the job broke after the beat"
    last_original = int(lines(job)[-1]["step"])

    os.kill(job.pid, 9)
    assert await wait_exit(job.pid, job.start_ticks, timeout=60)
    n = len(lines(job))
    restored = await g.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await g.wait_step(job, 1, count=n + 2, timeout=120)
    after = lines(job)[n:]
    assert 3 <= int(after[0]["step"]) <= last_original, f"did not resume the beat: {after[0]}"
    assert all(ln["ok"] == "True" and ln["fp"] == fp0 for ln in after), after[:3]


# -- failure paths: the job is left running, or cleanly failed; never stuck ----------

SMALL = 2.0  # GiB: enough to take real time in the driver, quick to dump


def holds_gpu(pid: int) -> bool:
    return any(pid in d["processes"] for d in gpuinfo.devices())


async def test_gpu_lock_timeout_leaves_the_job_running(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str) -> None:
    """A job whose kernels run longer than the lock timeout: every attempt
    times out, the request fails with that reason, and the job never stops."""
    async with running(GpuHarness, criu_binary, nats_users, tmp_path, node, 30.0,
                       cuda_lock_timeout=0.5, max_deliver=2) as g:
        # Kernels of 30 s, and the request sent just as one begins (a step
        # printed): every attempt, retries included, meets a kernel running.
        # With 4 s kernels a retry sometimes landed between two, and locked.
        job = await g.start_gpu(1.0, "--busy-s", "30", "--interval", "0")
        await g.wait_step(job, int(lines(job)[-1]["step"]) + 1, timeout=90)
        done = await g.checkpoint(job.id)
        print("lock-timeout result", done.status, done.error)
        assert done.status == "failed" and done.error
        assert done.error["code"] == "cuda-lock-timeout", done.error
        assert "SMR_CUDA_LOCK_TIMEOUT" in done.error["hint"]
        assert cuda_checkpoint.driver().state(job.pid) is CudaState.RUNNING
        last = int(lines(job)[-1]["step"])
        await g.wait_step(job, last + 2, timeout=150)
        assert all(ln["ok"] == "True" for ln in lines(job)), "GPU state broke"
        assert await g.node.store.latest(LOCAL_NAMESPACE, job.id) is None  # type: ignore[union-attr]
        await assert_unlocked(g, job.id)


async def test_gpu_job_exiting_mid_checkpoint_fails_cleanly(g: GpuHarness) -> None:
    job = await g.start_gpu(SMALL)
    task = asyncio.create_task(g.checkpoint(job.id))
    drv = cuda_checkpoint.driver()
    for _ in range(3000):  # kill it inside the driver's checkpoint
        if drv.state(job.pid) in (CudaState.LOCKED, CudaState.CHECKPOINTED):
            break
        await asyncio.sleep(0.002)
    seen = drv.state(job.pid)
    os.kill(job.pid, 9)
    done = await task
    print("killed in CUDA state", seen, "->", done.status, done.error)
    assert seen in (CudaState.LOCKED, CudaState.CHECKPOINTED)
    assert done.status == "failed" and done.error
    assert done.error["code"] in ("job-exited", "cuda-checkpoint-failed"), done.error
    assert await g.node.store.latest(LOCAL_NAMESPACE, job.id) is None  # type: ignore[union-attr]
    await assert_unlocked(g, job.id)
    assert await wait_exit(job.pid, job.start_ticks, timeout=30)
    for _ in range(100):
        if not holds_gpu(job.pid):
            break
        await asyncio.sleep(0.1)
    assert not holds_gpu(job.pid), "the dead job still holds GPU memory"
    again = await g.checkpoint(job.id)
    assert again.status == "failed" and again.error and again.error["code"] == "job-not-running"


async def test_gpu_tampered_and_corrupted_images_fail_cleanly_then_restore(
        g: GpuHarness) -> None:
    """Another GPU model in the manifest, then a flipped byte in the images:
    each restore fails with its reason and leaves nothing behind; with the
    image put right, the same checkpoint restores with its tensors intact."""
    job = await g.start_gpu(SMALL)
    fp0 = lines(job)[0]["fp"]
    done = await g.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    frozen = int(lines(job)[-1]["step"])
    gen_dir = g.settings.storage_root / LOCAL_NAMESPACE / job.id / f"{done.generation:08d}"

    manifest = gen_dir / "manifest.json"
    original = manifest.read_text()
    doc = json.loads(original)
    for d in [doc["gpu"], *doc["gpu"].get("devices", [])]:
        d["model"] = "NVIDIA A100-SXM4-40GB"
    manifest.write_text(json.dumps(doc))
    refused = await g.restore(job.id)
    print("other model:", refused.error)
    assert refused.status == "failed" and refused.error
    assert refused.error["code"] == "gpu-mismatch" and "A100" in refused.error["message"]
    manifest.write_text(original)

    pages = max((gen_dir / "files" / "images").glob("pages-*.img"),
                key=lambda p: p.stat().st_size)
    flip_byte(pages, pages.stat().st_size // 3)
    corrupt = await g.restore(job.id)
    print("corrupted:", corrupt.error)
    assert corrupt.status == "failed" and corrupt.error
    assert corrupt.error["code"] == "checkpoint-corrupt", corrupt.error
    assert corrupt.pid is None
    record, _ = await g.jobs.get(job.id)
    assert not record.alive()
    await assert_unlocked(g, job.id)

    flip_byte(pages, pages.stat().st_size // 3)
    restored = await g.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await assert_resumes(g, job, frozen, fp0)


async def test_gpu_checkpoint_recovery_records_the_gpu(g: GpuHarness) -> None:
    """The worker died after the driver checkpoint and the dump, before the
    commit: recovery commits the images with the job's GPU facts, and the
    restore brings the GPU state back."""
    from services.checkpointer.step import CheckpointStep

    step = g.node.workers[0].step
    assert isinstance(step, CheckpointStep) and step.cuda
    job = await g.start_gpu(SMALL)
    fp0 = lines(job)[0]["fp"]
    req = CkptRequested(request_id=f"crashed-{job.id}", checkpoint_id=job.id,
                        target=Target.job(job.id), node=g.settings.node)
    work = step.work_dir / req.request_id
    gpu, tcp = await step._prepare(req, job, work)
    assert gpu
    await step.cuda.suspend_all(gpu["pids"])
    await step.criu.dump(job.pid, work / "images", tcp=tcp)
    frozen = int(lines(job)[-1]["step"])

    result = await step.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded", result
    gen = await g.node.store.get(LOCAL_NAMESPACE, job.id, result.generation)  # type: ignore[union-attr]
    assert gen.manifest["gpu"]["used_bytes"] >= SMALL * 2**30 * 0.9
    restored = await g.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await assert_resumes(g, job, frozen, fp0)
