"""Two processes on two GPUs with NCCL for the GPU frameworks matrix
(docs/compatibility.md): an MLP under DistributedDataParallel, its gradients all-reduced by NCCL
every step, started by torchrun as a user would. Each rank draws its own
batch i from a generator seeded with i and its rank, so a run is the same
whenever it is interrupted. Rank 0 prints each step and, at the end,
``final=<sha256>`` of the weights and the optimizer state (equal on every
rank after the all-reduce), to compare with an uninterrupted run.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m tests.workloads.ddp_train --steps 300

``--coop`` adds the one line of smr's cooperative path (``import smr.coop``,
docs/gpu.md), with which smr checkpoints ranks that use NCCL's P2P transport.
``--cpu`` runs on the CPU over gloo (the tests' stand-in for NCCL). At the
end, rank 0 prints ``rate=`` (steps per second after the first 20 steps).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

SEED = 20261124


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gib", type=float, default=0.5, help="GPU ballast per rank")
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--coop", action="store_true", help="import smr.coop")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    a = ap.parse_args()
    if a.coop:
        import smr.coop  # noqa: F401  (the one line a training script adds)

    local = int(os.environ["LOCAL_RANK"])
    if a.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    w = a.width
    model = torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(),
                                torch.nn.Linear(4 * w, w)).to(dev)
    ddp = DistributedDataParallel(model, device_ids=None if a.cpu else [local])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    # GPU memory a checkpoint must carry, with content to check after a restore.
    ballast = torch.arange(int(a.gib * 2**30) // 4, device=dev, dtype=torch.float32) % 1021
    ballast_sum = float(ballast.sum().item())
    t20 = time.monotonic()
    for i in range(1, a.steps + 1):
        if i == 21:
            t20 = time.monotonic()
        g = torch.Generator().manual_seed(SEED + 2 * i + rank)
        x = torch.randn(256, w, generator=g).to(dev)
        loss = ((ddp(x) - torch.sin(x)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()  # NCCL all-reduces the gradients here
        opt.step()
        if rank == 0:
            print(f"step={i} loss={loss.item():.6f}", flush=True)
        time.sleep(a.interval)
    if not a.cpu:
        torch.cuda.synchronize()
    rate = (a.steps - 20) / (time.monotonic() - t20) if a.steps > 20 else 0.0
    assert float(ballast.sum().item()) == ballast_sum, "the GPU ballast changed"
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    for state in opt.state.values():
        h.update(state["momentum_buffer"].cpu().numpy().tobytes())
    digest = torch.tensor(list(h.digest()), dtype=torch.uint8, device=dev)
    others = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(others, digest)
    same = all(bool((o == digest).all()) for o in others)
    if rank == 0:
        print(f"final={h.hexdigest()} ranks_agree={same}", flush=True)
        print(f"rate={rate:.2f} steps/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
