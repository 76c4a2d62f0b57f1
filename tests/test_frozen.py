"""smr.gpu.frozen: one thread of a stopped process runs while the others stay
stopped (how a restored GPU process gets its GPU state back before any of
its threads can touch it), also when the holder is killed mid-hold. A real
multi-threaded process; no GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from smr.gpu import frozen
from smr.process.tree import process_tree

# Every thread counts in a file named by its thread id, every 2 ms.
WORKLOAD = """
import os, sys, threading, time
out = sys.argv[1]
def count():
    path = os.path.join(out, str(threading.get_native_id()))
    n = 0
    while True:
        n += 1
        with open(path + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(path + ".tmp", path)
        time.sleep(0.002)
for _ in range(3):
    threading.Thread(target=count, daemon=True).start()
count()
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ptrace of another process needs root")


def counts(d: Path) -> dict[int, int]:
    out = {}
    for p in d.iterdir():
        if p.name.isdigit():
            try:
                out[int(p.name)] = int(p.read_text() or 0)
            except (OSError, ValueError):
                pass
    return out


def test_only_the_named_thread_runs_then_all_go_on(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(tmp_path)])
    try:
        deadline = time.monotonic() + 30
        while len(counts(tmp_path)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        tids = frozen.threads(proc.pid)
        assert len(tids) == 4 and set(counts(tmp_path)) == set(tids)
        os.kill(proc.pid, signal.SIGSTOP)  # as CRIU's --leave-stopped leaves it
        for t in tids:
            frozen._until(t, "T")
        chosen = tids[-1]
        seen: dict[str, object] = {}

        def work() -> None:
            before = counts(tmp_path)
            time.sleep(0.5)
            after = counts(tmp_path)
            seen["moved"] = {t for t in tids if after[t] != before[t]}
            seen["states"] = {t: frozen.state(t) for t in tids}

        frozen.with_only(proc.pid, chosen, work)
        # By state as well as by count: the chosen thread may wait for the
        # GIL that a stopped thread holds, but no other thread may move.
        assert seen["moved"] <= {chosen}, seen  # type: ignore[operator]
        assert seen["states"][chosen] not in ("t", "T"), seen  # type: ignore[index]
        assert all(s == "t" for t, s in seen["states"].items() if t != chosen), seen
        os.kill(proc.pid, signal.SIGCONT)
        # Detached and continued: every thread runs on.
        before = counts(tmp_path)
        time.sleep(0.5)
        after = counts(tmp_path)
        assert {t for t in tids if after[t] > before[t]} == set(tids), (before, after)
    finally:
        proc.kill()
        proc.wait()


def test_a_tree_whose_stop_is_still_on_its_way_is_continued(tmp_path: Path) -> None:
    """CRIU leaves a tree stopped by sending SIGSTOP to each task while it
    still traces it, then detaching (compel's resume for TASK_STOPPED): the
    task stops only once it runs again, so right after CRIU exits its state
    may still say running. That exact sequence, with a tracer thread here in
    CRIU's place; resume_tree is called in the gap, as the restore step
    calls it once CRIU has exited. (The fault campaign found such restores
    'succeeded' with the workload stopped for good.)"""
    import asyncio
    import threading

    from smr.gpu.cuda_checkpoint import CudaCheckpoint
    from tests.chaos import gpu_standin

    gpu_dir = tmp_path / "gpu"
    out = tmp_path / "counts"
    out.mkdir()
    env = {**os.environ, gpu_standin.ENV: "w1"}
    proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(out)], env=env)
    drv = gpu_standin.StandInDriver(gpu_dir)
    try:
        deadline = time.monotonic() + 30
        while len(counts(out)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        tids = frozen.threads(proc.pid)
        (gpu_dir / "w1").write_text("CHECKPOINTED")  # as CRIU brings a GPU process back
        traced, release = threading.Event(), threading.Event()

        def criu_exit() -> None:  # every ptrace call from this one thread
            for t in tids:
                frozen._ptrace(frozen.PTRACE_SEIZE, t, 0, 0)
                frozen._ptrace(frozen.PTRACE_INTERRUPT, t, 0, 0)
            for t in tids:
                frozen._until(t, "t")
            os.kill(proc.pid, signal.SIGSTOP)
            traced.set()
            release.wait(5)
            for t in tids:
                frozen._ptrace(frozen.PTRACE_DETACH, t, 0, 0)

        tracer = threading.Thread(target=criu_exit)
        tracer.start()
        assert traced.wait(10)
        assert frozen.state(proc.pid) != "T"  # the gap: the stop is only pending
        threading.Timer(0.3, release.set).start()
        asyncio.run(CudaCheckpoint(drv=drv).resume_tree(proc.pid))  # type: ignore[arg-type]
        tracer.join()
        assert drv.state(proc.pid) is not None and drv.state(proc.pid).name == "RUNNING"
        time.sleep(0.3)
        before = counts(out)
        time.sleep(0.5)
        after = counts(out)
        assert frozen.state(proc.pid) not in ("T", "t"), frozen.state(proc.pid)
        assert {t for t in tids if after[t] > before[t]} == set(tids), (before, after)
    finally:
        proc.kill()
        proc.wait()


# A process whose main thread has ended (pthread_exit) while its other
# threads run on: the leader stays a zombie thread (Z) for good.
ZOMBIE_LEADER = r"""
#include <pthread.h>
#include <unistd.h>
static void *spin(void *a) { for (;;) usleep(2000); return a; }
int main(void) {
    pthread_t t;
    for (int i = 0; i < 3; i++) pthread_create(&t, 0, spin, 0);
    pthread_exit(0);
}
"""



def zombie_leader(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """ZOMBIE_LEADER built and started, once its main thread has ended
    (leader Z) and its three workers run: the process and the workers."""
    src, exe = tmp_path / "zl.c", tmp_path / "zl"
    src.write_text(ZOMBIE_LEADER)
    subprocess.run(["gcc", "-O1", "-pthread", "-o", str(exe), str(src)], check=True)
    proc = subprocess.Popen([str(exe)])
    deadline = time.monotonic() + 30
    while (len(frozen.threads(proc.pid)) < 4 or frozen.state(proc.pid) != "Z") \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc, [t for t in frozen.threads(proc.pid) if t != proc.pid]

def test_a_stopped_process_whose_main_thread_ended_is_continued(tmp_path: Path) -> None:
    """Its leader shows Z, never T, and once the group stop is done no
    SIGSTOP is pending: judged by the leader alone it was taken for a
    running process, never continued, and the job stayed stopped for good."""
    import asyncio

    from smr.gpu.cuda_checkpoint import CudaCheckpoint
    from tests.chaos import gpu_standin

    (tmp_path / "gpu").mkdir()
    proc, workers = zombie_leader(tmp_path)
    try:
        assert len(workers) == 3 and frozen.state(proc.pid) == "Z"
        os.kill(proc.pid, signal.SIGSTOP)  # as CRIU's --leave-stopped leaves it
        for t in workers:
            frozen._until(t, "T")
        drv = gpu_standin.StandInDriver(tmp_path / "gpu")
        asyncio.run(CudaCheckpoint(drv=drv).resume_tree(proc.pid))  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        while any(frozen.state(t) == "T" for t in workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {t: frozen.state(t) for t in workers if frozen.state(t) == "T"} == {}
    finally:
        proc.kill()
        proc.wait()


def test_one_thread_runs_in_a_process_whose_main_thread_ended(tmp_path: Path) -> None:
    """The zombie leader cannot be seized (EPERM) and never runs: the hold
    takes the threads that live, and the GPU restore goes on."""
    proc, workers = zombie_leader(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        frozen.wait_stopped([proc.pid], timeout=10)
        chosen = workers[-1]
        seen = frozen.with_only(proc.pid, chosen, lambda: {t: frozen.state(t) for t in workers})
        assert seen[chosen] not in ("t", "T") and all(
            s == "t" for t, s in seen.items() if t != chosen), seen
    finally:
        proc.kill()
        proc.wait()


def _tree_with_a_zombie() -> tuple[subprocess.Popen[bytes], int]:
    """A process whose child has ended and is never reaped (sleep never
    waits for the child it inherits from the shell it replaced)."""
    proc = subprocess.Popen(["sh", "-c", "sleep 0 & exec sleep 60"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        zombies = [p for p in process_tree(proc.pid) if frozen.state(p) == "Z"]
        if zombies and Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
            return proc, zombies[0]
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("no zombie child appeared")


def test_a_stopped_tree_holding_a_zombie_is_held() -> None:
    """A zombie never stops: CRIU saves a child caught between its exit and
    its parent's wait as one, and it stays one while the tree is held. Taken
    for a running process, it made a pod's recovery run a heartbeat again
    instead of storing the dump it had (the CI flake of
    test_a_heartbeat_whose_agent_died_mid_capture_runs_on_and_is_stored_whole)."""
    proc, zombie = _tree_with_a_zombie()
    try:
        tree = process_tree(proc.pid)
        assert zombie in tree and not frozen.held(tree, timeout=0.2)  # running: not held
        os.kill(proc.pid, signal.SIGSTOP)
        frozen._until(proc.pid, "T")
        assert frozen.held(tree, timeout=10)  # bounds a hang only
    finally:
        proc.kill()
        proc.wait()


def test_a_tree_with_a_running_process_or_none_stopped_is_not_held() -> None:
    proc, _ = _tree_with_a_zombie()
    child = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        frozen._until(proc.pid, "T")
        assert not frozen.held([proc.pid, child.pid], timeout=0.2)
        assert not frozen.held([p for p in process_tree(proc.pid) if p != proc.pid])  # zombie
        assert not frozen.held([child.pid + 10_000_000])  # gone
    finally:
        for p in (proc, child):
            p.kill()
            p.wait()


def test_a_held_process_whose_main_thread_ended_is_held(tmp_path: Path) -> None:
    proc, _ = zombie_leader(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        frozen.wait_stopped([proc.pid], timeout=10)
        assert frozen.held([proc.pid], timeout=10)  # bounds a hang only
    finally:
        proc.kill()
        proc.wait()


def test_a_tree_whose_stop_is_still_pending_is_held() -> None:
    """Right after CRIU's --leave-stopped detach a task may still run to
    its SIGSTOP: waited for, not taken for a running one."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        frozen._until(proc.pid, "S")
        detached = threading.Event()

        def criu_exit() -> None:  # every ptrace call from this one thread
            frozen._ptrace(frozen.PTRACE_SEIZE, proc.pid, 0, 0)
            frozen._ptrace(frozen.PTRACE_INTERRUPT, proc.pid, 0, 0)
            frozen._until(proc.pid, "t")
            os.kill(proc.pid, signal.SIGSTOP)
            detached.wait(5)
            frozen._ptrace(frozen.PTRACE_DETACH, proc.pid, 0, 0)

        tracer = threading.Thread(target=criu_exit)
        tracer.start()
        deadline = time.monotonic() + 10
        while not frozen.stopping(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert frozen.state(proc.pid) == "t"  # the gap: the stop is only pending
        threading.Timer(0.3, detached.set).start()
        assert frozen.held([proc.pid], timeout=5)
        tracer.join()
        assert frozen.state(proc.pid) == "T"
    finally:
        proc.kill()
        proc.wait()


# -- the holder (the agent's worker) killed while its hold is on: a real
# multi-threaded process, the holder a process of its own killed with SIGKILL.

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
