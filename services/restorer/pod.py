"""The restore step for pod containers (the node agent).

The container was started by the kubelet as usual; its smr-init waits as
PID 1 of an otherwise empty PID namespace. Then:

    check the fit: same image digest as at the checkpoint, the GPU (if any)
    → download and verify the images into the pod's smr volume
    → put the writable layer back (rootfs.tar), through the container's root
    → CRIU, inside the container's namespaces, restores the tree; smr-init
      adopts it (the kernel reparents it to the namespace's init)
    → the tree joins the container's cgroups; smr-init is told its PID

Beside smr-init's files the workload finds ``restored`` (JSON: the
checkpoint, its generation, whether it was a template), written before the
tree runs again: how a server started from a template learns that it is a
clone (docs/warm-start.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import orjson

from services.containers import gpus, host, rootfs
from services.containers.confined import Root
from services.containers.host import Shim
from services.containers.incontainer import set_last_pid
from services.containers.pods import PodContainer, PodStep
from services.restorer import imageref, launcher
from services.restorer.stream import restore_streamed
from services.storage import layout
from services.storage.generation import Generation, streamable
from smr.bus import Progress
from smr.contract.errors import PermanentError
from smr.contract.messages import RestoreDone, RestoreRequested, now
from smr.gpu import gpuinfo, gpupairs
from smr.identity import ProcessIdentity
from smr.process import linkremap, sockets
from smr.process.criu import kill_tree

# Beside CRIU's restored.pid: the restored tree's root, by its host PID,
# start tick and boot (smr.identity); what a recovery adopts, and only that.
IDENTITY = "restored.id"
# Touched as CRIU starts: the restored tree's root started after it.
BEGUN = "restore.begun"

# Restore a template's images from the node's cached files where it holds them
# all (False: stream them, as any checkpoint; bench/warmstart.py measures both).
FROM_CACHED_FILES = True


class ImageMismatch(PermanentError):
    code = "image-mismatch"


class PodRestoreStep(PodStep):
    kind = "restore.requested"

    async def run(self, req: RestoreRequested, progress: Progress) -> RestoreDone:
        started, t0 = now(), time.monotonic()
        c = await self.pods.container(req.target)
        shim = self.shim_of(c)
        await self.lock.acquire(c.lock_key(), req.request_id)
        work = self.work(req.request_id)
        work_fd = -1
        keep = False  # cancelled after CRIU began: its files are recover()'s
        try:
            st = await asyncio.to_thread(shim.status)
            if not st or st[0] != "waiting":
                raise PermanentError(
                    f"{req.target} has already started its command (smr-init status: "
                    f"{' '.join(st) or 'unknown'}); a restore would run it twice",
                    code="container-started",
                    hint="a container is restored only as it starts; delete the pod to "
                         "start it again from its latest checkpoint")
            gen = await self.store.pick(c.namespace, req.checkpoint_id, req.generation)
            self.check_fits(gen, c)  # before any byte moves
            pairs = await self.gpu_pairs(req, gen, c, shim)
            progress.update("download", done_bytes=0, total_bytes=gen.size_bytes)
            t = time.monotonic()
            await asyncio.to_thread(shutil.rmtree, work, True)
            # Streamed: only the writable layer first; CRIU's images stream
            # into it as it restores (services/restorer/stream).
            streamed = streamable(gen.manifest)
            await self.store.fetch(gen, work, on_bytes=lambda n: progress.update(done_bytes=n),
                                   only=(lambda p: not p.startswith("images/")) if streamed
                                   else None)
            # A template this node holds (pre-pulled, or read by an earlier
            # replica): CRIU reads its images as local files, linked from the
            # node's cache, rather than through a stream; the page images are
            # verified meanwhile (``pages_ok``), before the tree runs.
            pages_ok = None
            if streamed and FROM_CACHED_FILES and self.store.cache is not None \
                    and layout.is_template(req.checkpoint_id):
                # Not cached yet (the first replica on this node): filled now,
                # as a streamed read fills each object before its first byte;
                # CRIU then reads local files, which it restores about twice
                # as fast as a stream (bench/warmstart.py).
                await self.store.prepull(gen)
                pages_ok = await self.store.link_cached(gen, work / "images")
                streamed = pages_ok is None
            durations = {"download": time.monotonic() - t}
            work_fd = self.open_work(work)  # the directory fetch made
            progress.update("restore")
            t = time.monotonic()
            await rootfs.apply(work / rootfs.TAR, shim.pid)
            await rootfs.apply(work / rootfs.SHM_TAR, shim.pid)
            await asyncio.to_thread(_point_link_names, shim.pid, work / linkremap.POD_NAMES)
            durations["rootfs"] = time.monotonic() - t
            # Before the tree runs again: a restored server may look for it
            # at once (it re-seeds what a clone must not share).
            await asyncio.to_thread(shim.restored, restored_note(req, gen, self.node))
            try:
                pid = await self._restore(c, gen, shim, work, work_fd, durations, streamed,
                                          progress, pages_ok, pairs)
                await asyncio.to_thread(_decide_restored, shim, pid)
            except asyncio.CancelledError:
                # The agent stopping: a CRIU already started runs on, outside
                # this task, and may yet bring the tree back into the
                # container. Its pidfile and the note stay for recover(),
                # which adopts that tree instead of restoring a second one.
                keep = (work / BEGUN).exists()
                if not keep:
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(shim.restored, None)
                raise
            except BaseException:
                with contextlib.suppress(Exception):  # the restore's own error is the one
                    await asyncio.to_thread(shim.restored, None)
                raise
        finally:
            if work_fd >= 0:
                os.close(work_fd)
            if not keep:
                await asyncio.to_thread(shutil.rmtree, work, True)
            await self.lock.release(c.lock_key(), req.request_id)
        durations["total"] = time.monotonic() - t0
        return RestoreDone.for_request(
            req, status="succeeded", generation=gen.number, location=gen.location,
            size_bytes=gen.size_bytes, pid=pid, durations=durations, started_at=started,
            sockets=sockets.outcome(gen.manifest, "close"))

    @staticmethod
    def check_fits(gen: Generation, c: PodContainer) -> None:
        saved = (gen.manifest.get("container") or {}).get("image_id", "")
        if saved and c.image_id and not imageref.same_image(saved, c.image_id):
            was = (gen.manifest.get("container") or {}).get("image", "")
            raise ImageMismatch(
                f"checkpoint {gen.manifest['checkpoint_id']} generation {gen.number} was "
                f"taken from image {was} ({saved}); container {c.name} of pod "
                f"{c.namespace}/{c.pod['metadata']['name']} runs {c.image} ({c.image_id})",
                hint="a process only resumes on the image it was frozen with (the same "
                     "digest, under any name or mirror): run that image, or use another "
                     "checkpoint id for the new one")

    async def gpu_pairs(self, req: RestoreRequested, gen: Generation, c: PodContainer,
                        shim: Shim, *, restored: int | None = None) -> gpupairs.Pairs | None:
        """Refuse GPU state this node cannot take back, and say which GPUs it
        goes onto: those the new container was given, as its runtime's spec
        says (services/containers/gpus), never what the request names.
        ``restored``: a recovery's restored tree, whose GPU memory is its own."""
        if req.gpus:
            raise PermanentError(
                f"{req.target}: a restore request names GPUs ({', '.join(req.gpus)}); a pod "
                "container's GPU state goes onto the GPUs its device plugin gave it",
                code="gpus-not-for-pods",
                hint="leave `gpus` out; ask for GPUs in the pod's resources (nvidia.com/gpu)")
        record = gen.manifest.get("gpu")
        targets = None
        if record and self.cuda is not None:
            node = await asyncio.to_thread(gpuinfo.devices)
            targets = await asyncio.to_thread(gpus.container_gpus, shim.pid, c.container_id,
                                              node)
            if targets is not None and restored is not None:
                targets = gpupairs.holding(targets, list(host.tree(restored)))
        what = f"checkpoint {gen.manifest['checkpoint_id']} generation {gen.number}"
        return gpupairs.for_restore(record, what, has_api=self.cuda is not None,
                                    targets=targets)

    async def _restore(self, c: PodContainer, gen: Generation, shim: Shim, work: Path,
                       work_fd: int, durations: dict[str, float], streamed: bool,
                       progress: Progress,
                       pages_ok: asyncio.Task[None] | None = None,
                       pairs: gpupairs.Pairs | None = None) -> int:
        try:
            return await self._restore_verified(c, gen, shim, work, work_fd, durations,
                                                streamed, progress, pages_ok, pairs)
        finally:
            if pages_ok is not None and not pages_ok.done():
                pages_ok.cancel()
            if pages_ok is not None:
                await asyncio.gather(pages_ok, return_exceptions=True)

    async def _restore_verified(self, c: PodContainer, gen: Generation, shim: Shim,
                                work: Path, work_fd: int, durations: dict[str, float],
                                streamed: bool,
                                progress: Progress, pages_ok: asyncio.Task[None] | None,
                                pairs: gpupairs.Pairs | None = None) -> int:
        criu = await self.criu_in(c, shim, work, work_fd, charged=True)
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        await set_last_pid(shim, pid_max - 1000, self.init_binary)
        pidfile = work / "restored.pid"
        # A new container has a new network namespace: connections come back closed.
        tcp = sockets.restore_mode(gen.manifest, same_place=False)
        # A GPU tree stays stopped until its GPU state is back (smr.gpu.frozen):
        # a thread that ran before would touch GPU mappings not yet there.
        gpu = bool(gen.manifest.get("gpu") and self.cuda)
        # The dumped stdout/stderr pipes become the new container's. Ours are
        # closed whatever happens: one kept open holds the container's log
        # open after its processes end (the runtime then waits on its logger).
        inherit, fds = {}, []
        try:
            for fd, pipe in ((gen.manifest.get("container") or {}).get("stdio") or {}).items():
                with contextlib.suppress(OSError):
                    mode = os.O_RDONLY if fd == "0" else os.O_WRONLY
                    new = os.open(f"/proc/{shim.pid}/fd/{fd}", mode)
                    fds.append(new)
                    inherit[pipe] = new
            if pages_ok is not None and not gpu:
                # CRIU lets a tree without GPU state run as it finishes: the
                # pages it reads are verified first.
                t = time.monotonic()
                await pages_ok
                durations["verify"] = time.monotonic() - t
            (work / BEGUN).touch()  # dates the restored tree, if the agent dies (recover)
            criu.on_start = lambda pid: launcher.note(work, pid)
            if streamed:
                # The socket in the pod's volume: CRIU, inside the container,
                # reaches it there under a short path.
                try:
                    run = await restore_streamed(
                        criu, self.store, gen, work / "images", durations, pidfile=pidfile,
                        inherit=inherit, tcp=tcp, sockets_dir=work / "stream",
                        leave_stopped=gpu, on_bytes=lambda n: progress.update(done_bytes=n))
                except Exception:
                    # CRIU may have succeeded on an image that then failed its
                    # sha256 (it closed the pipe before the end): the tree it
                    # made must not run on. Not on a cancel: recover() adopts.
                    await asyncio.to_thread(_end_restored, shim, pidfile)
                    raise
            else:
                run = await criu.restore(work / "images", pidfile=pidfile, inherit=inherit,
                                         tcp=tcp, leave_stopped=gpu)
        finally:
            for fd in fds:
                os.close(fd)
        durations["restore"] = run.seconds
        inner = int(pidfile.read_text())
        root = _find_ns_pid(shim, inner)
        ident = ProcessIdentity.of(root) if root is not None else None
        if root is None or ident is None:
            raise PermanentError(f"the restored process {inner} is not running",
                                 code="restore-died")
        # Before anything else can fail: who CRIU restored, so a recovery
        # adopts that tree and never a later holder of its PID.
        ident.write(work / IDENTITY)
        try:
            for p in host.tree(root):
                host.move_to_cgroups_of(p, shim.pid)
            if pages_ok is not None:
                # Stopped (GPU) until the pages CRIU read from the node's
                # cache are known to be the stored ones.
                t = time.monotonic()
                await pages_ok
                durations["verify_after_criu"] = time.monotonic() - t
            if gpu:
                # CRIU brought the tree back CHECKPOINTED and stopped: GPU
                # memory goes back (onto the GPUs ``pairs`` names), then
                # unlock, then the tree is continued.
                durations.update(await self.cuda.resume_tree(  # type: ignore[union-attr]
                    root, gpu_pairs=pairs))
        except BaseException:
            # A tree whose GPU state did not come back must not linger
            # half-restored: all of it goes, not only its root.
            kill_tree(root)
            raise
        return inner

    async def recover(self, req: RestoreRequested, state: dict[str, Any]) -> RestoreDone | None:
        """A worker died mid-restore: if the container already holds the
        restored tree, its GPU state is brought back (CRIU left a GPU tree
        stopped and CHECKPOINTED) and it is answered; a restore never runs
        twice."""
        try:
            c = await self.pods.container(req.target)
            shim = self.shim_of(c)
        except PermanentError:
            # The pod is gone: what a cancelled step kept for it is no one's.
            await asyncio.to_thread(shutil.rmtree, self.work(req.request_id), True)
            return None
        try:
            st = await asyncio.to_thread(shim.status)
        except PermanentError:  # a status the workload replaced: run() reports it
            st = []
        pidfile = self.work(req.request_id) / "restored.pid"
        inner, root = 0, None
        if st and st[0] == "waiting" and (ran := launcher.noted(pidfile.parent)):
            # A CRIU the dead or stopped step began may still be restoring:
            # its pidfile comes at its end.
            await launcher.ended(f"restore {req.request_id} of {req.target}", *ran,
                                 self.bundle.programs(), self.criu_timeout)
        if st and st[0] == "waiting" and pidfile.is_file():
            with contextlib.suppress(OSError, ValueError):
                inner = int(pidfile.read_text())
                root = _find_ns_pid(shim, inner)
            # The tree CRIU restored, by PID, start tick and boot: a PID alone
            # may name another process by now. Without a match the restore
            # is not done, and nothing is adopted or killed.
            ident = restored_root(pidfile, root)
            if ident is None or ident.pid != root:
                root = None
        if root:
            # run() may have died before it moved the tree (idempotent).
            for p in host.tree(root):
                host.move_to_cgroups_of(p, shim.pid)
            # Outside the suppress: storage away must not pass for "nothing
            # restored", a restore beside the tree; redelivered, it is tried again.
            await self._gpu_back(req, c, shim, root)
            await asyncio.to_thread(_decide_restored, shim, inner)
            # run()'s finally never ran: its files (the writable layer) go now.
            await asyncio.to_thread(shutil.rmtree, pidfile.parent, True)
            await self.lock.release(c.lock_key(), req.request_id)
            return RestoreDone.for_request(req, status="succeeded", pid=inner)
        await self.lock.release(c.lock_key(), req.request_id)
        return None

    async def _gpu_back(self, req: RestoreRequested, c: PodContainer, shim: Shim,
                        root: int) -> None:
        """The restored tree under ``root`` RUNNING and continued, as run()
        would have left it: its GPU state onto the GPUs decided again as
        run() did (its own GPU memory counted as room: the driver's restore
        may be done), unlocked, then SIGCONT. A no-op for a tree already
        running (a second recovery restores nothing twice); a tree without
        GPU state was never left stopped (CRIU continues it)."""
        if self.cuda is None:
            return
        gen = await self.store.pick(c.namespace, req.checkpoint_id, req.generation)
        if not gen.manifest.get("gpu"):
            return
        try:
            pairs = await self.gpu_pairs(req, gen, c, shim, restored=root)
            await self.cuda.resume_tree(root, gpu_pairs=pairs)
        except BaseException:
            # Half-restored it must not linger: the next recovery finds no
            # tree and the restore runs again, as after run()'s failure.
            kill_tree(root)
            raise


