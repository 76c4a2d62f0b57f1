"""A GPU pod's threads stay held until its GPU state is back, at a heartbeat
and at a restore on another node (JAX threads that ran between
CRIU's thaw and the driver's restore died of SIGSEGV in libcuda on the H100).

REAL: containerd + runc + CRIU 4.2, smr-init, the webhook, the watcher, two
node agents, nats-server; the workload is a multi-threaded Python process in
a pod. STAND-IN: the CUDA driver (tests/chaos/gpu_standin.py; no GPU here),
whose restore refuses a process with a thread running besides the one it
restores through, the order the real driver needs and cannot check.
tests/agent/test_gpu_pods.py runs the same paths on a real GPU.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from services.containers.host import Shim
from services.restorer.pod import PodRestoreStep
from smr.contract.messages import CkptRequested, RestoreRequested, Target
from smr.gpu import cuda_checkpoint, gpuinfo
from tests.agent.cluster import USR_IMAGE, Cluster
from tests.agent.test_dev_shm_pods import steps_of
from tests.agent.test_injection import create, plain_pod
from tests.agent.test_programs_pods import migrate
from tests.chaos import gpu_standin
from tests.helpers.live import live

CKPT = "gpu-order"
# Three threads count; the main one (the stand-in's restore thread) waits.
WORKLOAD = """
import threading, time
n = 0
lock = threading.Lock()
def count():
    global n
    while True:
        with lock:
            n += 1
            print(f"step {n}", flush=True)
        time.sleep(0.05)
for _ in range(3):
    threading.Thread(target=count, daemon=True).start()
threading.Event().wait()
"""
STEP = re.compile(r"^step (\d+)$", re.M)


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> gpu_standin.StandInDriver:
    """The stand-in driver, for the agents the ``cluster`` fixture makes next."""
    for mod, name in ((cuda_checkpoint, "for_settings"), (gpuinfo, "devices"),
                      (gpuinfo, "job_gpus")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # put back after the test
    drv = gpu_standin.StandInDriver(tmp_path / "gpu-states", held=True)
    gpu_standin.install(drv.root, drv)
    return drv


class AgentKilled(BaseException):
    """The agent's process ending where the test says: no except clause of
    the agent's runs for it, as none would for a SIGKILL."""


