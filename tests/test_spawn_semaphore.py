"""A local job whose Python multiprocessing workers are started by 'spawn'
and share a semaphore (what a PyTorch DataLoader with spawn workers does;
issue #26's DataLoader row). Real CRIU, real nats-server; no GPU needed.

glibc's sem_open creates /dev/shm/sem.XXXXXX, maps it, links it to the
semaphore's name and unlinks the first name: the mapping's path is deleted
while the file still has a link. CRIU dumps such a file only with
--link-remap, a hard link it leaves in that directory for the restore. smr
does not pass it yet. Tried here: with it, this test passes (a final dump,
one restore), but the links (/dev/shm/link_remap.N, N a per-dump counter,
the host's /dev/shm for a local job) are consumed by the first restore, and
a leave-running dump (a heartbeat) deletes its own at once, so its image
cannot be restored ('Can't link dev/shm/link_remap.21 -> dev/shm/sem.1KCQV9:
No such file or directory'). Until smr carries those files in the image,
the dump fails and the job runs on.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smr.jobs import launch
from tests import nats_auth
from tests.test_local_smr import Harness, running

pytestmark = pytest.mark.criu

PROGRAM = """
import multiprocessing as mp, time

def work(lock, q):
    n = 0
    while True:
        with lock:
            n += 1
            q.put(n)
        time.sleep(0.05)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    lock, q = ctx.Lock(), ctx.Queue()
    ctx.Process(target=work, args=(lock, q), daemon=True).start()
    while True:
        print(f"step={q.get()}", flush=True)
"""


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as harness:
        yield harness


def steps(log: Path) -> list[int]:
    return [int(ln[5:]) for ln in log.read_text().splitlines() if ln.startswith("step=")]


async def until(log: Path, more_than: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not (got := steps(log)) or got[-1] <= more_than:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        await asyncio.sleep(0.05)
    return got


@pytest.mark.xfail(strict=True, reason="CRIU needs --link-remap for sem_open's mapping; "
                   "smr does not carry link remaps yet (docs/compatibility.md, GPU frameworks)")
async def test_a_job_with_spawn_workers_and_a_semaphore_migrates(h: Harness,
                                                                  tmp_path: Path) -> None:
    script = tmp_path / "spawner.py"
    script.write_text(PROGRAM)
    job = launch("spawner", [sys.executable, str(script)], log=tmp_path / "spawner.log",
                 cwd=tmp_path, node=h.settings.node)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    log = Path(job.log)
    await until(log, 5)
    done = await h.checkpoint(job.id)
    if done.status != "succeeded":
        assert "link remap" in str(done.error), done.error  # the known cause, nothing else
        assert job.alive(), "a failed dump leaves the job running"
    assert done.status == "succeeded", done.error
    frozen = steps(log)[-1]
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    after = [s for s in await until(log, frozen + 3) if s > frozen]
    assert after[0] == frozen + 1 and after == list(range(after[0], after[0] + len(after)))
