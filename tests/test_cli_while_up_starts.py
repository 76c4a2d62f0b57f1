"""A command run while `smr up` starts (`smr up &` then a command at once, as
the README's one-machine section reads) waits for it, saying so; one run
where no `smr up` exists fails at once and says what to run.

`smr up` is held in its start by a condition, not a sleep: the test runs its
real `main(["up"])` behind an import hook that stops at the import of the
embedded node (its heavy part) until the test opens a FIFO."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.lifetime import interrupt

# A log line as logging.basicConfig in smrctl.cli formats it.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ (DEBUG|INFO|WARNING|ERROR) ",
                      re.MULTILINE)

# `smr up`, held at its import of smrctl.embedded until the FIFO's writer closes it.
HELD_UP = """
import os, sys
class Gate:
    def find_spec(self, name, path=None, target=None):
        if name == "smrctl.embedded":
            sys.meta_path.remove(self)
            with open(os.environ["HELD_UP_GATE"]) as f:
                f.read()
        return None
sys.meta_path.insert(0, Gate())
from smrctl.cli import main
sys.exit(main(["up"]))
"""


@pytest.fixture
def env(tmp_path: Path, criu_binary: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SMR_")},
            "SMR_DATA_DIR": str(tmp_path / "data"), "SMR_METRICS_PORT": "0",
            "SMR_NODE_NAME": f"node-{uuid.uuid4().hex[:8]}", "SMR_CRIU": criu_binary}


def smr(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "smrctl.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)


class HeldUp:
    """`smr up` in its own process, stopped in its start until released."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.gate = tmp_path / "gate"
        os.mkfifo(self.gate)
        self.out = tmp_path / "up.out"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", HELD_UP],
                                         env={**env, "HELD_UP_GATE": str(self.gate)},
                                         stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.writer: int | None = None

    def wait_held(self, timeout: float = 120) -> None:
        """Until it reads the FIFO (a writer opens only once a reader has)."""
        deadline = time.monotonic() + timeout
        while self.writer is None:
            try:
                self.writer = os.open(self.gate, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"smr up never reached its import: {self.out.read_text()}")
                time.sleep(0.05)

    def release(self) -> None:
        if self.writer is not None:
            os.close(self.writer)
            self.writer = None

    def stop(self) -> str:
        self.release()
        interrupt(self.proc)
        return self.out.read_text(errors="replace")


def test_a_command_started_while_smr_up_starts_waits_for_it(
        tmp_path: Path, env: dict[str, str]) -> None:
    # The URL file a killed `smr up` left: the starting one's is waited for, not this.
    data = tmp_path / "data"
    data.mkdir()
    (data / "nats.url").write_text("nats://stale-token@127.0.0.1:9\n")
    up = HeldUp(tmp_path, env)
    try:
        up.wait_held()
        ps = smr(env, "ps")
        assert ps.stderr is not None
        said = ps.stderr.readline()  # its first word: waiting, or a failure
        if f"smr up (pid {up.proc.pid}) is starting" not in said:
            out, err = ps.communicate(timeout=60)
            pytest.fail(f"it did not wait for the starting smr up:\n{out}{said}{err}")
        up.release()
        out, err = ps.communicate(timeout=120)
        assert ps.returncode == 0, out + said + err
        assert out.startswith("ID"), out
        assert "Traceback" not in err and not LOG_LINE.search(err), err
    finally:
        text = up.stop()
    assert "smr up: node" in text and "Traceback" not in text, text


def test_a_command_waiting_for_an_smr_up_that_dies_says_so(
        tmp_path: Path, env: dict[str, str]) -> None:
    up = HeldUp(tmp_path, env)
    try:
        up.wait_held()
        ps = smr(env, "ps")
        assert ps.stderr is not None
        said = ps.stderr.readline()
        assert "is starting" in said, said + ps.communicate(timeout=60)[1]
        up.proc.kill()
        up.proc.wait()
        out, err = ps.communicate(timeout=120)
        assert ps.returncode == 2, out + err
        assert f"smr up (pid {up.proc.pid}) stopped before it started serving" in err, err
        assert "its output says why" in err, err
    finally:
        up.stop()


def test_a_command_where_no_smr_up_runs_fails_at_once_saying_what_to_run(
        env: dict[str, str]) -> None:
    ps = smr(env, "ps")
    out, err = ps.communicate(timeout=120)
    assert ps.returncode == 2, out + err
    assert "smr is not running on this machine" in err and "`smr up`" in err, err
    assert "waiting" not in err, err