def restored_root(pidfile: Path, root: int | None) -> ProcessIdentity | None:
    """The restored tree's root (host PID ``root``, what CRIU's pidfile
    names), if it still runs: by the identity written as CRIU returned, or,
    where the agent died before writing it (at that very moment, or CRIU
    finished on its own after the agent died), by a start between the
    restore's start of CRIU and CRIU's pidfile (smr.identity). Without
    either, the restore would run again beside a tree nobody tracks."""
    if pidfile.with_name(IDENTITY).exists():
        return ProcessIdentity.read_match(pidfile.with_name(IDENTITY))
    if not root:
        return None
    return ProcessIdentity.started_between(root, pidfile.with_name(BEGUN), pidfile)


def restored_note(req: RestoreRequested, gen: Generation, node: str) -> bytes:
    """What a restored workload may read in ``/smr/<container>/restored``: which
    checkpoint it came from, and whether it is a clone of a template (then
    every replica holds the same random state: docs/warm-start.md)."""
    return orjson.dumps({
        "checkpoint_id": req.checkpoint_id, "generation": gen.number,
        "template": layout.is_template(req.checkpoint_id), "node": node,
        "pod": req.target.pod, "restore_id": req.request_id, "restored_at": now()},
        option=orjson.OPT_APPEND_NEWLINE)


