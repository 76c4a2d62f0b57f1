"""The cooperative path (smr/coop.py, smr/gpu/coopgate.py): before the GPU lock,
the ranks of a job that imported ``smr.coop`` reach a step boundary, drop
their process group and acknowledge; after the checkpoint, or in the
restored copy, they build it again and training goes on.

Real CRIU, a real nats-server, real processes: stand-in ranks that speak
the request/acknowledge protocol through the library's own protocol class
(``smr.gpu.coopproto.Rank``) and never acknowledge."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from services.checkpointer.step import CheckpointStep
from smr.gpu import coopgate, coopproto
from smr.jobs import launch
from tests.test_local_smr import Harness

pytestmark = pytest.mark.criu

# Two stand-in ranks (a process and its child) that register as
# cooperative and then run a step that never ends at a boundary.
SILENT_RANKS = r"""
import os, sys, time
from pathlib import Path
from smr.gpu.coopproto import ENV, Rank
rank = 0 if os.fork() else 1
Rank(Path(os.environ[ENV]), rank, 2).register()
n = 0
while True:
    n += 1
    if rank == 0:
        print(f"step={n}", flush=True)
    time.sleep(0.05)
"""


def steps(log: Path) -> list[int]:
    return [int(ln.split()[0][5:]) for ln in log.read_text().splitlines()
            if ln.startswith("step=")]


async def until(log: Path, more_than: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not (got := steps(log)) or got[-1] <= more_than:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        await asyncio.sleep(0.05)
    return got


def coop_env(h: Harness, job_id: str) -> dict[str, str]:
    """The environment `smr exec` gives a job: its cooperation directory."""
    import os

    return {**os.environ, coopproto.ENV: str(coopgate.directory(h.settings.work_path, job_id))}


async def test_ranks_that_never_acknowledge_are_refused_before_anything_is_frozen(
        h: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CheckpointStep, "coop_deadline_s", 2.0)
    script = tmp_path / "silent.py"
    script.write_text(SILENT_RANKS)
    job = launch("silent", [sys.executable, str(script)], log=tmp_path / "silent.log",
                 cwd=tmp_path, node=h.settings.node, env=coop_env(h, "silent"))
    h.pids.append(job.pid)
    await h.jobs.put(job)
    d = coopgate.directory(h.settings.work_path, "silent")
    deadline = time.monotonic() + 30
    while len(list(d.glob("rank-*.json"))) < 2:
        assert time.monotonic() < deadline, "the stand-in ranks never registered"
        await asyncio.sleep(0.05)
    await until(tmp_path / "silent.log", 3)

    done = await h.checkpoint("silent")
    assert done.status == "failed", done
    assert done.error and done.error["code"] == "coop-no-ack", done.error
    assert "did not acknowledge within 2 s" in done.error["message"]
    assert "nothing was frozen, the job runs on" in done.error["message"]
    # The request is withdrawn, and the job steps on.
    assert not (d / coopproto.REQUEST).exists()
    at = steps(tmp_path / "silent.log")[-1]
    await until(tmp_path / "silent.log", at + 5)
