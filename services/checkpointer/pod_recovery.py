"""A pod container's checkpoint after a failure: its container brought back
after a failed dump, and, after its worker died mid-step, what the world
shows (a generation committed, a dump on disk, the container held) decides
whether the step finished, failed, or runs again."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

from services.checkpointer import endings, takeover
from services.checkpointer.pod_capture import _dumped_in, capture, captured
from services.containers import host
from services.containers.host import Shim
from services.containers.pods import PodContainer
from smr.bus import Progress
from smr.contract.errors import PermanentError, SmrError
from smr.contract.messages import CkptDone, CkptRequested
from smr.gpu import frozen
from smr.gpu.cuda_checkpoint import GpuStateLost, lost_after
from smr.jobs import proc_start_ticks, signal_tree, wait_exit
from smr.metrics import GPU_STATE_LOST
from smr.process.criu import dump_finished


class PodRecovery:
    """The recovery side of PodCheckpointStep (pod.py)."""

    async def _bring_back(self, pid: int, target: str) -> None:
        """After a failure past the GPU lock (the one being handled): the
        workload's GPU state back, each process checked RUNNING, before its
        tree runs on; then the failure says it keeps running. If the driver
        does not give every process back, the workload (which could not run
        on) is ended and the failure is GpuStateLost."""
        failure = sys.exc_info()[1]
        try:
            await asyncio.shield(self.cuda.recover_tree(pid))  # type: ignore[union-attr]
        except GpuStateLost as lost:
            signal_tree(pid, signal.SIGKILL)
            GPU_STATE_LOST.inc()
            raise lost_after(lost, failure, target) from failure
        if isinstance(failure, SmrError) and "keeps running" not in failure.message:
            failure.message = f"{failure.message}; {target} keeps running"

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        """A worker died mid-checkpoint: committed → that result; a finished
        dump in the work directory → store it; either way a final dump's
        workload, held stopped, is then ended (or, if it cannot be stored,
        runs on). Otherwise run again. Under the container's lock, taken
        again (its worker beats for this request meanwhile): a later
        checkpoint waits for it. A dump committed behind a later one leaves
        latest there and is answered superseded."""
        try:
            c: PodContainer | None = await self.pods.container(req.target)
            shim: Shim | None = self.shim_of(c)  # type: ignore[arg-type]
        except PermanentError:
            c = shim = None
        if c is None:
            return await self._recover(req, c, shim)
        await self.lock.acquire(c.lock_key(), req.request_id)
        try:
            return await self._recover(req, c, shim)
        finally:
            await self.lock.release(c.lock_key(), req.request_id)

    async def _recover(self, req: CkptRequested, c: PodContainer | None,
                       shim: Shim | None) -> CkptDone | None:
        ns = req.target.namespace or ""
        work = self.work(req.request_id)
        if await asyncio.to_thread(endings.ran_on, self.work_dir, req.request_id):
            # Its step let the workload run on past its final dump after a
            # failure, and died before answering it (or before the SIGCONT):
            # that dump, stored or not, is neither the workload's end nor an
            # answer. Never run again under this id: a commit of it is
            # idempotent, and would come back with that dump.
            await self._settle_held(req, c, shim, work, signal.SIGCONT, "failed ran-on")
            await self._drop(work)
            return CkptDone.for_request(req, status="failed", error=PermanentError(
                f"the final checkpoint of {req.target} failed after its dump, and its workload "
                "runs on from where it was (the agent stopped before it answered)",
                code="ran-on", hint="a final request under a new id dumps it again").as_dict())
        final = not req.leave_running or takeover.taken_by(work) is not None
        if (gen := await self._committed(req)) and final and not await asyncio.to_thread(
                endings.ends, self.node_dir, self.work_dir, req, gen):
            if gen.manifest.get("request_id") == req.request_id:
                # Stored, but nothing here says the workload was held since
                # (the work directory of its dump is gone: a new agent's
                # pod): its step may have let it run on past it.
                await self._settle_held(req, c, shim, work, signal.SIGCONT,
                                        "failed final-unconfirmed")
                await self._drop(work)
                return CkptDone.for_request(req, status="failed", error=PermanentError(
                    f"the final checkpoint of {req.target} is stored as generation "
                    f"{gen.number}, but this node cannot tell whether that dump ended its "
                    "workload or the workload ran on past it (its agent stopped midway)",
                    code="final-unconfirmed",
                    hint="latest is kept; a final request under a new id dumps the workload "
                         "again if it runs").as_dict())
            gen = None  # a dump this request took over: its own step's recovery settles it
        if gen:
            current = await self.store.ensure_latest(ns, req.checkpoint_id, gen)
            if final:  # held stopped since its dump: this ends it
                await endings.note_end(self.node_dir, ns, req.checkpoint_id, gen.number)
            await self._settle_held(req, c, shim, work, signal.SIGKILL, f"done {gen.number}")
            await self._drop(work)
            return self._result(req, gen, current)
        if not dump_finished(work / "images"):
            # Never resumed: the step runs again afresh, gives way to a final
            # one before its lock, or finds its pod gone. None may find it left.
            await self._drop(work)
            return None
        if c is None or shim is None:
            return None  # run() reports it
        if not captured(work) and not await self._capture_again(c, shim, work):
            # Its layer and /dev/shm can no longer be read as the dump
            # left them: never stored without them; run again.
            await self._settle_held(req, c, shim, work, signal.SIGCONT, "")
            await self._drop(work)
            return None
        try:
            self._check_trusted(req, work)
            gen, current = await self._durable(req, c, shim, Progress())
        except PermanentError as e:
            await self._settle_held(req, c, shim, work, signal.SIGCONT, f"failed {e.code}")
            await self._drop(work)
            return CkptDone.for_request(req, status="failed", error=e.as_dict())
        if final:
            await endings.note_end(self.node_dir, ns, req.checkpoint_id, gen.number)
        await self._settle_held(req, c, shim, work, signal.SIGKILL, f"done {gen.number}")
        await self._drop(work)
        return self._result(req, gen, current)

    async def _settle_held(self, req: CkptRequested, c: PodContainer | None,
                           shim: Shim | None, work: Any, sig: int, outcome: str) -> None:
        """End (SIGKILL) or continue (SIGCONT) the workload a final dump left
        stopped, and tell its preStop hook the ``outcome`` (as run() does: the
        hook waits for it, and the kubelet's SIGTERM waits for the hook): only
        in the very container that was dumped, never a restored one that has
        replaced it since."""
        if c is None or shim is None or _dumped_in(work) != c.container_id:
            return  # nothing of that dump is left (settled already), or replaced
        running = await asyncio.to_thread(shim.workload)
        final = takeover.taken_by(work)
        if final is not None and sig != signal.SIGKILL:
            # A final request took this dump over, and it is not stored:
            # the tree runs on, and that request dumps it itself (its hook
            # waits for that one).
            outcome = ""
        if req.leave_running and final is None:
            # A heartbeat's tree, left stopped by an agent that died before
            # it ran on, runs on whatever the outcome (a SIGCONT to a
            # running one changes nothing). A GPU tree gets its GPU state
            # back first, its threads held meanwhile, as the resume would
            # have done: continued without it, they run on a GPU state that
            # is not there.
            if running is not None and self.cuda:
                await self.cuda.resume_tree(running[0], quiet=True)
            elif running is not None:
                signal_tree(running[0], signal.SIGCONT)
            return
        if sig != signal.SIGKILL:
            if running is not None:
                # Before it runs on past the dump.
                await endings.note_ran_on(self.work_dir, req.request_id)
                signal_tree(running[0], sig)
            if outcome:
                await asyncio.to_thread(shim.final, outcome)
            return
        # A final ends held, as run() ends it: smr-init, its workload ended,
        # outlives it until the hook has read the outcome (unheld, it ended
        # the container, and the hook in it, whenever the outcome came a
        # moment after the kill). The release also drops a hold that a step
        # dying between its kill and its release left, which smr-init would
        # heed for another minute (under this lock no step of ours holds it).
        try:
            if running is not None:
                with contextlib.suppress(OSError, SmrError):
                    await asyncio.to_thread(shim.hold, True)
                ticks = proc_start_ticks(running[0])
                signal_tree(running[0], sig)
                if ticks is not None:
                    await wait_exit(running[0], ticks)
            if outcome:
                await asyncio.to_thread(shim.final, outcome)
        finally:
            with contextlib.suppress(OSError, SmrError):
                await asyncio.to_thread(shim.hold, False)

    async def _capture_again(self, c: PodContainer, shim: Shim, work: Path) -> bool:
        """The captures of a finished dump, cut short (the agent died), done
        again: only from the very container dumped, its workload still held
        stopped as the dump left it (a running one has moved on from its
        memory image). False where they cannot be."""
        if _dumped_in(work) != c.container_id:
            return False
        running = await asyncio.to_thread(shim.workload)
        if running is None or not await asyncio.to_thread(frozen.held, host.tree(running[0])):
            return False
        try:
            await capture(shim, work, host.upperdir(shim.pid), self.budget(c))
        except PermanentError:
            return False  # over its cap: run again, which reports it
        return True
