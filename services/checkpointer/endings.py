"""Which stored final checkpoints ended their workload, recorded by the node
that ended it, before the kill.

A final dump's generation can be stored, and even be ``latest``, while its
workload ran on: its step could not learn whether its ``latest`` write landed
(the answer lost, storage then down past the commit deadline), answered
failed, and the workload ran on from where it was. A later final request of
that container finds the generation as ``latest`` and, once the workload has
ended by itself, no workload left: only this record tells a final that ended
its workload from one the workload ran past. Only the first is a final
request's answer (services/checkpointer/finals); the other would answer
``succeeded`` for a state the workload went beyond.

The records live in the node's own directory that every agent of the node
shares and that outlives an agent's pod (SMR_STEP_LOCK_DIR, a hostPath: a
rollout's new agent answers the old one's finals; never a container's), one
empty file per generation, fsynced before the kill: a crash after the write
leaves the workload held stopped, which the step's recovery ends. That
directory is a tmpfs: a reboot, which ends every container, forgets them, and
a final request after it is answered failed, never wrongly.

The other way round, a final request whose dump's workload is let run on
(the dump not stored, as far as its step knows) is marked so before the
SIGCONT (``mark_ran_on``), until a new run of that request, in the agent's
work directory beside the dump itself: an agent that dies before the failure
is answered leaves a dump its recovery must neither store as the workload's
end, end the workload by, nor answer with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path

from services.storage.generation import Generation
from smr.bus.liveness import StepLocks
from smr.contract.messages import CkptRequested
from smr.identity import write_durably
from smr.process.criu import dump_finished

log = logging.getLogger("smr.checkpointer")

# Never a request id (none starts with a dot: schemas/common.json), nor a
# step lock (named by a hash, ".lock" at the end: smr/bus/liveness.py).
ENDED, RAN_ON = ".ended", ".ran-on"
# A final request comes within its pod's grace period; a month is far past any.
KEEP_S = 30 * 86400


def _path(node_dir: Path, namespace: str, checkpoint_id: str, generation: int) -> Path:
    name = hashlib.sha256(f"{namespace}\0{checkpoint_id}\0{generation}".encode()).hexdigest()
    return node_dir / ENDED / name


def record(node_dir: Path, namespace: str, checkpoint_id: str, generation: int) -> None:
    """Generation ``generation`` of the lineage ends its workload: called
    before the kill, on disk when it returns."""
    _write(_path(node_dir, namespace, checkpoint_id, generation))


def ended(node_dir: Path, namespace: str, checkpoint_id: str, generation: int) -> bool:
    """Did this node end the workload of that generation's dump with it?"""
    return _path(node_dir, namespace, checkpoint_id, generation).is_file()


def mark_ran_on(work_dir: Path, request_id: str) -> None:
    """The workload that request's final dump held runs on from here: called
    before the SIGCONT, on disk when it returns."""
    _write(work_dir / RAN_ON / request_id)


def ran_on(work_dir: Path, request_id: str) -> bool:
    return (work_dir / RAN_ON / request_id).is_file()


def clear_ran_on(work_dir: Path, request_id: str) -> None:
    """A new run of the request: a new dump, whose workload has not run on."""
    (work_dir / RAN_ON / request_id).unlink(missing_ok=True)


async def note_end(node_dir: Path, namespace: str, checkpoint_id: str,
                   generation: int) -> None:
    """``record``, off the event loop. Not recorded (the disk failing), the
    workload still ends: its later final requests are then answered failed,
    never wrongly."""
    try:
        await asyncio.to_thread(record, node_dir, namespace, checkpoint_id, generation)
    except OSError as e:
        log.warning("cannot record that generation %d of %s ends its workload (%s): a later "
                    "final request of it is answered failed", generation, checkpoint_id, e)


async def note_ran_on(work_dir: Path, request_id: str) -> None:
    """``mark_ran_on``, off the event loop. Not marked (the disk failing),
    the dump's log goes instead (an unlink needs no free space): the dump
    no longer reads as finished, so no recovery takes it for the workload's
    end. The workload runs on either way."""
    try:
        await asyncio.to_thread(mark_ran_on, work_dir, request_id)
    except OSError as e:
        log.warning("cannot mark the final dump of %s as run past (%s); its log is "
                    "removed instead", request_id, e)
        with contextlib.suppress(OSError):
            (work_dir / request_id / "images" / "dump.log").unlink()


def held_since(work_dir: Path, node_dir: Path, request_id: str, asking: str) -> bool:
    """Is that request's finished dump still in its work directory, unmarked,
    and no live worker on it (its agent died): its workload held stopped
    since (a step marks it before it lets the workload run on, and ends the
    workload before it drops the dump)? A live step, still storing it, may
    yet let the workload run on. ``asking``: the request of the caller, whose
    own worker holds its step lock. Read under that request's lock, shared
    with other such reads: a worker that gave up on it marks the dump run
    past, lets the workload go and lets go of the lock, all between two reads
    of ours otherwise."""
    def unmarked() -> bool:
        return dump_finished(work_dir / request_id / "images") \
            and not ran_on(work_dir, request_id)

    if request_id == asking:
        return unmarked()
    with StepLocks(node_dir).reading(request_id) as free:
        return free and unmarked()


def ends(node_dir: Path, work_dir: Path, req: CkptRequested, gen: Generation) -> bool:
    """Did ``gen``, a final dump of ``req``'s container, end its workload
    here, or is it ending it: recorded so, or its dump still held
    (``held_since``: an agent died after storing it, before the kill)?"""
    # The manifest's request id is a plain name: the store checks manifests
    # against schemas/manifest.json as it reads them.
    return ended(node_dir, req.target.namespace or "", req.checkpoint_id, gen.number) or \
        held_since(work_dir, node_dir, str(gen.manifest.get("request_id") or ""),
                   req.request_id)


async def answering(node_dir: Path, work_dir: Path, req: CkptRequested,
                    gen: Generation | None) -> Generation | None:
    """``gen``, a final dump stored for ``req``'s container, if it ended its
    workload on this node (``ends``); else None (its workload ran on past it)."""
    if gen is None or await asyncio.to_thread(ends, node_dir, work_dir, req, gen):
        return gen
    log.warning("final checkpoint %s of %s: generation %d is stored, but this node cannot "
                "tell that it ended its workload (it may have run on past it); not answered "
                "with it", req.request_id, req.target, gen.number)
    return None


def _write(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_durably(path, b"")
    _prune(path.parent)


def _prune(where: Path) -> None:
    old = time.time() - KEEP_S
    with os.scandir(where) as entries:
        for e in entries:
            with contextlib.suppress(OSError):
                if e.stat(follow_symlinks=False).st_mtime < old:
                    os.unlink(e.path)
