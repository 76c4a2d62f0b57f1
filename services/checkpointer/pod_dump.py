"""The dump of one pod container's tree, as the checkpoint step runs it:
CRIU in the container's namespaces, then the layer and /dev/shm captured
while the tree stays stopped, and CRIU's link remaps noted for the restore
and taken out of the container again (services/checkpointer/pod.py runs
it; its restore is services/restorer/pod.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from services.checkpointer.pod_capture import capture
from services.containers import rootfs
from services.containers.confined import Root, UnsafePath
from services.containers.host import Shim
from services.containers.pods import PodContainer
from smr.contract.errors import PermanentError, SmrError
from smr.jobs import signal_tree
from smr.process import linkremap, sockets
from smr.process.criu import CriuError


def dumped(dump: asyncio.Task[Any]) -> bool:
    """Did the dump task end with CRIU's success (the images complete)?"""
    return dump.done() and not dump.cancelled() and dump.exception() is None


def _note_link_names(pid: int, remaps: list[tuple[str, str]], work: Path) -> None:
    """Each link's other names in the container's /dev/shm (a semaphore's),
    for the restore to point them at the file the link restores: devshm.tar
    holds every name as a file of its own (services/restorer/pod.py)."""
    if not remaps:
        return
    records = []
    with Root.of_pid(pid) as root:
        d = root.open(linkremap.SHM, os.O_RDONLY | os.O_DIRECTORY)  # listed: not O_PATH
        try:
            for link, _ in remaps:
                name = os.path.basename(link)
                try:
                    st = os.stat(name, dir_fd=d, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed by the workload since the dump: no names to note
                if stat.S_ISREG(st.st_mode):
                    records.append({"link": name, "uid": st.st_uid,
                                    "names": linkremap.other_names(d, name, st)})
        finally:
            os.close(d)
    (work / linkremap.POD_NAMES).write_bytes(orjson.dumps(records))


def _drop_link_remaps(pid: int, remaps: list[tuple[str, str]]) -> None:
    """CRIU's link remaps (``linkremap.linked``), in the captures now, out of
    the container of ``pid`` (its smr-init): one that runs on would keep
    them, and its next dump would meet them. Through the container's root,
    no link followed; only regular files of CRIU's names."""
    if not remaps:
        return
    with Root.of_pid(pid) as root:
        for link, _ in remaps:
            parent, name = os.path.split(link)
            if not linkremap.REMAP_NAME.fullmatch(name):
                continue
            # OSError: the name changed since its check (a sidecar shares the
            # pod's /dev/shm, and is never stopped): what is there now is not
            # CRIU's, and is left as it is.
            with contextlib.suppress(OSError, UnsafePath), root.dir(parent) as d:
                if stat.S_ISREG(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=d)


def maybe_running(shim: Shim) -> bool:
    """Does the workload still run? True when its status cannot be read
    safely: the cautious answer (a GPU is resumed, a failure is not called an exit)."""
    try:
        return shim.workload() is not None
    except SmrError:
        return True


async def dump_tree(c: PodContainer, shim: Shim, criu: Any, pid: int, inner: int,
                    work: Any, upper: Any, leave_running: bool, tcp: sockets.Tcp,
                    budget: rootfs.Budget, *, gpu: bool = False,
                    held: Callable[[], bool] | None = None) -> dict[str, float]:
    """CRIU dumps the tree of ``pid`` (``inner`` in its namespaces) into
    ``work``, then its layer and /dev/shm are captured; seconds of each."""
    # The tree stays stopped from its dump until its layer and /dev/shm are
    # read: a final dump's until its images are durable (then it is
    # killed) or cannot be stored (then it runs on), so that its state is
    # never in the dump alone; a heartbeat's until the captures are done
    # (then it runs on), since a workload running meanwhile changes its
    # /dev/shm and layer past what its memory image saw (a restored copy
    # would find its shared memory ahead of itself). A GPU heartbeat's
    # tree is continued by resume_after (it waits for this task), once
    # the driver has its GPU state back.
    if leave_running:
        # CRIU unlocks the connections it dumped (TCP repair mode, their
        # packets dropped) only for a tree it lets run: one it leaves
        # stopped keeps them locked for good. A heartbeat's connections
        # are never restored (a restore is in a new network namespace;
        # sockets.restore_mode), so CRIU leaves them alone (--tcp-close:
        # neither dumped nor locked) and they go on as they are ("keep").
        tcp = "close"
    try:
        # CRIU's link remaps (a 'spawn' semaphore's mapping) go in the
        # container's /dev/shm or layer, which the captures carry.
        run = await criu.dump(inner, work / "images", leave_running=False,
                              leave_stopped=True, tcp=tcp, link_remap=True)
    except CriuError as e:
        if not await asyncio.to_thread(maybe_running, shim):
            raise PermanentError(f"{c.target()} exited during its checkpoint; nothing "
                                 "was stored", code="job-exited", detail=e.detail) from None
        if not gpu:  # a GPU tree runs on once its GPU state is back (_bring_back)
            e.message = f"{e.message}; {c.target()} keeps running"
        raise
    t = time.monotonic()
    remaps = await asyncio.to_thread(linkremap.linked, work / "images")
    failed = cancelled = False
    try:
        if outside := [orig for link, orig in remaps
                       if os.path.dirname(link) != linkremap.SHM]:
            # Its link would be in a volume or the layer: a volume is not
            # carried, so such an image would not restore elsewhere.
            raise linkremap.LinkRemapError(
                f"{c.target()} maps or holds open {', '.join(outside)}, whose name was "
                "deleted while the file still has another: CRIU can save it only through "
                f"a link beside it, which smr carries only in {linkremap.SHM}; "
                f"{c.target()} keeps running",
                hint="close or unmap that file before the checkpoint, or keep it in "
                     "/dev/shm")
        await asyncio.to_thread(_note_link_names, shim.pid, remaps, work)
        await capture(shim, work, upper, budget)
    except asyncio.CancelledError:
        cancelled = True
        raise
    except BaseException:
        failed = True
        raise
    finally:
        # A final dump cut short stays as it is, links and all, for
        # recover() to capture again from the tree still stopped.
        try:
            if not (cancelled and not leave_running):
                _drop_link_remaps(shim.pid, remaps)
        finally:  # whatever the container's files did, a tree that runs on is continued
            if leave_running and not (failed or cancelled) and held and held():
                pass  # a final request took this dump over: its tree stays stopped
            elif (leave_running or failed) and not gpu:
                # A heartbeat runs on; so does a final dump's tree when its
                # captures failed (nothing is stored; a GPU tree is resumed
                # by the caller, its GPU state first).
                signal_tree(pid, signal.SIGCONT)
    return {"dump": run.seconds, "rootfs": time.monotonic() - t}
