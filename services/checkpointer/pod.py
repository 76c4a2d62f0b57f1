"""The checkpoint step for pod containers (the node agent).

    find the container (pod status → container ID → its smr-init in /proc)
    → CRIU, run inside the container's namespaces, dumps the workload's tree
      into the pod's smr volume, uploaded while it is written
    → the container's writable layer is added as rootfs.tar
    → the manifest records the image, so a restore can refuse another one
"""

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

import orjson
from nats.js.kv import KeyValue

from services import timings
from services.checkpointer import dumpstamp, endings, finals, pod_dump, takeover
from services.checkpointer.admission import over_threshold, resident_bytes
from services.checkpointer.durable import result, until_stored
from services.checkpointer.pod_capture import CONTAINER_FILE
from services.checkpointer.pod_recovery import PodRecovery
from services.containers import host, rootfs
from services.containers.host import Shim
from services.containers.incontainer import NAMESPACES, NAMESPACES_SAVING_IPC
from services.containers.pods import PodContainer, PodStep
from services.policy import tcp_policy
from services.storage.generation import Generation
from smr import __version__
from smr.bus import Progress
from smr.contract.errors import PermanentError, SmrError, TemporaryError
from smr.contract.messages import CkptDone, CkptRequested, now
from smr.gpu import frozen, gpugate, gpuinfo
from smr.identity import write_durably
from smr.jobs import proc_start_ticks, signal_tree, wait_exit
from smr.process import sockets
from smr.process.criu import dump_finished

log = logging.getLogger("smr.checkpointer")


# smr-init ignores a hold not touched for HOLD_STALE_S (60 s, smr-init.c): a
# crashed agent's hold expires; a live agent's is touched well within that.
HOLD_REFRESH_S = 15.0


async def _keep_holding(shim: Shim) -> None:
    while True:
        await asyncio.sleep(HOLD_REFRESH_S)
        with contextlib.suppress(OSError, SmrError):  # the step itself reports
            await asyncio.to_thread(shim.refresh_hold)


