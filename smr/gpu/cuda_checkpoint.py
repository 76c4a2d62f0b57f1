"""The CUDA driver's process checkpoint API, driven from another process.

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED   (GPU memory now in
    RUNNING <-unlock- LOCKED <--restore----- CHECKPOINTED    host memory, GPU free)

Between ``checkpoint`` and ``restore`` the process holds no GPU resources and
CRIU can dump it like any other. ``suspend`` brings the process back to
RUNNING if anything fails after the lock, and the steps call ``resume_all``
on any error of theirs, so a job is never left locked or checkpointed (the
failure other tools are known for). Calls go through ctypes on libcuda
(driver.py); each blocking call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from functools import cache
from pathlib import Path
from typing import Any

from smr.contract.errors import PermanentError, SmrError
from smr.gpu import frozen
from smr.gpu.driver import LOCK_TIMEOUT_HINT, CudaError, CudaLockTimeout, CudaState, Driver
from smr.process.tree import process_tree

# (checkpointed GPU's UUID, GPU to restore onto), one for every GPU the
# process had: smr.gpu.gpupairs decides them; None restores onto the same GPUs.
GpuPairs = list[tuple[str, str]] | None

log = logging.getLogger("smr.cuda")

# Rounds at locking a job's CUDA processes together (CudaCheckpoint._lock_all).
LOCK_ROUNDS = 3


class GpuStateLost(PermanentError):
    """A failure after the lock, and the driver did not bring every CUDA
    process of the job back to RUNNING: the job cannot go on (a CHECKPOINTED
    process blocks in every CUDA call, and a restore that failed once fails
    for good: later ones answer 304)."""
    code = "gpu-state-lost"


def lost_after(lost: GpuStateLost, failure: BaseException | None, what: str) -> GpuStateLost:
    """``lost``, its message saying what failed first (``failure``, after
    the GPU lock of ``what``) and that ``what`` was ended."""
    first = getattr(failure, "message", None) or (
        f"{type(failure).__name__}: {failure}" if failure else "")
    lost.message = (f"the checkpoint of {what} failed after its GPU was locked"
                    + (f" ({first})" if first else "") + f", and {lost.message}; "
                    f"{what} was ended")
    if isinstance(failure, SmrError) and failure.detail and not lost.detail:
        lost.detail = failure.detail
    return lost


def _stop_tree(tree: list[int]) -> None:
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGSTOP)


def _cont_tree(tree: list[int]) -> None:
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGCONT)


@cache
def driver() -> Driver:
    return Driver()


def available() -> bool:
    try:
        driver()
    except CudaError:
        return False
    return True


async def _finished(fn: Any, *args: Any) -> None:
    """``fn(*args)`` in a thread; a cancel waits for the driver call to end
    before it propagates, so a rollback never runs beside a lock or a
    checkpoint still landing (it found the process RUNNING, did nothing, and
    the lock landed after: the job stayed LOCKED for good)."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.shield(fut)
        raise


