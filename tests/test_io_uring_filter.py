"""`smr exec` jobs run with io_uring_setup failing (ENOSYS), as libuv needs
to fall back to epoll, in both of their launchers (smr-init --local in a PID
namespace of the job's own; smr.process.reaper for GPU jobs); the filter comes back
with a restored job (CRIU saves and restores it). Real CRIU, a real
nats-server, the real kernel."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from smr.jobs import Job, launch
from tests.test_local_smr import Harness

pytestmark = pytest.mark.criu

# Tries io_uring_setup at start and on each SIGUSR1, one line each.
JOB = r"""
import ctypes, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
def attempt(*_):
    fd = libc.syscall(425, 8, ctypes.create_string_buffer(120))
    print(f"uring fd={fd} errno={ctypes.get_errno() if fd < 0 else 0}", flush=True)
    if fd >= 0:
        import os
        os.close(fd)
signal.signal(signal.SIGUSR1, attempt)
attempt()
n = 0
while True:
    n += 1
    print(f"step={n}", flush=True)
    time.sleep(0.05)
"""


def attempts(job: Job) -> list[str]:
    return [ln for ln in Path(job.log).read_text().splitlines() if ln.startswith("uring ")]


async def until(job: Job, n: int) -> list[str]:
    for _ in range(400):
        if len(seen := attempts(job)) >= n:
            return seen
        await asyncio.sleep(0.025)
    raise AssertionError(f"{job.id} printed {attempts(job)}: {Path(job.log).read_text()[-500:]}")


async def start(h: Harness, own_pid_namespace: bool, env: dict[str, str] | None = None) -> Job:
    job_id = f"uring-{uuid.uuid4().hex[:6]}"
    job = launch(job_id, [sys.executable, "-c", JOB], log=h.tmp / f"{job_id}.log", cwd=h.tmp,
                 node=h.settings.node, own_pid_namespace=own_pid_namespace,
                 env={**os.environ, **(env or {})})
    h.pids.append(job.pid)
    await h.jobs.put(job)
    await h.wait_step(job, 2)
    return job


@pytest.mark.parametrize("own_pid_namespace", [True, False], ids=["smr-init", "reaper"])
async def test_io_uring_setup_fails_with_enosys_and_still_after_a_restore(
        h: Harness, own_pid_namespace: bool) -> None:
    job = await start(h, own_pid_namespace)
    assert (await until(job, 1)) == ["uring fd=-1 errno=38"]  # ENOSYS
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, 1, count=2)
    os.kill(restored.pid or job.pid, signal.SIGUSR1)
    assert (await until(job, 2))[1] == "uring fd=-1 errno=38", "the filter did not come back"


async def test_a_job_started_with_io_uring_allowed_keeps_it(h: Harness) -> None:
    job = await start(h, False, {"SMR_IO_URING": "allow"})
    assert (await until(job, 1))[0].startswith("uring fd=") and "errno=0" in attempts(job)[0]


RING = r"""
import ctypes, mmap, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(425, 8, ctypes.create_string_buffer(120))
if sys.argv[1] == "mapped":
    ring = mmap.mmap(fd, 4096, offset=0)  # the submission ring, as libuv maps it
print("ready", flush=True)
time.sleep(120)
"""


async def test_criu_failing_on_an_io_uring_is_explained(criu_binary: str,
                                                        tmp_path: Path) -> None:
    """Without smr's gate (CRIU run directly), CRIU's own failure on a
    mapped ring ('Unknown shit 600 (anon_inode:[io_uring])') is told as
    io-uring, naming the process. (A ring's descriptor alone fails later, in
    'send_fds failed (-22)', which does not say why: smr's gate finds it.)"""
    from smr.process.criu import Criu, CriuError

    p = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RING, "mapped", stdout=asyncio.subprocess.PIPE,
        start_new_session=True, env={**os.environ, "SMR_IO_URING": "allow"})
    try:
        assert p.stdout and (await p.stdout.readline()).strip() == b"ready"
        with pytest.raises(CriuError) as failed:
            await Criu(criu_binary).dump(p.pid, tmp_path / "images", leave_running=True)
        print("CRIU on an io_uring:", failed.value.as_dict())
        assert failed.value.code == "io-uring", failed.value.as_dict()
        assert f"process {p.pid} holds an io_uring" in failed.value.message
        assert p.returncode is None, "the process must run on"
    finally:
        p.kill()
        await p.wait()