def _decide_restored(shim: Shim, inner: int) -> None:
    """Tell smr-init that its workload is the restored tree whose root is
    ``inner`` in its PID namespace, or end that tree: one smr-init does not
    know of would run untracked (never checkpointed, its exit never
    reported). The tree runs already, so its workload may have made
    ``decision`` something that cannot be written."""
    try:
        shim.decide(f"restored {inner}")
    except Exception as e:
        if (root := _find_ns_pid(shim, inner)) is not None:
            kill_tree(root)
        if isinstance(e, OSError | PermanentError):
            why = (f"{e.strerror} on {shim.dir}/decision" if isinstance(e, OSError)
                   else e.message)  # a file the workload replaced (UnsafePath)
            raise PermanentError(
                f"could not tell smr-init that its workload was restored ({why}); the "
                "restored processes were ended", code="restore-undecided",
                hint="the workload must leave smr's files under /smr alone") from None
        raise


def _end_restored(shim: Shim, pidfile: Path) -> None:
    """Kill the tree CRIU restored (its pidfile, written at its end, names
    the root in the container's PID namespace), if there is one."""
    with contextlib.suppress(OSError, ValueError):
        inner = int(pidfile.read_text())
        if inner > 1 and (root := _find_ns_pid(shim, inner)) is not None:
            kill_tree(root)


