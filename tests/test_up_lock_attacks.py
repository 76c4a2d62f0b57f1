"""`smr up`'s data directory lock under attack, with the real programs as a
user runs them: a command looking at the lock as `smr up` starts, a command
left waiting for a result when its `smr up` is killed, and a command run with
another data directory than the running `smr up`'s."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from smr.jobs import signal_tree
from tests.helpers.lifetime import interrupt
from tests.test_cli_while_up_starts import smr


@pytest.fixture
def env(tmp_path: Path, criu_binary: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SMR_")},
            "SMR_DATA_DIR": str(tmp_path / "data"), "SMR_METRICS_PORT": "0",
            "SMR_NODE_NAME": f"node-{uuid.uuid4().hex[:8]}", "SMR_CRIU": criu_binary}


class Up:
    """A real `smr up`, its output in a file; stopped with Ctrl-C at the end."""

    def __init__(self, tmp_path: Path, env: dict[str, str], name: str = "up") -> None:
        self.out = tmp_path / f"{name}.out"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "smrctl.cli", "up"], env=env,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def serving_or_ended(self, timeout: float = 120) -> str:
        """Its output once it says it serves, or once it has exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.out.read_text(errors="replace")
            if "smr up: node" in text or self.proc.poll() is not None:
                return self.out.read_text(errors="replace")
            time.sleep(0.1)
        return self.out.read_text(errors="replace")

    def stop(self) -> str:
        interrupt(self.proc)
        return self.out.read_text(errors="replace")


# `smr ps`, stopped inside its look at the lock (holding the shared flock that
# uplock.holder takes) until the FIFO's writer closes it.
HELD_LOOK = """
import fcntl, os, sys
real = fcntl.flock
def flock(fd, op):
    real(fd, op)
    if op & fcntl.LOCK_SH:
        fcntl.flock = real
        with open(os.environ["HELD_LOOK_GATE"]) as f:
            f.read()
fcntl.flock = flock
from smrctl.cli import main
sys.exit(main(["ps"]))
"""


def opened_by_reader(fifo: Path, proc: subprocess.Popen[str], timeout: float = 120) -> int:
    """The FIFO's writer end, once ``proc`` reads it (a writer opens only then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"it never reached its gate: {proc.communicate()}")
            time.sleep(0.05)


def has_open(pid: int, path: Path) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            pass
    return False


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "smrctl.cli", *args], env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=180)


def test_smr_up_starts_while_a_command_looks_at_the_lock(
        tmp_path: Path, env: dict[str, str]) -> None:
    # What the last `smr up` of this data directory left in the lock file: its
    # PID, long gone by now.
    gone = subprocess.Popen(["true"])
    gone.wait()
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "up.lock").write_text(f"{gone.pid}\n")
    # A real `smr ps` caught inside its look at the lock, as when a script
    # runs commands in a loop while `smr up` (re)starts.
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    ps = subprocess.Popen([sys.executable, "-c", HELD_LOOK],
                          env={**env, "HELD_LOOK_GATE": str(gate)}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL)
    writer = None
    up = None
    try:
        writer = opened_by_reader(gate, ps)
        up = Up(tmp_path, env)
        # Let the look end only once `smr up` has the lock file open: it is
        # taking the lock (or has given up, on the old code) by then.
        deadline = time.monotonic() + 120
        while up.proc.poll() is None and not has_open(up.proc.pid, data / "up.lock"):
            assert time.monotonic() < deadline, "smr up never opened its lock file"
            time.sleep(0.01)
        os.close(writer)
        writer = None
        said = up.serving_or_ended()
        assert "smr up: node" in said, f"smr up did not start beside a command:\n{said}"
    finally:
        if writer is not None:
            os.close(writer)
        ps.communicate(timeout=120)
        text = up.stop() if up else ""
    assert "Traceback" not in text, text


def test_a_command_waiting_for_its_result_ends_when_smr_up_is_killed(
        tmp_path: Path, env: dict[str, str]) -> None:
    up = Up(tmp_path, env)
    job = 0
    try:
        assert "smr up: node" in up.serving_or_ended(), up.stop()
        started = run(env, "exec", "-i", "sleeper", "--", "sleep", "1000")
        assert started.returncode == 0, started.stdout + started.stderr
        job = int(started.stdout.split("pid ")[1].split(",")[0])
        # Held before it takes the request: the command waits for a result
        # that this `smr up` will never give.
        up.proc.send_signal(signal.SIGSTOP)
        ck = smr(env, "checkpoint", "sleeper", "--leave-running")
        assert ck.stderr is not None
        asked = ck.stderr.readline()  # "checkpoint of ID requested (RID)": it is published
        assert "requested (" in asked, asked + ck.communicate(timeout=60)[1]
        rid = asked.split("(")[1].split(")")[0]
        up.proc.kill()
        up.proc.wait()
        try:
            out, err = ck.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            ck.kill()
            out, err = ck.communicate()
            pytest.fail("the command still waited 120 s after its smr up was killed:\n"
                        + err[-1500:])
        assert ck.returncode == 3, out + err
        assert f"smr up (pid {up.proc.pid}) stopped" in err and rid in err, err
        assert "Traceback" not in err, err
        # What it says to do: the next `smr up` runs the request, and asking
        # with its id again answers it, running nothing twice.
        again = Up(tmp_path, env, "up-again")
        try:
            assert "smr up: node" in again.serving_or_ended(), again.stop()
            waited = run(env, "checkpoint", "sleeper", "--leave-running", "--request-id", rid)
            assert waited.returncode == 0, waited.stdout + waited.stderr
            assert "checkpoint sleeper: generation 1," in waited.stdout, waited.stdout
        finally:
            again.stop()
    finally:
        up.stop()
        if job:
            signal_tree(job, signal.SIGKILL)


def test_a_command_with_another_data_directory_names_the_one_it_looked_in(
        tmp_path: Path, env: dict[str, str]) -> None:
    up = Up(tmp_path, env)
    try:
        assert "smr up: node" in up.serving_or_ended(), up.stop()
        elsewhere = {**env, "SMR_DATA_DIR": str(tmp_path / "elsewhere")}
        ps = run(elsewhere, "ps")
        assert ps.returncode == 2, ps.stdout + ps.stderr
        # A `smr up` does run on this machine: the user must learn which data
        # directory the command looked in, and that it must be the same.
        assert str(tmp_path / "elsewhere") in ps.stderr, ps.stderr
        assert "SMR_DATA_DIR" in ps.stderr, ps.stderr
    finally:
        up.stop()
