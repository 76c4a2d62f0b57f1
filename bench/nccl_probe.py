"""What the CUDA driver's checkpoint API does with an NCCL job (issue #26), at
the driver's level only (no CRIU), on a machine with two GPUs:

    python3 bench/nccl_probe.py --variant p2p|net|shm [--interval 0.05] [--steps 300]

It starts tests/workloads/ddp_train.py under torchrun (two ranks, NCCL
all-reduce every step; ``net``: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, so the
ranks share no GPU memory; ``shm``: NCCL_P2P_DISABLE=1 alone, so the ranks
share host memory through NCCL's SHM transport), prints what each rank holds (descriptors,
mappings of the GPU's and shared-memory files, NVML's view), then suspends
every rank as smr does (smr.gpu.cuda_checkpoint: all locked, in rounds, then all
checkpointed), restores and unlocks them, and lets the job finish. ``--ref``
runs the job uninterrupted and prints its final hash. Every driver answer is
printed as the driver gave it."""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from smr.gpu.cuda_checkpoint import CudaCheckpoint, driver
from smr.gpu.driver import CudaError, CudaState, Driver
from smr.process.tree import process_tree


def nvidia_smi() -> str:
    return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                           "--format=csv,noheader"], capture_output=True, text=True
                          ).stdout.strip() or "(no GPU processes)"


def holdings(pid: int) -> tuple[dict[str, int], dict[str, int]]:
    """What a rank holds: its descriptors' targets and its mappings of the
    GPU's device files and of shared memory, counted by name."""
    fds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[re.sub(r"\[\d+\]", "[N]", os.readlink(f"/proc/{pid}/fd/{fd}"))] += 1
        except OSError:
            continue
    maps: collections.Counter[str] = collections.Counter()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and re.search(r"nvidia|/dev/shm|memfd|SYSV", parts[5]):
            maps[re.sub(r"\d{3,}", "N", parts[5])] += 1
    return dict(fds), dict(maps)


def restore_each(drv: Driver, pids: list[int], say: Callable[..., None]) -> None:
    """The driver's restore of each process, then its unlock, each answer
    printed as the driver gave it (a failure does not stop the others)."""
    for step, call in (("restore", drv.restore), ("unlock", drv.unlock)):
        for p in pids:
            t = time.monotonic()
            try:
                call(p)
                say(f"{step} {p}: ok {time.monotonic() - t:.2f}s")
            except CudaError as e:
                say(f"{step} {p}: {e.message}; state {drv.state(p)!r}")


def suspend_and_restore(drv: Driver, pids: list[int], say: Callable[..., None], *,
                        pause: float, again: bool = False) -> None:
    """Suspend ``pids`` as smr does (all locked, then all checkpointed), wait
    ``pause`` s, restore and unlock each; ``again``: those still CHECKPOINTED
    once more, every other one running again. Every answer printed."""
    t = time.monotonic()
    try:
        took = asyncio.run(CudaCheckpoint(drv, lock_timeout_s=10).suspend_all(pids))
    except CudaError as e:
        say(f"suspend failed after {time.monotonic() - t:.2f}s: {e.code}: {e.message}; "
            f"states {[drv.state(p) for p in pids]}")
        return
    say(f"suspended {pids}: {took} in {time.monotonic() - t:.2f}s; states "
        f"{[drv.state(p) for p in pids]}; nvidia-smi: {nvidia_smi()}")
    time.sleep(pause)
    restore_each(drv, pids, say)
    if again:
        time.sleep(pause)
        restore_each(drv, [p for p in pids if drv.state(p) is CudaState.CHECKPOINTED], say)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["p2p", "net", "shm"], required=True)
    ap.add_argument("--interval", default="0.05")
    ap.add_argument("--steps", default="300")
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    a = ap.parse_args()
    env = dict(os.environ, NCCL_DEBUG="INFO")
    if a.variant == "net":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_NVLS_ENABLE="0")
    elif a.variant == "shm":  # P2P off, NCCL's shared-memory transport on
        env.update(NCCL_P2P_DISABLE="1")
    tag = f"{a.variant}-{a.interval}{'-ref' if a.ref else ''}"
    job_log = a.out / f"nccl-{tag}-job.log"
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tests.workloads.ddp_train", "--steps", a.steps, "--interval", a.interval],
        env=env, stdout=job_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def step() -> int:
        m = re.findall(r"step=(\d+)", job_log.read_text())
        return int(m[-1]) if m else 0

    def say(*what: object) -> None:
        print(f"[nccl {tag}]", *what, flush=True)

    if not a.ref:
        t0 = time.monotonic()
        while step() < 20 and job.poll() is None and time.monotonic() - t0 < 180:
            time.sleep(0.5)
        drv = driver()
        ranks = [p for p in process_tree(job.pid) if drv.state(p) is not None]
        say(f"at step {step()}: ranks {ranks}")
        for r in ranks:
            fds, maps = holdings(r)
            say(f"rank {r} descriptors: {fds}")
            say(f"rank {r} mappings: {maps}")
        say("nvidia-smi:", nvidia_smi())
        at = step()
        suspend_and_restore(drv, ranks, say, pause=2.0)
        say(f"steps while held: {step() - at}")
    try:
        job.wait(240)
    except subprocess.TimeoutExpired:
        say(f"the job still runs at step {step()} 240 s on: killed")
        os.killpg(job.pid, 9)
    text = job_log.read_text()
    say("final:", re.findall(r"final=\S+ ranks_agree=\S+", text), "exit", job.returncode)
    say("NCCL transports:", sorted(set(re.findall(r"via (\S+)", text)))[:10])
    return 0


if __name__ == "__main__":
    sys.exit(main())
