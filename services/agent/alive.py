"""Two agents of one node, one after the other: a DaemonSet rollout, a restart.

**The mark of life.** While it runs, the agent touches a file on its node
(SMR_AGENT_MARK, beside smr-runtime) every MARK_S. smr-runtime reads its age
when it creates an opted-in container: within SMR_AGENT_WAIT of the agent's
last touch, an agent is coming (the old one was just stopped, the new one
pulls its image, connects to NATS, waits for its consumers), and smr-init
waits for it up to what is left of SMR_AGENT_WAIT, not only its own 30 s
(services/agent/init/smr-init.c). An older mark, or none (no agent ever ran
here, or an uninstall removed it), means none is coming: smr-init's own
timeout applies. So a restore is never turned into a fresh start by a gap
between agents, and no container waits for ever for an agent that is gone.

**One agent answers container starts.** With ``maxSurge: 1`` the new agent
runs beside the old one until it is ready. Both would scan the same
containers; only the one holding the node's starts lock (a flock in the
node's step-lock directory, which the kernel lets go when its holder ends)
answers them. The other waits its turn: the old agent's ends with it. A start
the old agent was answering when it stopped is answered again by the new one,
with the same request id (derived from the container ID), so it joins the
restore already under way rather than starting a second one; the steps
themselves are held by the node's step locks and the cluster's job locks,
whichever agent runs them.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from pathlib import Path

from smr.aio import wait_event

log = logging.getLogger("smr.agent")

MARK_S = 5.0  # how often the mark is touched (far below any useful SMR_AGENT_WAIT)
TURN_S = 1.0  # how often an agent waiting for its turn looks again
STARTS_LOCK = "starts.lock"  # no step lock has this name (they are hashes)


def touch(mark: Path) -> None:
    mark.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


async def keep_alive(mark: Path | None, stop: asyncio.Event) -> None:
    """Touch ``mark`` every MARK_S until ``stop``; never fatal to the agent
    (without it a container waits only smr-init's own timeout)."""
    if mark is None:
        await stop.wait()  # a task of the agent ends only with it
        return
    said = False
    while not stop.is_set():
        try:
            await asyncio.to_thread(touch, mark)
            said = False
        except OSError as e:
            if not said:
                log.warning("cannot touch %s (%s): containers starting on this node while "
                            "no agent runs wait only smr-init's own timeout", mark, e)
                said = True
        await wait_event(stop, MARK_S)


class StartsTurn:
    """The node's starts lock: held by the one agent that answers smr-init."""

    def __init__(self, root: Path) -> None:
        self.path = root / STARTS_LOCK
        self._fd: int | None = None

    def _try(self) -> bool:
        self.path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    async def take(self, stop: asyncio.Event) -> bool:
        """Wait for the lock; False if ``stop`` came first."""
        said = False
        while not stop.is_set():
            if await asyncio.to_thread(self._try):
                if said:
                    log.info("this agent answers container starts now (the other agent of "
                             "this node let go)")
                return True
            if not said:
                log.info("another agent of this node answers container starts (the one "
                         "this agent replaces, in a rollout); waiting for its turn")
                said = True
            await wait_event(stop, TURN_S)
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
