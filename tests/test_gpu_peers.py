"""A job of several CUDA processes that wait on one another's GPU work, as
NCCL's ranks do, through the checkpoint engine (smr.cuda_checkpoint) with a
**stand-in** driver (no GPU here) that behaves as the real one did on two
H200s with a DDP job (bench/results/frameworks-ddp-nccl-h200x2-2026-11-24.log):
the second rank's lock times out (CUDA_ERROR_NOT_READY: its all-reduce waits
for the first rank, which can launch nothing while locked), and a rank
checkpointed while its peer runs cannot be restored
(cuCheckpointProcessRestore: CUDA_ERROR_NOT_SUPPORTED)."""

from __future__ import annotations

import pytest

from smr.cuda_checkpoint import CudaCheckpoint, CudaError, CudaLockTimeout, CudaState
from tests.test_nothing_lost import StandInDriver


class PeersDriver(StandInDriver):
    """Ranks ``peers``: a lock waits for a collective that a locked or
    checkpointed peer will never join; a restore is refused while a peer is
    not checkpointed too."""

    def __init__(self, peers: list[int]) -> None:
        super().__init__()
        self.peers = peers
        for p in peers:
            self.states[p] = CudaState.RUNNING

    def lock(self, pid: int, timeout_s: float) -> None:
        if any(self.states[p] is not CudaState.RUNNING for p in self.peers if p != pid):
            raise CudaLockTimeout(f"process {pid} did not reach a point where its GPU work "
                                  f"could be locked within {timeout_s:g}s (CUDA_ERROR_NOT_READY)")
        super().lock(pid, timeout_s)

    def restore(self, pid: int) -> None:
        if any(self.states[p] is not CudaState.CHECKPOINTED for p in self.peers if p != pid):
            raise CudaError("cuCheckpointProcessRestore failed: CUDA_ERROR_NOT_SUPPORTED (801)")
        super().restore(pid)


async def test_a_rank_that_cannot_be_locked_leaves_every_rank_running() -> None:
    """The checkpoint fails (the job's GPU work cannot be locked), and every
    rank is RUNNING after it: the job goes on. Before, the first rank was
    checkpointed before the second was locked, its restore was refused, and
    the job hung for good on the H200s."""
    drv = PeersDriver([101, 102])
    cuda = CudaCheckpoint(drv, lock_timeout_s=0.1)  # type: ignore[arg-type]
    with pytest.raises(CudaLockTimeout, match="102"):
        await cuda.suspend_all([101, 102])
    assert drv.states == {101: CudaState.RUNNING, 102: CudaState.RUNNING}


async def test_ranks_all_locked_are_all_checkpointed_and_all_come_back() -> None:
    """Where every rank could be locked (the stand-in's lock only waits on a
    peer already locked), all are checkpointed and all are restored."""
    drv = StandInDriver()
    drv.states.update({201: CudaState.RUNNING, 202: CudaState.RUNNING})
    cuda = CudaCheckpoint(drv, lock_timeout_s=0.1)  # type: ignore[arg-type]
    took = await cuda.suspend_all([201, 202])
    assert set(took) == {"cuda_lock", "cuda_checkpoint"}
    assert drv.states == {201: CudaState.CHECKPOINTED, 202: CudaState.CHECKPOINTED}
    await cuda.resume_all([201, 202])
    assert drv.states == {201: CudaState.RUNNING, 202: CudaState.RUNNING}


async def test_a_cancel_during_a_lock_leaves_the_process_running() -> None:
    """The checkpoint is cancelled (the request's deadline, a shutdown) while
    the driver is still locking: the driver call runs on in its thread, so
    the rollback must wait for it. Before, the rollback found the process
    still RUNNING, did nothing, and the lock then landed: the job was left
    LOCKED, frozen for good."""
    import asyncio
    import threading

    entered, release, locked = threading.Event(), threading.Event(), threading.Event()

    class SlowLock(StandInDriver):
        def lock(self, pid: int, timeout_s: float) -> None:
            entered.set()
            release.wait(10)
            super().lock(pid, timeout_s)
            locked.set()

    drv = SlowLock()
    drv.states[301] = CudaState.RUNNING
    cuda = CudaCheckpoint(drv, lock_timeout_s=0.1)  # type: ignore[arg-type]
    task = asyncio.create_task(cuda.suspend_all([301]))
    await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    await asyncio.wait([task], timeout=1.0)  # the old code's rollback is done by then
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(locked.wait, 10)  # the driver's lock has landed
    assert drv.states == {301: CudaState.RUNNING}