def _find_ns_pid(shim: Shim, inner: int) -> int | None:
    """The host pid of the process ``inner`` of the shim's PID namespace."""
    try:
        ns = os.readlink(f"/proc/{shim.pid}/ns/pid")
    except OSError:
        return None
    for p in host.all_pids():
        with contextlib.suppress(OSError):
            if host.ns_pid(p) == inner and os.readlink(f"/proc/{p}/ns/pid") == ns:
                return p
    return None


def _point_link_names(pid: int, records_file: Path) -> None:
    """A semaphore's names in the restored container's /dev/shm pointed at
    the file CRIU's link restores (the tree's own mapping of it): devshm.tar
    made each a file of its own, and a worker started after the restore,
    opening the semaphore by its name, would not share the tree's. Through
    the container's root; no link followed (smr.process.linkremap.point_name)."""
    try:
        records = orjson.loads(records_file.read_bytes())
    except FileNotFoundError:
        return
    with Root.of_pid(pid) as root, root.dir(linkremap.SHM) as d:
        for r in records:
            if not linkremap.REMAP_NAME.fullmatch(r["link"]):
                raise linkremap.LinkRemapError(f"checkpoint names {r['link']!r} as a link remap")
            try:
                fd = os.open(r["link"], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
            except FileNotFoundError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    for other in r["names"]:
                        linkremap.point_name(d, fd, other, r["uid"])
            finally:
                os.close(fd)
