"""Which checkpoint request of a node starts first, and when (the
``Admission`` of the node agent's checkpointer; smr/bus/ahead.py says how
its worker uses it).

- **Final first.** A final checkpoint (drain, preemption, shutdown: the
  kubelet stops the workload within its grace period) starts before every
  leave-running one waiting (a cordon's, a heartbeat's), whatever came first.
- **Bounded by bandwidth**: a leave-running dump starts while fewer than
  ``SMR_CHECKPOINTS_PER_NODE`` dumps run (each one's images go up while CRIU
  writes them; more at once only share the link), a final one while fewer
  than that many final ones run: leave-running dumps, whoever asked for
  them, never keep a final one from starting. (A final one that takes over
  its container's leave-running dump counts as that dump.)
- **One per container and kind**: a leave-running request for a container
  whose leave-running one is in flight here waits outside the slots, and a
  final one for a container whose final one is (smr/bus/ahead.py). A final
  one does start beside its container's leave-running one: it takes that
  dump over, makes it step aside, or waits for its lock.
- **Shared by namespace**: of the requests as urgent, those of the namespace
  with the fewest as urgent in flight start first: one tenant's queue holds
  another namespace's requests as urgent back only until one of the dumps of
  that kind in flight ends (final ones still go before every leave-running one).
- **Bounded by scratch**: a dump's images are written to the agent's work
  directory before they are stored (with the container's writable layer and
  /dev/shm, their data only: services/containers/rootfs). One starts only
  when the estimates of the dumps in flight and its own fit the free space
  there now (a disk, or memory on a tmpfs), at most ``SMR_CHECKPOINT_SCRATCH`` bytes. The free
  space measured already lacks what the dumps in flight have written: the
  bound errs on the safe side. A dump always starts when none is in flight.
- **Above the kubelet's eviction thresholds**: the room is what the file
  system has free above the kubelet's hard eviction threshold for it
  (``SMR_KUBELET_EVICTION_HARD``; the largest of its disk signals, as the
  work directory, an emptyDir, usually shares one file system with the
  images). Below it the node gets DiskPressure and the kubelet evicts pods
  with no grace, no preStop, no final checkpoint. The step itself refuses a
  dump that would cross it (``over_threshold``), also the one that starts
  alone: code ``eviction-threshold``, and the workload runs on.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Hashable
from pathlib import Path

from smr.config import Settings
from smr.config_values import eviction_hard
from smr.contract.errors import PermanentError
from smr.contract.messages import CkptRequested

THRESHOLD = "eviction-threshold"

FINAL, LEAVE_RUNNING = 0, 1
# Requests fetched beyond those running, to find the final ones among them:
# more than the opted-in containers of one node (110 pods by default).
LOOK_AHEAD = 256


def agent_windows(s: Settings) -> dict[str, int]:
    """Each request kind's window of a node agent's workers (services/agent:
    concurrency plus what it fetches ahead), the max_ack_pending of the node's
    durables. The watcher makes them with it (its agents' user may create no
    consumer), from the same settings (the ConfigMap smr-config)."""
    return {"ckpt.requested": s.checkpoints_per_node + LOOK_AHEAD,
            "restore.requested": s.restores_per_node}


def urgency(req: CkptRequested) -> int:
    """Final checkpoints first: the kubelet does not wait for leave-running ones."""
    return LEAVE_RUNNING if req.leave_running else FINAL


class CheckpointAdmission:
    def __init__(self, scratch: Path, estimate: Callable[[CkptRequested], Awaitable[int]],
                 limit: int = 0, eviction: str = "",
                 rides: Callable[[CkptRequested], bool] | None = None) -> None:
        self.scratch = scratch
        self._estimate = estimate
        self._rides = rides  # a final that takes over a dump in flight: no slot
        self.limit = limit  # 0: the free space alone
        self.eviction = eviction  # the kubelet's --eviction-hard; "": no threshold

    def urgency(self, req: CkptRequested) -> int:
        return urgency(req)

    async def estimate(self, req: CkptRequested) -> int:
        return await self._estimate(req)

    def rides(self, req: CkptRequested) -> bool:
        return self._rides is not None and self._rides(req)

    def job(self, req: CkptRequested) -> Hashable:
        """The container ``req`` is for, as it names it (whichever pod uid)."""
        t = req.target
        return t.kind, t.namespace, t.pod, t.container, t.job_id

    def share(self, req: CkptRequested) -> Hashable:
        """Whose share of the node's slots it takes: its namespace's."""
        return req.target.namespace_name

    def room(self) -> int:
        free, size = space(self.scratch)
        free = max(0, free - reserve(size, self.eviction))
        return min(free, self.limit) if self.limit else free


def space(path: Path) -> tuple[int, int]:
    """Free bytes for an unprivileged writer on ``path``'s file system (its
    nearest existing parent's: the work directory is made by the first step),
    and its size: the kubelet's ``available`` and ``capacity``."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return 0, 0


def reserve(size: int, eviction: str) -> int:
    """The bytes the kubelet wants free on a file system of ``size``: the
    largest of its disk thresholds (``eviction``, the --eviction-hard form)."""
    return max((int(frac * size) or n for frac, n in eviction_hard(eviction).values()),
               default=0)


def over_threshold(target: str, scratch: Path, need: int, eviction: str) -> None:
    """Raise ``eviction-threshold`` if writing ``need`` bytes into ``scratch``
    would leave its file system below the kubelet's hard eviction threshold."""
    free, size = space(scratch)
    keep = reserve(size, eviction)
    if need <= free - keep:
        return
    mib = 1 << 20
    raise PermanentError(
        f"the checkpoint of {target} needs about {need // mib} MiB in {scratch}, which has "
        f"{free // mib} MiB free of {size // mib} MiB; the kubelet evicts pods with no grace "
        f"below {keep // mib} MiB free there ({eviction}): nothing was dumped, the workload "
        "runs on", code=THRESHOLD,
        hint="free space on the node's disk or give the agent's work directory a larger one; "
             "set SMR_KUBELET_EVICTION_HARD to the kubelet's own evictionHard if it differs")


def resident_bytes(pids: list[int]) -> int:
    """The resident memory of ``pids``, summed (pages two share are counted
    twice: an estimate on the safe side). A process gone meanwhile counts 0."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total