def gpu_pod(name: str, node: str, _: str = "") -> dict[str, Any]:
    p = plain_pod(name, node, image=USR_IMAGE, labels={"smr.dev/node-restore": "true"},
                  env={"SMR_CHECKPOINT": CKPT, gpu_standin.ENV: "workload-1"}, owner="gpu",
                  command=["/usr/bin/python3", "-c", WORKLOAD])
    p["spec"]["restartPolicy"] = "Never"
    p["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "usr", "mountPath": "/usr", "readOnly": True}]
    p["spec"]["volumes"] = [{"name": "usr", "hostPath": {"path": "/usr"}}]
    return p


def steps(cluster: Cluster, name: str, node: str) -> list[int]:
    return [int(s) for s in STEP.findall(cluster.log(name, node))]


async def more_steps(cluster: Cluster, name: str, node: str, than: int,
                     timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(got := steps(cluster, name, node)) <= than:
        assert time.monotonic() < deadline, cluster.log(name, node)[-2000:]
        await asyncio.sleep(0.1)
    return got


async def test_gpu_pod_threads_are_held_until_the_gpu_state_is_back(
        standin: gpu_standin.StandInDriver, cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    await create(cluster, gpu_pod("gpu-a", a))
    await more_steps(cluster, "gpu-a", a, 5)
    beat = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=CKPT, node=a, reason="heartbeat",
        leave_running=True, target=Target(kind="pod", namespace="default", pod="gpu-a",
                                          container="main")), timeout=90)
    assert beat.status == "succeeded", beat.error
    assert beat.durations["cuda_restore"] >= 0 and beat.durations["downtime"] > 0
    # The heartbeat's tree was held, then let go: the pod counts on.
    n = len(steps(cluster, "gpu-a", a))
    await more_steps(cluster, "gpu-a", a, n + 5)
    assert gpu_standin.state_of(standin.root, "workload-1") == "RUNNING"

    await migrate(cluster, "gpu-a", "gpu-b", a, b, "", gpu_pod, CKPT)
    before = steps(cluster, "gpu-a", a)
    after = await more_steps(cluster, "gpu-b", b, 5)
    # The restored tree goes on from its memory (not a fresh start), its
    # counting threads held until the stand-in's restore, then continued.
    assert 1 < after[0] <= before[-1] + 1, (before[-3:], after[:3])
    assert after == list(range(after[0], after[0] + len(after)))
    assert gpu_standin.state_of(standin.root, "workload-1") == "RUNNING"
    # Each restore (the heartbeat's, the migration's) held the three counters.
    assert [held for _, held in standin.restores] == [3, 3], standin.restores


# The GPU process starts a helper without the stand-in's mark (no CUDA
# context), which maps a file named as a GPU device file: what a worker
# forked from a CUDA process is to the real driver (Inductor's compile pool
# after a restore: docs/compatibility.md).
FORKED = """
import os, subprocess, sys, time
env = {k: v for k, v in os.environ.items() if k != "MARK"}
subprocess.Popen([sys.executable, "-c", '''
import mmap, time
f = open("/dev/nvidia-standin", "w+b")
f.write(bytes(4096))
f.flush()
m = mmap.mmap(f.fileno(), 4096)
time.sleep(3600)
'''], env=env)
n = 0
while True:
    n += 1
    print(f"step {n}", flush=True)
    time.sleep(0.05)
""".replace("MARK", gpu_standin.ENV)


async def test_a_gpu_pod_with_a_device_mapping_outside_cuda_is_refused_before_freezing(
        standin: gpu_standin.StandInDriver, cluster: Cluster) -> None:
    a, _ = list(cluster.kubelets)
    p = gpu_pod("gpu-forked", a)
    p["spec"]["containers"][0]["command"] = ["/usr/bin/python3", "-c", FORKED]
    await create(cluster, p)
    await more_steps(cluster, "gpu-forked", a, 5)
    await asyncio.sleep(1)  # the helper has mapped its file
    beat = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="gpu-forked", node=a, reason="heartbeat",
        leave_running=True, target=Target(kind="pod", namespace="default", pod="gpu-forked",
                                          container="main")), timeout=90)
    assert beat.status == "failed" and beat.error["code"] == "gpu-forked-mapping", beat.error
    assert "/dev/nvidia-standin" in beat.error["message"], beat.error
    # Nothing was frozen or locked: the pod counts on, its "GPU" never left RUNNING.
    assert not standin.restores
    assert gpu_standin.state_of(standin.root, "workload-1") == "RUNNING"
    n = len(steps(cluster, "gpu-forked", a))
    await more_steps(cluster, "gpu-forked", a, n + 5)


