"""A GPU job's checkpoint past the driver's lock: the gate before the lock,
the check again after it, and a failure path that tells the truth.

Real CRIU, a real nats-server, real processes and the real kernel (an
io_uring, a unix socket CRIU cannot save); the CUDA driver is the
**stand-in** of tests/test_nothing_lost.py (no GPU here), extended to watch
the job's threads while its GPU state is checkpointed and, where a test
says so, to refuse the restore as driver 580 refuses a process it cannot
bring back (CUDA_ERROR_NOT_SUPPORTED)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from smr.gpu import frozen, gpugate
from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.gpu.driver import CudaError, CudaState
from smr.jobs import Job, launch, proc_start_ticks
from tests import nats_auth
from tests.test_local_smr import Harness, running
from tests.test_nothing_lost import StandInDriver, ckpt_step

pytestmark = pytest.mark.criu

# A job of two threads: the main one counts (a step a line), the other
# idles (it stands for the driver's restore thread). It holds a connection
# to a unix socket outside its tree (CRIU's dump fails on it), and makes an
# io_uring on SIGUSR1.
JOB = r"""
import ctypes, os, signal, socket, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
rings = []
def ring(*_):
    params = ctypes.create_string_buffer(120)
    rings.append(libc.syscall(425, 8, params))  # io_uring_setup
signal.signal(signal.SIGUSR1, ring)
if sys.argv[1] != "-":
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
if sys.argv[3] == "ring":
    ring()
def idle():
    while True:
        time.sleep(1)
t = threading.Thread(target=idle, daemon=True)
t.start()
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(t.native_id))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
n = 0
while True:
    n += 1
    print(f"step={n}", flush=True)
    time.sleep(0.02)
"""


class WatchingDriver(StandInDriver):
    """The **stand-in** driver; it restores each process through the thread
    the job named, and from the checkpoint on, watches the job's main
    thread: once it was seen stopped, any state of a running thread before
    the restore began is recorded in ``ran`` (a thread running while its
    process's GPU state is CHECKPOINTED: on a real GPU it would block or
    crash). ``refuse``: restores answer as driver 580 answers a process it
    cannot bring back. ``on_checkpoint``: called with the pid once its GPU
    state is checkpointed."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.refuse = refuse
        self.tids: dict[int, int] = {}
        self.ran: list[str] = []
        self.restores: list[int] = []
        self.restoring = threading.Event()
        self.on_checkpoint = lambda pid: None
        self.done = threading.Event()

    def checkpoint(self, pid: int) -> None:
        super().checkpoint(pid)
        self.on_checkpoint(pid)
        threading.Thread(target=self._watch, args=(pid,), daemon=True).start()

    def _watch(self, pid: int) -> None:
        stopped, run = False, []
        while not self.restoring.is_set() and not self.done.is_set():
            s = frozen.state(pid)
            if s in ("t", "T"):
                stopped, run = True, []
            # Running untraced: the job's own code (CRIU's parasite, and a
            # thread smr lets run, run traced). A thread on its way into a
            # stop (a SIGSTOP pending as CRIU lets go of it) shows R for an
            # instant: running is seen several times in a row.
            elif stopped and s in ("R", "S", "D") and not traced(pid):
                run.append(s)
                if len(run) == 8:
                    self.ran.extend(run)
            time.sleep(0.0005)

    def restore_tid(self, pid: int) -> int | None:
        super().restore_tid(pid)
        return self.tids[pid]

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        self.restoring.set()
        self.restores.append(pid)
        if self.refuse:
            raise CudaError(f"cuCheckpointProcessRestore({pid}) failed: "
                            "CUDA_ERROR_NOT_SUPPORTED (801)", detail="801")
        super().restore(pid, gpu_pairs)


