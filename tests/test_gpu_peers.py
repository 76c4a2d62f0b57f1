"""A job of several CUDA processes that wait on one another's GPU work, as
NCCL's ranks do, through the checkpoint engine (smr.gpu.cuda_checkpoint) with a
**stand-in** driver (no GPU here) that behaves as the real one did on two
H200s with a DDP job (bench/results/frameworks-ddp-nccl-h200x2-2026-11-24.log):
the second rank's lock times out (CUDA_ERROR_NOT_READY: its all-reduce waits
for the first rank, which can launch nothing while locked), and a rank
checkpointed while its peer runs cannot be restored
(cuCheckpointProcessRestore: CUDA_ERROR_NOT_SUPPORTED)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.gpu.driver import CudaError, CudaLockTimeout, CudaState
from tests.test_nothing_lost import StandInDriver

# The ranks launch a collective every PERIOD seconds, at offsets of a fraction
# of it: wide enough that a loaded 2-core machine (a thread woken late, the
# loop's next lock dispatched late) keeps the order the test sets up. A lock
# waits at most about a period for a peer to catch up; LOCK_S only bounds a
# hang, since a lock that can never complete answers at once (see lock).
PERIOD = 1.0
LOCK_S = 60.0
READY_S = 30.0  # bounds a hang only: a thread that never starts


class CollectiveRanks(StandInDriver):
    """**Stand-in** ranks of an NCCL job, in time: rank ``i`` launches
    collective ``k`` at ``k * period + offsets[i]`` (a rank with the smaller
    offset runs ahead, as a rank that never syncs its CPU with the GPU
    does). As the driver documents its lock: it stops the rank's launches at
    once, then waits (up to its timeout) for what the rank launched to
    complete, that is, for every peer to launch as many; a collective a peer
    never launches is never waited out (CUDA_ERROR_NOT_READY). ``stuck``:
    ranks that launch nothing more (a rank hung in its own code). A rank
    checkpointed while a peer ran cannot be restored (as measured). A lock
    that waits on peers all locked behind it (none can launch again) fails
    at once with the driver's answer, rather than after the timeout."""

    def __init__(self, offsets: dict[int, float], period: float = PERIOD,
                 stuck: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.launched = dict.fromkeys(offsets, 0)
        self.blocked: set[int] = set()
        self.unrestorable: set[int] = set()  # checkpointed while a peer ran
        self.cv = threading.Condition()
        self.done = threading.Event()
        for p in offsets:
            self.states[p] = CudaState.RUNNING
        start = time.monotonic()
        for p, offset in offsets.items():
            if p not in stuck:
                threading.Thread(target=self._launch, args=(p, start + offset, period),
                                 daemon=True).start()

    def _launch(self, pid: int, first: float, period: float) -> None:
        k = 0
        while not self.done.wait(max(0.0, first + k * period - time.monotonic())):
            with self.cv:
                while pid in self.blocked and not self.done.is_set():
                    self.cv.wait(0.05)
                self.launched[pid] += 1
                self.cv.notify_all()
            k += 1

    def lock(self, pid: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cv:
            self.blocked.add(pid)
            while self.launched[pid] > min(self.launched.values()):
                behind = [p for p, n in self.launched.items() if n < self.launched[pid]]
                if all(p in self.blocked for p in behind) or not self.cv.wait(
                        max(0.0, deadline - time.monotonic())):
                    self.blocked.discard(pid)
                    self.cv.notify_all()
                    raise CudaLockTimeout(
                        f"process {pid} did not reach a point where its GPU work could be "
                        f"locked within {timeout_s:g}s (CUDA_ERROR_NOT_READY)")
        super().lock(pid, timeout_s)

    def launching(self, pids: list[int], ahead: bool = False,
                  timeout_s: float = READY_S) -> None:
        """Wait until each of ``pids`` has launched a collective (the job
        runs) and, with ``ahead``, one rank has launched more than another."""
        def ready() -> bool:
            n = [self.launched[p] for p in pids]
            return min(n) > 0 and (not ahead or max(n) > min(n))

        with self.cv:
            assert self.cv.wait_for(ready, timeout_s), (
                f"the stand-in ranks {pids} were not running (ahead={ahead}) after "
                f"{timeout_s:g}s: {self.launched}")

    def unlock(self, pid: int) -> None:
        super().unlock(pid)
        with self.cv:
            self.blocked.discard(pid)
            self.cv.notify_all()

    def checkpoint(self, pid: int) -> None:
        super().checkpoint(pid)
        if any(st is CudaState.RUNNING for st in self.states.values()):
            self.unrestorable.add(pid)

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        if pid in self.unrestorable:
            raise CudaError("cuCheckpointProcessRestore failed: CUDA_ERROR_NOT_SUPPORTED (801)")
        super().restore(pid, gpu_pairs)


@pytest.fixture
def ranks() -> Iterator[list[CollectiveRanks]]:
    made: list[CollectiveRanks] = []
    yield made
    for r in made:
        r.done.set()


async def test_a_rank_that_cannot_be_locked_leaves_every_rank_running(
        ranks: list[CollectiveRanks]) -> None:
    """The checkpoint fails (a rank waits on a collective its hung peer never
    launches), and every rank is RUNNING after it: the job goes on. Before
    dd6c6f2 the first rank was checkpointed before the second was locked,
    its restore was refused, and the job hung for good on the H200s."""
    drv = CollectiveRanks({101: 0.0, 102: 0.0}, stuck=frozenset({101}))
    ranks.append(drv)
    await asyncio.to_thread(drv.launching, [102])  # a collective 101 never will
    cuda = CudaCheckpoint(drv, lock_timeout_s=0.3)  # type: ignore[arg-type]
    with pytest.raises(CudaLockTimeout, match="could not all be locked in 3 rounds"):
        await cuda.suspend_all([101, 102])
    assert drv.states == {101: CudaState.RUNNING, 102: CudaState.RUNNING}


@pytest.mark.parametrize("offsets", [
    {201: 0.96 * PERIOD, 202: 0.0},  # 202 runs ahead nearly always: its lock waits on 201
    {301: 0.9 * PERIOD, 302: 0.6 * PERIOD, 303: 0.0},
], ids=["two-ranks", "three-ranks"])
async def test_ranks_running_ahead_of_one_another_lock_together(
        ranks: list[CollectiveRanks], offsets: dict[int, float]) -> None:
    """Ranks whose collectives are launched at different moments, the later
    ranks locked first by the old order: every rank is locked, checkpointed
    and restored, and each had launched as many collectives as the others
    (none was left waiting on a peer). Before, one round of locks in the
    job's order: the rank ahead waited on its locked peer and timed out
    (nine runs in ten, for the two ranks' offsets here)."""
    drv = CollectiveRanks(offsets)
    ranks.append(drv)
    await asyncio.to_thread(drv.launching, list(offsets), True)  # one runs ahead
    cuda = CudaCheckpoint(drv, lock_timeout_s=LOCK_S)  # type: ignore[arg-type]
    pids = list(offsets)
    took = await cuda.suspend_all(pids)
    assert set(took) == {"cuda_lock", "cuda_checkpoint"}
    assert drv.states == dict.fromkeys(pids, CudaState.CHECKPOINTED)
    assert len(set(drv.launched.values())) == 1, drv.launched
    await cuda.resume_all(pids)
    assert drv.states == dict.fromkeys(pids, CudaState.RUNNING)


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
    assert drv.restored_onto == [(201, None), (202, None)]  # no pairs: the same GPUs


async def test_every_process_of_a_job_is_restored_with_the_restores_gpu_pairs() -> None:
    """A restore onto other GPUs (smr.gpu.gpupairs) hands each CUDA process of
    the job the same pairs (the manifest records the job's GPUs); a
    suspend's own rollback passes none."""
    drv = StandInDriver()
    drv.states.update({201: CudaState.RUNNING, 202: CudaState.RUNNING})
    cuda = CudaCheckpoint(drv, lock_timeout_s=0.1)  # type: ignore[arg-type]
    await cuda.suspend_all([201, 202])
    pairs = [("GPU-00000000-0000-0000-0000-000000000000",
              "GPU-11111111-0000-0000-0000-000000000001")]
    await cuda.resume_all([201, 202], gpu_pairs=pairs)
    assert drv.restored_onto == [(201, pairs), (202, pairs)]
    assert drv.states == {201: CudaState.RUNNING, 202: CudaState.RUNNING}


async def test_a_cancel_during_a_lock_leaves_the_process_running() -> None:
    """The checkpoint is cancelled (the request's deadline, a shutdown) while
    the driver is still locking: the driver call runs on in its thread, so
    the rollback must wait for it. Before, the rollback found the process
    still RUNNING, did nothing, and the lock then landed: the job was left
    LOCKED, frozen for good."""
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


def test_a_restore_onto_other_gpus_hands_the_driver_its_documented_arguments() -> None:
    """``Driver.restore`` with GPU pairs builds CUcheckpointRestoreArgs as
    cuda.h lays it out (64 bytes: the pairs' address, their count, zeros),
    each pair the old GPU's 16 UUID bytes then the new one's. Checked against
    a recording **stand-in** for libcuda; no GPU here."""
    import ctypes

    from smr.gpu.driver import Driver

    got: list[bytes] = []

    class Lib:
        def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:
            raw = ctypes.string_at(ctypes.addressof(args._obj), 64)
            ptr = int.from_bytes(raw[:8], "little")
            count = int.from_bytes(raw[8:12], "little")
            got.extend([raw[12:], ctypes.string_at(ptr, 32 * count)])
            return 0

    drv = Driver.__new__(Driver)
    drv.cu = Lib()  # type: ignore[assignment]
    a, b = "GPU-00112233-4455-6677-8899-aabbccddeeff", "GPU-ffeeddcc-bbaa-9988-7766-554433221100"
    drv.restore(7, [(a, b), (b, a)])
    rest, pairs = got
    assert rest == bytes(52), "the reserved bytes must be zero"
    assert pairs == bytes.fromhex("00112233445566778899aabbccddeeff"
                                  + "ffeeddccbbaa99887766554433221100" * 2
                                  + "00112233445566778899aabbccddeeff")
    with pytest.raises(CudaError, match="not a GPU UUID"):
        drv.restore(7, [("GPU-1234", b)])


@pytest.mark.parametrize("rc", [801, 1, 304])
def test_a_restore_refused_is_not_blamed_on_a_cause_the_answer_cannot_tell(rc: int) -> None:
    """Driver 580 gives the same answers for a process with peer access
    between two GPUs (one JAX process, no IPC at all), one that imported
    another's GPU memory, and others: the error names the process and the
    driver's answer, and blames no cause the answer alone cannot tell. A
    recording **stand-in** for libcuda; no GPU here."""
    from smr.gpu.driver import Driver

    class Lib:
        def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:
            return rc

        def cuGetErrorName(self, rc: int, out: Any) -> int:
            return 1  # unnamed: the number is shown

    drv = Driver.__new__(Driver)
    drv.cu = Lib()  # type: ignore[assignment]
    with pytest.raises(CudaError) as failed:
        drv.restore(4242)
    assert failed.value.code == "cuda-checkpoint-failed"
    assert failed.value.message == f"cuCheckpointProcessRestore(4242) failed: {rc} ({rc})"
    assert "IPC" not in str(failed.value)


def test_a_restore_refused_with_gpu_pairs_says_what_the_pairs_must_name() -> None:
    """Another answer (out of memory) keeps the plain error; INVALID_VALUE
    where GPU pairs were given says what they must name (measured: a list
    missing one of the process's GPUs is refused so)."""
    from smr.gpu.driver import Driver

    answer = 2

    class Lib:
        def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:
            return answer

        def cuGetErrorName(self, rc: int, out: Any) -> int:
            return 1

    drv = Driver.__new__(Driver)
    drv.cu = Lib()  # type: ignore[assignment]
    with pytest.raises(CudaError) as failed:
        drv.restore(7)
    assert failed.value.code == "cuda-checkpoint-failed", failed.value.message
    answer = 1
    a = "GPU-00112233-4455-6677-8899-aabbccddeeff"
    with pytest.raises(CudaError) as failed:
        drv.restore(7, [(a, a)])
    assert failed.value.code == "cuda-checkpoint-failed", failed.value.message
    assert "must name every GPU the process had" in failed.value.message


async def test_a_heartbeat_whose_dump_was_cancelled_is_left_to_its_caller() -> None:
    """``resume_after`` waits for the dump: a cancelled dump is a failed one,
    left for the caller to resume; before, asking its exception raised the
    dump's cancel in the heartbeat as if the heartbeat itself were cancelled."""
    cuda = CudaCheckpoint(StandInDriver(), lock_timeout_s=1)
    resumed: list[int] = []

    async def resume_tree(root: int, **kw: Any) -> dict[str, float]:
        resumed.append(root)
        return {}

    cuda.resume_tree = resume_tree  # type: ignore[method-assign]
    dump = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    dump.cancel()
    durations: dict[str, float] = {}
    await cuda.resume_after(dump, 4242, durations, 0.0)
    assert resumed == [] and "downtime" not in durations
    done = asyncio.create_task(asyncio.sleep(0))
    await cuda.resume_after(done, 4242, durations, 0.0)
    assert resumed == [4242] and "downtime" in durations
