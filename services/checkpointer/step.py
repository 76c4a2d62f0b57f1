"""The checkpoint step for local jobs (the embedded mode)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import orjson

from services.checkpointer import dumpstamp
from services.checkpointer.durable import StorageUnavailable, result, until_stored
from services.checkpointer.step_recovery import LocalRecovery
from services.local_job import LocalJobStep
from services.storage.generation import Generation
from services.storage.layout import LOCAL_NAMESPACE
from smr import __version__
from smr.bus import Progress
from smr.contract.errors import PermanentError, TemporaryError
from smr.contract.messages import CkptDone, CkptRequested, now
from smr.gpu import coopgate, frozen, gpugate, gpuinfo
from smr.identity import write_durably
from smr.jobs import Job, own_pid_namespace, signal_tree, wait_exit
from smr.process import linkremap, netlock, procfs, reaper, sockets
from smr.process.criu import CriuError, dump_finished
from smr.process.tree import process_tree
from smr.retry import retry_nats

log = logging.getLogger("smr.checkpointer")


def finished(dump: asyncio.Task[Any]) -> bool:
    """Did the dump task end with CRIU's success (the images complete on disk)?"""
    return dump.done() and not dump.cancelled() and dump.exception() is None


def _restore_args(job: Job) -> str:
    source = job.checkpoint_id or job.id
    return source if source == job.id else f"{source} --as {job.id}"