class PodCheckpointStep(PodRecovery, PodStep):
    kind = "ckpt.requested"

    def __init__(self, *, timings: KeyValue | None = None, capture_bytes: int = 16 << 30,
                 eviction: str = "", node_dir: Path | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.node_dir = node_dir or self.work_dir  # the node's, every agent's (endings.py)
        self.eviction = eviction  # the kubelet's hard eviction thresholds (admission.py)
        self.timings = timings  # where each checkpoint's measured time goes (timings.py)
        self.capture_bytes = capture_bytes  # the captures' cap without a pod's own
        # The size of each checkpoint's last dump here: a GPU workload's
        # device memory is in its images, not in its resident memory.
        self._last_size: dict[tuple[str, str], int] = {}
        self.flights = takeover.Flights()  # a final takes over a dump in flight

    def budget(self, c: PodContainer) -> rootfs.Budget:
        """What the captures of ``c``'s checkpoint may write: its own
        ephemeral-storage limit (what the kubelet lets its layer hold), else
        SMR_CAPTURE_BYTES."""
        limit = c.ephemeral_storage_limit()
        if limit is not None:
            return rootfs.Budget(limit, f"{c.target()}'s ephemeral-storage limit")
        return rootfs.Budget(self.capture_bytes, "SMR_CAPTURE_BYTES")

    def rides(self, req: CkptRequested) -> bool:
        """A final request whose container's leave-running dump is in flight
        here, frozen: it takes that dump over, and starts at once. (Before
        the freeze, that dump steps aside for it and it dumps itself: in a
        final slot, as any final dump.)"""
        flight = None if req.leave_running else \
            self.flights.flight_for(takeover.key(req.target), req)
        return flight is not None and flight.phase == "frozen"

    async def estimate(self, req: CkptRequested) -> int:
        """The bytes this request's dump will write: its workload's resident
        memory, or its last dump's size if larger, and what its writable
        layer and /dev/shm take to save, up to their cap (see
        services/checkpointer/admission)."""
        c = await self.pods.container(req.target)
        shim = self.shim_of(c)
        running = await asyncio.to_thread(shim.workload)
        rss = await asyncio.to_thread(resident_bytes, host.tree(running[0])) if running else 0
        files = await asyncio.to_thread(rootfs.saved_bytes, host.upperdir(shim.pid), shim.pid,
                                        self.budget(c).limit)
        return max(rss + files, self._last_size.get((c.namespace, req.checkpoint_id), 0))

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        started, t0 = now(), time.monotonic()
        if req.leave_running:
            takeover.make_way(self.flights, req)
            return await self._run(req, progress, await self.pods.container(req.target),
                                   started, t0)
        # A leave-running dump of this container in flight is taken over,
        # not waited for and dumped again (services/checkpointer/takeover).
        key = takeover.key(req.target)
        with self.flights.final(key, req):
            try:
                c = await self.pods.container(req.target)
            except PermanentError:
                # Its container gone: a generation that names this request
                # (a taken-over dump, stored by the leave-running step's
                # recovery, the pod ended since), or its pod's final, is its answer.
                if gen := await endings.answering(self.node_dir, self.work_dir, req,
                                                  await self._committed(req)) or \
                        await finals.of_pod(self.store, req, self.node_dir, self.work_dir):
                    current = await self.store.ensure_latest(req.target.namespace or "",
                                                             req.checkpoint_id, gen)
                    return self._result(req, gen, current, started_at=started,
                                        durations={"total": time.monotonic() - t0})
                raise
            flight = self.flights.flight_for(key, req)
            if flight is not None and flight.container_id == c.container_id and \
                    (got := await takeover.wait(flight, req, progress)):
                return self._result(req, *got, durations={"total": time.monotonic() - t0},
                                    started_at=started)
            return await self._run(req, progress, c, started, t0)

    async def _run(self, req: CkptRequested, progress: Progress, c: PodContainer,
                   started: str, t0: float) -> CkptDone:
        # Under the container's lock: a restore into it (which holds the lock)
        # is over, and smr-init told so, before its workload is looked for.
        await self.lock.acquire(c.lock_key(), req.request_id,
                                lambda holder: progress.update("waiting", waiting_for=holder),
                                check=lambda: takeover.make_way(self.flights, req))
        work = self.work(req.request_id)
        work_fd = -1
        keep_work = False  # a finished dump that could not be stored yet: recover() stores it
        flight = self.flights.begin(takeover.key(req.target), req, c.container_id) \
            if req.leave_running else None
        outcome: tuple[Generation, bool] | None = None
        try:
            if not req.leave_running and \
                    (gen := await finals.stored(self.store, req, c, self.node_dir, self.work_dir)):
                return self._result(req, gen, True)  # another request's final ended it
            shim = self.shim_of(c)  # under the lock: a final before it may have ended it
            if not req.leave_running and (done := await self._taken_over(req, c, shim)):
                return done  # answered from the dump it took over (a redelivery)
            pid, inner = await asyncio.to_thread(self._workload, req, shim)
            # Also a dump that starts alone: none may take the node into
            # DiskPressure, whose evictions give no grace at all.
            await asyncio.to_thread(over_threshold, str(c.target()), self.work_dir,
                                    await self.estimate(req), self.eviction)
            ticks = proc_start_ticks(pid)
            await asyncio.to_thread(shutil.rmtree, work, True)
            await asyncio.to_thread(endings.clear_ran_on, self.work_dir, req.request_id)
            work_fd = self.open_work(work)
            ipc = await asyncio.to_thread(host.maps_sysv_memory, pid)
            criu = await self.criu_in(c, shim, work, work_fd,
                                      namespaces=NAMESPACES_SAVING_IPC if ipc else NAMESPACES)
            # The shim's mounts, not the workload's: a workload can make mount
            # namespaces of its own and name any directory as its upperdir.
            upper = host.upperdir(shim.pid)
            # A restore always lands in a new container, with a new network
            # namespace: kept connections could not come back there.
            tcp = sockets.dump_mode(policy=tcp_policy(c.pod, self.label_prefix)[0],
                                    leave_running=req.leave_running, reason=req.reason,
                                    requested=req.tcp, same_netns_possible=False)
            # Host PIDs: the driver's checkpoint API takes them from outside.
            cuda_pids = await self.cuda.processes(pid) if self.cuda else []
            # Before anything is locked or frozen, as for a local job: what
            # the driver or CRIU cannot bring back (smr.gpu.gpugate).
            await asyncio.to_thread(gpugate.check_io_uring, host.tree(pid))
            if cuda_pids:
                assert self.cuda
                await asyncio.to_thread(gpugate.before_lock, host.tree(pid), cuda_pids,
                                        gpuinfo.gpus_by_pid(cuda_pids), self.cuda.allow)
            gpu = gpuinfo.for_checkpoint(cuda_pids, work)
            # The dump's place in the container's order, under its lock.
            stamp = await dumpstamp.take(self.lock, c.lock_key(), req.request_id)
            # Kept in the volume: a recovered commit records the same facts.
            (work / CONTAINER_FILE).write_bytes(orjson.dumps({
                "image": c.image, "image_id": c.image_id, "container_id": c.container_id,
                "stdio": host.stdio(pid),
                "sockets": {**sockets.inventory(host.tree(pid)), "tcp": tcp}, "gpu": gpu,
                "dump": stamp}))
            try:
                signalled = await asyncio.to_thread(shim.hold, True)
            except (FileNotFoundError, ProcessLookupError):
                # The kubelet stopped the container meanwhile (its grace ran
                # out): nothing is frozen yet, and nothing is left to save.
                raise PermanentError(f"{req.target} exited before its checkpoint began "
                                     f"(its smr-init, pid {shim.pid}, is gone); nothing "
                                     "was saved", code="job-exited") from None
            holding = asyncio.create_task(_keep_holding(shim))
            try:
                if signalled is not None:
                    # Its image would hold a workload on its way out: every
                    # restored copy would stop again.
                    raise PermanentError(
                        f"{req.target} was sent signal {signalled} (asked to stop) before "
                        "its checkpoint began; nothing was saved", code="terminating",
                        hint="a final checkpoint must come before the kubelet's SIGTERM: "
                             "the preStop hook smr's webhook adds waits for it")
                # Nothing frozen yet: a final request asked for meanwhile dumps, once.
                takeover.make_way(self.flights, req)
                if flight:
                    # From here a final request takes the dump over, as it
                    # ends; a GPU tree's (resumed by resume_after, or its
                    # heartbeat's caller) is not: a final then dumps again.
                    flight.phase = "ran-on" if cuda_pids else "frozen"
                durations: dict[str, float] = {}
                frozen_at = time.monotonic()
                if cuda_pids:
                    progress.update("cuda-checkpoint")
                    assert self.cuda
                    durations.update(await self.cuda.suspend_all(cuda_pids))
                    try:
                        # Held stopped by smr from here (CRIU thaws a tree
                        # whose dump failed), and checked again as CRIU
                        # will find it.
                        signal_tree(pid, signal.SIGSTOP)
                        await asyncio.to_thread(frozen.wait_stopped, host.tree(pid))
                        await asyncio.to_thread(gpugate.after_lock, host.tree(pid), cuda_pids)
                    except BaseException:
                        await self._bring_back(pid, str(c.target()))
                        raise
                progress.update("dump")
                # A GPU heartbeat leaves the tree stopped too: its GPU state
                # comes back before any of its threads runs (smr.gpu.frozen; JAX's
                # died touching a GPU mapping between CRIU's thaw and the
                # driver's restore), as for a local job.
                gpu_heartbeat = bool(cuda_pids and req.leave_running)
                held = None
                if flight and not cuda_pids:
                    held = lambda: self._hold_for_final(req, flight, work)  # noqa: E731
                dump = asyncio.create_task(pod_dump.dump_tree(
                    c, shim, criu, pid, inner, work, upper, req.leave_running, tcp,
                    self.budget(c), gpu=bool(cuda_pids), held=held))
                syncing = asyncio.create_task(self._mark_synced(work, dump))
                resumed = None
                if gpu_heartbeat:
                    assert self.cuda
                    resumed = asyncio.create_task(
                        self.cuda.resume_after(dump, pid, durations, frozen_at))
                try:
                    try:
                        gen, durable = await self._commit(req, c, shim, progress, dump)
                        current = await self.store.ensure_latest(c.namespace,
                                                                 req.checkpoint_id, gen)
                    except TemporaryError as e:
                        if not pod_dump.dumped(dump):
                            raise
                        # The dump is complete in the volume: store it from
                        # there, never dump again (the workload may be gone).
                        gen, current = await self._durable(req, c, shim, progress, e)
                        durable = time.monotonic() - frozen_at
                    if resumed:
                        await resumed
                    syncing.cancel()  # stored: the images on disk are needed no more
                except asyncio.CancelledError:
                    # The agent stopping: a finished dump (its workload held
                    # stopped) stays for recover() to store and settle, also
                    # one whose captures were cut short (recover() does them);
                    # a heartbeat's GPU tree runs on meanwhile.
                    keep_work = pod_dump.dumped(dump) or dump_finished(work / "images")
                    syncing.cancel()
                    if keep_work:  # on disk first, at once: a reboot may come next
                        await asyncio.gather(asyncio.shield(asyncio.create_task(
                            self._mark_synced(work, dump, 0))), return_exceptions=True)
                    if gpu_heartbeat and keep_work:
                        await asyncio.shield(self.cuda.resume_tree(  # type: ignore[union-attr]
                            pid, quiet=True))
                    raise
                except BaseException:
                    syncing.cancel()
                    if not dump.done():
                        await asyncio.wait([dump])  # the workload must not stay frozen
                    final_dump = (not req.leave_running or (flight and flight.phase == "taken")) \
                        and pod_dump.dumped(dump)
                    if final_dump:
                        # Its generation may be stored (even ``latest``)
                        # unbeknown to us: never an answer from here on.
                        await endings.note_ran_on(self.work_dir, req.request_id)
                    if cuda_pids and await asyncio.to_thread(pod_dump.maybe_running, shim):
                        # Never left locked: back to running whatever failed,
                        # held stopped until its GPU state is back, checked.
                        await self._bring_back(pid, str(c.target()))
                    elif final_dump:
                        # Not stored: the workload, held stopped, runs on (a
                        # final request that took it over dumps it itself).
                        signal_tree(pid, signal.SIGCONT)
                    raise
                durations.update(dump.result())
                durations["durable"] = durable
                # From the freeze to stored: what a final checkpoint of it
                # needs of the pod's grace period (services/webhook/admission).
                measured = time.monotonic() - frozen_at
                if not req.leave_running or (flight and flight.phase == "taken"):
                    # Recorded first: only a final that ended its workload
                    # answers the container's later final requests.
                    await endings.note_end(self.node_dir, c.namespace, req.checkpoint_id,
                                           gen.number)
                    signal_tree(pid, signal.SIGKILL)  # durable: its stopped tree ends
                    if ticks is not None:
                        await wait_exit(pid, ticks)
                    await asyncio.to_thread(shim.final, f"done {gen.number}")
                    outcome = (gen, current)
            except Exception as e:
                # The preStop hook waits for this. Not on a cancel: the agent
                # stopping is no failure, and recover() may still store the dump.
                if not req.leave_running:
                    await asyncio.to_thread(
                        shim.final, f"failed {getattr(e, 'code', type(e).__name__)}")
                raise
            finally:
                holding.cancel()
                # A container the kubelet stopped meanwhile has no hold left
                # to release: its outcome above stands.
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    await asyncio.to_thread(shim.hold, False)
        finally:
            if flight:  # first, before any await: a final riding on it waits for this
                self.flights.end(takeover.key(req.target), flight, outcome)
            if work_fd >= 0:
                os.close(work_fd)
            if not keep_work:
                await self._drop(work)
            await self.lock.release(c.lock_key(), req.request_id)
        durations["total"] = time.monotonic() - t0
        self._last_size[(c.namespace, req.checkpoint_id)] = gen.size_bytes
        if self.timings is not None:
            await timings.record(self.timings, c.namespace, req.checkpoint_id, measured,
                                 gen.number)
        return self._result(req, gen, current, durations=durations, started_at=started)

    def _synced_file(self, work: Path) -> Path:
        # Beside the work directory, whose whole content is uploaded.
        return work.with_name(work.name + ".synced")

    async def _mark_synced(self, work: Path, dump: asyncio.Task[Any],
                           after_s: float = dumpstamp.SYNC_AFTER_S) -> None:
        """``after_s`` from the end of the dump and its captures: all of it
        fsynced, then marked so (a recovery after a host crash trusts only
        such a dump; see services/checkpointer/dumpstamp). Cancelled once it
        is stored."""
        await asyncio.wait([dump])
        if not pod_dump.dumped(dump):
            return
        await asyncio.sleep(after_s)
        await asyncio.to_thread(dumpstamp.sync_tree, work)
        # On this thread, so that a cancel after it leaves no marker behind.
        write_durably(self._synced_file(work), b"")

    async def _drop(self, work: Path) -> None:
        await asyncio.to_thread(shutil.rmtree, work, True)
        self._synced_file(work).unlink(missing_ok=True)
        takeover.marker(work).unlink(missing_ok=True)

    def _hold_for_final(self, req: CkptRequested, flight: takeover.Flight, work: Path) -> bool:
        """At the end of a leave-running dump, before its tree runs on: a
        final request of this container in progress takes it over (True):
        recorded durably first, its manifest-to-be made the final's."""
        final = self.flights.final_for(takeover.key(req.target), flight)
        if final is None:
            flight.phase = "ran-on"
            return False
        try:
            takeover.hold_for(work, req, final)
        except OSError as e:
            # Not recorded, so not taken over: the tree runs on, and the
            # final request dumps it itself.
            log.warning("dump %s of %s cannot be held for final checkpoint %s (%s); it runs "
                        "on", req.request_id, req.target, final.request_id, e)
            takeover.marker(work).unlink(missing_ok=True)
            flight.phase = "ran-on"
            return False
        if flight.meta is not None:
            takeover.as_final(flight.meta, final)
        flight.phase = "taken"
        log.info("dump %s of %s is finished as final checkpoint %s: its tree stays stopped",
                 req.request_id, req.target, final.request_id)
        return True

    async def _taken_over(self, req: CkptRequested, c: PodContainer,
                          shim: Shim) -> CkptDone | None:
        """Under the lock, for a final request: a dump it took over, left
        here by a step that ended before storing or settling it (the agent
        died), stored and settled now; then the answer if latest is that
        dump (recorded as this request's), else None: it dumps itself."""
        for dumped in takeover.naming(self.work_dir, req.request_id):
            await self._recover(dumped, c, shim)
        ns = c.namespace
        latest = await self.store.latest(ns, req.checkpoint_id)
        if latest is None or latest.manifest.get("final_request_id") != req.request_id:
            return None
        if await endings.answering(self.node_dir, self.work_dir, req, latest) is None:
            return None
        return self._result(req, latest, True)

    def _check_trusted(self, req: CkptRequested, work: Path) -> None:
        try:
            stamp = orjson.loads((work / CONTAINER_FILE).read_bytes()).get("dump")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            stamp = None
        dumpstamp.check_trusted(stamp, self._synced_file(work).is_file(), work / "images",
                                str(req.target),
                                f"latest of {req.checkpoint_id} is kept; a restore "
                                "resumes from it")

    def _workload(self, req: CkptRequested, shim: Shim) -> tuple[int, int]:
        """The workload's (host pid, namespace pid), or why there is none to save."""
        running = shim.workload()
        status = shim.status()
        if running is None and status[:1] == ["waiting"]:
            raise TemporaryError(f"{req.target} is starting (smr-init is waiting for its "
                                 "restore or start decision)", code="container-starting",
                                 hint="it is retried once the container runs its workload")
        if running is None:
            raise PermanentError(f"{req.target} is not running its workload (smr-init "
                                 f"status: {' '.join(status) or 'unknown'})",
                                 code="job-not-running")
        if self.cuda is None and host.holds_gpu(running[0]):
            # CRIU alone cannot save GPU memory: refused before anything is frozen.
            raise PermanentError(f"{req.target} holds an NVIDIA GPU and this node has no "
                                 "driver with the CUDA checkpoint API (or SMR_GPU=off)",
                                 code="gpu-unsupported",
                                 hint="run the agent with the NVIDIA runtime (the gpu overlay) "
                                      "on a node with driver 560 or newer")
        return running

    async def _commit(self, req: CkptRequested, c: PodContainer, shim: Shim,
                      progress: Progress, writer: asyncio.Task[Any] | None
                      ) -> tuple[Generation, float]:
        t = time.monotonic()
        work = self.work(req.request_id)
        container = orjson.loads((work / CONTAINER_FILE).read_bytes())
        gpu = container.pop("gpu", None)
        meta = {
            "request_id": req.request_id, "node": self.node, "reason": req.reason,
            "target": req.target.to_dict(), "leave_running": req.leave_running,
            "pre_dump": False,
            "versions": {"criu": await self.criu.version(), "smr": __version__,
                         **(gpuinfo.versions() if gpu else {})},
            "gpu": gpu,
            "container": container,
        }
        if held := container.pop("sockets", None):
            meta["sockets"] = held
        if stamp := container.pop("dump", None):
            meta["dump"] = stamp
        if final := takeover.taken_by(work):
            takeover.as_final(meta, final)
        elif (flight := self.flights.flight(takeover.key(req.target))) and \
                flight.request_id == req.request_id:
            # Read by the store once the dump is written: a takeover until
            # then is recorded (_hold_for_final).
            flight.meta = meta
        gen = await self.store.commit(
            c.namespace, req.checkpoint_id, work, meta,
            writer=writer, on_bytes=lambda n: progress.update(done_bytes=n))
        return gen, time.monotonic() - t

    async def _durable(self, req: CkptRequested, c: PodContainer, shim: Shim,
                       progress: Progress, error: TemporaryError | None = None
                       ) -> tuple[Generation, bool]:
        """The finished dump in the volume, committed once and ``latest`` moved
        to it unless a later dump holds it (then False: superseded), retried
        until the deadline (see services/checkpointer/durable)."""
        async def attempt() -> tuple[Generation, bool]:
            # Its own commit: one it took over (final_request_id) may be run past.
            gen = await self._committed(req)
            if gen is None or gen.manifest.get("request_id") != req.request_id:
                gen = (await self._commit(req, c, shim, progress, None))[0]
            return gen, await self.store.ensure_latest(c.namespace, req.checkpoint_id, gen)

        return await until_stored(attempt, what=f"the checkpoint of {c.target()}",
                                  deadline_s=self.commit_deadline, progress=progress,
                                  error=error)

    async def _committed(self, req: CkptRequested) -> Generation | None:
        return await self.store.committed(req.target.namespace or "", req.checkpoint_id,
                                          req.request_id)

    def _result(self, req: CkptRequested, gen: Generation, current: bool,
                **kw: Any) -> CkptDone:
        return result(req, gen, current, f"a restore of {req.checkpoint_id}", **kw)
