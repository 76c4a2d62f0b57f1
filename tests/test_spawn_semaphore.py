"""A local job whose Python multiprocessing workers are started by 'spawn'
and share semaphores (what a PyTorch DataLoader with spawn workers does;
the GPU frameworks matrix's DataLoader row). Real CRIU, real nats-server; no GPU needed.

glibc's sem_open creates /dev/shm/sem.XXXXXX, maps it, links it to the
semaphore's name and unlinks the first name: the creator's mapping names a
deleted path of a file that still has a link (the worker maps it by that
link). CRIU dumps such a file only with --link-remap, through a hard link
it leaves in /dev/shm for the restore; smr carries those links in the
checkpoint (smr.process.linkremap). Before, every dump failed ('Can't create link
remap for /dev/shm/sem.R1Yr50. Use link-remap option.'), and with CRIU's
links left in the host's /dev/shm a heartbeat could not be restored.

The job ping-pongs between its main process and its worker through two
semaphores: if the restored processes did not share each semaphore's file,
as they did, it would stop at the next step ('stuck').
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest

from services.restorer import step as restorer_step
from smr.jobs import launch, proc_start_ticks, signal_tree
from smr.process import reaper
from smr.process.tree import process_tree
from tests.test_local_smr import Harness

pytestmark = pytest.mark.criu

PROGRAM = """
import multiprocessing as mp, sys, time

def work(ping, pong):
    while True:
        ping.acquire()
        pong.release()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ping, pong = ctx.Semaphore(0), ctx.Semaphore(0)
    ctx.Process(target=work, args=(ping, pong), daemon=True).start()
    n = 0
    while True:
        ping.release()
        if not pong.acquire(timeout=20):
            print("stuck: the worker never answered", flush=True)
            sys.exit(1)
        n += 1
        print(f"step={n}", flush=True)
        time.sleep(0.05)
"""


def steps(log: Path) -> list[int]:
    return [int(ln[5:]) for ln in log.read_text().splitlines() if ln.startswith("step=")]


async def until(log: Path, more_than: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not (got := steps(log)) or got[-1] <= more_than:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        await asyncio.sleep(0.05)
    return got


async def killed(pid: int) -> None:
    ticks = proc_start_ticks(pid)
    signal_tree(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc_start_ticks(pid) == ticks:
        assert time.monotonic() < deadline, f"{pid} outlived SIGKILL"
        reaper.reap()  # a restored job is the node's (this process's) to reap
        await asyncio.sleep(0.05)


def semaphores_named(root: int) -> None:
    """Each semaphore the restored tree maps under a deleted name is the
    file its name opens: a worker started now would share it."""
    mapped = set()
    for pid in process_tree(root):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "/dev/shm/sem." in line:
                mapped.add(int(line.split()[4]))
    named = {p.stat().st_ino for p in Path("/dev/shm").glob("sem.mp-*")}
    assert len(mapped) == 2 and mapped <= named, (mapped, named)


def link_remaps_in_shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("link_remap.*")}


async def goes_on_from(log: Path, step: int) -> None:
    """The restored job prints step+1, step+2, ... (its semaphores work)."""
    after = [s for s in await until(log, step + 3) if s > step]
    assert after[:4] == list(range(step + 1, step + 5)), log.read_text()[-1000:]


async def test_a_job_with_spawn_workers_and_semaphores_migrates(
        h: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat, the job killed, restored from the heartbeat; a final
    checkpoint, restored twice from that one generation."""
    script = tmp_path / "spawner.py"
    script.write_text(PROGRAM)
    job = launch("spawner", [sys.executable, str(script)], log=tmp_path / "spawner.log",
                 cwd=tmp_path, node=h.settings.node)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    log = Path(job.log)
    await until(log, 5)
    before = link_remaps_in_shm()

    beat = await h.checkpoint(job.id, leave_running=True)
    assert beat.status == "succeeded", beat.error
    beat_step = steps(log)[-1]  # the job ran on: its last step at the dump is at most this
    await until(log, beat_step + 3)
    assert link_remaps_in_shm() == before, "a heartbeat leaves no link in /dev/shm"
    await killed(job.pid)  # its node lost: the heartbeat is what is left
    log.write_text("")
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    first = await until(log, 0)
    assert first[0] <= beat_step + 1, (first[:3], beat_step)
    await goes_on_from(log, first[0] - 1)
    semaphores_named(restored.pid)
    assert link_remaps_in_shm() == before, "the restore leaves no link in /dev/shm"

    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    assert link_remaps_in_shm() == before, "a final dump leaves no link in /dev/shm"
    # The heartbeat's restore streamed the images to CRIU, fetching the links
    # alone; these two download the generation whole, the links with it (as
    # an incremental one is: a pre-dump, on a kernel that tracks dirty pages).
    monkeypatch.setattr(restorer_step, "streamable", lambda manifest: False)
    frozen = steps(log)[-1]
    for as_id in (job.id, "second"):  # the same generation, twice
        again = await h.restore(job.id, as_id=as_id, generation=done.generation)
        assert again.status == "succeeded", again.error
        # A copy under another id writes a log of its own, beside the job's.
        out = log if as_id == job.id else log.with_name(f"{as_id}.log")
        await goes_on_from(out, frozen)
        semaphores_named(again.pid)
        await killed(again.pid)
        out.write_text("")
    assert link_remaps_in_shm() == before


HOLDS_DELETED_NAME = """
import os, sys, time
d = sys.argv[1]
f = open(os.path.join(d, "first"), "w")
os.link(os.path.join(d, "first"), os.path.join(d, "second"))
os.unlink(os.path.join(d, "first"))  # open under a deleted name, linked as 'second'
n = 0
while True:
    n += 1
    print(f"step={n}", flush=True)
    time.sleep(0.05)
"""


async def test_a_link_remap_outside_dev_shm_is_refused_and_the_job_runs_on(
        h: Harness, tmp_path: Path) -> None:
    """CRIU would leave its link in the job's own directory, which smr does
    not carry: the dump is refused with a code of its own, naming the file."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDS_DELETED_NAME)
    job = launch("holder", [sys.executable, str(script), str(tmp_path)],
                 log=tmp_path / "holder.log", cwd=tmp_path, node=h.settings.node)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    log = Path(job.log)
    await until(log, 3)
    done = await h.checkpoint(job.id)
    assert done.status == "failed" and done.error["code"] == "link-remap-unsupported", done.error
    assert f"{tmp_path}/first" in done.error["message"], done.error
    assert not list(tmp_path.glob("link_remap.*")), "CRIU's link is gone with the failed dump"
    await until(log, steps(log)[-1] + 3)  # it runs on
