"""The checkpoint step for local jobs (the embedded mode)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import orjson

from services.local_job import LocalJobStep
from services.storage.layout import LOCAL_NAMESPACE
from services.storage.store import Generation
from smr import __version__, gpuinfo, sockets
from smr.bus import Progress
from smr.criu import CriuError, dump_finished
from smr.errors import PermanentError
from smr.jobs import Job, wait_exit
from smr.messages import CkptDone, CkptRequested, now

log = logging.getLogger("smr.checkpointer")



class CheckpointStep(LocalJobStep):
    kind = "ckpt.requested"

    def _work(self, req: CkptRequested) -> Path:
        return self.work_dir / req.request_id

    def _facts_file(self, req: CkptRequested) -> Path:
        # What the manifest records of the job beyond its images (GPU use,
        # sockets), kept so that a recovered commit (the worker died after the
        # dump) records the same. Beside the work dir, not in it (its whole
        # content is uploaded).
        return self.work_dir / f"{req.request_id}.facts.json"

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        started = now()
        t0 = time.monotonic()
        job_id = self.job_id(req.target)
        await self.lock.acquire(job_id, req.request_id)
        try:
            job, _ = await self.jobs.get(job_id)  # read under the lock: no lost update
            if not job.alive():
                raise PermanentError(
                    f"job {job_id} is not running (state {job.observed_state()})",
                    code="job-not-running",
                    hint=f"restore it first (`smr restore {job_id}`), or check its log {job.log}",
                )
            work = self._work(req)
            shutil.rmtree(work, ignore_errors=True)
            durations: dict[str, float] = {}
            parent = None
            pre_dump = req.pre_dump and await self._can_pre_dump(job_id)
            if pre_dump:
                progress.update("pre-dump")
                run = await self._criu(job, self.criu.pre_dump(job.pid, work / "pre"))
                durations["pre_dump"] = run.seconds
                parent = work / "pre"
            gpu, tcp = await self._prepare(req, job, work)
            cuda_pids = gpu["pids"] if gpu else []
            frozen_at = time.monotonic()
            if cuda_pids:
                progress.update("cuda-checkpoint")
                assert self.cuda
                durations.update(await self.cuda.suspend_all(cuda_pids))
            try:
                progress.update("dump")
                # The images go up while CRIU writes them (see services/storage/upload).
                dump = asyncio.create_task(self._criu(job, self.criu.dump(
                    job.pid, work / "images", leave_running=req.leave_running, parent=parent,
                    tcp=tcp)))
                resumed = None
                if cuda_pids and req.leave_running:
                    # A heartbeat: the job runs again as soon as its image is
                    # written; the upload goes on behind it.
                    resumed = asyncio.create_task(
                        self.cuda.resume_after(dump, cuda_pids, durations, frozen_at))
                gen, durable_s = await self._commit(req, job, progress, writer=dump)
                if resumed:
                    await resumed
            except BaseException:
                self._facts_file(req).unlink(missing_ok=True)
                if cuda_pids and job.alive():
                    await asyncio.shield(self.cuda.resume_all(cuda_pids, quiet=True))  # type: ignore[union-attr]
                raise
            durations["dump"] = dump.result().seconds
            durations["durable"] = durable_s  # from the dump's start to the manifest
            if not req.leave_running:
                await wait_exit(job.pid, job.start_ticks)
        finally:
            await self.lock.release(job_id, req.request_id)
        durations["total"] = time.monotonic() - t0
        return self._result(req, gen, durations=durations, started_at=started)

    async def _prepare(self, req: CkptRequested, job: Job, work: Path
                       ) -> tuple[dict[str, Any] | None, sockets.Tcp]:
        """The job's GPU use and what its TCP connections get, recorded for
        the manifest (and for a recovered commit)."""
        gpu = await self._gpu(job, work)
        tcp = sockets.dump_mode(policy=job.tcp, leave_running=req.leave_running,
                                reason=req.reason, requested=req.tcp)
        held = {**sockets.inventory(gpuinfo.process_tree(job.pid)), "tcp": tcp}
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._facts_file(req).write_bytes(orjson.dumps({
            "gpu": {k: v for k, v in gpu.items() if k != "pids"} if gpu else None,
            "sockets": held}))
        return gpu, tcp

    async def _gpu(self, job: Job, work: Path) -> dict[str, Any] | None:
        """The job's GPU use (None without one), checked against the room here."""
        if self.cuda is None:
            return None
        pids = await self.cuda.processes(job.pid)
        gpu = gpuinfo.for_checkpoint(pids, work)
        return {**gpu, "pids": pids} if gpu else None

    async def _can_pre_dump(self, job_id: str) -> bool:
        if await self.criu.tracks_memory():
            return True
        # A checkpoint matters more than a shorter freeze: dump in full.
        log.warning("pre-dump of %s skipped: this kernel cannot track dirty memory "
                    "(CONFIG_MEM_SOFT_DIRTY is off); doing a full dump", job_id)
        return False

    async def _criu(self, job: Job, call: Any) -> Any:
        try:
            return await call
        except CriuError as e:
            if not job.alive():
                raise PermanentError(
                    f"job {job.id} exited during its checkpoint; nothing was stored",
                    code="job-exited", detail=e.detail, hint=f"see its log {job.log}",
                ) from None
            e.message = f"{e.message}; job {job.id} keeps running"
            raise

    async def _commit(self, req: CkptRequested, job: Job, progress: Progress,
                      writer: asyncio.Task[Any] | None = None) -> tuple[Generation, float]:
        """Store the dumped images (while ``writer``, the dump, still writes
        them), record them on the job, drop the work dir."""
        t = time.monotonic()
        progress.update(done_bytes=0)
        saved = self._facts_file(req)
        facts = orjson.loads(saved.read_bytes()) if saved.is_file() else {}
        gpu = facts.get("gpu")
        meta = {
            "request_id": req.request_id, "node": self.node, "reason": req.reason,
            "target": req.target.to_dict(), "leave_running": req.leave_running,
            "pre_dump": (self._work(req) / "pre").is_dir(),
            "versions": {"criu": await self.criu.version(), "smr": __version__,
                         **(gpuinfo.versions() if gpu else {})},
            "gpu": gpu,
            "job": {"cmd": job.cmd, "cwd": job.cwd, "log": job.log, "tcp": job.tcp},
        }
        if facts.get("sockets"):
            meta["sockets"] = facts["sockets"]
        try:
            gen = await self.store.commit(
                LOCAL_NAMESPACE, req.checkpoint_id, self._work(req), meta, writer=writer,
                on_bytes=lambda n: progress.update(done_bytes=n))
        except BaseException:
            if writer and not writer.done():
                # An upload failed while CRIU dumps: let the dump end (the job
                # must not stay frozen) before the error travels on.
                await asyncio.wait([writer])
            raise
        seconds = time.monotonic() - t
        job.checkpointed(gen.number, leave_running=req.leave_running)
        await self.jobs.put(job)
        shutil.rmtree(self._work(req), ignore_errors=True)
        self._facts_file(req).unlink(missing_ok=True)
        return gen, seconds

    def _result(self, req: CkptRequested, gen: Generation, **kw: Any) -> CkptDone:
        return CkptDone.for_request(req, status="succeeded", generation=gen.number,
                                    location=gen.location, size_bytes=gen.size_bytes,
                                    sockets=sockets.outcome(gen.manifest), **kw)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        """A worker died mid-checkpoint. Committed → that result. Dump complete
        but not committed → commit it now. Job still running → dump again."""
        for gen in reversed(await self.store.generations(LOCAL_NAMESPACE, req.checkpoint_id)):
            if gen.manifest["request_id"] == req.request_id:
                return self._result(req, gen)
        job_id = self.job_id(req.target)
        job = await self.jobs.find(job_id)
        if job is None:
            return None  # run() reports the missing job
        if dump_finished(self._work(req) / "images"):
            gen, _ = await self._commit(req, job, Progress())
            await self.lock.release(job_id, req.request_id)
            return self._result(req, gen)
        if job.alive():
            return None  # CRIU thaws a tree whose dump did not finish: safe to redo
        await self.lock.release(job_id, req.request_id)
        return CkptDone.for_request(req, status="failed", error={
            "code": "interrupted",
            "message": f"the checkpoint of job {job_id} was interrupted and the job is gone",
            "hint": f"restore its latest checkpoint: smr restore {job_id}"})
