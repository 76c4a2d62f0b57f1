"""When a final checkpoint request takes a container's workload for ended
(services/checkpointer/finals.py): the looks at its smr-init that a
final before it leaves in every state smr-init passes through as it ends.
smr-init here is a FAKE (``Ending``): its states are scripted look by look;
the pod tests drive the real one (tests/agent/test_data_path_attacks.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.checkpointer import endings, finals
from services.containers import host
from smr.bus.liveness import StepLocks
from smr.contract.errors import SmrError
from smr.jobs import proc_start_ticks
from smr.process.tree import process_tree


class Ending:
    """A FAKE smr-init, one state per look: ("running", True) a live workload,
    ("running", False) its status still "running" with the workload reaped,
    ("exited", False), "unreadable" (its status read fails as it exits),
    or None (no smr-init any more)."""

    def __init__(self, states: list[object]) -> None:
        self.states: Iterator[object] = iter(states)
        self.now: object = next(self.states)
        self.looks = 0

    def find(self, container_id: str) -> Ending | None:
        if self.looks:
            self.now = next(self.states, self.now)
        self.looks += 1
        return None if self.now is None else self

    def workload(self) -> tuple[int, int] | None:
        if self.now == "unreadable":
            raise SmrError("status unreadable", code="unsafe-path")
        assert isinstance(self.now, tuple)
        return (100, 1) if self.now[1] else None

    def status(self) -> list[str]:
        assert isinstance(self.now, tuple)
        return [self.now[0]]


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finals, "ENDING_LOOK_S", 0.001)


@pytest.mark.parametrize(("states", "gone"), [
    # The final before ended it and smr-init is gone: ended.
    ([None], True),
    # smr-init says so.
    ([("exited", False)], True),
    # Reaped, "exited" not written yet, then written: ended.
    ([("running", False), ("running", False), ("exited", False)], True),
    # Its status unreadable as it exits, then gone: ended.
    (["unreadable", None], True),
    # A workload running: never taken for ended, whatever comes next
    # (smr-init killed by the kubelet's grace right after this look).
    ([("running", True), None], False),
    # Waiting for its start (a restore may put a workload there).
    ([("waiting", False)], False),
    # Status "running" and no workload child for good (a restored root not
    # yet its child, say): not taken for ended.
    ([("running", False)], False),
    (["unreadable"], False),
])
def test_a_workload_is_taken_for_ended_only_once_smr_init_says_so_or_is_gone(
        monkeypatch: pytest.MonkeyPatch, quick: None, states: list[object], gone: bool
        ) -> None:
    fake = Ending(states)
    monkeypatch.setattr(host, "find_shim", fake.find)
    assert finals._workload_gone("c1") is gone


def test_a_dump_counts_as_held_only_once_no_live_worker_is_on_it(tmp_path: Path) -> None:
    """A final dump left finished and unmarked in its work directory counts
    as its workload's end only while no live worker holds that request (its
    agent died): a live step still storing it may yet let the workload run
    on. The caller's own request, whose lock its own worker holds, counts."""
    work, node = tmp_path / "pods", tmp_path / "steps"
    (work / "f1" / "images").mkdir(parents=True)
    (work / "f1" / "images" / "dump.log").write_text("(00.5) Dumping finished successfully\n")
    with StepLocks(node).hold("f1") as mine:
        assert mine
        assert not endings.held_since(work, node, "f1", asking="f2")
        assert endings.held_since(work, node, "f1", asking="f1")
    assert endings.held_since(work, node, "f1", asking="f2")
    endings.mark_ran_on(work, "f1")
    assert not endings.held_since(work, node, "f1", asking="f2")


def test_a_worker_that_lets_its_workload_run_on_between_two_reads_is_never_missed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live worker gives up on its final dump (marks it run past, lets the
    workload go, lets go of its lock) just after another caller read the
    mark as absent: the caller must not then find the lock free and take the
    dump for the workload's end. Its reads are made under the request's lock,
    which the worker held until its mark was written."""
    work, node = tmp_path / "pods", tmp_path / "steps"
    (work / "f1" / "images").mkdir(parents=True)
    (work / "f1" / "images" / "dump.log").write_text("(00.5) Dumping finished successfully\n")
    worker = StepLocks(node).hold("f1")
    assert worker.__enter__()
    real = endings.ran_on

    def read_then_worker_ends(work_dir: Path, request_id: str) -> bool:
        seen = real(work_dir, request_id)
        endings.mark_ran_on(work, "f1")  # the worker's tail, between two reads
        worker.__exit__(None, None, None)
        return seen

    monkeypatch.setattr(endings, "ran_on", read_then_worker_ends)
    try:
        assert not endings.held_since(work, node, "f1", asking="f2")
    finally:
        worker.__exit__(None, None, None)


# Three children, never reaped: one ended, one running, one whose first
# thread ended while another runs (a zombie to /proc's stat, and running).
CHILDREN = """
import ctypes, os, threading, time
def child(body):
    pid = os.fork()
    if pid == 0:
        body()
        os._exit(0)
    return pid
