"""A job that maps a file whose name it deleted (NCCL keeps a 33 MiB one in
/dev/shm, even over sockets) is checkpointed and restored with the file's
content: CRIU saves such a "ghost" file in the images only up to its
--ghost-limit (1 MiB by default). Real CRIU and nats-server."""

from __future__ import annotations

import sys
import uuid

import pytest

from smr.jobs import launch
from tests.test_local_smr import Harness

pytestmark = pytest.mark.criu

# 8 MiB of /dev/shm, mapped, its name deleted; a copy in anonymous memory:
# each step changes both and says whether they still agree.
JOB = r"""
import mmap, os, sys, time
size = 8 << 20
path = f"/dev/shm/smr-ghost-{os.getpid()}-{time.time_ns()}"
fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
os.ftruncate(fd, size)
m = mmap.mmap(fd, size)
os.unlink(path)
os.close(fd)
copy = bytearray(os.urandom(size))
m[:] = copy
n = 0
while True:
    n += 1
    i = (n * 7919 * 4099) % size
    copy[i] ^= 0xFF
    m[i] ^= 0xFF
    print(f"step={n} ok={m[:] == copy}", flush=True)
    time.sleep(0.05)
"""


async def test_a_job_mapping_a_deleted_8_mib_file_is_migrated_with_it(h: Harness) -> None:
    job_id = f"ghost-{uuid.uuid4().hex[:6]}"
    job = launch(job_id, [sys.executable, "-c", JOB], log=h.tmp / f"{job_id}.log", cwd=h.tmp,
                 node=h.settings.node)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    await h.wait_step(job, 3)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    frozen = int(h.lines(job)[-1]["step"])
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, frozen + 3)
    after = [ln for ln in h.lines(job) if int(ln["step"]) > frozen]
    assert int(after[0]["step"]) == frozen + 1 and all(ln["ok"] == "True" for ln in after), after
