"""smr-init's signal handling around a dump, and its preStop wait mode, run as
plain processes (no container needed: the agent's Shim reaches the state
directory through /proc/PID/root as it does in a container)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.containers.host import Shim
from smr.process.criu import kill_tree

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def until(what: Callable[[], object], timeout: float = 10, why: str = "") -> object:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, why or "timed out"
        time.sleep(0.05)
    return got


def pending_term(pid: int) -> bool:
    """SIGTERM pending in the kernel for ``pid`` (what CRIU saves in an image)."""
    text = Path(f"/proc/{pid}/status").read_text()
    masks = {k: int(v, 16) for k, v in (line.split(":\t") for line in text.splitlines()
                                         if line.startswith(("SigPnd", "ShdPnd")))}
    return any(m & SIGTERM_BIT for m in masks.values())


@pytest.fixture
def state(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "SMR_INIT_DIR": str(tmp_path), "SMR_CONTAINER": "main"}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            # Its workload too: smr-init starts it in a session of its own,
            # where killing smr-init alone left it looping for good.
            kill_tree(p.pid)
            p.wait(5)


def test_a_sigterm_during_a_dump_waits_for_it_and_reaches_the_original(
        smr_init: Path, tmp_path: Path, state: dict[str, str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    # The workload records each SIGTERM and goes on (its handler decides when to stop).
    marks = tmp_path / "terms"
    script = f'trap "echo term >> {marks}" TERM; while true; do sleep 0.05; done'
    init = subprocess.Popen([str(smr_init), "--", "/bin/sh", "-c", script], env=state)
    procs.append(init)
    shim = Shim(init.pid, str(tmp_path), "main")
    until(lambda: shim.status()[:1] == ["waiting"], why="smr-init did not start")
    shim.decide("fresh")
    workload = until(shim.workload, why="the workload did not start")
    assert isinstance(workload, tuple)

    assert shim.hold(True) is None, "no signal was forwarded before the dump"
    init.send_signal(signal.SIGTERM)  # the kubelet, while the dump runs
    time.sleep(1)
    assert not marks.exists(), "the workload got SIGTERM while a dump held it"
    assert not pending_term(workload[0]), "a SIGTERM is pending: CRIU would save it"

    shim.hold(False)  # the dump is over: now the signal goes through, once
    until(marks.exists, why="the held SIGTERM never reached the workload")
    time.sleep(0.5)
    assert marks.read_text() == "term\n"
    # A later dump learns that the workload was asked to stop.
    assert shim.hold(True) == signal.SIGTERM
    shim.hold(False)


@pytest.mark.parametrize("stop", [signal.SIGWINCH, signal.SIGRTMIN + 3],
                         ids=["httpd-SIGWINCH", "systemd-SIGRTMIN+3"])
def test_an_images_stop_signal_reaches_the_workload(
        stop: int, smr_init: Path, tmp_path: Path, state: dict[str, str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    """The runtime sends the image's STOPSIGNAL (httpd's SIGWINCH, systemd's
    SIGRTMIN+3) to PID 1: smr-init passes it on, or the container would wait
    out its whole grace period."""
    marks = tmp_path / "got"
    script = ("import pathlib, signal, sys, time\n"
              "def stop(*_):\n"
              f"    pathlib.Path({str(marks)!r}).write_text('got')\n"
              "    sys.exit(0)\n"
              f"signal.signal({stop}, stop)\n"
              "while True: time.sleep(0.05)\n")
    init = subprocess.Popen([str(smr_init), "--", sys.executable, "-c", script], env=state)
    procs.append(init)
    shim = Shim(init.pid, str(tmp_path), "main")
    until(lambda: shim.status()[:1] == ["waiting"], why="smr-init did not start")
    shim.decide("fresh")
    workload = until(shim.workload, why="the workload did not start")
    assert isinstance(workload, tuple)
    try:
        time.sleep(0.5)  # its handler in place
        init.send_signal(stop)
        until(marks.exists, why=f"signal {stop} never reached the workload")
        assert init.wait(10) == 0, "smr-init did not end with its workload"
    finally:
        with contextlib.suppress(ProcessLookupError):  # not left behind if smr-init died
            os.kill(workload[0], signal.SIGKILL)


def test_prestop_wait_ends_with_the_final_checkpoint(
        smr_init: Path, tmp_path: Path, state: dict[str, str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    init = subprocess.Popen([str(smr_init), "--", "/bin/sh", "-c", "exec sleep 600"], env=state)
    procs.append(init)
    shim = Shim(init.pid, str(tmp_path), "main")
    until(lambda: shim.status()[:1] == ["waiting"], why="smr-init did not start")
    shim.decide("fresh")
    until(shim.workload, why="the workload did not start")

    wait = subprocess.Popen([str(smr_init), "--wait-final", "60"], env=state,
                            stdout=subprocess.PIPE, text=True)
    procs.append(wait)  # type: ignore[arg-type]
    shim.hold(True)  # the final dump: it ends the workload before its images are stored
    os.kill(shim.workload()[0], signal.SIGKILL)  # type: ignore[index]
    until(lambda: shim.status() == ["exited"], why="smr-init did not see the workload end")
    time.sleep(0.5)
    assert wait.poll() is None, "the hook ended while the final checkpoint was being stored"
    shim.final("done 4")
    out, _ = wait.communicate(timeout=10)
    assert wait.returncode == 0 and "final checkpoint done 4" in out
    shim.hold(False)
    init.wait(10)


def test_prestop_wait_ends_when_the_workload_is_gone_without_a_dump(
        smr_init: Path, tmp_path: Path, state: dict[str, str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    init = subprocess.Popen([str(smr_init), "--", "/bin/sh", "-c", "sleep 0.5"], env=state)
    procs.append(init)
    shim = Shim(init.pid, str(tmp_path), "main")
    until(lambda: shim.status()[:1] == ["waiting"], why="smr-init did not start")
    shim.decide("fresh")
    init.wait(10)
    out = subprocess.run([str(smr_init), "--wait-final", "60"], env=state, timeout=10,
                         capture_output=True, text=True).stdout
    assert "no final checkpoint; the workload is exited" in out


def test_a_stale_hold_keeps_no_signal_back_and_a_refreshed_one_does(
        smr_init: Path, tmp_path: Path, state: dict[str, str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    """An agent that crashed mid-dump leaves `hold`: after HOLD_STALE_S (60 s)
    smr-init ignores it for signals too, so the kubelet's SIGTERM still
    reaches the workload. A live agent refreshes it in place, never removing
    it (a moment without `hold` would let the held signal through mid-dump)."""
    marks = tmp_path / "terms"
    script = f'trap "echo term >> {marks}" TERM; while true; do sleep 0.05; done'
    init = subprocess.Popen([str(smr_init), "--", "/bin/sh", "-c", script], env=state)
    procs.append(init)
    shim = Shim(init.pid, str(tmp_path), "main")
    until(lambda: shim.status()[:1] == ["waiting"], why="smr-init did not start")
    shim.decide("fresh")
    until(shim.workload, why="the workload did not start")

    assert shim.hold(True) is None
    hold = tmp_path / "main" / "hold"
    old = time.time() - 120
    os.utime(hold, (old, old))
    inode = hold.stat().st_ino
    shim.refresh_hold()  # the live agent's touch: the same file, fresh again
    assert hold.stat().st_ino == inode and hold.stat().st_mtime > old + 100
    init.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert not marks.exists(), "a refreshed hold let the SIGTERM through"

    os.utime(hold, (old, old))  # the agent crashed: nobody touches it any more
    until(marks.exists, why="a stale hold kept the kubelet's SIGTERM back")


def test_a_workload_of_another_user_still_forwards_under_the_agents_lock(
        smr_init: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """A container that runs as a non-root user: the agent (root) created
    `signal.lock`, so smr-init can only open it for reading. It must still
    take the lock: a SIGTERM forwarded while the agent holds it (between
    reading `signalled` and creating `hold`) is one CRIU would save."""
    top = Path(tempfile.mkdtemp(prefix="smr-init-user-"))
    try:
        top.chmod(0o777)  # reachable and writable by the container's user
        marks = top / "terms"
        script = f'trap "echo term >> {marks}" TERM; while true; do sleep 0.05; done'
        init = subprocess.Popen([str(smr_init), "--", "/bin/sh", "-c", script], user=65534,
                                env={**os.environ, "SMR_INIT_DIR": str(top),
                                     "SMR_CONTAINER": "main"})
        procs.append(init)
        shim = Shim(init.pid, str(top), "main")
        until(lambda: shim.status()[:1] == ["waiting"], why="smr-init did not start")
        shim.decide("fresh")
        until(shim.workload, why="the workload did not start")
        shim.hold(True)  # a leave-running dump: the agent creates the lock, root's
        shim.hold(False)
        assert (top / "main/signal.lock").stat().st_uid == 0

        lock = os.open(top / "main/signal.lock", os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the next hold is being taken
            init.send_signal(signal.SIGTERM)
            time.sleep(1)
            assert not marks.exists(), "smr-init forwarded a SIGTERM past the agent's lock"
        finally:
            os.close(lock)
        until(marks.exists, why="the SIGTERM never reached the workload")
    finally:
        shutil.rmtree(top, ignore_errors=True)