async def test_a_gpu_heartbeat_whose_agent_died_before_the_resume_gets_its_gpu_back_first(
        standin: gpu_standin.StandInDriver, cluster: Cluster,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent dies after the heartbeat's dump (the tree held stopped, its
    GPU state checkpointed) and before the resume. The redelivered request's
    recovery stores nothing twice and must bring the GPU state back before
    any thread runs, as the resume would have: continued without it, the
    threads run on a GPU state that is not there (JAX died of SIGSEGV)."""
    a, _ = list(cluster.kubelets)
    await create(cluster, gpu_pod("gpu-hb", a))
    await more_steps(cluster, "gpu-hb", a, 5)
    entered, crash = asyncio.Event(), asyncio.Event()
    real = cuda_checkpoint.CudaCheckpoint.resume_after

    async def dies_here(self: Any, writer: asyncio.Task[Any], *_: Any) -> None:
        await asyncio.wait([writer])
        entered.set()
        await crash.wait()
        raise RuntimeError("the agent was killed (test)")

    monkeypatch.setattr(cuda_checkpoint.CudaCheckpoint, "resume_after", dies_here)
    req = CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="gpu-hb", node=a, reason="heartbeat",
        leave_running=True, target=Target(kind="pod", namespace="default", pod="gpu-hb",
                                          container="main"))
    first = asyncio.create_task(cluster.bus.request(req, timeout=120))
    try:
        await asyncio.wait_for(entered.wait(), 60)
        monkeypatch.setattr(cuda_checkpoint.CudaCheckpoint, "resume_after", real)
        held_at = len(steps(cluster, "gpu-hb", a))
        await asyncio.sleep(1)
        assert len(steps(cluster, "gpu-hb", a)) == held_at, "not held stopped after its dump"
        assert gpu_standin.state_of(standin.root, "workload-1") == "CHECKPOINTED"
        [step] = steps_of(a)
        done = await step.recover(req, {})
        await more_steps(cluster, "gpu-hb", a, held_at + 5)  # it runs on
    finally:
        crash.set()
        await asyncio.gather(first, return_exceptions=True)
    assert done is not None and done.status == "succeeded", done
    assert gpu_standin.state_of(standin.root, "workload-1") == "RUNNING"
    # The recovery restored the GPU state with the three counters held.
    assert [held for _, held in standin.restores] == [3], standin.restores


def restore_steps_of(node: str) -> list[PodRestoreStep]:
    return [o for o in live(PodRestoreStep) if o.node == node]


async def test_a_gpu_pod_restore_whose_agent_died_before_the_resume_gets_its_gpu_back(
        standin: gpu_standin.StandInDriver, cluster: Cluster,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent dies after CRIU restored a GPU pod's tree (left stopped, its
    GPU state CHECKPOINTED) and before the driver's restore, unlock and
    SIGCONT. The redelivered request's recovery finds the tree in the
    container: answered succeeded as it was, with nothing resumed, the pod
    stayed stopped for good. It must bring the GPU state back and continue
    the tree first; a recovery that dies after that and is itself recovered
    must not restore the GPU state twice."""
    a, b = list(cluster.kubelets)
    await create(cluster, gpu_pod("gpr-a", a))
    await more_steps(cluster, "gpr-a", a, 5)
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    drain = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=CKPT, node=a, reason="drain",
        target=Target(kind="pod", namespace="default", pod="gpr-a", container="main")),
        timeout=90)
    assert drain.status == "succeeded", drain.error
    assert gpu_standin.state_of(standin.root, "workload-1") == "CHECKPOINTED"

    reqs: list[RestoreRequested] = []
    entered, crash = asyncio.Event(), asyncio.Event()
    real_run, real_resume = PodRestoreStep.run, cuda_checkpoint.CudaCheckpoint.resume_tree

    async def run(self: PodRestoreStep, req: RestoreRequested, progress: Any) -> Any:
        reqs.append(req)
        return await real_run(self, req, progress)

    async def dies_here(self: Any, root: int, **_: Any) -> dict[str, float]:
        entered.set()
        await crash.wait()  # the agent's last moment: SIGKILL comes here
        raise RuntimeError("the agent was killed (test)")

    monkeypatch.setattr(PodRestoreStep, "run", run)
    monkeypatch.setattr(cuda_checkpoint.CudaCheckpoint, "resume_tree", dies_here)
    await create(cluster, gpu_pod("gpr-b", b))
    try:
        await asyncio.wait_for(entered.wait(), 90)
        monkeypatch.setattr(cuda_checkpoint.CudaCheckpoint, "resume_tree", real_resume)
        await asyncio.sleep(1)
        assert not steps(cluster, "gpr-b", b), "CRIU let the GPU tree run before its GPU state"
        assert gpu_standin.state_of(standin.root, "workload-1") == "CHECKPOINTED"
        [step], [req] = restore_steps_of(b), reqs
        # What the redelivered request's worker does on the next agent; that
        # worker dies too, after the GPU resume, before smr-init is told.
        real_decide = Shim.decide

        def recovery_dies(self: Shim, decision: str) -> None:
            # Not an Exception: a SIGKILLed agent runs no handler of its own
            # (a decision that fails with an error ends the restored tree).
            raise AgentKilled("the agent was killed again (test)")

        monkeypatch.setattr(Shim, "decide", recovery_dies)
        with pytest.raises(AgentKilled, match="killed again"):
            await step.recover(req, {})
        monkeypatch.setattr(Shim, "decide", real_decide)
        assert gpu_standin.state_of(standin.root, "workload-1") == "RUNNING", (
            "recovery left the restored tree's GPU state "
            f"{gpu_standin.state_of(standin.root, 'workload-1')} (the tree stopped)")
        after = await more_steps(cluster, "gpr-b", b, 5, timeout=30)  # it runs on
        done = await step.recover(req, {})
    finally:
        crash.set()
    assert done is not None and done.status == "succeeded", done
    # From its memory (read now: the log file lags the pipe), its three
    # counters held until the driver's restore.
    before = steps(cluster, "gpr-a", a)
    assert 1 < after[0] <= before[-1] + 1, (before[-3:], after[:3])
    # Restored once (the drain's checkpoint restored none): the second
    # recovery found the tree RUNNING and restored nothing again.
    assert [held for _, held in standin.restores] == [3], standin.restores
