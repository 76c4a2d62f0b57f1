"""Review of #26's GPU heartbeat for local jobs: the dump leaves the job
stopped (--leave-stopped) so that its GPU state comes back before it runs.
CRIU unlocks the TCP connections it dumped only for a tree it lets run: a
GPU job's connections (a parameter server, NCCL's TCP bootstrap, a data
service) must go on after a heartbeat as a CPU job's do. Real CRIU and
redis-server; the CUDA driver is the stand-in of tests/test_nothing_lost.py
(no GPU here)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.gpu.driver import CudaError, CudaState
from tests import nats_auth
from tests.test_local_smr import Harness, running
from tests.test_nothing_lost import FailingPuts, StandInDriver, ckpt_step
from tests.test_sockets import client, h, start_redis  # noqa: F401

pytestmark = pytest.mark.criu


class OldDriver(StandInDriver):
    """A driver without cuCheckpointProcessGetRestoreThreadId (before 570):
    the stopped tree is continued, then its GPU state restored."""

    def restore_tid(self, pid: int) -> int | None:
        if pid not in self.states:
            raise CudaError(f"{pid}: no CUDA context (stand-in)")
        return None


async def test_a_gpu_jobs_connection_goes_on_after_a_heartbeat(h: Harness) -> None:  # noqa: F811
    step = ckpt_step(h)
    drv = OldDriver()
    step.cuda = CudaCheckpoint(drv)  # type: ignore[arg-type]
    job, port = await start_redis(h, keys=1000)
    drv.states[job.pid] = CudaState.RUNNING  # "holds a GPU"
    r = client(port)
    me = r.client_id()
    assert r.incr("n") == 1
    beat = await h.checkpoint(job.id, leave_running=True)
    assert beat.status == "succeeded", beat.error
    assert drv.states[job.pid] is CudaState.RUNNING
    assert beat.sockets and beat.sockets["connections"] == "kept"
    try:
        n = r.incr("n")
    except Exception as e:
        raise AssertionError(f"the GPU job's client connection died at its heartbeat: "
                             f"{type(e).__name__}: {e}") from None
    assert n == 2 and r.client_id() == me
    r.close()


async def test_a_final_checkpoint_that_cannot_be_stored_leaves_the_connections_working(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str) -> None:
    """Storage stays down past the commit deadline after a final dump that
    kept the job's connections (held stopped, for a restore on this node):
    the request fails and the job runs on where it was (#32's promise), and
    so must its clients' connections."""
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       storage_path=str(tmp_path / "store"), commit_deadline=6.0) as node_h:
        job, port = await start_redis(node_h, keys=1000)
        r = client(port)
        assert r.incr("n") == 1
        await unstorable_final_checkpoint(node_h, job.id)
        assert_counts_on(r, 2)
        # Nor is the connection left in CRIU's lock table on the node (its
        # packets dropped should the 4-tuple come back, the table kept for ever).
        mine = r.connection._sock.getsockname()[1]  # type: ignore[union-attr]
        assert f". {mine} ." not in locked(), f"port {mine} still in CRIU's lock: {locked()}"
        r.close()


async def unstorable_final_checkpoint(node_h: Harness, job_id: str) -> None:
    """A final checkpoint of ``job_id`` whose manifest storage refuses past
    the commit deadline: it fails as storage-unavailable."""
    fault = FailingPuts(ckpt_step(node_h).store.backend, "manifest.json", times=None)
    try:
        done = await node_h.checkpoint(job_id)
    finally:
        fault.restore()
    assert done.status == "failed" and done.error, done
    assert done.error["code"] == "storage-unavailable", done.error


def assert_counts_on(r: Any, n: int) -> None:
    """The job's client, on the connection it had, gets its next count."""
    try:
        got = r.incr("n")
    except Exception as e:
        raise AssertionError(f"the job runs on, its client's connection does not: "
                             f"{type(e).__name__}: {e}") from None
    assert got == n


def locked() -> str:
    """The connections CRIU's lock tables on this node drop (their set elements)."""
    out = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True,
                         check=True).stdout
    return "\n".join(line for line in out.splitlines() if "elements" in line or ". " in line)
