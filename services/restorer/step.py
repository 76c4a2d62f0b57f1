"""The restore step for local jobs (the embedded mode)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from services.local_job import LocalJobStep
from services.restorer.ports import wait_ports_free
from services.restorer.stream import restore_streamed
from services.storage.generation import Generation, streamable
from services.storage.layout import LOCAL_NAMESPACE
from smr.bus import Progress
from smr.contract.errors import PermanentError, TemporaryError
from smr.contract.messages import RestoreDone, RestoreRequested, now
from smr.gpu import gpugate, gpupairs
from smr.gpu.driver import CudaError
from smr.identity import ProcessIdentity
from smr.jobs import Job, JobChanged
from smr.process import linkremap, reaper, sockets
from smr.process.criu import wait_finished
from smr.process.tree import process_tree
from smr.retry import retry_nats

log = logging.getLogger("smr.restorer")

# Beside CRIU's restored.pid: the restored process's identity (smr.identity).
IDENTITY = "restored.id"
# Written as CRIU starts: the restored process started after it.
BEGUN = "restore.begun"
# Written just before BEGUN: the job this restore restores, so that
# another restore of it finds the process this one left unrecorded.
TARGET = "restore.job"


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
            existing, revision = await self.jobs.read(job_id)
            if existing and existing.alive():
                raise PermanentError(
                    f"job {job_id} is still running (pid {existing.pid}); a restore would "
                    "run it twice", code="job-running",
                    hint=f"stop it first (`smr kill {job_id}`), or restore beside it under "
                         f"another id: smr restore {req.checkpoint_id} --as NEW_ID",
                )
            self._not_restored_by_another(req, job_id)
            gen = await self._generation(req)
            pairs = self._gpu_pairs(req, gen)  # before any byte moves
            shutil.rmtree(work, ignore_errors=True)
            durations: dict[str, float] = {}
            await self._pids_free(gen.manifest.get("job") or {}, progress, durations)
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
            await wait_ports_free(self.store, gen, work, streamed, progress, durations)
            job = await self._restore(req, gen, work, (existing, revision), durations, tcp,
                                      progress, streamed, pairs)
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

    async def _link_remaps(self, gen: Generation, work: Path, streamed: bool) -> Path:
        """Where the checkpoint's link remaps (smr.process.linkremap) are on disk: a
        streamed restore fetches them alone (they are small: semaphores)."""
        if not streamed:
            return work / linkremap.CARRY
        prefix = linkremap.CARRY + "/"
        if not any(f["path"].startswith(prefix) for f in gen.manifest["files"]):
            return work / linkremap.CARRY  # none
        await self.store.fetch(gen, work / "remaps", only=lambda p: p.startswith(prefix))
        return work / "remaps" / linkremap.CARRY

    async def _generation(self, req: RestoreRequested) -> Generation:
        return await self.store.pick(LOCAL_NAMESPACE, req.checkpoint_id, req.generation,
                                     hint=f"take one first: smr checkpoint {req.checkpoint_id}")

    async def _restore(self, req: RestoreRequested, gen: Generation, work: Path,
                       existing: tuple[Job | None, int], durations: dict[str, float],
                       tcp: sockets.Tcp, progress: Progress, streamed: bool,
                       pairs: gpupairs.Pairs | None = None) -> Job:
        spec = gen.manifest.get("job") or {}
        log = spec.get("log", "")
        inherit, fds = {}, []
        # Our descriptors are closed whatever fails below (a full disk too).
        try:
            if log:
                # The job's log has grown since the dump; hand CRIU an open descriptor
                # instead of letting it reopen the file and refuse the new size. A
                # copy's descriptor is its own log's, under the dumped path's name.
                own = restored_log(spec, req)
                Path(own).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(own, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                fds.append(fd)
                inherit[log] = fd
            pidfile = work / "restored.pid"
            work.mkdir(parents=True, exist_ok=True)
            (work / TARGET).write_text(self.job_id(req.target))
            (work / BEGUN).touch()  # dates the restored process, if its worker dies (recover)
            # A GPU process stays stopped until its GPU state is back (_gpu_back).
            gpu = bool(gen.manifest.get("gpu") and self.cuda)
            try:
                carry = await self._link_remaps(gen, work, streamed)
                async with linkremap.put_back(carry):
                    if not streamed:  # fetched first: CRIU reads the files
                        run = await self.criu.restore(work / "images", pidfile=pidfile,
                                                      inherit=inherit, tcp=tcp, leave_stopped=gpu)
                    else:
                        run = await restore_streamed(
                            self.criu, self.store, gen, work / "images", durations,
                            pidfile=pidfile, inherit=inherit, tcp=tcp, leave_stopped=gpu,
                            on_bytes=lambda n: progress.update(done_bytes=n))
            except BaseException:
                # CRIU failed part-way: the processes it had made, killed, came to
                # this subreaper as it exited. Reaped here, their PIDs (the job's
                # own, in the host's namespace) are free for the next restore.
                for p in dumped_pids(spec):
                    reaper.adopt(p)
                reaper.reap()
                raise
        finally:
            for fd in fds:
                os.close(fd)
        durations["restore"] = run.seconds
        pid = int(pidfile.read_text())
        # Before anything else can fail: who CRIU restored, so a recovery
        # adopts that process and never a later holder of its PID.
        ident = ProcessIdentity.of(pid)
        if ident is not None:
            ident.write(work / IDENTITY)
        reaper.adopt(pid)  # CRIU has exited: the tree is this process's to reap
        step = "after CRIU resumed it"
        if gpu:
            # CRIU brought the process back CHECKPOINTED: GPU memory goes back, then unlock.
            step = "after the driver restored its GPU state"
            try:
                durations.update(await self._gpu_back(pid, pairs, gen.manifest.get("gpu")))
            except BaseException:
                # A process whose GPU state did not come back must not linger
                # half-restored (holding the job id, never running again).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise
        await self._running(pid, step, restored_log(spec, req), run.log)
        try:
            return await self._record(req, gen, existing, pid,
                                      ident.start_ticks if ident else None)
        except Exception:
            # Unrecorded, it would run on unknown to the registry while the
            # restore fails: the next restore would start a second copy. (Not
            # on a cancel: recover() finds it by restored.pid and records it.)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise

    def _not_restored_by_another(self, req: RestoreRequested, job_id: str) -> None:
        """Refuse, for now, while another restore of ``job_id`` left a live
        process it has not recorded (its worker died after CRIU, before the
        record; the job lock it held has gone stale): restored beside it,
        the job would run twice until that restore's recovery ends one.
        Temporary: the bus retries this restore, and that recovery either
        records the process (this one then answers job-running) or ends it
        (this one then restores)."""
        for target in self.work_dir.glob(f"*/{TARGET}"):
            work = target.parent
            if work.name == req.request_id:
                continue
            try:
                if target.read_text() != job_id:
                    continue
            except OSError:
                continue
            if (ident := restored_process(work)) is None:
                continue  # that restore's process is gone: nothing runs twice
            raise TemporaryError(
                f"job {job_id} runs as pid {ident.pid}, restored by request {work.name}, "
                "whose worker stopped before recording it; a restore now would run the "
                "job twice", code="job-busy",
                hint=f"retried: that restore's recovery records its process (this restore "
                     f"then answers job-running) or ends it (this one then restores); if "
                     f"that request is never answered, end pid {ident.pid} and restore again")

    async def _pids_free(self, dumped: dict[str, Any], progress: Progress,
                         durations: dict[str, float]) -> None:
        """A job in the host's PID namespace comes back with its very PIDs:
        wait until the dumped ones are free (their zombies reaped), saying
        so, rather than let CRIU fail on the first one taken."""
        if dumped.get("own_pid_namespace", True) and "own_pid_namespace" in dumped:
            return
        pids = dumped_pids(dumped)
        t = time.monotonic()
        deadline = t + self.pid_wait_s
        told = None
        while True:
            reaper.reap()
            held = {p: h for p in pids if (h := reaper.holder(p))}
            if not held:
                break
            pid, who = next(iter(held.items()))
            if "zombie" not in who or time.monotonic() > deadline:
                raise PermanentError(
                    f"pid {pid}, which the job had and gets back on restore, is held by {who}"
                    + (f" after {self.pid_wait_s:g}s" if "zombie" in who else ""),
                    code="pid-taken",
                    hint="a zombie's parent must reap it (jobs `smr exec` starts and `smr up` "
                         "restores are reaped by smr; one left to a PID 1 that does not reap "
                         "stays); restore under another id on another node, or end that "
                         "process")
            if told != pid:
                log.info("restore waits for pid %d: held by %s", pid, who)
                progress.update("waiting-for-pids", waiting_for=f"pid {pid}: {who}")
                told = pid
            await asyncio.sleep(0.1)
        if told is not None:
            durations["pid_wait"] = time.monotonic() - t

    async def _running(self, pid: int, step: str, job_log: str, criu_log: Path) -> None:
        """The restored process still runs ``settle_s`` after it was let go;
        if not, say how it ended, where, and its last words."""
        deadline = time.monotonic() + self.settle_s
        while True:  # polled: an exit is seen in /proc, nothing signals it here
            how = reaper.how_ended(pid)
            if how is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                continue
            if how is None:
                return
            break
        raise PermanentError(
            f"restored process {pid} {how} {step}", code="restore-died",
            detail=died_detail(pid, job_log, criu_log),
            hint="the checkpoint is kept; see the job's log"
                 + (f" ({job_log})" if job_log else "")
                 + "; a process that dies once restored dies the same way each time")

    async def _record(self, req: RestoreRequested, gen: Generation,
                      existing: tuple[Job | None, int], pid: int,
                      start_ticks: int | None = None) -> Job:
        """Register the restored process under the target's job id, over
        the record ``existing`` (as read, with its revision) and only over
        it: a record written meanwhile (`smr exec` of the same id) is never
        overwritten; the restore fails instead, and its process is ended by
        the caller."""
        spec = gen.manifest.get("job") or {}
        job, revision = existing
        job = job or Job(id=self.job_id(req.target), cmd=spec.get("cmd", []),
                         cwd=spec.get("cwd", ""), log=restored_log(spec, req), node=self.node,
                         checkpoint_id=req.checkpoint_id, tcp=spec.get("tcp", "auto"))
        job.restored(pid, request_id=req.request_id, generation=gen.number, node=self.node,
                     start_ticks=start_ticks)
        try:
            async for attempt in retry_nats():  # NATS restarting: the restore is not undone
                with attempt:
                    await self.jobs.replace(job, revision)
        except JobChanged:
            now, _ = await self.jobs.read(job.id)
            if now and now.restored_by == req.request_id and now.pid == pid:
                return now  # our own write, its answer lost to a NATS restart
            raise PermanentError(
                f"job {job.id} was written by another while it was restored"
                + (f" (now pid {now.pid}, {now.observed_state()})" if now else "")
                + "; the restored process is ended", code="job-running",
                hint=f"`smr ps` shows it; to restore beside it: smr restore "
                     f"{req.checkpoint_id} --as NEW_ID") from None
        return job

    async def recover(self, req: RestoreRequested, state: dict[str, Any]) -> RestoreDone | None:
        """A worker died mid-restore. If the process it restored is running,
        bring its GPU state back (CRIU restores it CHECKPOINTED), record it and
        answer; a restore never runs twice."""
        job_id = self.job_id(req.target)
        await wait_finished(self.work_dir / req.request_id / "images", self.criu.timeout)
        job, revision = await self.jobs.read(job_id)
        if job and job.restored_by == req.request_id and job.alive():
            await self._gpu_back(job.pid)
            await self.lock.release(job_id, req.request_id)
            return RestoreDone.for_request(req, status="succeeded", generation=job.generation,
                                           pid=job.pid)
        # The process CRIU restored, if it still runs: same PID, start tick
        # and boot. A PID alone may name a stranger by now (the restored
        # process ended, or the host rebooted), which would be recorded as
        # the job, then dumped and killed by its next checkpoint. Without a
        # match the restore is not done: it runs again, and nothing is
        # killed that is not ours.
        ident = restored_process(self.work_dir / req.request_id)
        if ident is None:
            if (self.work_dir / req.request_id / "restored.pid").exists():
                log.info("restore %s: the process it restored no longer runs (or its PID "
                         "is another's now); the restore runs again", req.request_id)
            return None
        pid = ident.pid
        if job is not None and job.alive():
            # Another process was recorded as the job since this restore read
            # its record (`smr exec`, or the job restored again while this one
            # waited for its recovery): written over, it would run on unknown
            # to the registry, a second copy. Ours is ended, as run() ends one
            # that loses the record.
            _kill_ours(ident)
            shutil.rmtree(self.work_dir / req.request_id, ignore_errors=True)
            await self.lock.release(job_id, req.request_id)
            return RestoreDone.for_request(req, status="failed", error=PermanentError(
                f"job {job_id} was recorded as pid {job.pid} ({job.restored_by or 'smr exec'}) "
                f"while this restore awaited its recovery; the process it restored (pid {pid}) "
                "is ended", code="job-running",
                hint=f"`smr ps` shows it; to restore beside it: smr restore "
                     f"{req.checkpoint_id} --as NEW_ID").as_dict())
        try:
            gen = await self._generation(req)
        except Exception as e:
            # Storage away (or the checkpoint gone): the process cannot be
            # recorded now, and unrecorded it would run on unknown to the
            # registry (the next restore would start a second copy). Ended;
            # the restore runs again.
            log.warning("restore %s: the process it restored (pid %d) cannot be recorded "
                        "(%s); it is ended and the restore runs again", req.request_id, pid, e)
            _kill_ours(ident)
            shutil.rmtree(self.work_dir / req.request_id, ignore_errors=True)
            return None
        if gen.manifest.get("gpu"):
            try:
                # Decided again as run() did (its checks passed then).
                await self._gpu_back(pid, self._gpu_pairs(req, gen, restored=pid))
            except BaseException:
                # A process whose GPU state did not come back must not linger
                # half-restored; the restore runs again.
                _kill_ours(ident)
                raise
        try:
            job = await self._record(req, gen, (job, revision), pid, ident.start_ticks)
        except Exception:
            _kill_ours(ident)  # never unknown to the registry
            raise
        await self.lock.release(job_id, req.request_id)
        shutil.rmtree(self.work_dir / req.request_id, ignore_errors=True)
        return RestoreDone.for_request(req, status="succeeded", generation=gen.number, pid=job.pid)

    def _gpu_pairs(self, req: RestoreRequested, gen: Generation, *, restored: int | None = None
                   ) -> gpupairs.Pairs | None:
        """Refuse GPU state this node cannot take back, and say which of its
        GPUs it goes onto (smr.gpu.gpupairs): those ``req.gpus`` names, else the
        checkpointed ones where this node has them with room, else others
        of their model. None: onto the checkpointed GPUs, as before pairs.
        ``restored``: a recovery's restored process, whose checks passed
        before; its tree's GPU memory is its own (it may hold it again).
        Refused, a process already running again would be killed and
        restored a second time."""
        gpu = gen.manifest.get("gpu")
        targets = gpupairs.node_targets(req.gpus) if (gpu and self.cuda) or req.gpus else None
        what = f"generation {gen.number} of {req.checkpoint_id}"
        if restored is not None:
            if targets is None:
                return None
            return gpupairs.decide(gpu, gpupairs.holding(targets, process_tree(restored)), what)
        return gpupairs.for_restore(gpu, what, has_api=self.cuda is not None, targets=targets)

    async def _gpu_back(self, pid: int, pairs: gpupairs.Pairs | None = None,
                        facts: dict[str, Any] | None = None) -> dict[str, float]:
        """Every CUDA process under ``pid`` RUNNING again (a no-op for those
        that are), its GPU state onto the GPUs ``pairs`` names, and the tree
        continued (CRIU left it stopped)."""
        if not self.cuda:
            return {}
        try:
            return await self.cuda.resume_tree(pid, gpu_pairs=pairs)
        except CudaError as e:
            if why := gpugate.restore_cause(facts):
                e.message = f"{e.message}; {why}"
            raise


def restored_log(spec: dict[str, Any], req: RestoreRequested) -> str:
    """Where the restored job writes: the checkpointed job's log, or for a
    copy under another id (`smr restore ID --as NEW`) a log of its own beside
    it, so that two processes never write one file."""
    log = spec.get("log", "")
    target = req.target.job_id
    if not log or not target or target == req.checkpoint_id:
        return log
    return str(Path(log).with_name(f"{target}.log"))


def died_detail(pid: int, job_log: str, criu_log: Path, lines: int = 8) -> str:
    """What explains a restored process's death: the kernel's word on it
    (a segfault names the library), CRIU's last step, the job's last lines."""
    out = [f"kernel: {ln}" for ln in kernel_lines(pid)]
    try:
        criu = [ln for ln in criu_log.read_text(errors="replace").splitlines()
                if "Restore finished" in ln or ("Error (" in ln and not _noise(ln))]
    except OSError:
        criu = []
    out += [f"criu: {ln.strip()}" for ln in criu[-2:]]
    if job_log:
        try:
            tail = Path(job_log).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        out += ["its log ends:"] + [f"  {ln}" for ln in tail]
    return "\n".join(out)


def _noise(line: str) -> bool:
    return "RLIMIT_NOFILE" in line


def kernel_lines(pid: int, limit: int = 3) -> list[str]:
    """The kernel log's recent lines about ``pid`` (``python3[639]: segfault
    at ...``); none where /dev/kmsg cannot be read."""
    want = f"[{pid}]"
    found: list[str] = []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        while True:
            try:
                rec = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record overwritten while read; go on
                continue
            msg = rec.split(";", 1)[-1].split("\n", 1)[0]
            if want in msg:
                found.append(msg)
    finally:
        os.close(fd)
    return found[-limit:]


def restored_process(work: Path) -> ProcessIdentity | None:
    """The process a restore in ``work`` had CRIU restore, if it still runs:
    by the identity written as CRIU returned, or, where its worker died
    before writing it (at that very moment, or CRIU finished on its own
    after its worker died), by CRIU's pidfile and a process that started
    between CRIU's start and that file (smr.identity). Without either the
    restore runs again beside a restored process nobody tracks: two copies
    of the job."""
    pidfile = work / "restored.pid"
    if (work / IDENTITY).exists():
        return ProcessIdentity.read_match(work / IDENTITY)
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return None  # CRIU wrote none (or not whole): it restored nothing that runs
    return ProcessIdentity.started_between(pid, work / BEGUN, pidfile) if pid > 0 else None


def _kill_ours(ident: ProcessIdentity) -> None:
    """SIGKILL the process ``ident`` names if it is still that process."""
    if ident.matches():
        with contextlib.suppress(ProcessLookupError):
            os.kill(ident.pid, signal.SIGKILL)


def dumped_pids(job: dict[str, Any]) -> list[int]:
    """The PIDs a job's manifest says were dumped (and come back on restore)."""
    return job.get("pids") or ([job["pid"]] if job.get("pid") else [])