class CudaCheckpoint:
    """The async engine the checkpointer and restorer use."""

    def __init__(self, drv: Driver | None = None, lock_timeout_s: float = 10.0,
                 hold_dir: Path | None = None, allow: tuple[str, ...] = ()) -> None:
        self._drv = drv
        self.lock_timeout_s = lock_timeout_s
        # The GPU gate's refusals this node lifts (smr.gpu.gpugate, SMR_GPU_ALLOW).
        self.allow = allow
        # Processes (pid, start time) whose restore the driver refused, and
        # its answer: a failure path must not try one again.
        self.refused: dict[tuple[int, str], CudaError] = {}
        # Where a held restore thread's own signal mask is kept (smr.gpu.frozen):
        # a directory that outlives the agent's process.
        self.hold_dir = hold_dir

    @property
    def drv(self) -> Driver:
        if self._drv is None:
            self._drv = driver()
        return self._drv

    async def state(self, pid: int) -> CudaState | None:
        return await asyncio.to_thread(self.drv.state, pid)

    async def processes(self, root: int) -> list[int]:
        """The processes of the tree under ``root`` that hold a CUDA context."""
        return [p for p in process_tree(root) if await self.state(p) is not None]

    async def suspend(self, pid: int) -> dict[str, float]:
        """RUNNING → CHECKPOINTED; on failure the process is left RUNNING."""
        return await self.suspend_all([pid])

    async def resume(self, pid: int, *, quiet: bool = False,
                     gpu_pairs: GpuPairs = None) -> dict[str, float]:
        """Whatever state it is in → RUNNING (restore if checkpointed, unlock
        if locked). ``quiet``: a best-effort recovery that logs instead of
        raising. ``gpu_pairs``: where a checkpointed process's GPU state goes
        (None: onto the GPUs it had)."""
        try:
            return await asyncio.to_thread(self._resume, pid, gpu_pairs)
        except CudaError:
            if not quiet:
                raise
            log.exception("could not bring process %d back to RUNNING", pid)
        return {}

    def _resume(self, pid: int, gpu_pairs: GpuPairs = None) -> dict[str, float]:
        out: dict[str, float] = {}
        st = self.drv.state(pid)
        t = time.monotonic()
        if st is CudaState.CHECKPOINTED:
            key = (pid, _started(pid))
            if key in self.refused:
                # Never twice: a second restore of a process the driver
                # refused fails for good (304), and hides the first answer.
                raise self.refused[key]
            try:
                if gpu_pairs:
                    self.drv.restore(pid, gpu_pairs)
                else:  # the call as it was before pairs: onto the same GPUs
                    self.drv.restore(pid)
            except CudaError as e:
                self.refused[key] = e
                raise
            out["cuda_restore"] = time.monotonic() - t
            st = self.drv.state(pid)
        t = time.monotonic()
        if st is CudaState.LOCKED:
            self.drv.unlock(pid)
            out["cuda_unlock"] = time.monotonic() - t
            st = self.drv.state(pid)
        if st is not CudaState.RUNNING:
            raise CudaError(f"process {pid} did not return to RUNNING (state "
                            f"{st and st.name})", hint="see the job's log; the GPU "
                            "state may be lost, restore the last checkpoint")
        return out

    async def resume_stopped(self, tree: list[int],
                             gpu_pairs: GpuPairs = None) -> dict[str, float]:
        """Like ``resume_all``, for a tree CRIU left stopped: each CUDA
        process gets its GPU state back while only the driver's restore
        thread runs, so none of its other threads can touch a GPU mapping
        before it is back (JAX's did, and died of SIGSEGV in libcuda). The
        caller continues the tree (SIGCONT) afterwards.

        The CUDA processes are those the driver names a restore thread for:
        ``cuCheckpointProcessGetState`` waits for the process itself, and
        never returned for a stopped one (H100, driver 580: 30 s and more),
        while ``cuCheckpointProcessGetRestoreThreadId`` answers at once."""
        total, failed = await self._restore_each(tree, gpu_pairs)
        if failed:
            for pid, e in failed[1:]:
                log.error("process %d: %s", pid, e.message)
            raise failed[0][1]
        return total

    async def _restore_each(self, tree: list[int], gpu_pairs: GpuPairs
                            ) -> tuple[dict[str, float], list[tuple[int, CudaError]]]:
        """Each CUDA process of the stopped ``tree`` restored once, through
        its restore thread alone, and checked RUNNING; every one is tried
        (a rank that failed must not keep its peers from coming back), and
        none twice (a second restore of one that failed answers 304)."""
        total: dict[str, float] = {}
        failed: list[tuple[int, CudaError]] = []
        for pid in tree:
            try:
                tid = await asyncio.to_thread(self.drv.restore_tid, pid)
            except CudaError:
                continue  # no CUDA context in this one
            try:
                if tid is None:  # a driver before 570: the threads run during the restore
                    os.kill(pid, signal.SIGCONT)
                    done = await asyncio.to_thread(self._resume, pid, gpu_pairs)
                else:
                    keep = self.hold_dir / f"{pid}-{tid}.sigmask" if self.hold_dir else None
                    done = await asyncio.to_thread(
                        frozen.with_only, pid, tid, lambda p=pid: self._resume(p, gpu_pairs),
                        keep)
            except (CudaError, frozen.FrozenError) as e:
                failed.append((pid, e))
                continue
            for k, v in done.items():
                total[k] = total.get(k, 0.0) + v
        return total, failed

    async def recover_tree(self, root: int) -> None:
        """After a failure past the lock: the tree under ``root`` held
        stopped by smr itself (CRIU thaws a tree whose dump failed, even
        with --leave-stopped), every CUDA process of it restored once and
        checked RUNNING through the driver, and only then continued.

        Raises GpuStateLost naming each process that did not come back, its
        tree left stopped for the caller to end: it cannot run on (each of
        its CUDA calls would block for good)."""
        tree = process_tree(root)
        _stop_tree(tree)
        try:
            await asyncio.to_thread(frozen.wait_stopped, tree)
        except frozen.FrozenError as e:  # a thread in the kernel: restore anyway
            log.warning("the tree of %d did not stop for its GPU restore: %s", root, e)
        _, failed = await self._restore_each(tree, None)
        # A process the driver named at the lock but not now (gone, or its
        # context torn down) is not one this checkpoint lost.
        if failed:
            raise GpuStateLost(
                "the GPU state of " + "; ".join(
                    f"process {pid} ({_comm(pid)}) could not be restored: {e.message}"
                    for pid, e in failed),
                detail=",".join(str(p) for p, _ in failed),
                hint="the driver checkpointed it and cannot give it back (a second try "
                     "fails for good); restart the job from its latest checkpoint or its "
                     "own; docs/gpu.md says which jobs the driver cannot restore")
        _cont_tree(tree)

    async def suspend_all(self, pids: list[int]) -> dict[str, float]:
        """Every CUDA process of a job, or none: a failure resumes those done.

        Every process is locked before any is checkpointed. Had a rank been
        checkpointed while a peer ran on, the driver could refuse to restore
        it (CUDA_ERROR_NOT_SUPPORTED, two H200s, DDP) and the job would hang
        for good; a rank only locked is always unlocked. See ``_lock_all``
        for why the locks may take more than one round."""
        total: dict[str, float] = {"cuda_lock": 0.0, "cuda_checkpoint": 0.0}
        for pid in pids:
            st = await self.state(pid)
            if st is not CudaState.RUNNING:
                raise CudaError(
                    f"process {pid} is in CUDA state {st and st.name}, not RUNNING",
                    hint="a previous checkpoint did not finish; see the agent's log")
        try:
            t = time.monotonic()
            await self._lock_all(pids)
            total["cuda_lock"] = time.monotonic() - t
            for pid in pids:
                t = time.monotonic()
                await _finished(self.drv.checkpoint, pid)
                total["cuda_checkpoint"] += time.monotonic() - t
        except BaseException as e:
            await asyncio.shield(self._roll_back(pids, e))
            raise
        return total

    async def _roll_back(self, pids: list[int], cause: BaseException) -> None:
        """``pids`` RUNNING again after a failed suspend; GpuStateLost (from
        ``cause``) naming any the driver did not give back."""
        lost = []
        for pid in pids:
            try:
                await asyncio.to_thread(self._resume, pid, None)
            except CudaError as e:
                lost.append(f"process {pid} ({_comm(pid)}): {e.message}")
        if lost:
            what = getattr(cause, "message", None) or f"{type(cause).__name__}: {cause}"
            raise GpuStateLost(
                f"the GPU checkpoint failed ({what}) and the GPU state of " + "; ".join(lost)
                + " could not be brought back",
                hint="restart the job from its latest checkpoint or its own") from cause

    async def _lock_all(self, pids: list[int]) -> None:
        """Lock ``pids`` one after another; raises with each left RUNNING or
        LOCKED, for the caller's rollback.

        Processes that wait on one another's GPU work (NCCL's ranks: each
        collective completes once every rank has launched it) lock together
        only where none has launched a collective the others have not: a lock
        stops the process's launches at once, then waits for what it launched
        (the driver's documented order). A rank ahead of a peer locked before
        it waits for that peer for good, and its lock times out. Locked first,
        it waits only until the peers, still running, catch up; then they
        lock at once. So a round where a process's lock timed out unlocks the
        others and starts again with that one first (``LOCK_ROUNDS`` rounds,
        within the one lock timeout)."""
        rounds = 1 if len(pids) == 1 else LOCK_ROUNDS
        timeout_s = self.lock_timeout_s / rounds
        order = list(pids)
        for n in range(1, rounds + 1):
            locked: list[int] = []
            try:
                for pid in order:
                    await _finished(self.drv.lock, pid, timeout_s)
                    locked.append(pid)
                return
            except CudaLockTimeout as e:
                late = order[len(locked)]
                if rounds == 1:
                    raise
                if n == rounds:
                    raise CudaLockTimeout(
                        f"the job's CUDA processes {pids} could not all be locked in {rounds} "
                        f"rounds of {timeout_s:g}s; the last to time out: {e.message}",
                        hint=LOCK_TIMEOUT_HINT) from None
                # The others go back to work, so the collective it waits on completes.
                await asyncio.shield(self.resume_all(locked, quiet=True))
                log.info("CUDA process %d of %s did not lock after %s (round %d of %d); "
                         "trying again with it first", late, pids, locked, n, rounds)
                order = [late, *(p for p in order if p != late)]

    async def resume_all(self, pids: list[int], *, quiet: bool = False,
                         gpu_pairs: GpuPairs = None) -> dict[str, float]:
        total: dict[str, float] = {}
        for pid in pids:
            for k, v in (await self.resume(pid, quiet=quiet, gpu_pairs=gpu_pairs)).items():
                total[k] = total.get(k, 0.0) + v
        return total

    async def resume_tree(self, root: int, *, quiet: bool = False,
                          gpu_pairs: GpuPairs = None) -> dict[str, float]:
        """Every CUDA process of the tree under ``root`` RUNNING again, and the
        tree continued. A tree CRIU left stopped gets its GPU state back
        before any of its threads runs (``resume_stopped``). ``gpu_pairs``:
        a restore's, for every CUDA process of the tree (the manifest records
        the job's GPUs, not each process's)."""
        tree = process_tree(root)
        held = [p for p in tree if frozen.stopping(p)]
        if not held:
            return await self.resume_all(await self.processes(root), quiet=quiet,
                                         gpu_pairs=gpu_pairs)
        try:
            # CRIU's SIGSTOP may still be on its way: a thread that took it
            # after the hold began would stop the tree again once continued.
            await asyncio.to_thread(frozen.wait_stopped, held)
            return await self.resume_stopped(tree, gpu_pairs)
        except (CudaError, frozen.FrozenError):
            if not quiet:
                raise
            log.exception("could not bring the tree of %d back to RUNNING", root)
            return {}
        finally:
            for p in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)

    async def resume_after(self, writer: asyncio.Task[Any], root: int,
                           durations: dict[str, float], frozen_at: float) -> None:
        """A heartbeat: the job runs again as soon as ``writer`` (the dump)
        has its image; the upload goes on behind. On a failed dump the caller
        resumes it. ``root``: the tree the dump left stopped (a local job's or
        a pod container's workload, by host PID)."""
        await asyncio.wait([writer])
        # A cancelled dump is a failed one (the caller resumes the tree);
        # asking its exception would raise the cancel here instead.
        if not writer.cancelled() and writer.exception() is None:
            durations.update(await self.resume_tree(root))
            # Wall clock from the lock to the unlock: what the job lost.
            durations["downtime"] = time.monotonic() - frozen_at


def _started(pid: int) -> str:
    """The process's start time (ticks since boot): a reused pid differs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2:].split()[19]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


def for_settings(gpu: str, lock_timeout_s: float, hold_dir: Path | None = None,
                 allow: tuple[str, ...] = ()) -> CudaCheckpoint | None:
    """The engine for a node (SMR_GPU, SMR_CUDA_LOCK_TIMEOUT, SMR_GPU_ALLOW);
    None where the driver has no checkpoint API or GPU checkpoints are off."""
    if gpu == "auto" and available():
        return CudaCheckpoint(lock_timeout_s=lock_timeout_s, hold_dir=hold_dir, allow=allow)
    return None