def first_thread_ends():
    threading.Thread(target=time.sleep, args=(60,)).start()
    ctypes.CDLL(None).pthread_exit(None)
kids = child(lambda: None), child(lambda: time.sleep(60)), child(first_thread_ends)
print(*kids, flush=True)
time.sleep(60)
"""


def test_a_workload_that_is_a_zombie_is_no_longer_running(tmp_path: Path) -> None:
    """A final dump kills the workload and waits until it is gone from
    /proc's view (a zombie); smr-init reaps it and writes "exited" a moment
    later. Meanwhile the container's next final request must not take the
    zombie for a running workload (to dump, or to say it ran on): real
    processes, a parent that has not reaped its ended child yet."""
    parent = subprocess.Popen([sys.executable, "-c", CHILDREN], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        ended, live, threaded = (int(x) for x in parent.stdout.readline().split())
        (tmp_path / "main").mkdir()
        shim = host.Shim(parent.pid, str(tmp_path), "main")
        deadline = time.monotonic() + 10
        while proc_start_ticks(ended) is not None:  # a zombie: /proc says nothing of it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert Path(f"/proc/{ended}").exists(), "reaped: no zombie to look at"
        (tmp_path / "main" / "status").write_text(f"running {ended}\n")
        assert shim.workload() is None
        (tmp_path / "main" / "status").write_text(f"running {live}\n")
        assert shim.workload() == (live, live)
        while proc_start_ticks(threaded) is not None:  # a zombie first thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (tmp_path / "main" / "status").write_text(f"running {threaded}\n")
        assert shim.workload() == (threaded, threaded), "a process whose other thread runs"
    finally:
        for p in process_tree(parent.pid)[::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        parent.wait()


def test_two_looks_at_one_held_dump_never_refuse_each_other(tmp_path: Path) -> None:
    """Two final requests of one pod (an eviction and the node's shutdown)
    look at the same dump left by a dead agent at once: both find it held;
    a worker that would take that request meanwhile is refused; the last
    look leaves no lock file behind."""
    work, node = tmp_path / "pods", tmp_path / "steps"
    (work / "f1" / "images").mkdir(parents=True)
    (work / "f1" / "images" / "dump.log").write_text("(00.5) Dumping finished successfully\n")
    locks = StepLocks(node)
    with locks.reading("f1") as first:
        assert first
        assert endings.held_since(work, node, "f1", asking="f2")
        with locks.hold("f1") as worker:
            assert not worker
    assert endings.held_since(work, node, "f1", asking="f3")
    assert list(node.iterdir()) == []
    with locks.hold("f1") as worker:
        assert worker
        assert not endings.held_since(work, node, "f1", asking="f2")


# A process whose memory takes a while to free (about 0.1 s), and whose
# first thread ends once its second runs: a zombie to /proc's stat, running.
BIG_THREADED = """
import ctypes, threading, time
ballast = bytearray(768 << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
threading.Thread(target=time.sleep, args=(60,)).start()
print("ok", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_killed_workload_whose_threads_are_still_exiting_has_ended(tmp_path: Path) -> None:
    """SIGKILL makes a process's first thread a zombie at once (a final's
    kill waits for that), while its other threads exit as its memory is
    freed: from then on the workload has ended. Which thread ends last after
    a kill is the scheduler's choice, so here the first thread has ended
    before the kill (the workload still runs), and the other thread frees
    the memory: every look between the kill and the reaping sees that
    moment. Real processes."""
    (tmp_path / "main").mkdir()
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", BIG_THREADED], stdout=subprocess.PIPE,
                             text=True)
        seen = 0
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "ok"
            deadline = time.monotonic() + 10
            while proc_start_ticks(p.pid) is not None:  # the first thread ends
                assert time.monotonic() < deadline
                time.sleep(0.001)
            (tmp_path / "main" / "status").write_text(f"running {p.pid}\n")
            shim = host.Shim(os.getpid(), str(tmp_path), "main")
            assert shim.workload() == (p.pid, p.pid), "a process whose other thread runs"
            os.kill(p.pid, signal.SIGKILL)
            while p.poll() is None:  # reaped only once every thread is gone
                if len(os.listdir(f"/proc/{p.pid}/task")) > 1:
                    seen += 1
                    assert shim.workload() is None, "a killed workload taken for running"
        finally:
            p.kill()
            p.wait()
        assert seen, "no look between the kill and the reaping saw a thread still exiting"


def test_a_look_waits_out_another_look_leaving(tmp_path: Path) -> None:
    """A look on its way out holds the request's file exclusively for a moment
    while it removes it: a second look then must not take it for a worker."""
    locks = StepLocks(tmp_path / "steps")
    locks.root.mkdir(parents=True)
    fd = os.open(locks._path("f1"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the leaving look holds it
    threading.Timer(0.05, os.close, (fd,)).start()
    with locks.reading("f1") as free:
        assert free
