"""`make test` runs the suite on several pytest-xdist workers at once
(tests/README.md, "In parallel"): what one worker starts must not outlive it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_killed_workers_servers_do_not_outlive_it(tmp_path: Path,
                                                     criu_binary: str) -> None:
    """A worker SIGKILLed mid-session runs no teardown: its nats-server, moto
    and containerd end with it all the same, holding no port or mount for
    the next run on the machine."""
    pids_file = tmp_path / "pids"
    env = {**os.environ, "SMR_TEST_KILLED_PIDS": str(pids_file)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--basetemp", str(tmp_path / "inner"), "tests/helpers/killed_worker.py"],
                       env=env, capture_output=True, text=True, timeout=300)
    if not pids_file.exists():
        pytest.fail(f"the inner worker did not start its servers:\n{r.stdout[-2000:]}")
    listed, ctd_root = pids_file.read_text().splitlines()
    pids = [int(p) for p in listed.split()]
    deadline = time.monotonic() + 30  # bounds a hang; they get SIGTERM at once
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in left]
    for p in left:  # leave nothing running, whatever the outcome
        os.kill(p, signal.SIGTERM)
    shutil.rmtree(ctd_root, ignore_errors=True)  # containerd's own, under /tmp
    assert not left, (f"servers of a killed worker still run: {names or left} "
                      "(nats-server, moto, containerd: tests/helpers/lifetime.py)")
