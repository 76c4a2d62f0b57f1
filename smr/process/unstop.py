"""Keeping a CRIU run going when someone stops it.

The node agent's CRIU runs in a container's PID namespace (it must, to dump
and restore the tree there), where the workload's root may signal it: a
process of the tenant outside the dumped tree (an orphan, a sidecar sharing
the PID namespace) can `kill -STOP` CRIU, and util-linux nsenter then stops
itself too. Nothing in CRIU would ever continue it: the step, and a
checkpoint slot of the node, would be held until the run's timeout, and a
CRIU killed then may leave a tree it had seized to die.

So while a run lasts, every process of it that is one of the agent's own
programs (the run's nsenter, setpriv, sh, CRIU's loader: known by the file
/proc/PID/exe names, never by a name the tenant could copy) is looked at
every ``INTERVAL`` and continued (SIGCONT) when found stopped. Nothing is
ever stopped here, and processes of the tree (a restore's tasks, once CRIU
gave them their own executable back) are left alone: a stop CRIU itself
asks for (--leave-stopped) is kept. Each continue is counted, so that the
run's outcome can say who held it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from smr.process.tree import process_tree

# Often enough that a stop costs CRIU little, rarely enough to cost nothing:
# a few /proc reads per look.
INTERVAL = 0.02
# How long a stopped child of CRIU's own program is left to CRIU (its checks
# hold one for milliseconds) before it counts as a tenant's stop.
CHILD_GRACE = 1.0


@dataclass
class Stops:
    """What a watch saw: how many times a process of the run was found stopped
    (and continued), and which."""

    count: int = 0
    pids: set[int] = field(default_factory=set)
    # CRIU's own stopped children (see continue_stopped): when each was first
    # seen stopped.
    held: dict[int, float] = field(default_factory=dict)


def identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """The (device, inode) of the file ``path`` names, or None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def programs(paths: Iterable[str | os.PathLike[str]]) -> frozenset[tuple[int, int]]:
    """The identities of the agent's own programs among ``paths``."""
    return frozenset(i for p in paths if (i := identity(p)) is not None)


def stopped(pid: int) -> bool:
    """Is ``pid`` in a group stop (state T)? A ptrace stop (t) is CRIU's own."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The state follows the command name, which may hold spaces and brackets.
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"T"


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def continue_stopped(root: int, own: frozenset[tuple[int, int]], stops: Stops) -> None:
    """One look: continue every stopped process of ``root``'s tree that runs one
    of the ``own`` programs. A child forked by its parent without an exec
    (the same program as its parent) may be CRIU's own, stopped on purpose:
    its kernel and vDSO checks stop one and inspect it for milliseconds, and
    continuing it then breaks CRIU. Such a child is continued only once it
    has stayed stopped for ``CHILD_GRACE`` (a tenant's stop, not CRIU's)."""
    now = time.monotonic()
    for pid in process_tree(root):
        if not stopped(pid):
            # A grace counts from the current stop: one seen running (its
            # parent continued it, or the pid is a new process's) starts over.
            stops.held.pop(pid, None)
            continue
        if (exe := identity(f"/proc/{pid}/exe")) in own:
            parent = _parent(pid)
            if parent is not None and identity(f"/proc/{parent}/exe") == exe:
                if now - stops.held.setdefault(pid, now) < CHILD_GRACE:
                    continue
                stops.held.pop(pid, None)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                stops.count += 1
                stops.pids.add(pid)


async def keep_running(root: int, own: frozenset[tuple[int, int]], stops: Stops,
                       interval: float = INTERVAL) -> None:
    """Until cancelled: continue, every ``interval``, what of ``root``'s run was
    stopped (``stops`` counts it)."""
    while True:
        continue_stopped(root, own, stops)
        await asyncio.sleep(interval)
