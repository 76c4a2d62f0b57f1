"""Can the CUDA driver restore a process onto another GPU than it was
checkpointed on (CUcheckpointRestoreArgs.gpuPairs, issue #28)? At the
driver's level (no CRIU), on a machine with two GPUs of one model:

    python3 bench/gpu_pairs_probe.py

A small deterministic PyTorch loop with 1 GiB of GPU ballast runs on GPU 0;
it is locked and checkpointed, then restored with each mapping below, and
unlocked; nvidia-smi says where it runs after, and its final hash is
compared with an uninterrupted run's. ``swap``: both GPUs named, 0→1 and
1→0; ``one``: only the GPU it used, 0→1; ``same``: each onto itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from smr.gpu.cuda_checkpoint import driver
from smr.gpu.driver import CudaError

PROGRAM = r'''
import hashlib, sys, time, torch
d = torch.device("cuda", 0)
x = torch.arange(2**20, device=d, dtype=torch.float32) / 2**20
w = torch.ones(1024, 1024, device=d) / 1024
ballast = torch.arange(2**28, device=d, dtype=torch.float32) % 977
total = float(ballast.sum().item())
for i in range(int(sys.argv[1])):
    x = torch.tanh(x.view(1024, 1024) @ w + i * 1e-3).flatten()
    print("step", i, flush=True)
    time.sleep(0.05)
assert float(ballast.sum().item()) == total, "the ballast changed"
print("final", hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest(), flush=True)
'''


def where() -> str:
    return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                           "--format=csv,noheader"], capture_output=True, text=True
                          ).stdout.strip() or "(none)"


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.split()
    print("[pairs] GPUs:", gpus, flush=True)
    if len(gpus) < 2:
        print("[pairs] needs two GPUs", flush=True)
        return 0
    g0, g1 = gpus[:2]
    drv = driver()
    for tag, pairs in [("ref", None), ("swap", [(g0, g1), (g1, g0)]), ("one", [(g0, g1)]),
                       ("same", [(g0, g0), (g1, g1)])]:
        log = out / f"pairs-{tag}-job.log"
        job = subprocess.Popen([sys.executable, "-c", PROGRAM, "200"], stdout=log.open("w"),
                               stderr=subprocess.STDOUT,
                               env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1"))
        while "step 20\n" not in log.read_text() and job.poll() is None:
            time.sleep(0.2)
        if pairs is not None:
            print(f"[pairs {tag}] before: {where()}", flush=True)
            drv.lock(job.pid, 5)
            drv.checkpoint(job.pid)
            t = time.monotonic()
            try:
                drv.restore(job.pid, pairs)
                print(f"[pairs {tag}] restore with {pairs}: ok {time.monotonic() - t:.2f}s",
                      flush=True)
            except CudaError as e:
                print(f"[pairs {tag}] restore with {pairs}: {e.message}", flush=True)
                try:
                    drv.restore(job.pid)
                    print(f"[pairs {tag}] restore without pairs: ok", flush=True)
                except CudaError as e2:
                    print(f"[pairs {tag}] restore without pairs: {e2.message}", flush=True)
            try:
                drv.unlock(job.pid)
            except CudaError as e:
                print(f"[pairs {tag}] unlock: {e.message}", flush=True)
            time.sleep(1)
            print(f"[pairs {tag}] after: {where()}", flush=True)
        try:
            job.wait(120)
        except subprocess.TimeoutExpired:
            job.kill()
            print(f"[pairs {tag}] hung: killed", flush=True)
        text = log.read_text()
        print(f"[pairs {tag}] exit {job.returncode}", re.findall(r"final \S+", text),
              text.strip().splitlines()[-1][:300] if text.strip() else "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
