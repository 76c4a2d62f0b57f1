"""What the CUDA driver's checkpoint API does with two processes that share
GPU memory through CUDA IPC (issue #26), at the driver's level only (no
CRIU), on one GPU:

    python3 bench/cuda_ipc_probe.py [--out DIR]

NCCL's P2P transport between the ranks of one node maps each peer's buffers
through CUDA IPC: legacy handles (cudaIpcGetMemHandle) or, since NCCL 2.19,
the virtual memory API's exported handles (cuMemExportToShareableHandle,
POSIX file descriptors). PyTorch shares a CUDA tensor with another process
the same two ways: legacy handles by default, descriptors with
``expandable_segments``. So one GPU is enough to ask the driver the
question of the two-GPU NCCL job.

For each kind of handle and each choice of process to suspend (the
importer, the exporter, both, both with the
importer restored first), a fresh pair: the exporter fills a tensor and
hands it to the importer, which reads its sum every 50 ms. The probe prints
what each holds (descriptors, mappings of the GPU's files), suspends the
chosen ones as smr does (smr.cuda_checkpoint: locked, then checkpointed),
restores and unlocks them (a failed restore is tried once more after
the others run again), and checks that the importer still reads the
same sum. Every driver answer is printed as the driver gave it."""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

N = 1 << 24  # 64 MiB of float32


def _importer(q: object, log: str) -> None:
    import torch
    t = q.get()  # type: ignore[attr-defined]
    first = float(t.sum())
    with open(log, "a") as f:
        for i in range(100000):
            s = float(t.sum())
            f.write(f"role=importer pid={os.getpid()} step={i} same={s == first}\n")
            f.flush()
            time.sleep(0.05)
    del torch


def worker(log: str) -> None:
    import torch
    import torch.multiprocessing as mp
    mp.set_start_method("spawn")
    t = torch.arange(N, device="cuda", dtype=torch.float32)
    q = mp.Queue()
    p = mp.Process(target=_importer, args=(q, log), daemon=True)
    p.start()
    q.put(t)
    with open(log, "a") as f:
        for i in range(100000):
            t.add_(0)  # the exporter uses its memory too
            torch.cuda.synchronize()
            f.write(f"role=exporter pid={os.getpid()} step={i}\n")
            f.flush()
            time.sleep(0.05)


def holdings(pid: int) -> tuple[dict[str, int], dict[str, int]]:
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


def probe(kind: str, which: str, out: Path) -> None:
    from smr.cuda_checkpoint import CudaCheckpoint, CudaError, CudaState, driver

    tag = f"{kind}-{which}"
    log = out / f"ipc-{tag}.log"
    log.write_text("")
    env = dict(os.environ)
    if kind == "cumem":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    job = subprocess.Popen([sys.executable, __file__, "--worker", str(log)], env=env,
                           stdout=(out / f"ipc-{tag}-stdout.log").open("w"),
                           stderr=subprocess.STDOUT, start_new_session=True)

    def say(*what: object) -> None:
        print(f"[ipc {tag}]", *what, flush=True)

    def last(role: str) -> tuple[int, str, str]:
        m = re.findall(rf"role={role} pid=(\d+) step=(\d+)(?: same=(\S+))?", log.read_text())
        return (int(m[-1][0]), m[-1][1], m[-1][2]) if m else (0, "", "")

    t0 = time.monotonic()
    while (not last("importer")[0] or int(last("importer")[1] or 0) < 10) \
            and job.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.2)
    exp, imp = last("exporter")[0], last("importer")[0]
    if not exp or not imp:
        say("the pair did not start:", (out / f"ipc-{tag}-stdout.log").read_text()[-2000:])
        os.killpg(job.pid, 9)
        return
    drv = driver()
    for name, pid in (("exporter", exp), ("importer", imp)):
        fds, maps = holdings(pid)
        say(f"{name} {pid} state {drv.state(pid)!r} descriptors {fds}")
        say(f"{name} {pid} mappings {maps}")
    # both-rev: the importer restored first, its exporter still checkpointed.
    pids = {"importer": [imp], "exporter": [exp], "both": [exp, imp],
            "both-rev": [imp, exp]}[which]
    cuda = CudaCheckpoint(drv, lock_timeout_s=10)
    t = time.monotonic()
    try:
        took = asyncio.run(cuda.suspend_all(pids))
        say(f"suspended {pids}: {took} in {time.monotonic() - t:.2f}s; states "
            f"{[drv.state(p) for p in pids]}")
        time.sleep(1)
        for p in pids:
            try:
                drv.restore(p)
                say(f"restore {p}: ok")
            except CudaError as e:
                say(f"restore {p}: {e.message}; state {drv.state(p)!r}")
        for p in pids:
            try:
                drv.unlock(p)
                say(f"unlock {p}: ok")
            except CudaError as e:
                say(f"unlock {p}: {e.message}; state {drv.state(p)!r}")
        time.sleep(1)
        for p in pids:  # once more, every other one running again
            if drv.state(p) is CudaState.CHECKPOINTED:
                try:
                    drv.restore(p)
                    drv.unlock(p)
                    say(f"restore and unlock {p} again: ok")
                except CudaError as e:
                    say(f"restore {p} again: {e.message}; state {drv.state(p)!r}")
    except CudaError as e:
        say(f"suspend failed after {time.monotonic() - t:.2f}s: {e.code}: {e.message}; "
            f"states {[drv.state(p) for p in pids]}")
    at = int(last("importer")[1] or 0)
    time.sleep(2)
    _, step, same = last("importer")
    say(f"afterwards: importer steps {at} -> {step}, reads the same sum: {same}; "
        f"exporter at step {last('exporter')[1]}; pair alive: {job.poll() is None}")
    os.killpg(job.pid, 9)
    job.wait()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--kinds", default="legacy,cumem")
    ap.add_argument("--which", default="importer,exporter,both,both-rev")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for kind in a.kinds.split(","):
        for which in a.which.split(","):
            probe(kind, which, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
