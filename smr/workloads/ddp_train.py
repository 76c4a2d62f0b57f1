"""Two processes on two GPUs with NCCL for the GPU frameworks matrix (issue
#26): an MLP under DistributedDataParallel, its gradients all-reduced by NCCL
every step, started by torchrun as a user would. Each rank draws its own
batch i from a generator seeded with i and its rank, so a run is the same
whenever it is interrupted. Rank 0 prints each step and, at the end,
``final=<sha256>`` of the weights and the optimizer state (equal on every
rank after the all-reduce), to compare with an uninterrupted run.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m smr.workloads.ddp_train --steps 300
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
    a = ap.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda", local)
    w = a.width
    model = torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(),
                                torch.nn.Linear(4 * w, w)).to(dev)
    ddp = DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    # GPU memory a checkpoint must carry, with content to check after a restore.
    ballast = torch.arange(int(a.gib * 2**30) // 4, device=dev, dtype=torch.float32) % 1021
    ballast_sum = float(ballast.sum().item())
    for i in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(SEED + 2 * i + rank)
        x = torch.randn(256, w, generator=g).to(dev)
        loss = ((ddp(x) - torch.sin(x)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()  # NCCL all-reduces the gradients here
        opt.step()
        if rank == 0:
            print(f"step={i} loss={loss.item():.6f}", flush=True)
        time.sleep(a.interval)
    torch.cuda.synchronize()
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
