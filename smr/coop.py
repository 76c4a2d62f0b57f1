"""The cooperative path: a distributed training job that smr can checkpoint
while its ranks talk over NVLink/P2P. The training script adds one line:

    import smr.coop

Driver 580 cannot restore a process that maps another's GPU memory, as
NCCL's P2P transport does between ranks. So on smr's request, before the GPU
lock, every rank reaches the same step boundary (the end of an optimizer
step), destroys its process group (the NCCL communicators, and with them the
imported memory), says so, and waits. smr checkpoints the tree. When the
request is gone (the heartbeat is stored, the checkpoint was refused, or
this is the restored copy) every rank builds the process group again, under
a new store prefix, and training goes on. The protocol is smr/gpu/coopproto.py;
without ``SMR_COOP_DIR`` (a job smr did not start) nothing here runs.

Imports the standard library and torch only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from smr.gpu.coopproto import ENV, Rank


class _Torch:
    """The torch side: a flag all-reduced at each boundary, read one
    boundary later (so no step waits for it), then the pause."""

    def __init__(self, directory: Path) -> None:
        self.torch, self.dist = torch, dist
        self.proto = Rank(directory, dist.get_rank(), dist.get_world_size())
        self.proto.register()
        self.backend = dist.get_backend()
        self.store = dist.distributed_c10d._get_default_store()
        self.pauses = 0
        self.work: Any = None
        self._flag_tensors()

    def _flag_tensors(self) -> None:
        torch = self.torch
        cuda = self.backend == "nccl"
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.flag = torch.zeros(1, dtype=torch.int32, device=dev)
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def boundary(self) -> None:
        if self._agreed():
            self._pause()
        self._post(self.proto.requested())

    def _post(self, want: bool) -> None:
        self.flag.fill_(1 if want else 0)
        self.work = self.dist.all_reduce(self.flag, op=self.dist.ReduceOp.MAX, async_op=True)
        if self.event is not None:
            # Ordered after the all-reduce on this stream; the next boundary
            # waits for this event alone, not for the step in between.
            self.work.wait()
            self.host.copy_(self.flag, non_blocking=True)
            self.event.record()

    def _agreed(self) -> bool:
        if self.work is None:
            return False
        if self.event is not None:
            self.event.synchronize()
            return bool(self.host.item())
        self.work.wait()
        return bool(self.flag.item())

    def _pause(self) -> None:
        torch, dist = self.torch, self.dist
        cuda = self.event is not None
        if cuda:
            torch.cuda.synchronize()
        rank, world = self.proto.rank, self.proto.world
        dist.destroy_process_group()
        self.work = None
        if cuda:
            torch.cuda.synchronize()
        answered = self.proto.acknowledge()
        self.proto.wait_released(answered)
        # A new prefix each time: the store keeps the keys of the groups
        # before (NCCL's unique id under the same names would be stale).
        self.pauses += 1
        store = dist.PrefixStore(f"smr-coop/{self.pauses}/", self.store)
        kw: dict[str, Any] = {}
        if cuda:
            kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world, **kw)
        self._flag_tensors()


_state: dict[str, Any] = {}


def _on_step(*_: Any) -> None:
    """After every optimizer step of the process: a step boundary."""
    d = os.environ.get(ENV)
    if not d:
        return
    if not dist.is_available() or not dist.is_initialized():
        return
    coop = _state.get("torch")
    if coop is None:
        coop = _state["torch"] = _Torch(Path(d))
    coop.boundary()


def _ddp_follows_the_current_group() -> None:
    """DDP keeps the process group it was built with; a group built again
    after a pause is another. A DDP on the default group gets torch's own
    all-reduce hook, which takes the default group at each call."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    init = DDP.__init__
    if getattr(init, "_smr_coop", False):
        return

    def __init__(self: DDP, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if kwargs.get("process_group") is None and kwargs.get("device_mesh") is None:
            self.register_comm_hook(None, default_hooks.allreduce_hook)

    __init__._smr_coop = True  # type: ignore[attr-defined]
    DDP.__init__ = __init__  # type: ignore[method-assign]


def enable() -> None:
    """What ``import smr.coop`` does: a boundary after each optimizer step,
    and DDP on the current default group. Idempotent."""
    if _state.get("enabled"):
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_on_step)
    _ddp_follows_the_current_group()
    _state["enabled"] = True


enable()
