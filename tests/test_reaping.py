"""Local jobs whose restore must not depend on the host's PID 1, and the
report of a restored process that ended at once. Real CRIU,
real nats-server, real `smr` processes; no GPU needed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smr.jobs import launch, ns_init_pid
from tests import nats_auth
from tests.test_local_smr import Harness, running

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as harness:
        yield harness


@pytest.mark.parametrize(("how", "said"), [("exit:3", "exited with status 3"),
                                          ("signal:SIGSEGV", "killed by SIGSEGV")])
async def test_a_restored_process_that_ends_at_once_says_how(
        h: Harness, how: str, said: str) -> None:
    job_id = f"dies-{how.split(':')[1].lower()}"
    job = launch(job_id, [sys.executable, "-m", "tests.helpers.dies_restored", how],
                 log=h.tmp / f"{job_id}.log", cwd=REPO, node=h.settings.node,
                 own_pid_namespace=False)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    await h.wait_step(job, 2)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    restored = await h.restore(job.id)
    assert restored.status == "failed", "a restore whose process ended was reported running"
    err = restored.error or {}
    assert err.get("code") == "restore-died", err
    assert said in err["message"], err
    # The job's own last words, and not CRIU's harmless rlimit line.
    assert f"restored, ending by {how.replace(':', ' ')}" in err.get("detail", ""), err
    assert "RLIMIT_NOFILE" not in err["message"] + err.get("detail", ""), err


def test_gpu_style_jobs_restore_under_a_pid_1_that_never_reaps(
        criu_binary: str, tmp_path: Path) -> None:
    """`smr up`, `smr exec --gpu` (no PID namespace of its own: its restore
    needs its very PIDs back), then checkpoint and restore twice, all in a
    PID namespace whose PID 1 is `sleep`: it never reaps an orphan."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare")
    data = tmp_path / "data"
    data.mkdir()
    result = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SMR_CRIU": criu_binary,
           "PYTHONUNBUFFERED": "1"}
    env.pop("SMR_NATS_URL", None)
    scenario = (f"{sys.executable} -m tests.helpers.pid1_scenario {data} > {result} 2>&1 & "
                "exec sleep 100000")
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", scenario],
                          cwd=REPO, env=env, start_new_session=True)
    try:
        init = ns_init_pid(ns.pid)
        deadline = time.monotonic() + 300
        out: dict = {}
        while time.monotonic() < deadline:
            text = result.read_text() if result.exists() else ""
            if text.rstrip().endswith("}"):
                out = json.loads(text.strip().splitlines()[-1])
                break
            time.sleep(0.2)
        assert out, f"the scenario printed no result: {result.read_text()[-3000:]}"
    finally:
        os.kill(init, signal.SIGKILL)  # the namespace's PID 1: everything in it ends
        ns.wait(30)
    assert out["pid1"] == "sleep", out
    assert out["exec"] == 0, out
    cycles = out["cycles"]
    for c in cycles:
        assert c["checkpoint"] == 0, out
        assert c["restore"] == 0, f"restore failed: {c['restore_err']}"
        assert c["resumed_with"] == c["frozen_at"] + 1, c
    assert len(cycles) == 2, out


async def test_a_restore_whose_pids_are_taken_names_the_holder(h: Harness) -> None:
    """A job in the host's PID namespace restored beside its still-running
    original: its PIDs are taken. The restore says by what, before CRIU
    runs, instead of CRIU's 'Can't fork for N: File exists'."""
    job = await h.start(16, own_pid_namespace=False)
    done = await h.checkpoint(job.id, leave_running=True)
    assert done.status == "succeeded", done.error
    beside = await h.restore(job.id, as_id=f"{job.id}-2")
    assert beside.status == "failed"
    err = beside.error or {}
    assert err.get("code") == "pid-taken", err
    assert f"pid {job.pid}" in err["message"] and "a running process" in err["message"], err
    assert job.alive()  # the original runs on


async def test_a_failed_restore_leaves_no_zombie_holding_the_jobs_pids(h: Harness) -> None:
    """A restore that fails part-way (a corrupt page image, found as it streams
    to CRIU) leaves the processes CRIU had made to this subreaper when CRIU
    exits. They must be reaped, or the job's next restore waits for its own
    PIDs and fails with pid-taken (seen on the H100 with a GPU job)."""
    from tests.test_local_smr import flip_byte

    job = await h.start(64, own_pid_namespace=False)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    gen_dir = h.settings.storage_root / "local" / job.id / f"{done.generation:08d}"
    pages = max((gen_dir / "files" / "images").glob("pages-*.img"),
                key=lambda p: p.stat().st_size)
    flip_byte(pages, pages.stat().st_size // 3)
    corrupt = await h.restore(job.id)
    assert corrupt.status == "failed" and (corrupt.error or {}).get("code") == \
        "checkpoint-corrupt", corrupt.error
    flip_byte(pages, pages.stat().st_size // 3)
    again = await h.restore(job.id)
    assert again.status == "succeeded", again.error


def test_a_child_that_ends_before_its_dying_parent_is_reaped_once_it_comes_here() -> None:
    """The torch.compile job on the H100: its second restore failed with
    'pid-taken … held by a zombie (python3) that its parent … has not reaped'.
    The job's child (Inductor's compile pool) had ended while the job, killed
    after its dump, was still ending (its main thread gone, driver threads
    not yet): the child was then the dying job's zombie, not `smr up`'s, and
    was dropped from what it reaps before it came to it."""
    out = subprocess.run([sys.executable, "-m", "tests.helpers.reap_scenario"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "B", out.stdout
