"""Deterministic PyTorch training loops for the GPU frameworks matrix
(docs/compatibility.md): an MLP trained by SGD with momentum, optionally compiled
(``--compile default``: Inductor's Triton kernels; ``reduce-overhead``: CUDA
graphs too), optionally fed by a DataLoader with worker processes and pinned
memory (``--loader``: num_workers=2, pin_memory=True, persistent_workers=True).
Each line carries the step and the loss; the last says ``final=<sha256>`` of
the weights and the optimizer state, to compare with an uninterrupted run.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m tests.workloads.torch_train \\
        --steps 300 [--compile reduce-overhead] [--loader [--spawn]] [--gib 1]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

SEED = 20261126


class Batches:
    """Batch i is drawn from a generator seeded with i: the same data whatever
    worker makes it and whenever."""

    def __init__(self, steps: int, width: int) -> None:
        self.steps, self.width = steps, width

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> Any:
        import torch

        g = torch.Generator().manual_seed(SEED + i)
        x = torch.randn(256, self.width, generator=g)
        return x, torch.sin(x)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--compile", choices=["none", "default", "reduce-overhead"], default="none")
    ap.add_argument("--loader", action="store_true")
    ap.add_argument("--spawn", action="store_true", help="DataLoader workers started by spawn")
    a = ap.parse_args()

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda")
    w = a.width
    model = torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(),
                                torch.nn.Linear(4 * w, w)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ballast = torch.rand(int(a.gib * 2**30) // 4, device=dev,
                         generator=torch.Generator(device=dev).manual_seed(SEED))
    ballast_sum = float(ballast.double().sum())

    def train_step(x: Any, y: Any) -> Any:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    if a.compile == "reduce-overhead":
        # CUDA graphs: the model's forward and backward are replayed graphs
        # (compiling the whole step would read the loss after the next
        # replay overwrote it); each step is marked as a new iteration.
        compiled = torch.compile(model, mode="reduce-overhead")

        def graphed_step(x: Any, y: Any) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            loss = torch.nn.functional.mse_loss(compiled(x), y)
            loss.backward()
            return loss.detach().clone()

        step_fn = graphed_step
    else:
        step_fn = train_step if a.compile == "none" else torch.compile(train_step)
    data = Batches(a.steps, w)
    if a.loader:
        batches: Any = torch.utils.data.DataLoader(
            data, batch_size=None, shuffle=False, num_workers=2, pin_memory=True,
            persistent_workers=True, multiprocessing_context="spawn" if a.spawn else None)
    else:
        batches = (data[i] for i in range(a.steps))

    def digest() -> str:
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().cpu().numpy().tobytes())
        for st in opt.state.values():
            h.update(st["momentum_buffer"].cpu().numpy().tobytes())
        return h.hexdigest()

    for i, (x, y) in enumerate(batches, start=1):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        # CUDA graphs: a gradient is an output of the last replay, which the
        # next overwrites; accumulating into it fails (fresh ones each step).
        opt.zero_grad(set_to_none=a.compile == "reduce-overhead")
        loss = step_fn(x, y)
        opt.step()
        line = f"step={i} loss={float(loss):.8f}"
        if i % 10 == 0:
            line += f" hash={digest()[:16]}"
        print(line, flush=True)
        time.sleep(a.interval)
    ok = float(ballast.double().sum()) == ballast_sum
    print(f"final={digest()} ballast_ok={ok} steps={a.steps} compile={a.compile} "
          f"loader={a.loader} device={torch.cuda.get_device_name()}", flush=True)


if __name__ == "__main__":
    main()
