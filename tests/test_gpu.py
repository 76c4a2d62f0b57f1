"""GPU save, migrate and resume through the CUDA driver's checkpoint API.

Runs where a GPU with the checkpoint API and PyTorch are present (the H100
machine); skips cleanly elsewhere (CI). A PyTorch job holding
SMR_TEST_GPU_GIB (default 8) GiB on the GPU is checkpointed through NATS
and storage, and must go on from the next step with its tensors intact.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smr import cuda_checkpoint
from smr.jobs import Job, launch, proc_start_ticks, wait_exit
from smr.natsserver import NatsServer
from smr.workloads import counter
from tests.test_local_smr import Harness, running

GIB = float(os.environ.get("SMR_TEST_GPU_GIB", "8"))

pytestmark = [
    pytest.mark.gpu, pytest.mark.criu,
    pytest.mark.skipif(not cuda_checkpoint.available(),
                       reason="no NVIDIA driver with the CUDA checkpoint API"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch not installed"),
]


class GpuHarness(Harness):
    async def start_gpu(self) -> Job:
        job_id = f"gpu-{uuid.uuid4().hex[:6]}"
        cmd = [sys.executable, "-m", "smr.workloads.gpu_counter", "--gib", str(GIB)]
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
async def g(criu_binary: str, nats_server: NatsServer, tmp_path: Path, node: str
            ) -> AsyncIterator[GpuHarness]:
    # A long ack wait: dumping 8 GiB takes longer than the CPU tests' 5 s.
    async with running(GpuHarness, criu_binary, nats_server, tmp_path, node, 30.0) as harness:
        yield harness


def lines(job: Job) -> list[dict[str, str]]:
    return [counter.parse_line(ln) for ln in Path(job.log).read_text().splitlines()
            if ln.startswith("step=")]


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
    await g.wait_step(job, frozen + 2, timeout=120)
    after = [ln for ln in lines(job) if int(ln["step"]) > frozen]
    assert int(after[0]["step"]) == frozen + 1, f"restarted instead of resuming: {after[0]}"
    assert all(ln["ok"] == "True" and ln["fp"] == fp0 for ln in after), after[:3]


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
