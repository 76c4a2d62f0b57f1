"""A Python multiprocessing pool (ProcessPoolExecutor, 4 workers, a
multiprocessing.shared_memory block) as a local job, as nobody: checkpointed
with tasks in flight, migrated (restored by another node), every task
finishes with the right digest and the shared block is intact. About 10 s."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path

import pytest

from smr.jobs import launch
from tests import nats_auth
from tests.programs import pool
from tests.programs.conftest import other_node
from tests.test_local_smr import Harness

pytestmark = pytest.mark.criu

TASKS, MIB = 16, 16
POOL = str(Path(pool.__file__).resolve())
DONE = re.compile(r"^done (\d+) (\w+)$", re.M)


async def until(log: Path, what: re.Pattern[str] | str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text() if log.exists() else ""
        if (what.search(text) if isinstance(what, re.Pattern) else what in text):
            return text
        assert time.monotonic() < deadline, f"never saw {what!r}: {text[-1500:]!r}"
        await asyncio.sleep(0.05)


def check_finished(text: str) -> None:
    done = {int(i): d for i, d in DONE.findall(text)}
    assert sorted(done) == list(range(TASKS)), f"tasks lost or doubled: {sorted(done)}"
    for i, d in done.items():
        assert d == pool.expected(i, TASKS, MIB), f"task {i} saw a corrupted block"
    assert "block ok" in text and f"finished {TASKS}" in text


async def test_pool_finishes_its_work_in_flight_after_a_migration(
        h: Harness, criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path) -> None:
    log = h.tmp / "pool.log"
    job = launch(f"pool-{uuid.uuid4().hex[:6]}", [
        "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
        "/usr/bin/python3", POOL, str(TASKS), str(MIB)], log=log, cwd=Path("/"),
        node=h.settings.node)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    await until(log, "ready ")
    await until(log, re.compile(r"^done ", re.M))  # some done, the rest in flight
    final = await h.checkpoint(job.id, reason="preemption")
    assert final.status == "succeeded", final.error
    before = len(DONE.findall(log.read_text()))
    assert before < TASKS, "the work was over before the checkpoint: nothing in flight"
    async with other_node(criu_binary, nats_users, tmp_path) as b:
        restored = await b.restore(job.id)
        assert restored.status == "succeeded", restored.error
        check_finished(await until(log, f"finished {TASKS}"))
        print("\n[compat] pool local non-root migration: " + json.dumps(dict(
            in_flight=TASKS - before, image_bytes=final.size_bytes, final=final.durations,
            restore=restored.durations)))
