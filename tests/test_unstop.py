"""smr.process.unstop continues the agent's own stopped processes of a run, and no other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator

from smr.process import unstop
from smr.process.tree import process_tree


def _wait_state(pid: int, stopped: bool) -> None:
    deadline = time.monotonic() + 5
    while unstop.stopped(pid) != stopped:
        assert time.monotonic() < deadline, f"{pid} never {'stopped' if stopped else 'ran'}"
        time.sleep(0.01)


@contextlib.asynccontextmanager
async def forking(code: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """A Python program ``code`` that forks a child of its own program and
    prints the child's pid, run by a shell (the run's root) as the agent runs
    CRIU under sh: the run and the child, once stopped. Killed at the end."""
    run = await asyncio.create_subprocess_exec(
        "sh", "-c", f'{sys.executable} -c "$0"; true', code,
        stdout=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        assert run.stdout is not None
        child = int((await run.stdout.readline()).decode())
        _wait_state(child, True)
        yield run, child
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        await run.wait()


async def test_a_stopped_process_of_the_run_is_continued_and_others_are_left_stopped() -> None:
    sleep, tail = shutil.which("sleep"), shutil.which("tail")
    assert sleep and tail
    # The run: a sh (the root) with two children, one of the agent's programs
    # (sleep, here) and one that is not (tail: a restored tree's process).
    run = await asyncio.create_subprocess_exec(
        "sh", "-c", f"{sleep} 30 & {tail} -f /dev/null & wait", start_new_session=True)
    try:
        own, theirs = unstop.programs([sleep]), unstop.programs([tail])
        deadline = time.monotonic() + 5
        while True:  # until both children have run exec
            exes = {p: unstop.identity(f"/proc/{p}/exe") for p in process_tree(run.pid)}
            mine = [p for p, i in exes.items() if i in own]
            other = [p for p, i in exes.items() if i in theirs]
            if mine and other:
                break
            assert time.monotonic() < deadline, exes
            await asyncio.sleep(0.01)
        mine, other = mine[0], other[0]
        for p in (mine, other):
            os.kill(p, signal.SIGSTOP)
            _wait_state(p, True)
        stops = unstop.Stops()
        watch = asyncio.create_task(unstop.keep_running(run.pid, own, stops, interval=0.01))
        try:
            await asyncio.to_thread(_wait_state, mine, False)
            os.kill(mine, signal.SIGSTOP)  # again: continued again
            await asyncio.sleep(0.3)
            await asyncio.to_thread(_wait_state, mine, False)
        finally:
            watch.cancel()
        assert stops.count >= 2 and stops.pids == {mine}, stops
        assert unstop.stopped(other), "a process that is not the agent's own was continued"
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        await run.wait()


async def test_a_child_its_parent_forked_and_stopped_is_left_to_its_parent() -> None:
    """CRIU's kernel and vDSO checks fork a child of CRIU's own program that
    stops itself, and inspect it: continuing it breaks CRIU (a dump hung
    after its vDSO check when it was). Such a child, the same program as its
    parent, is left stopped for a grace; the parent, when stopped, is
    continued at once; a child stopped past the grace is a tenant's stop."""
    code = ("import os, signal, sys, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "    os._exit(0)\n"
            "print(pid, flush=True)\n"
            "time.sleep(30)\n")
    async with forking(code) as (run, child):
        parent = next(p for p in process_tree(run.pid) if p not in (run.pid, child))
        os.kill(parent, signal.SIGSTOP)
        _wait_state(parent, True)
        own = unstop.programs([sys.executable])
        stops = unstop.Stops()
        unstop.continue_stopped(run.pid, own, stops)
        await asyncio.to_thread(_wait_state, parent, False)
        assert stops.pids == {parent}, stops
        await asyncio.sleep(0.2)
        unstop.continue_stopped(run.pid, own, stops)
        assert unstop.stopped(child), "the child its parent stopped on purpose was continued"
        # Held for longer than CRIU ever holds one: a tenant's stop, continued.
        await asyncio.sleep(unstop.CHILD_GRACE)
        unstop.continue_stopped(run.pid, own, stops)
        await asyncio.to_thread(_wait_state, child, False)


async def test_a_child_stopped_again_after_running_gets_a_fresh_grace() -> None:
    """The grace of a child of its parent's own program counts from its
    current stop: a child its parent stopped, continued, and stops again
    later (or a new child on a reused pid) is left to its parent again, not
    continued at once on its earlier stop's time."""
    code = ("import os, signal, sys, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "    time.sleep(0.5)\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "    os._exit(0)\n"
            "print(pid, flush=True)\n"
            "time.sleep(30)\n")
    async with forking(code) as (run, child):
        own = unstop.programs([sys.executable])
        stops = unstop.Stops()
        unstop.continue_stopped(run.pid, own, stops)  # its first stop is seen
        first = time.monotonic()
        os.kill(child, signal.SIGCONT)  # its parent's continue, within the grace
        _wait_state(child, False)
        unstop.continue_stopped(run.pid, own, stops)  # seen running
        await asyncio.to_thread(_wait_state, child, True)  # its second stop
        await asyncio.sleep(max(0.0, first + unstop.CHILD_GRACE + 0.1 - time.monotonic()))
        unstop.continue_stopped(run.pid, own, stops)
        assert unstop.stopped(child) and not stops.pids, (
            "a child stopped anew was continued on its earlier stop's time", stops)
