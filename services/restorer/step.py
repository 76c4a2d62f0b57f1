"""The restore step for local jobs (the embedded mode)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from services.local_job import LocalJobStep
from services.restorer.stream import restore_streamed
from services.storage.layout import LOCAL_NAMESPACE
from services.storage.store import Generation, streamable
from smr import gpuinfo, sockets
from smr.bus import Progress
from smr.criu import wait_finished
from smr.errors import PermanentError
from smr.jobs import Job
from smr.messages import RestoreDone, RestoreRequested, now
from smr.retry import retry_nats

log = logging.getLogger("smr.restorer")


class RestoreStep(LocalJobStep):
    kind = "restore.requested"

    async def run(self, req: RestoreRequested, progress: Progress) -> RestoreDone:
        started = now()
        t0 = time.monotonic()
        job_id = self.job_id(req.target)
        await self.lock.acquire(job_id, req.request_id,
                                lambda holder: progress.update("waiting", waiting_for=holder))
        work = self.work_dir / req.request_id
        try:
            existing = await self.jobs.find(job_id)
            if existing and existing.alive():
                raise PermanentError(
                    f"job {job_id} is still running (pid {existing.pid}); a restore would "
                    "run it twice", code="job-running",
                    hint=f"stop it first (`smr kill {job_id}`), or restore beside it under "
                         f"another id: smr restore {req.checkpoint_id} --as NEW_ID",
                )
            gen = await self._generation(req)
            gpuinfo.check_restorable(  # before any byte moves
                gen.manifest.get("gpu"), f"generation {gen.number} of {req.checkpoint_id}",
                has_api=self.cuda is not None)
            shutil.rmtree(work, ignore_errors=True)
            durations: dict[str, float] = {}
            streamed = streamable(gen.manifest)
            if not streamed:
                progress.update("download", done_bytes=0, total_bytes=gen.size_bytes)
                t = time.monotonic()
                await self.store.fetch(gen, work,
                                       on_bytes=lambda n: progress.update(done_bytes=n))
                durations["download"] = time.monotonic() - t
            progress.update("restore", done_bytes=0, total_bytes=gen.size_bytes)
            # A local job runs in its node's network namespace: its kept
            # connections can come back on the node that took them.
            tcp = sockets.restore_mode(gen.manifest, same_place=gen.manifest["node"] == self.node)
            job = await self._restore(req, gen, work, existing, durations, tcp, progress,
                                      streamed)
            shutil.rmtree(work, ignore_errors=True)
        except Exception:
            # A failed restore leaves nothing behind. Not on a cancel: a worker
            # stopped after CRIU restored the job needs restored.pid to find
            # it (recover), or a second copy would be restored.
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            await self.lock.release(job_id, req.request_id)
        durations["total"] = time.monotonic() - t0
        return RestoreDone.for_request(
            req, status="succeeded", generation=gen.number, location=gen.location,
            size_bytes=gen.size_bytes, pid=job.pid, durations=durations, started_at=started,
            sockets=sockets.outcome(gen.manifest, tcp))

    async def _generation(self, req: RestoreRequested) -> Generation:
        return await self.store.pick(LOCAL_NAMESPACE, req.checkpoint_id, req.generation,
                                     hint=f"take one first: smr checkpoint {req.checkpoint_id}")

    async def _restore(self, req: RestoreRequested, gen: Generation, work: Path,
                       existing: Job | None, durations: dict[str, float],
                       tcp: sockets.Tcp, progress: Progress, streamed: bool) -> Job:
        spec = gen.manifest.get("job") or {}
        log = spec.get("log", "")
        inherit, fds = {}, []
        if log:
            # The job's log has grown since the dump; hand CRIU an open descriptor
            # instead of letting it reopen the file and refuse the new size.
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            fds.append(fd)
            inherit[log] = fd
        pidfile = work / "restored.pid"
        try:
            if not streamed:  # fetched first: CRIU reads the files
                run = await self.criu.restore(work / "images", pidfile=pidfile,
                                              inherit=inherit, tcp=tcp)
            else:
                run = await restore_streamed(
                    self.criu, self.store, gen, work / "images", durations,
                    pidfile=pidfile, inherit=inherit, tcp=tcp,
                    on_bytes=lambda n: progress.update(done_bytes=n))
        finally:
            for fd in fds:
                os.close(fd)
        durations["restore"] = run.seconds
        pid = int(pidfile.read_text())
        if gen.manifest.get("gpu") and self.cuda:
            # CRIU brought the process back CHECKPOINTED: GPU memory goes back, then unlock.
            try:
                durations.update(await self.cuda.resume_all(await self.cuda.processes(pid)))
            except BaseException:
                # A process whose GPU state did not come back must not linger
                # half-restored (holding the job id, never running again).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise
        try:
            return await self._record(req, gen, existing, pid)
        except Exception:
            # Unrecorded, it would run on unknown to the registry while the
            # restore fails: the next restore would start a second copy. (Not
            # on a cancel: recover() finds it by restored.pid and records it.)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise

    async def _record(self, req: RestoreRequested, gen: Generation, job: Job | None,
                      pid: int) -> Job:
        """Register the restored process under the target's job id."""
        spec = gen.manifest.get("job") or {}
        job = job or Job(id=self.job_id(req.target), cmd=spec.get("cmd", []),
                         cwd=spec.get("cwd", ""), log=spec.get("log", ""), node=self.node,
                         checkpoint_id=req.checkpoint_id, tcp=spec.get("tcp", "auto"))
        job.restored(pid, request_id=req.request_id, generation=gen.number, node=self.node)
        async for attempt in retry_nats():  # NATS restarting: the restore is not undone for it
            with attempt:
                await self.jobs.put(job)
        return job

    async def recover(self, req: RestoreRequested, state: dict[str, Any]) -> RestoreDone | None:
        """A worker died mid-restore. If the process it restored is running,
        bring its GPU state back (CRIU restores it CHECKPOINTED), record it and
        answer; a restore never runs twice."""
        job_id = self.job_id(req.target)
        await wait_finished(self.work_dir / req.request_id / "images", self.criu.timeout)
        job = await self.jobs.find(job_id)
        if job and job.restored_by == req.request_id and job.alive():
            await self._gpu_back(job.pid)
            await self.lock.release(job_id, req.request_id)
            return RestoreDone.for_request(req, status="succeeded", generation=job.generation,
                                           pid=job.pid)
        pidfile = self.work_dir / req.request_id / "restored.pid"
        try:
            pid = int(pidfile.read_text())
        except (OSError, ValueError):
            return None  # nothing was restored: safe to run
        if not _alive(pid):
            return None  # it died: safe to run
        try:
            gen = await self._generation(req)
        except Exception as e:
            # Storage away (or the checkpoint gone): the process cannot be
            # recorded now, and unrecorded it would run on unknown to the
            # registry (the next restore would start a second copy). Ended;
            # the restore runs again.
            log.warning("restore %s: the process it restored (pid %d) cannot be recorded "
                        "(%s); it is ended and the restore runs again", req.request_id, pid, e)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.work_dir / req.request_id, ignore_errors=True)
            return None
        if gen.manifest.get("gpu"):
            try:
                await self._gpu_back(pid)
            except BaseException:
                # A process whose GPU state did not come back must not linger
                # half-restored; the restore runs again.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise
        try:
            job = await self._record(req, gen, job, pid)
        except Exception:
            with contextlib.suppress(ProcessLookupError):  # never unknown to the registry
                os.kill(pid, signal.SIGKILL)
            raise
        await self.lock.release(job_id, req.request_id)
        shutil.rmtree(self.work_dir / req.request_id, ignore_errors=True)
        return RestoreDone.for_request(req, status="succeeded", generation=gen.number, pid=job.pid)

    async def _gpu_back(self, pid: int) -> None:
        """Every CUDA process under ``pid`` RUNNING again (a no-op for those that are)."""
        if self.cuda:
            await self.cuda.resume_all(await self.cuda.processes(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
