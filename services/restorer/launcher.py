"""The CRIU a cancelled pod restore left behind, by the process the agent ran
it through.

A restore step cancelled while its CRIU runs (the agent stopping, say) leaves
that CRIU running: nothing kills it on a cancel. The redelivered request's
recovery must wait for it before it adopts the tree or restores again. It
knows that CRIU by the process the agent started it through (nsenter, which
lives exactly as long as the CRIU it forks), noted with its start tick beside
``restore.begun`` as CRIU starts, never by a name the workload could take too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from smr.contract.errors import TemporaryError
from smr.jobs import proc_start_ticks, wait_exit
from smr.process import unstop
from smr.process.criu import kill_tree

log = logging.getLogger("smr.restorer")

# Beside restore.begun: the host PID and start tick of the process the agent
# ran CRIU through.
LAUNCHER = "criu.launcher"


def note(work: Path, pid: int) -> None:
    (work / LAUNCHER).write_text(f"{pid} {proc_start_ticks(pid)}")


def noted(work: Path) -> tuple[int, int] | None:
    """The process a step of this agent ran its CRIU through, if it noted one."""
    try:
        pid, ticks = (work / LAUNCHER).read_text().split()
        return int(pid), int(ticks)
    except (OSError, ValueError):
        return None  # none noted (CRIU never started), or it had ended already


async def ended(what: str, pid: int, ticks: int, programs: Sequence[str],
                timeout: float) -> None:
    """Until the CRIU a cancelled step ran through ``pid`` (started at
    ``ticks``) has ended. Kept going as the step's own watch kept it
    (smr.process.unstop: ``programs`` are the run's own): a tenant that
    stopped CRIU in its PID namespace stopped nsenter too, which nothing else
    would continue, and the recovery would wait for it to the timeout, then
    restore beside it. Past ``timeout`` it is ended, as a step's CRIU would
    be; never is a second restore begun while it is there."""
    stops = unstop.Stops()
    watch = asyncio.create_task(_keep_running(pid, ticks, unstop.programs(programs), stops))
    try:
        gone = await wait_exit(pid, ticks, timeout=timeout)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    if stops.count:
        log.warning("%s: its CRIU (launched as pid %d) was stopped by someone else and "
                    "continued %d times after its step ended", what, pid, stops.count)
    if gone:
        return
    if proc_start_ticks(pid) == ticks:
        kill_tree(pid)
    if not await wait_exit(pid, ticks, timeout=30):
        raise TemporaryError(f"the CRIU of {what}'s cancelled restore (pid {pid}) did not end",
                             code="criu-restore-timeout")


async def _keep_running(pid: int, ticks: int, own: frozenset[tuple[int, int]],
                        stops: unstop.Stops) -> None:
    """unstop.keep_running for a run this process did not start: only while
    ``pid`` is still the process started at ``ticks``."""
    while proc_start_ticks(pid) == ticks:
        unstop.continue_stopped(pid, own, stops)
        await asyncio.sleep(unstop.INTERVAL)
