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


class _Item:
    """Just what tests.helpers.ordering reads of a collected test."""

    def __init__(self, nodeid: str, fixtures: tuple[str, ...]) -> None:
        self.nodeid, self.fixturenames = nodeid, fixtures


def test_pod_tests_run_in_as_many_lanes_as_asked_whole_files_each() -> None:
    """No more pod tests run at once than there are lanes, whatever the
    number of workers: each lane is one work unit, and a file's tests stay
    in one lane, in their order; other tests are each a unit of their own."""
    from tests.helpers import ordering

    items = [_Item(f"tests/agent/test_{f}.py::t{i}", ("cluster",))
             for f, n in (("a", 5), ("b", 2), ("c", 2), ("d", 1)) for i in range(n)]
    items += [_Item("tests/agent/test_init.py::t", ("tmp_path",)),
              _Item("tests/test_cluster.py::t", ("cluster",))]
    lane_of = ordering.lanes(items, 2)  # type: ignore[arg-type]
    assert set(lane_of) == {i.nodeid for i in items[:10]}
    for f in "abcd":
        assert len({v for k, v in lane_of.items() if f"test_{f}.py" in k}) == 1
    assert sorted(list(lane_of.values()).count(lane) for lane in (0, 1)) == [5, 5]
    assert set(ordering.lanes(items, 1).values()) == {0}  # type: ignore[arg-type]
