"""Review of smr.gpu.frozen (#26): the agent that holds a restored GPU process's
threads (ptrace) is killed while the hold is on. A real multi-threaded
process; the holder is a process of its own, killed with SIGKILL. No GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smr.gpu import frozen
from tests.test_frozen import WORKLOAD, counts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ptrace of another process needs root")

# A holder like the agent's worker thread: the driver's restore (work) never ends.
HOLDER = """
import sys, time
from smr.gpu import frozen
from pathlib import Path
frozen.with_only(int(sys.argv[1]), int(sys.argv[2]), lambda: time.sleep(3600),
                 Path(sys.argv[3]))
"""


def blocked(pid: int, tid: int) -> str:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigBlk:"))


def moved(d: Path, tids: list[int], seconds: float = 0.5) -> set[int]:
    before = counts(d)
    time.sleep(seconds)
    after = counts(d)
    return {t for t in tids if after.get(t) != before.get(t)}


def killed_mid_hold(tmp_path: Path) -> tuple[str, str]:
    """The scenario; returns the chosen thread's blocked-signal mask before
    the first hold and after the second one."""
    proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(tmp_path)])
    holder = None
    try:
        deadline = time.monotonic() + 30
        while len(counts(tmp_path)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        tids = frozen.threads(proc.pid)
        chosen = tids[-1]
        mask = blocked(proc.pid, chosen)
        os.kill(proc.pid, signal.SIGSTOP)  # CRIU's --leave-stopped
        for t in tids:
            frozen._until(t, "T")
        keep = tmp_path / "held" / f"{proc.pid}-{chosen}.sigmask"
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(proc.pid), str(chosen),
                                   str(keep)],
                                  env={**os.environ, "PYTHONPATH": os.getcwd()},
                                  stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        others = [t for t in tids if t != chosen]
        # Held: the chosen thread out of any stop, every other one in a
        # ptrace stop. (By state, not by its count moving: a Python thread
        # can wait for the GIL that a stopped thread holds.)
        while frozen.state(chosen) in "tT" or any(frozen.state(t) != "t" for t in others):
            if holder.poll() is not None:
                assert holder.stderr is not None
                raise AssertionError(f"the holder ended: {holder.stderr.read()[-2000:]!r}")
            assert time.monotonic() < deadline, "the hold never let the chosen thread run"
            time.sleep(0.05)
        assert not moved(tmp_path, others, 0.2), "a held thread ran"
        holder.kill()  # the agent dies with the hold on
        holder.wait()
        time.sleep(0.2)
        assert not moved(tmp_path, others), "the other threads ran once the holder died"
        # The redelivered step: its GPU restore holds the tree again, then continues it.
        frozen.with_only(proc.pid, chosen, lambda: None, keep)
        assert not keep.exists(), "the kept mask outlived the hold that gave it back"
        os.kill(proc.pid, signal.SIGCONT)
        assert moved(tmp_path, tids) == set(tids), "the tree did not run on"
        return mask, blocked(proc.pid, chosen)
    finally:
        if holder and holder.poll() is None:
            holder.kill()
        proc.kill()
        proc.wait()


def test_a_holder_killed_mid_hold_leaves_the_tree_stopped_and_a_second_hold_frees_it(
        tmp_path: Path) -> None:
    """Held: the other threads stay stopped when the holder dies (no thread
    touches a GPU mapping before its state is back), and the redelivered
    step's hold and SIGCONT let the whole tree run on."""
    killed_mid_hold(tmp_path)


def test_a_holder_killed_mid_hold_leaves_no_signal_mask_behind(tmp_path: Path) -> None:
    """The held thread runs with every signal but SIGTRAP blocked; its own
    mask is given back when the hold ends. A holder killed meanwhile never
    gave it back, and the next hold read the blocked mask as the thread's:
    its own is now kept in a file the next agent finds."""
    before, after = killed_mid_hold(tmp_path)
    assert after == before, (f"the held thread was left blocking signals {after} (was "
                             f"{before}): the dead holder's mask outlived it")