def traced(tid: int) -> bool:
    try:
        status = Path(f"/proc/{tid}/status").read_text()
    except OSError:
        return False
    return any(ln.split()[1:] != ["0"] for ln in status.splitlines()
               if ln.startswith("TracerPid:"))


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as harness:
        yield harness


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[str]:
    """A unix socket outside the job's tree, accepting its connection."""
    path = str(tmp_path / "outside.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    yield path
    stop.set()
    for c in held:
        c.close()
    srv.close()


async def start(h: Harness, drv: WatchingDriver, sock: str = "-", ring: str = "") -> Job:
    job_id = f"gate-{uuid.uuid4().hex[:6]}"
    tid_file = h.tmp / f"{job_id}.tid"
    # io_uring allowed: these jobs make rings for the gate to find (smr's
    # seccomp filter would refuse them; tests/test_io_uring_filter.py).
    job = launch(job_id, [sys.executable, "-c", JOB, sock, str(tid_file), ring or "-"],
                 log=h.tmp / f"{job_id}.log", cwd=h.tmp, node=h.settings.node,
                 own_pid_namespace=False, env={**os.environ, "SMR_IO_URING": "allow"})
    h.pids.append(job.pid)
    await h.jobs.put(job)
    for _ in range(400):
        if tid_file.exists() and h.lines(job):
            break
        await asyncio.sleep(0.025)
    drv.tids[job.pid] = int(tid_file.read_text())
    drv.states[job.pid] = CudaState.RUNNING  # "holds a GPU"
    return job


def with_driver(h: Harness, refuse: bool = False) -> WatchingDriver:
    drv = WatchingDriver(refuse=refuse)
    ckpt_step(h).cuda = CudaCheckpoint(drv)  # type: ignore[arg-type]
    return drv


async def steps_go_on(h: Harness, job: Job) -> None:
    at = int(h.lines(job)[-1]["step"])
    await h.wait_step(job, at + 3, timeout=30)


@pytest.mark.parametrize("leave_running", [True, False], ids=["heartbeat", "final"])
async def test_a_dump_failing_after_the_lock_holds_the_job_stopped_until_its_gpu_runs(
        h: Harness, outside: str, leave_running: bool) -> None:
    """CRIU fails after the GPU lock (a connection to a socket outside the
    tree): no thread of the job runs while its GPU state is checkpointed
    (CRIU thaws a tree whose dump failed; smr holds it stopped), the GPU
    state comes back through the restore thread alone, once, and only then
    does the answer say the job keeps running; it does."""
    drv = with_driver(h)
    job = await start(h, drv, outside)
    try:
        done = await h.checkpoint(job.id, leave_running=leave_running)
    finally:
        drv.done.set()
    assert done.status == "failed" and done.error
    assert done.error["code"] == "external-unix-socket", done.error
    assert done.error["message"].endswith(f"job {job.id} keeps running"), done.error
    assert drv.ran == [], f"the job ran while its GPU state was checkpointed: {drv.ran[:5]}"
    assert drv.restores == [job.pid]
    assert drv.states[job.pid] is CudaState.RUNNING
    await steps_go_on(h, job)


async def test_a_failed_dump_whose_gpu_restore_fails_is_gpu_state_lost(
        h: Harness, outside: str) -> None:
    """The same failure, and the driver refuses the restore: the answer is
    gpu-state-lost, naming the process, the driver's answer and CRIU's
    reason, never "keeps running"; the restore is not tried twice; the job,
    which could not run on, is ended and its record says failed."""
    drv = with_driver(h, refuse=True)
    job = await start(h, drv, outside)
    try:
        done = await h.checkpoint(job.id, leave_running=True)
    finally:
        drv.done.set()
    assert done.status == "failed" and done.error
    print("gpu-state-lost answer:", done.error)
    assert done.error["code"] == "gpu-state-lost", done.error
    message = done.error["message"]
    assert "keeps running" not in message
    assert f"process {job.pid}" in message and "CUDA_ERROR_NOT_SUPPORTED (801)" in message
    assert "unix socket" in message  # what failed first
    assert drv.restores == [job.pid], "a failed restore must not be tried again"
    record, _ = await h.jobs.get(job.id)
    assert record.state == "failed"
    for _ in range(200):
        if proc_start_ticks(job.pid) != job.start_ticks:
            break
        await asyncio.sleep(0.05)
    assert proc_start_ticks(job.pid) != job.start_ticks, "the job whose GPU is lost still runs"


async def test_a_job_holding_an_io_uring_is_refused_before_the_lock(h: Harness) -> None:
    """A job that made an io_uring (libuv does in every loop) is refused
    before anything is locked or frozen, naming the process; it runs on."""
    drv = with_driver(h)
    job = await start(h, drv, ring="ring")
    done = await h.checkpoint(job.id)
    drv.done.set()
    assert done.status == "failed" and done.error
    assert done.error["code"] == "io-uring", done.error
    assert f"process {job.pid}" in done.error["message"]
    assert drv.restores == [] and drv.states[job.pid] is CudaState.RUNNING, "it was locked"
    await steps_go_on(h, job)


async def test_an_io_uring_made_during_the_lock_is_refused_before_criu(h: Harness) -> None:
    """The job makes its io_uring while the driver checkpoints it (after the
    check before the lock): found again with the tree stopped, before CRIU;
    the GPU state comes back and the job runs on."""
    drv = with_driver(h)
    job = await start(h, drv)

    def make_ring(pid: int) -> None:
        os.kill(pid, signal.SIGUSR1)
        for _ in range(400):
            if gpugate.io_uring_held(pid):
                return
            time.sleep(0.005)

    drv.on_checkpoint = make_ring
    done = await h.checkpoint(job.id, leave_running=True)
    drv.done.set()
    assert done.status == "failed" and done.error
    assert done.error["code"] == "io-uring", done.error
    assert "keeps running" in done.error["message"]
    assert drv.restores == [job.pid] and drv.states[job.pid] is CudaState.RUNNING
    await steps_go_on(h, job)


async def test_a_pre_dump_of_a_gpu_job_is_refused_up_front(h: Harness) -> None:
    drv = with_driver(h)
    job = await start(h, drv)
    done = await h.checkpoint(job.id, pre_dump=True)
    drv.done.set()
    assert done.status == "failed" and done.error
    assert done.error["code"] == "gpu-pre-dump", done.error
    assert drv.states[job.pid] is CudaState.RUNNING and drv.restores == []
    await steps_go_on(h, job)


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(e.split("=", 1) for e in raw.decode().split("\0") if "=" in e)


async def test_smr_exec_gpu_scopes_the_gpus_and_runs_one_compile_thread(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """`smr exec --gpu --gpus N|LIST` sets CUDA_VISIBLE_DEVICES, and a GPU
    job gets TORCHINDUCTOR_COMPILE_THREADS=1 unless its environment sets it."""
    from tests.test_local_smr import smr_cli

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    seen = {}
    for gpus, own in (("2", None), ("GPU-a,GPU-b", "6")):
        if own:
            monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", own)
        job_id = f"env-{uuid.uuid4().hex[:6]}"
        rc, out = await smr_cli(h, "exec", "--gpu", "--gpus", gpus, "-i", job_id, "--", *sleeper)
        assert rc == 0, out
        record, _ = await h.jobs.get(job_id)
        h.pids.append(record.pid)
        env = environ(record.pid)
        seen[gpus] = (env.get("CUDA_VISIBLE_DEVICES"), env.get("TORCHINDUCTOR_COMPILE_THREADS"))
    assert seen == {"2": ("0,1", "1"), "GPU-a,GPU-b": ("GPU-a,GPU-b", "6")}
    rc, out = await smr_cli(h, "exec", "--gpus", "1", "-i", "no-gpu", "--", *sleeper)
    assert rc != 0 and "--gpus is for a GPU job" in out
