"""A stateful GPU sample workload (PyTorch): a counter tensor incremented on
the GPU each step, and a seeded random tensor that never changes. Each line
carries the step, whether every counter element equals it, and a fingerprint
of the random tensor: a restored job that goes on with the next step, ok=True
and the first line's fingerprint has its GPU memory intact.

    python -m tests.workloads.gpu_counter --gib 8 [--interval 0.1] [--busy-s 5]

``--busy-s`` keeps a spinning kernel on the GPU for that long each step: a job
whose GPU work cannot reach a lockable point quickly (the lock-timeout test).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

SEED = 20261121
CHUNK = 1 << 26  # elements summed at once (the int64 copy stays at 512 MiB)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--busy-s", type=float, default=0.0)
    a = ap.parse_args()
    n = int(a.gib * 2**30) // 4 // 2  # int32 elements in each of the two tensors
    counter = torch.zeros(n, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    fixed = torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda", generator=gen)

    def fingerprint() -> int:
        total = 0
        for i in range(0, n, CHUNK):
            c = fixed[i : i + CHUNK].to(torch.int64)
            total += int((c * (torch.arange(c.numel(), device="cuda") % 65521 + 1)).sum())
        return total

    cycles_per_s = _spin_rate(torch) if a.busy_s else 0.0
    step = 0
    while True:
        step += 1
        if a.busy_s:
            torch.cuda._sleep(int(a.busy_s * cycles_per_s))
        counter.add_(1)
        torch.cuda.synchronize()
        ok = int(counter.min()) == int(counter.max()) == step
        print(f"step={step} ok={ok} fp={fingerprint()} gib={a.gib:g}", flush=True)
        time.sleep(a.interval)


def _spin_rate(torch: Any) -> float:
    """GPU clock cycles per second, as ``torch.cuda._sleep`` counts them."""
    t = time.monotonic()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / (time.monotonic() - t)


if __name__ == "__main__":
    main()