class CheckpointStep(LocalRecovery, LocalJobStep):
    kind = "ckpt.requested"

    # How long the ranks of a cooperative job (smr.coop) have to reach a
    # step boundary and release their communicators.
    coop_deadline_s = 120.0

    @property
    def _paused(self) -> dict[str, list[int]]:
        """Per job being checkpointed: its ranks that released their communicators."""
        return self.__dict__.setdefault("_paused_ranks", {})

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
        await self.lock.acquire(job_id, req.request_id,
                                lambda holder: progress.update("waiting", waiting_for=holder))
        try:
            job, _ = await self.jobs.get(job_id)  # read under the lock: no lost update
            try:
                on_disk = self._dump_on_disk(req, job)
            except PermanentError:
                await self._give_up(req, job, await self._cuda_pids(job))  # drops it
                raise
            if on_disk:
                # An earlier attempt of this very request dumped the job (its
                # worker died, or storage failed): store that dump, never dump again.
                gen, current = await self._durable(req, job, progress)
                await self._settle(req, job, gen, current)
                durations: dict[str, float] = {}
            else:
                coop = coopgate.directory(self.work_dir, job.id)
                try:
                    # Before anything else sees the job: its ranks at a step
                    # boundary without communicators (smr.gpu.coopgate).
                    t_coop = time.monotonic()
                    paused = self._paused[job.id] = await coopgate.pause(
                        coop, process_tree(job.pid) if job.alive() else [],
                        req.request_id, self.coop_deadline_s)
                    paused_s = time.monotonic() - t_coop
                    gen, current, durations = await self._checkpoint(req, job, progress)
                    if paused:
                        durations["coop_pause"] = paused_s
                finally:
                    # Heartbeat, refusal or failure: the ranks go on; after a
                    # final checkpoint its restored copy finds no request.
                    self._paused.pop(job.id, None)
                    coopgate.release(coop)
        finally:
            await self.lock.release(job_id, req.request_id)
        durations["total"] = time.monotonic() - t0
        skipped = None
        if req.pre_dump and not gen.manifest.get("pre_dump"):
            skipped = gen.manifest.get("pre_dump_skipped") or "no pre-dump was taken"
        return self._result(req, gen, current, durations=durations, started_at=started,
                            pre_dump_skipped=skipped)

    def _dump_on_disk(self, req: CkptRequested, job: Job) -> bool:
        """Is a finished dump of ``req`` on disk, to be stored? One a host
        crash may have torn (see dumpstamp) is dropped and refused."""
        if not dump_finished(self._work(req) / "images"):
            return False
        facts = self._facts(req)
        # A refusal leaves the dump to the caller's _give_up: its log names
        # CRIU's lock on the connections of a job held stopped, undone before
        # the job runs on.
        dumpstamp.check_trusted(
            facts.get("dump"), bool(facts.get("synced")), self._work(req) / "images",
            f"job {job.id}",
            f"its latest stored generation is kept: `smr restore {job.id}` resumes from it")
        return True

    def _facts(self, req: CkptRequested) -> dict[str, Any]:
        try:
            facts = orjson.loads(self._facts_file(req).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}  # none, or torn by a crash: nothing it says is known
        return facts if isinstance(facts, dict) else {}

    async def _mark_synced(self, req: CkptRequested, dump: asyncio.Task[Any],
                           after_s: float = dumpstamp.SYNC_AFTER_S) -> None:
        """``after_s`` from the dump's end: its images fsynced, then its facts
        say so (a recovery after a host crash trusts only such a dump; see
        dumpstamp). Cancelled once the dump is stored: then nothing is written."""
        await asyncio.wait([dump])
        if not finished(dump):
            return
        await asyncio.sleep(after_s)
        await asyncio.to_thread(dumpstamp.sync_tree, self._work(req))
        # On this thread, so that a cancel after it writes no facts behind
        # _settle (a small file: a few milliseconds).
        if facts := self._facts(req):
            write_durably(self._facts_file(req), orjson.dumps({**facts, "synced": True}))

    async def _checkpoint(self, req: CkptRequested, job: Job, progress: Progress
                          ) -> tuple[Generation, bool, dict[str, float]]:
        if not job.alive():
            raise PermanentError(
                f"job {job.id} is not running (state {job.observed_state()})",
                code="job-not-running",
                # A copy (`--as`) restores from the checkpoint it came from.
                hint=f"restore it first (`smr restore {_restore_args(job)}`), or check its "
                f"log {job.log}",
            )
        if held := self._held_for(req, job):
            raise PermanentError(
                f"job {job.id} is held stopped for checkpoint {held}, whose dump is on disk and "
                "not yet stored (smr was stopped or died after it); a dump now would save a "
                "stopped job", code="job-held",
                hint=f"that checkpoint is stored by its recovery and answered; its job ends "
                     f"then: restore it with `smr restore {job.id}`")
        work = self._work(req)
        shutil.rmtree(work, ignore_errors=True)
        durations: dict[str, float] = {}
        parent = None
        if req.pre_dump and self.cuda and await self.cuda.processes(job.pid):
            # CRIU's pre-dump runs on the live process, its GPU's device
            # mappings in place (CRIU's CUDA plugin does nothing for a
            # pre-dump): it would fail on them, before any GPU check.
            raise PermanentError(
                f"job {job.id} holds GPU state, and a pre-dump cannot save a GPU job; "
                "nothing was frozen, the job runs on", code="gpu-pre-dump",
                hint="checkpoint it without --pre-dump: its freeze is the driver's copy of "
                     "GPU memory, which a pre-dump would not shorten")
        # Why not, told to the user with the result and kept with the generation.
        skipped = await self._why_no_pre_dump(job.id) if req.pre_dump else None
        if req.pre_dump and not skipped:
            progress.update("pre-dump")
            run = await self._criu(job, self.criu.pre_dump(job.pid, work / "pre"),
                                   running=True)
            durations["pre_dump"] = run.seconds
            parent = work / "pre"
        # The dump's place in the job's order, taken under its lock as it starts.
        stamp = await dumpstamp.take(self.lock, job.id, req.request_id)
        gpu, tcp = await self._prepare(req, job, work, stamp, skipped)
        cuda_pids = gpu["pids"] if gpu else []
        frozen_at = time.monotonic()
        if cuda_pids:
            progress.update("cuda-checkpoint")
            assert self.cuda
            durations.update(await self.cuda.suspend_all(cuda_pids))
            try:
                await self._hold_and_check(job, cuda_pids)
            except BaseException:
                await self._give_up(req, job, cuda_pids)
                raise
        # A final checkpoint leaves the job stopped, not dead, until its images
        # are stored: if they cannot be, it runs on (see _give_up).
        final = not req.leave_running
        # A GPU heartbeat leaves the job stopped too: its GPU state comes back
        # before any of its threads runs (JAX's died touching a GPU mapping
        # in the moment between CRIU's thaw and the driver's restore).
        gpu_heartbeat = bool(cuda_pids and req.leave_running)
        dump: asyncio.Task[Any] | None = None
        syncing: asyncio.Task[None] | None = None
        try:
            progress.update("dump")
            # The images go up while CRIU writes them (see services/storage/upload).
            # CRIU unlocks the connections it dumped (TCP repair mode, their
            # packets dropped) only for a tree it lets run: one it leaves
            # stopped keeps them locked for good. A heartbeat's are never
            # restored (sockets.restore_mode), so a GPU heartbeat leaves them
            # alone (--tcp-close: neither dumped nor locked): they go on ("keep").
            dump = asyncio.create_task(self._criu(job, self.criu.dump(
                job.pid, work / "images", leave_running=req.leave_running and not gpu_heartbeat,
                leave_stopped=final or gpu_heartbeat, parent=parent,
                tcp="close" if gpu_heartbeat else tcp, carry=work / linkremap.CARRY),
                running=not cuda_pids))
            syncing = asyncio.create_task(self._mark_synced(req, dump))
            resumed = None
            if gpu_heartbeat:
                # A heartbeat: the job runs again as soon as its image is
                # written; the upload goes on behind it.
                resumed = asyncio.create_task(
                    self.cuda.resume_after(dump, job.pid, durations, frozen_at))  # type: ignore[union-attr]
            try:
                gen, durable_s = await self._store(req, job, progress, writer=dump)
            except TemporaryError as e:
                if not finished(dump):
                    raise
                # The dump is complete on disk: store it from there, never dump again.
                gen, _ = await self._durable(req, job, progress, error=e)
                durable_s = time.monotonic() - frozen_at
            if resumed:
                await resumed
        except asyncio.CancelledError:
            if dump is not None and finished(dump):
                # smr up stopping: the dump, its facts and a stopped job stay as
                # they are for recover(); a heartbeat's GPU runs on meanwhile.
                # Its images on disk first: a reboot may come next.
                if syncing is not None:
                    syncing.cancel()
                    await asyncio.gather(asyncio.shield(asyncio.create_task(
                        self._mark_synced(req, dump, 0))), return_exceptions=True)
                if cuda_pids and req.leave_running:
                    await asyncio.shield(self.cuda.resume_tree(job.pid, quiet=True))  # type: ignore[union-attr]
                raise
            await self._give_up(req, job, cuda_pids)
            raise
        except BaseException:
            if syncing is not None:
                syncing.cancel()
            await self._give_up(req, job, cuda_pids)
            raise
        # Stored: the images on disk are needed no more.
        syncing.cancel()
        await asyncio.gather(syncing, return_exceptions=True)
        current = await self.store.ensure_latest(LOCAL_NAMESPACE, req.checkpoint_id, gen)
        await self._settle(req, job, gen, current)
        durations["dump"] = dump.result().seconds
        durations["durable"] = durable_s  # from the dump's start to the manifest
        return gen, current, durations

    async def _durable(self, req: CkptRequested, job: Job, progress: Progress,
                       error: TemporaryError | None = None) -> tuple[Generation, bool]:
        """Make the finished dump of ``req`` durable from disk: committed (once:
        an earlier attempt's manifest counts) and ``latest`` moved to it unless
        a later dump holds it (then False: superseded), retried until the
        deadline. Past it, the job runs on and the step fails."""
        async def attempt() -> tuple[Generation, bool]:
            gen = (await self._committed(req)) or (await self._store(req, job, progress))[0]
            return gen, await self.store.ensure_latest(LOCAL_NAMESPACE, req.checkpoint_id, gen)

        try:
            gen = await until_stored(attempt, what=f"the checkpoint of job {job.id}",
                                     deadline_s=self.commit_deadline, progress=progress,
                                     error=error)
        except StorageUnavailable:
            await self._give_up(req, job, await self._cuda_pids(job))  # says if it runs on
            raise
        return gen

    async def _settle(self, req: CkptRequested, job: Job, gen: Generation,
                      current: bool) -> None:
        """The checkpoint is durable: end the job (final) or make sure its GPU
        runs (heartbeat), drop the work, record the generation (unless
        superseded: ``current`` False). Idempotent (recovery repeats it)."""
        dumped = gen.manifest.get("job") or {}
        if "pid" in dumped and (dumped["pid"], dumped.get("start_ticks")) != (
                job.pid, job.start_ticks):
            # The registry names another process than the one dumped: one
            # restored since (recovery comes late). It is not ours to end.
            log.warning("job %s now runs as pid %d (restored by %s), not the process "
                        "checkpoint %s dumped; left as it is", job.id, job.pid,
                        job.restored_by, req.request_id)
            shutil.rmtree(self._work(req), ignore_errors=True)
            self._facts_file(req).unlink(missing_ok=True)
            return
        if req.leave_running:
            if self.cuda and job.alive():
                await self.cuda.resume_tree(job.pid, quiet=True)
        else:
            if job.alive():
                signal_tree(job.pid, signal.SIGKILL)
                await wait_exit(job.pid, job.start_ticks)
                reaper.reap()  # a restored job is ours to reap: its PIDs free at once
            # CRIU's lock table of a dump that kept no connection: nothing a
            # restore needs, and only a restore on this node would delete it.
            await netlock.drop_unused(self._work(req) / "images" / "dump.log")
        # CRIU's links in /dev/shm, if smr died before the dump's own cleanup:
        # the checkpoint has them.
        await asyncio.to_thread(linkremap.discard_left, self._work(req) / linkremap.CARRY)
        shutil.rmtree(self._work(req), ignore_errors=True)
        self._facts_file(req).unlink(missing_ok=True)
        if (current and (job.generation or 0) < gen.number) or (
                job.state == "running" and not req.leave_running):
            job.checkpointed(gen.number, leave_running=req.leave_running)
            async for attempt in retry_nats():
                with attempt:
                    await self.jobs.put(job)

    def _held_for(self, req: CkptRequested, job: Job) -> str | None:
        """Another request whose final dump of this very process waits on
        disk for its commit (its worker stopped or died after the dump; its
        recovery stores it): its request id. The process is stopped (CRIU's
        --leave-stopped) until then."""
        for facts in self.work_dir.glob("*.facts.json"):
            rid = facts.name.removesuffix(".facts.json")
            if rid == req.request_id:
                continue
            try:
                f = orjson.loads(facts.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                continue
            p = f.get("process") or {}
            if not f.get("leave_running") and \
                    (p.get("pid"), p.get("start_ticks")) == (job.pid, job.start_ticks) and \
                    dump_finished(self.work_dir / rid / "images"):
                return rid
        return None

    async def _cuda_pids(self, job: Job) -> list[int]:
        if not self.cuda or not job.alive():
            return []
        tree = process_tree(job.pid)
        if any(frozen.stopping(p) for p in tree):
            # Left stopped by a dump: the driver's GetState would wait for the
            # process itself; resume_tree finds the CUDA ones of the tree.
            return tree
        return await self.cuda.processes(job.pid)

    async def _prepare(self, req: CkptRequested, job: Job, work: Path,
                       stamp: dict[str, Any] | None = None, pre_dump_skipped: str | None = None
                       ) -> tuple[dict[str, Any] | None, sockets.Tcp]:
        """The job's GPU use and what its TCP connections get, recorded for
        the manifest (and for a recovered commit)."""
        # CRIU cannot save an io_uring, a job's without GPU neither.
        gpugate.check_io_uring(process_tree(job.pid))
        gpu = await self._gpu(job, work)
        tcp = sockets.dump_mode(policy=job.tcp, leave_running=req.leave_running,
                                reason=req.reason, requested=req.tcp)
        held = {**sockets.inventory(process_tree(job.pid)), "tcp": tcp}
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._facts_file(req).write_bytes(orjson.dumps({
            **({"pre_dump_skipped": pre_dump_skipped} if pre_dump_skipped else {}),
            "gpu": {k: v for k, v in gpu.items() if k != "pids"} if gpu else None,
            "sockets": held, "process": {
                "pid": job.pid, "start_ticks": job.start_ticks,
                # A restore in the host's PID namespace needs all of these free.
                "pids": process_tree(job.pid),
                "own_pid_namespace": own_pid_namespace(job.pid)},
            "leave_running": req.leave_running, **({"dump": stamp} if stamp else {})}))
        return gpu, tcp

    async def _gpu(self, job: Job, work: Path) -> dict[str, Any] | None:
        """The job's GPU use (None without one), checked against the room here."""
        if self.cuda is None:
            return None
        pids = await self.cuda.processes(job.pid)
        tree = process_tree(job.pid)
        if pids:
            # Before the lock: what the driver or CRIU cannot bring back is
            # refused while the job still runs (smr.gpu.gpugate).
            # Ranks that dropped their communicators (smr.gpu.coopgate) hold no P2P.
            gpugate.before_lock(tree, pids, gpuinfo.gpus_by_pid(pids), self.cuda.allow,
                                released=self._paused.get(job.id, ()))
        gpu = gpuinfo.for_checkpoint(pids, work)
        return {**gpu, "pids": pids} if gpu else None

    async def _why_no_pre_dump(self, job_id: str) -> str | None:
        """Why a pre-dump cannot be taken here (None: it can)."""
        if await self.criu.tracks_memory():
            return None
        # A checkpoint matters more than a shorter freeze: dump in full.
        why = "this kernel cannot track dirty memory (CONFIG_MEM_SOFT_DIRTY is off)"
        log.warning("pre-dump of %s skipped: %s; doing a full dump", job_id, why)
        return why

    async def _criu(self, job: Job, call: Any, *, running: bool) -> Any:
        """``call`` (a CRIU run); ``running``: CRIU's thaw on failure is all
        the job needs to run on (no GPU state to give back), so the error
        says so at once; otherwise ``_give_up`` says it once it is so."""
        try:
            return await call
        except CriuError as e:
            # Killed meanwhile, it may still be freeing its memory: ending.
            if not job.alive() or await asyncio.to_thread(procfs.ended, job.pid):
                raise PermanentError(
                    f"job {job.id} exited during its checkpoint; nothing was stored",
                    code="job-exited", detail=e.detail, hint=f"see its log {job.log}",
                ) from None
            if running:
                e.message = f"{e.message}; job {job.id} keeps running"
            raise

    async def _hold_and_check(self, job: Job, cuda_pids: list[int]) -> None:
        """After the lock: the tree held stopped by smr, so that nothing runs
        while its GPU state is checkpointed, whatever CRIU does after (it
        thaws a tree whose dump failed, even with --leave-stopped, but gives
        a tree stopped before it seized one its stop back), and checked again
        as CRIU will find it: a worker that mapped the GPU's devices, or an
        io_uring made, since the check before the lock."""
        tree = process_tree(job.pid)
        signal_tree(job.pid, signal.SIGSTOP)
        await asyncio.to_thread(frozen.wait_stopped, tree)
        gpugate.after_lock(process_tree(job.pid), cuda_pids)

    async def _store(self, req: CkptRequested, job: Job, progress: Progress,
                     writer: asyncio.Task[Any] | None = None) -> tuple[Generation, float]:
        """Store the dumped images (while ``writer``, the dump, still writes them)."""
        t = time.monotonic()
        progress.update(done_bytes=0)
        facts = self._facts(req)
        gpu = facts.get("gpu")
        meta = {
            "request_id": req.request_id, "node": self.node, "reason": req.reason,
            "target": req.target.to_dict(), "leave_running": req.leave_running,
            "pre_dump": (self._work(req) / "pre").is_dir(),
            **({"pre_dump_skipped": facts["pre_dump_skipped"]}
               if facts.get("pre_dump_skipped") else {}),
            "versions": {"criu": await self.criu.version(), "smr": __version__,
                         **(gpuinfo.versions() if gpu else {})},
            "gpu": gpu,
            # The process dumped: recovery ends that one, never a later restore.
            "job": {"cmd": job.cmd, "cwd": job.cwd, "log": job.log, "tcp": job.tcp,
                    **facts.get("process", {"pid": job.pid, "start_ticks": job.start_ticks})},
        }
        if facts.get("sockets"):
            meta["sockets"] = facts["sockets"]
        if facts.get("dump"):
            meta["dump"] = facts["dump"]
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
        return gen, time.monotonic() - t

    async def _committed(self, req: CkptRequested) -> Generation | None:
        return await self.store.committed(LOCAL_NAMESPACE, req.checkpoint_id, req.request_id)

    def _result(self, req: CkptRequested, gen: Generation, current: bool,
                **kw: Any) -> CkptDone:
        return result(req, gen, current, f"`smr restore {self.job_id(req.target)}`", **kw)
