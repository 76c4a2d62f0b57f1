"""A container's final checkpoint is taken once, whichever requests ask for it.

Several final requests, each under its own id, can name one container: the
watcher derives one per reason (an eviction, the node's graceful shutdown),
and a preStop hook may be retried. The first to hold the container's lock
dumps it and ends its workload; the others find no workload left to save.
Their answer is that final checkpoint, not a failure: ``latest`` of the
lineage is a final dump (``leave_running: false``, also a taken-over one)
of this very container (its ID in the manifest), the workload is gone, and
this node recorded that the dump ended it (services/checkpointer/endings): a
final whose workload ran on past it (its step answered failed, not knowing
that ``latest`` had moved to it) is no answer.
A workload still there (a final stored, its tree not yet ended: the agent
died in between) is not answered so: its step's recovery ends it, or the
request dumps it again, as before. A request that names its pod by uid is
answered so also once that pod is gone or replaced by a new one of its name
(a bare pod recreated): the final dump was of the pod it names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from services.checkpointer import endings
from services.containers import host
from services.containers.pods import PodContainer
from services.storage.generation import Generation
from services.storage.store import CheckpointStore
from smr.contract.errors import SmrError
from smr.contract.messages import CkptRequested

log = logging.getLogger("smr.checkpointer")


# How long a look waits for smr-init to settle into a state it can be read
# in: it looks for its workload's end every 0.1 s, and writes "exited" (or
# exits) only then; on a loaded node it may wait for a core meanwhile.
ENDING_LOOKS, ENDING_LOOK_S = 30, 0.1


def _workload_gone(container_id: str) -> bool:
    """No smr-init left for the container, or one whose workload has ended
    (not one still waiting for its start: a restore may put one there).

    smr-init whose workload is no longer its child while its status still
    says "running" (it has not written "exited" yet), or whose status cannot
    be read (it is exiting), is looked at again for a second: it is taken
    for ended only once it says so or is gone. A workload seen running is
    never taken for ended."""
    shim = host.find_shim(container_id)
    for _ in range(ENDING_LOOKS):
        if shim is None:
            return True
        try:
            if shim.workload() is not None:
                return False
            st = shim.status()[:1]
            if st not in (["waiting"], ["running"]):
                return True
            if st == ["waiting"]:
                return False
        except SmrError:
            pass  # unreadable: smr-init exiting, or a tenant's doing
        time.sleep(ENDING_LOOK_S)
        shim = host.find_shim(container_id)
    return False  # not taken for an ending


async def _final_latest(store: CheckpointStore, namespace: str,
                        checkpoint_id: str) -> Generation | None:
    """``latest`` of the lineage if it is a final dump."""
    latest = await store.latest(namespace, checkpoint_id)
    return latest if latest is not None and latest.manifest.get("leave_running") is False \
        else None


async def stored(store: CheckpointStore, req: CkptRequested, c: PodContainer,
                 node_dir: Path, work_dir: Path) -> Generation | None:
    """The final checkpoint of ``c`` that ended its workload, if ``latest``
    of ``req``'s lineage is one: ``req`` (a final request) is answered with it."""
    latest = await _final_latest(store, c.namespace, req.checkpoint_id)
    if latest is None:
        return None
    if (latest.manifest.get("container") or {}).get("container_id") != c.container_id:
        return None  # another container's (an earlier instance of the pod's)
    if not await asyncio.to_thread(_workload_gone, c.container_id):
        return None
    if await endings.answering(node_dir, work_dir, req, latest) is None:
        return None
    log.info("final checkpoint %s of %s: its final checkpoint is stored already "
             "(generation %d, request %s), which ended its workload; answered with it",
             req.request_id, req.target, latest.number,
             latest.manifest.get("final_request_id") or latest.manifest.get("request_id"))
    return latest


async def of_pod(store: CheckpointStore, req: CkptRequested, node_dir: Path,
                 work_dir: Path) -> Generation | None:
    """For ``req`` (a final request) whose pod is gone or replaced: ``latest``
    of its lineage if that is a final dump of the very pod (by uid) and
    container it names."""
    if not req.target.pod_uid:
        return None  # which pod it meant is not known
    namespace = req.target.namespace or ""
    latest = await _final_latest(store, namespace, req.checkpoint_id)
    if latest is None:
        return None
    dumped = latest.manifest.get("target") or {}
    if (dumped.get("pod_uid"), dumped.get("container")) != (req.target.pod_uid,
                                                             req.target.container):
        return None
    if await endings.answering(node_dir, work_dir, req, latest) is None:
        return None
    log.info("final checkpoint %s of %s: its pod is gone, and its final checkpoint is "
             "stored (generation %d); answered with it", req.request_id, req.target,
             latest.number)
    return latest
