"""A local job's checkpoint after a failure: given up (its GPU brought back,
the job left running or ended when its GPU state is lost), and, after its
worker died mid-step, what the world shows decides whether the step
finished, failed, or runs again."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import sys
from typing import Any

from services.checkpointer.durable import StorageUnavailable
from services.storage.layout import LOCAL_NAMESPACE
from smr.bus import Progress
from smr.contract.errors import PermanentError, SmrError, TemporaryError
from smr.contract.messages import CkptDone, CkptRequested
from smr.gpu.cuda_checkpoint import GpuStateLost, lost_after
from smr.jobs import Job, signal_tree, wait_exit
from smr.metrics import GPU_STATE_LOST
from smr.process import linkremap, netlock, reaper
from smr.process.criu import dump_finished, wait_finished
from smr.retry import retry_nats

log = logging.getLogger("smr.checkpointer")


class LocalRecovery:
    """The recovery side of CheckpointStep (step.py)."""

    async def _give_up(self, req: CkptRequested, job: Job, cuda_pids: list[int]) -> None:
        """Nothing was stored: the job goes on where it was (CRIU thawed it after
        a failed dump; a finished final dump left it stopped), its GPU running.

        Called with the failure being handled: its message says "keeps
        running" only once that is so. A GPU job whose processes the driver
        did not all give back cannot run on: it is ended, and the failure
        becomes GpuStateLost (the error that was handled named in it)."""
        failure = sys.exc_info()[1]
        lost: GpuStateLost | None = None
        dump_log = self._work(req) / "images" / "dump.log"
        if job.alive():
            # A final dump that kept connections left them in repair mode
            # behind CRIU's lock, for a restore that now never comes; so did
            # any dump whose CRIU was killed (a heartbeat's too, its tree
            # running again already): undone before the tree runs again.
            await asyncio.shield(netlock.release(job.pid, dump_log))
        elif self._maybe_stored(req, failure):
            # Gone with its host or killed, its dump complete and the failure
            # storage's: a lock that holds no connection only costs every
            # packet of the node. One that holds some stays: the dump may be
            # latest all the same (a write whose answer was lost), and its
            # restore on this node needs it.
            await asyncio.shield(netlock.drop_unused(dump_log))
        else:
            # Gone, and no restore can ever use this dump (unfinished,
            # refused, never stored): nothing takes its connections back, and
            # the lock would drop their packets on the node for good.
            await asyncio.shield(netlock.drop(dump_log))
        if cuda_pids and job.alive():
            # Held stopped while every process's GPU state comes back, each
            # checked RUNNING; only then continued.
            try:
                await asyncio.shield(self.cuda.recover_tree(job.pid))  # type: ignore[union-attr]
            except GpuStateLost as e:
                lost = e
        elif not req.leave_running and job.alive():
            signal_tree(job.pid, signal.SIGCONT)
        self._facts_file(req).unlink(missing_ok=True)
        await asyncio.to_thread(linkremap.discard_left, self._work(req) / linkremap.CARRY)
        shutil.rmtree(self._work(req), ignore_errors=True)
        if lost is not None:
            await self._lost(job, lost, failure)
        if isinstance(failure, SmrError) and job.alive() and "keeps running" not in \
                failure.message:
            failure.message = f"{failure.message}; job {job.id} keeps running"

    def _maybe_stored(self, req: CkptRequested, failure: BaseException | None) -> bool:
        """Could the dump of ``req`` be a stored checkpoint all the same? Only
        a complete one whose storing failed: a write may land with its answer
        lost. A refusal, a CRIU that did not finish, or a job gone mid-dump
        leaves none."""
        return dump_finished(self._work(req) / "images") and isinstance(
            failure, StorageUnavailable | TemporaryError)

    async def _lost(self, job: Job, lost: GpuStateLost, failure: BaseException | None) -> None:
        """The job's GPU state is gone: its tree (held stopped) is ended and
        its record says failed; raises ``lost``, saying what failed first."""
        signal_tree(job.pid, signal.SIGKILL)
        await wait_exit(job.pid, job.start_ticks)
        reaper.reap()
        job.state = "failed"
        async for attempt in retry_nats():
            with attempt:
                await self.jobs.put(job)
        GPU_STATE_LOST.inc()
        lost_after(lost, failure, f"job {job.id}")
        log.error("%s", lost.message)
        raise lost from failure

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        """A worker died mid-checkpoint (or storage failed after the dump).
        Committed, or a finished dump on disk → stored, latest moved unless a
        later dump holds it (then answered superseded), the job settled. Job
        still running → dump again (its GPU made to run first). Under the
        job's lock, taken again (its worker beats for this request
        meanwhile): a later checkpoint waits for it, not the other way."""
        job_id = self.job_id(req.target)
        await self.lock.acquire(job_id, req.request_id)
        try:
            return await self._recover(req, job_id)
        finally:
            await self.lock.release(job_id, req.request_id)

    async def _recover(self, req: CkptRequested, job_id: str) -> CkptDone | None:
        await wait_finished(self._work(req) / "images", self.criu.timeout)
        job = await self.jobs.find(job_id)
        current = True
        if job is not None and dump_finished(self._work(req) / "images"):
            # The dump is the job's state (a final one holds the job stopped):
            # an earlier attempt's commit counts, else it is stored from disk,
            # retried until the deadline like a failure in run(), not given up
            # after the few quick deliveries of a storage error raised here.
            try:
                gen = await self._committed(req)
                if gen is None:
                    self._dump_on_disk(req, job)
                    gen, current = await self._durable(req, job, Progress())
                else:
                    current = await self.store.ensure_latest(
                        LOCAL_NAMESPACE, req.checkpoint_id, gen)
            except PermanentError as e:
                if e.code == "dump-unverified":
                    # Dropped; a live job (its connections given back first)
                    # runs on, to be dumped again.
                    await self._give_up(req, job, await self._cuda_pids(job))
                    if job.alive():
                        return None
                return CkptDone.for_request(req, status="failed", error=e.as_dict())
        else:
            gen = await self._committed(req)
            if job is None:
                if gen is None:
                    return None  # run() reports the missing job
                current = await self.store.ensure_latest(LOCAL_NAMESPACE, req.checkpoint_id, gen)
                return self._result(req, gen, current)
            if gen is not None:
                current = await self.store.ensure_latest(LOCAL_NAMESPACE, req.checkpoint_id, gen)
        if gen is not None:
            await self._settle(req, job, gen, current)
            return self._result(req, gen, current)
        if job.alive():
            # CRIU thaws a tree whose dump did not finish: safe to redo, once
            # the GPU that was suspended for it runs again.
            await self._give_up(req, job, await self._cuda_pids(job))
            return None
        return CkptDone.for_request(req, status="failed", error={
            "code": "interrupted",
            "message": f"the checkpoint of job {job_id} was interrupted and the job is gone",
            "hint": f"restore its latest checkpoint: smr restore {job_id}"})
