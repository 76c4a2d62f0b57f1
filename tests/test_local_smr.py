"""Save, migrate and resume on one machine with real CRIU, driven through NATS.

Each test runs an embedded node (checkpointer + restorer + local storage) on
a real nats-server with the shipped users, logged in as its node's, launches
real processes, and judges the result
by what the processes print: the step they continue from and the digest of
their memory, recomputed independently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import smr.jobs
from services.restorer.step import IDENTITY
from services.storage.layout import LOCAL_NAMESPACE
from smr import config
from smr.bus import (
    KV_JOBS,
    KV_LOCKS,
    KV_STEPS,
    Bus,
    BusConfig,
    Progress,
    StepLocks,
    message_subject,
)
from smr.contract.errors import SmrError, TemporaryError
from smr.contract.messages import CkptDone, CkptRequested, RestoreDone, RestoreRequested, Target
from smr.identity import ProcessIdentity, booted_at
from smr.jobs import Job, JobLock, JobRegistry, job_key, launch, proc_start_ticks
from smr.natsserver import NatsServer
from smr.process import reaper
from smr.process.criu import Criu
from smrctl import demo_counter as counter
from smrctl import reach
from smrctl.embedded import EmbeddedNode, windows
from tests import nats_auth

pytestmark = pytest.mark.criu

H = TypeVar("H", bound="Harness")


class Harness:
    def __init__(self, node: EmbeddedNode, settings: config.Settings, tmp: Path,
                 bus: Bus | None = None) -> None:
        assert node.bus is not None
        self.node = node
        self.bus: Bus = bus or node.bus  # the test's own, where it has one
        self.node_bus: Bus = node.bus  # the node's own: a fault on its writes goes here
        self.settings = settings
        self.tmp = tmp
        self.jobs = JobRegistry(self.bus.kv(KV_JOBS), job_key(settings.job_key_path))
        self.lock = JobLock(self.bus.kv(KV_LOCKS), self.bus.kv(KV_STEPS))
        self.pids: list[int] = []

    async def start(self, mib: int, *extra: str, job_id: str | None = None,
                    own_pid_namespace: bool = True) -> Job:
        job_id = job_id or f"job-{uuid.uuid4().hex[:6]}"
        # A digest of the whole memory each second and after each restore,
        # not at every step: the memory is read only where a test looks.
        cmd = [sys.executable, "-m", "smrctl.demo_counter", "--mib", str(mib),
               "--interval", "0.05", "--digest-every", "1", *extra]
        job = launch(job_id, cmd, log=self.tmp / f"{job_id}.log", cwd=self.tmp,
                     node=self.settings.node, own_pid_namespace=own_pid_namespace)
        self.pids.append(job.pid)
        await self.jobs.put(job)
        await self.wait_step(job, 3)
        return job

    def lines(self, job: Job) -> list[dict[str, str]]:
        text = Path(job.log).read_text()
        return [counter.parse_line(ln) for ln in text.splitlines() if ln.startswith("step=")]

    async def wait_step(self, job: Job, at_least: int, count: int = 1,
                        timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(int(ln["step"]) >= at_least for ln in self.lines(job)) >= count:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{job.id} never reached step {at_least}: {self.lines(job)[-3:]}")

    async def checkpoint(self, job_id: str, **kw: Any) -> CkptDone:
        req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=job_id,
                            target=Target.job(job_id), node=self.settings.node, **kw)
        result = await self.bus.request(req, timeout=120)
        assert isinstance(result, CkptDone)
        return result

    async def restore(self, ckpt_id: str, as_id: str | None = None, *, timeout: float = 120,
                      **kw: Any) -> RestoreDone:
        req = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=ckpt_id,
                               target=Target.job(as_id or ckpt_id), node=self.settings.node,
                               **kw)
        result = await self.bus.request(req, timeout=timeout)
        assert isinstance(result, RestoreDone)
        if result.pid:
            self.pids.append(result.pid)
        return result

    def cleanup(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def running(cls: type[H], criu_binary: str, nats: nats_auth.SecuredNats,
                  tmp_path: Path, node: str, ack_wait: float, **settings: Any
                  ) -> AsyncIterator[H]:
    """An embedded node on a shared nats-server with the shipped users
    (``nats_users``), and a harness on it. The node logs in as its own user
    (local-node.conf.template, added to the server for a node it has none
    for), as `smr up` on a NATS several machines share does; the harness
    (playing `smr exec`, `smr checkpoint` and the operator) as smr-admin,
    which makes the streams first. No node runs on an open server: what the
    shipped permissions refuse it fails its test (``nats_users``)."""
    user = await asyncio.to_thread(nats.node_user, node)
    s = config.load({}).replace(
        nats_url=nats.url, node_name=node, data_dir=str(tmp_path / "data"),
        criu=criu_binary, ack_wait=ack_wait, **settings)
    admin = await nats.connect("smr-admin", BusConfig.from_settings(s))
    # The operator's step (`smr node-consumers`): the node's user may create none.
    await admin.make_node_consumers(node, windows(s))
    s = s.replace(nats_user=user, nats_password=nats.passwords[user], nats_setup=False)
    try:
        async with EmbeddedNode(s) as n:
            harness = cls(n, s, tmp_path, admin)
            try:
                yield harness
            finally:
                harness.cleanup()
    finally:
        await admin.close()


def assert_continues(lines: list[dict[str, str]], frozen: int, mib: int) -> None:
    """After the checkpoint the job's next line is step frozen+1, and its memory
    digest (carried by the first step after a restore, or the second:
    counter.resumed_digest) is the one
    recomputed from scratch for that step."""
    after = [ln for ln in lines if int(ln["step"]) > frozen]
    assert after, "no output after the restore"
    first = after[0]
    assert int(first["step"]) == frozen + 1, f"restarted instead of resuming: {first}"
    shown = counter.resumed_digest(after)
    assert shown, f"no digest in the first two steps after a restore: {after[:2]}"
    assert shown["digest"] == counter.expected_digest(mib, int(shown["step"])), shown


async def test_checkpoint_kill_restore_resumes_with_memory_intact(h: Harness) -> None:
    job = await h.start(256)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    assert done.generation == 1 and done.size_bytes and done.size_bytes > 256 << 20
    assert proc_start_ticks(job.pid) is None, "the original must be gone after a dump"
    frozen = int(h.lines(job)[-1]["step"])

    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    assert restored.pid != job.pid
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 256)
    record, _ = await h.jobs.get(job.id)
    assert record.alive() and record.pid == restored.pid and record.generation == 1


async def test_job_without_its_own_pid_namespace_is_restored_with_its_pid(h: Harness) -> None:
    """How GPU jobs run (`smr exec --gpu`): the restore takes the dumped PID back."""
    job = await h.start(64, own_pid_namespace=False)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    frozen = int(h.lines(job)[-1]["step"])
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    assert restored.pid == job.pid
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 64)


async def test_leave_running_then_restore_beside_original(h: Harness) -> None:
    job = await h.start(64)
    done = await h.checkpoint(job.id, leave_running=True)
    assert done.status == "succeeded", done.error
    assert proc_start_ticks(job.pid) == job.start_ticks, "the original must keep running"
    frozen_gen_lines = len(h.lines(job))

    # Same id while the original runs: refused, it would run the job twice.
    twice = await h.restore(job.id)
    assert twice.status == "failed" and twice.error and twice.error["code"] == "job-running"

    copy = await h.restore(job.id, as_id=f"{job.id}-copy")
    assert copy.status == "succeeded", copy.error
    original, _ = await h.jobs.get(job.id)
    clone, _ = await h.jobs.get(f"{job.id}-copy")
    assert original.alive() and clone.alive() and original.pid != clone.pid
    # The copy goes on from the dumped step, in a log of its own; the original
    # goes on in its: each with the right memory.
    ckpt_step = max(int(ln["step"]) for ln in h.lines(job)[:frozen_gen_lines])
    await h.wait_step(clone, 1, count=2)
    copied = h.lines(clone)
    assert 3 < int(copied[0]["step"]) <= ckpt_step + 1, f"the copy did not resume: {copied[0]}"
    shown = counter.resumed_digest(copied)
    assert shown, f"no digest in the copy's first two steps: {copied[:2]}"
    assert shown["digest"] == counter.expected_digest(64, int(shown["step"])), shown
    await h.wait_step(job, ckpt_step + 30)
    later = [ln for ln in h.lines(job)[frozen_gen_lines:] if "digest" in ln]
    assert later, "the original printed no digest since the checkpoint"
    assert later[-1]["digest"] == counter.expected_digest(64, int(later[-1]["step"]))


async def test_job_with_open_file_and_child_process(h: Harness) -> None:
    state = h.tmp / "state.txt"
    job = await h.start(32, "--state-file", str(state), "--child")
    child = int(h.lines(job)[-1]["child"])  # its PID inside the job's namespace
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    frozen = int(h.lines(job)[-1]["step"])
    # Frozen between writing the file and printing the line, or after both.
    assert frozen <= int(state.read_text()) <= frozen + 1

    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, frozen + 3)
    assert_continues(h.lines(job), frozen, 32)
    assert int(state.read_text()) > frozen, "the open file is written again after restore"
    last = h.lines(job)[-1]
    assert int(last["child"]) == child  # same child, same namespace PID
    assert restored.pid
    kids = Path(f"/proc/{restored.pid}/task/{restored.pid}/children").read_text().split()
    assert len(kids) == 1, "the child process was restored with its parent"


# The counter's look at which process it is, with every file it opens named.
OPENS = """
import sys
from smrctl import demo_counter
opened = []
sys.addaudithook(lambda ev, args: opened.append(str(args[0])) if ev == "open" else None)
print(demo_counter.started(), opened)
"""


def test_a_counter_in_a_pid_namespace_of_its_own_opens_no_file_of_its_host_pid(
        tmp_path: Path) -> None:
    """A local job's counter sees the host's /proc: a file of /proc/<host
    PID> open at the freeze names a PID its restored copy lacks, and CRIU
    failed to restore it ("Can't open file proc/3361/stat on restore"). Its
    look at which process it is opens no file there; in the host's namespace
    (where its PID comes back) it reads its start time."""
    init = config.load().init_binary()
    own = subprocess.run([init, "--local-ns", "--", sys.executable, "-c", OPENS],
                         capture_output=True, text=True, check=True, cwd=Path.cwd()).stdout
    assert "/proc" not in own.split(")", 1)[1], own
    host = subprocess.run([sys.executable, "-c", OPENS], capture_output=True, text=True,
                          check=True).stdout
    assert "/proc/self/stat" in host, host


async def test_pre_dump_then_dump_writes_less_and_restores(h: Harness, criu_binary: str) -> None:
    crit = Criu(criu_binary)
    if not await crit.tracks_memory():
        pytest.skip("this kernel has no dirty-page tracking (CONFIG_MEM_SOFT_DIRTY is off): "
                    "CRIU cannot pre-dump here")
    job = await h.start(256)
    work = h.tmp / "engine"
    await crit.pre_dump(job.pid, work / "pre")
    await crit.dump(job.pid, work / "images", leave_running=True, parent=work / "pre")
    pre = sum(p.stat().st_size for p in (work / "pre").glob("pages-*.img"))
    final = sum(p.stat().st_size for p in (work / "images").glob("pages-*.img"))
    assert pre > 256 << 20
    assert final < pre / 10, f"incremental dump {final} B vs pre-dump {pre} B"

    # Through the services: pre-dump + dump stored as one generation, restorable.
    done = await h.checkpoint(job.id, pre_dump=True)
    assert done.status == "succeeded", done.error
    assert "pre_dump" in done.durations
    frozen = int(h.lines(job)[-1]["step"])
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 256)


async def test_pre_dump_request_without_dirty_tracking_still_checkpoints(
    h: Harness, criu_binary: str
) -> None:
    if await Criu(criu_binary).tracks_memory():
        pytest.skip("this kernel tracks dirty memory: the pre-dump path runs instead")
    job = await h.start(64)
    done = await h.checkpoint(job.id, pre_dump=True)
    assert done.status == "succeeded", done.error
    assert "pre_dump" not in done.durations  # fell back to one full dump
    frozen = int(h.lines(job)[-1]["step"])
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 64)


async def test_duplicate_request_runs_once(h: Harness) -> None:
    job = await h.start(16)
    req = CkptRequested(request_id=f"dup-{job.id}", checkpoint_id=job.id,
                        target=Target.job(job.id), node=h.settings.node, leave_running=True)
    await h.bus.publish(req)
    first = await h.bus.wait_result(req.request_id, req.SCHEMA, timeout=60)
    # The same request again, bypassing the publish dedupe: answered from state.
    await h.bus.publish_raw(message_subject(req), req.to_payload())
    await asyncio.sleep(1.5)
    gens = await h.node.workers[0].step.store.generations(  # type: ignore[attr-defined]
        LOCAL_NAMESPACE, job.id)
    assert first.status == "succeeded" and [g.number for g in gens] == [1]



async def test_a_request_named_like_the_step_locks_leaves_them_be(h: Harness) -> None:
    """A request_id is the requester's text, and a local step's work directory
    is WORK_DIR/<request_id>, emptied as it starts. The node's step locks
    (which say a worker still runs a step: no redelivery recovers it, nor is
    it answered failed, beside it) must not be a directory a request of some
    name empties, or every live worker of the node looks dead."""
    job = await h.start(16)
    locks = StepLocks(h.settings.step_lock_path)
    with locks.hold("a-step-another-worker-runs") as ours:  # a live worker of the node
        assert ours
        req = CkptRequested(request_id="steps", checkpoint_id=job.id,
                            target=Target.job(job.id), node=h.settings.node, leave_running=True)
        done = await h.bus.request(req, timeout=120)
        assert done.status == "succeeded", done.error
        assert locks.live("a-step-another-worker-runs"), "a live worker's lock was removed"


async def test_a_request_named_like_the_gpu_hold_directory_leaves_it_be(h: Harness) -> None:
    """The same for the directory that describes a GPU tree held across a
    crash (its threads' signal masks, given back by recovery): a request named
    `held` emptied it while it was WORK_DIR/held."""
    job = await h.start(16)
    kept = h.settings.hold_path / "4242-1.sigmask"  # what a held tree leaves there
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(b"mask")
    req = CkptRequested(request_id=h.settings.hold_path.name.lstrip("."), checkpoint_id=job.id,
                        target=Target.job(job.id), node=h.settings.node, leave_running=True)
    done = await h.bus.request(req, timeout=120)
    assert done.status == "succeeded", done.error
    assert kept.read_bytes() == b"mask", "a request emptied the GPU hold directory"


# -- bad input ------------------------------------------------------------------------

async def assert_unlocked(h: Harness, job_id: str) -> None:
    assert await h.lock.holder(job_id) is None, "a failed step left its job locked"


async def test_checkpoint_of_unknown_job(h: Harness) -> None:
    bystander = await h.start(16)
    done = await h.checkpoint("no-such-job")
    assert done.status == "failed" and done.error and done.error["code"] == "job-not-found"
    assert "smr ps" in done.error["hint"]
    await assert_unlocked(h, "no-such-job")
    assert (await h.checkpoint(bystander.id, leave_running=True)).status == "succeeded"


async def test_restore_of_missing_checkpoint(h: Harness) -> None:
    done = await h.restore("never-checkpointed")
    assert done.status == "failed" and done.error
    assert done.error["code"] == "checkpoint-not-found"
    assert "smr checkpoint" in done.error["hint"]
    await assert_unlocked(h, "never-checkpointed")
    job = await h.start(16)
    await h.checkpoint(job.id, leave_running=True)
    missing_gen = await h.restore(job.id, as_id="other", generation=7)
    assert missing_gen.status == "failed" and missing_gen.error
    assert missing_gen.error["code"] == "checkpoint-not-found"


def criu_dumping(pid: int) -> bool:
    """Is a `criu dump -t pid` process running?"""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dump" in args and str(pid).encode() in args and any(b"criu" in a for a in args):
            return True
    return False


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


async def test_job_exiting_during_its_checkpoint(h: Harness) -> None:
    job = await h.start(768)
    task = asyncio.create_task(h.checkpoint(job.id))
    # Kill the job as soon as CRIU has started dumping it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if criu_dumping(job.pid):
            break
        await asyncio.sleep(0.005)
    os.kill(job.pid, signal.SIGKILL)
    done = await task
    assert done.status == "failed" and done.error, "a dump of a dying job must not succeed"
    assert done.error["code"] == "job-exited", done.error
    assert "nothing was stored" in done.error["message"]
    assert await h.node.workers[0].step.store.latest(  # type: ignore[attr-defined]
        LOCAL_NAMESPACE, job.id) is None
    await assert_unlocked(h, job.id)


async def test_corrupted_checkpoint_is_refused(h: Harness) -> None:
    job = await h.start(32)
    other = await h.start(16)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    gen_dir = h.settings.storage_root / LOCAL_NAMESPACE / job.id / f"{done.generation:08d}"
    pages = max((gen_dir / "files" / "images").glob("pages-*.img"),
                key=lambda p: p.stat().st_size)
    flip_byte(pages, pages.stat().st_size // 2)

    restored = await h.restore(job.id)
    assert restored.status == "failed" and restored.error
    assert restored.error["code"] == "checkpoint-corrupt"
    assert pages.name in restored.error["message"]
    assert restored.pid is None
    record, _ = await h.jobs.get(job.id)
    assert not record.alive()
    await assert_unlocked(h, job.id)
    # The other job is untouched and still checkpointable.
    assert proc_start_ticks(other.pid) == other.start_ticks
    assert (await h.checkpoint(other.id, leave_running=True)).status == "succeeded"


async def test_streamed_restore_never_resumes_on_a_byte_only_sha256_catches(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
        ) -> None:
    """Stored uncompressed, a flipped byte decodes fine: only the file's sha256,
    known at its last frame, catches it. CRIU has read the frames before it by
    then; the restore must still fail and the process never run."""
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       zstd_level=0) as h:
        job = await h.start(64)
        done = await h.checkpoint(job.id)
        assert done.status == "succeeded", done.error
        frozen = max(int(ln["step"]) for ln in h.lines(job))
        gen_dir = h.settings.storage_root / LOCAL_NAMESPACE / job.id / f"{done.generation:08d}"
        pages = max((gen_dir / "files" / "images").glob("pages-*.img"),
                    key=lambda p: p.stat().st_size)
        assert pages.stat().st_size > 3 * (8 << 20), "the image must span several ranges"
        flip_byte(pages, 4096)  # in the first range: long consumed when the digest is known

        restored = await h.restore(job.id)
        assert restored.status == "failed" and restored.error
        assert restored.error["code"] == "checkpoint-corrupt", restored.error
        assert "sha256" in restored.error["message"], restored.error
        assert restored.pid is None
        await asyncio.sleep(1)  # what a resumed process would print by now
        assert max(int(ln["step"]) for ln in h.lines(job)) == frozen, "it ran on altered bytes"
        record, _ = await h.jobs.get(job.id)
        assert not record.alive()
        await assert_unlocked(h, job.id)


# -- crash recovery: the states a worker killed mid-step leaves behind ----------------

async def test_checkpoint_recovery_commits_a_finished_dump(h: Harness) -> None:
    """Killed after CRIU finished but before the upload: recovery commits the
    images instead of losing the only copy of the (now stopped) job."""
    from services.checkpointer.step import CheckpointStep

    step = h.node.workers[0].step
    assert isinstance(step, CheckpointStep)
    job = await h.start(32)
    req = CkptRequested(request_id=f"crashed-{job.id}", checkpoint_id=job.id,
                        target=Target.job(job.id), node=h.settings.node)
    await step.criu.dump(job.pid, step.work_dir / req.request_id / "images")
    frozen = int(h.lines(job)[-1]["step"])

    result = await step.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded" and result.generation == 1
    record, _ = await h.jobs.get(job.id)
    assert record.state == "checkpointed" and record.generation == 1
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 32)


async def test_restore_recovery_records_the_restored_process_once(h: Harness) -> None:
    """Killed after CRIU restored the job but before it was recorded: recovery
    finds the live process from the pidfile and does not restore a second one."""
    from services.restorer.step import RestoreStep

    step = h.node.workers[1].step
    assert isinstance(step, RestoreStep)
    job = await h.start(32)
    assert (await h.checkpoint(job.id)).status == "succeeded"
    stopped, _ = await h.jobs.get(job.id)
    restored = await h.restore(job.id)
    assert restored.status == "succeeded" and restored.pid
    # Rewind to the moment between CRIU's restore and the registry write.
    await h.jobs.put(stopped)
    pidfile = step.work_dir / restored.request_id / "restored.pid"
    pidfile.parent.mkdir(parents=True)
    pidfile.write_text(str(restored.pid))
    ident = ProcessIdentity.of(restored.pid)
    assert ident is not None
    ident.write(pidfile.with_name(IDENTITY))
    req = RestoreRequested(request_id=restored.request_id, checkpoint_id=job.id,
                           target=Target.job(job.id), node=h.settings.node)

    result = await step.recover(req, {"state": "running"})
    assert result is not None and result.status == "succeeded"
    assert result.pid == restored.pid  # the one process CRIU made, not a new one
    record, _ = await h.jobs.get(job.id)
    assert record.alive() and record.pid == restored.pid
    assert record.restored_by == restored.request_id


def copies(h: Harness) -> list[int]:
    """The counter processes running in this test's directory: each copy of
    a job it started or restored (smr-init's own command line left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            here = os.readlink(entry / "cwd") == str(h.tmp)
        except OSError:
            continue
        if here and argv[0] == sys.executable.encode() and b"smrctl.demo_counter" in argv:
            found.append(int(entry.name))
    return found


async def test_a_restore_whose_worker_died_as_criu_returned_is_not_run_twice(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker dies the moment CRIU has restored the job, before it could
    write who CRIU restored (a SIGKILL then, or CRIU finishing on its own
    after its worker died). The redelivery adopts the process CRIU restored
    and records it: the job never runs as two copies."""
    import services.restorer.step as restorer

    step = h.node.workers[1].step
    assert isinstance(step, restorer.RestoreStep)
    job = await h.start(8)
    assert (await h.checkpoint(job.id)).status == "succeeded"
    rr = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                          target=Target.job(job.id), node=h.settings.node)

    class DiesAsCriuReturns(ProcessIdentity):
        @classmethod
        def of(cls, pid: int) -> ProcessIdentity | None:
            h.pids.append(pid)  # ended by the test's cleanup, whatever happens
            raise asyncio.CancelledError  # nothing after this point runs

    with monkeypatch.context() as m:
        m.setattr(restorer, "ProcessIdentity", DiesAsCriuReturns)
        with pytest.raises(asyncio.CancelledError):
            await step.run(rr, Progress())
    first = h.pids[-1]
    assert copies(h) and proc_start_ticks(first) is not None
    await h.bus.kv(KV_STEPS).put(rr.request_id, json.dumps({
        "state": "running", "owner": "restorer@dead/1/x", "claim": "c",
        "heartbeat": time.time() - 600, "attempt": 1, "subject": message_subject(rr),
        "phase": "restore", "checkpoint_id": job.id}).encode())

    restored = await h.bus.request(rr, timeout=120)
    assert isinstance(restored, RestoreDone) and restored.status == "succeeded", \
        restored.error
    if restored.pid:
        h.pids.append(restored.pid)
    await asyncio.sleep(0.5)
    running = copies(h)
    assert len(running) == 1, \
        f"job {job.id} runs as {len(running)} copies ({running}): the process CRIU " \
        f"restored (pid {first}) was not adopted, and the redelivery restored another " \
        f"(pid {restored.pid})"
    record, _ = await h.jobs.get(job.id)
    assert record.pid == first and record.alive() and record.restored_by == rr.request_id


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process, nothing to do with smr (``sleep``)."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


async def test_restore_recovery_never_adopts_a_process_that_took_the_restored_pid(
        h: Harness, bystander: subprocess.Popen[bytes]) -> None:
    """A restore's worker died after CRIU wrote the pidfile; by its recovery
    the restored process has ended and a bystander holds its PID. The
    bystander is not recorded as the job: the restore runs again, and the
    job's next final checkpoint dumps and ends the job, not the bystander."""
    job = await h.start(8)
    assert (await h.checkpoint(job.id)).status == "succeeded"
    rr = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                          target=Target.job(job.id), node=h.settings.node)
    work = h.settings.work_path / rr.request_id
    work.mkdir(parents=True)
    (work / "restored.pid").write_text(str(bystander.pid))
    # What the restore wrote as CRIU returned: the process that held this
    # PID then, which started earlier than the bystander.
    ident = ProcessIdentity.of(bystander.pid)
    assert ident is not None
    ProcessIdentity(ident.pid, ident.start_ticks - 1, ident.boot_id).write(work / IDENTITY)
    await h.bus.kv(KV_STEPS).put(rr.request_id, json.dumps({
        "state": "running", "owner": "restorer@dead/1/x", "claim": "c",
        "heartbeat": time.time() - 600, "attempt": 1, "subject": message_subject(rr),
        "phase": "restore", "checkpoint_id": job.id}).encode())

    restored = await h.bus.request(rr, timeout=120)
    assert isinstance(restored, RestoreDone) and restored.status == "succeeded", \
        restored.error
    if restored.pid:
        h.pids.append(restored.pid)
    record, _ = await h.jobs.get(job.id)
    assert record.pid != bystander.pid, \
        f"the bystander `sleep` (pid {bystander.pid}) was recorded as job {job.id}"
    assert record.alive()
    frozen = int(h.lines(job)[-1]["step"])
    await h.wait_step(job, frozen + 2)  # the job itself runs again

    final = await h.checkpoint(job.id)
    assert final.status == "succeeded", final.error
    await asyncio.sleep(0.3)
    assert bystander.poll() is None, \
        f"the bystander was killed by the job's checkpoint (returncode {bystander.poll()})"


async def test_a_restore_recovered_after_another_restore_of_its_job_never_overwrites_it(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore's worker dies after CRIU restored the job and it wrote who,
    before the job's record; the job is started again under its id
    meanwhile (`smr exec`), and recorded. The restore's recovery then finds
    the record naming that other live process: it ends the process it
    restored and answers job-running, never writing over the record. One
    copy runs, and the registry knows it. (Another restore of the job
    waits for that recovery instead: the test above.)"""
    import services.restorer.step as restorer

    step = h.node.workers[1].step
    assert isinstance(step, restorer.RestoreStep)
    job = await h.start(8)
    assert (await h.checkpoint(job.id)).status == "succeeded"
    first = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                             target=Target.job(job.id), node=h.settings.node)

    async def dies_before_the_record(self: restorer.RestoreStep, pid: int, *args: Any,
                                     **kw: Any) -> None:
        h.pids.append(pid)
        raise asyncio.CancelledError  # nothing after this point runs

    with monkeypatch.context() as m:
        m.setattr(restorer.RestoreStep, "_running", dies_before_the_record)
        with pytest.raises(asyncio.CancelledError):
            await step.run(first, Progress())
    await h.bus.kv(KV_STEPS).put(first.request_id, json.dumps({
        "state": "running", "owner": "restorer@dead/1/x", "claim": "c",
        "heartbeat": time.time() - 600, "attempt": 1, "subject": message_subject(first),
        "phase": "restore", "checkpoint_id": job.id}).encode())
    again = await h.start(8, job_id=job.id)

    recovered = await h.bus.request(first, timeout=120)
    assert isinstance(recovered, RestoreDone)
    await asyncio.sleep(0.5)
    record, _ = await h.jobs.get(job.id)
    running = copies(h)
    assert len(running) == 1 and record.pid == again.pid and record.alive(), \
        f"job {job.id} runs as {len(running)} copies ({running}); its record names pid " \
        f"{record.pid} (restored by {record.restored_by}), smr exec's is " \
        f"{again.pid}; the restore's recovery answered {recovered.status}"
    assert recovered.status == "failed" and recovered.error, recovered
    assert recovered.error["code"] == "job-running"


@pytest.mark.parametrize("then", ["recorded", "ended"])
async def test_a_restore_never_starts_beside_an_unrecorded_restore_of_its_job(
        h: Harness, monkeypatch: pytest.MonkeyPatch, then: str) -> None:
    """A restore's worker dies after CRIU restored the job, before the job's
    record; the job is restored again before that restore's recovery. The
    second restore finds the first one's live process and answers a
    temporary job-busy (the bus retries it) instead of restoring beside it.
    Once the first recovery records its process, the second answers
    job-running; once that process has ended, the second restores."""
    import services.restorer.step as restorer

    step = h.node.workers[1].step
    assert isinstance(step, restorer.RestoreStep)
    job = await h.start(8)
    assert (await h.checkpoint(job.id)).status == "succeeded"

    def request() -> RestoreRequested:
        return RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                                target=Target.job(job.id), node=h.settings.node)

    async def dies_before_the_record(self: restorer.RestoreStep, pid: int, *args: Any,
                                     **kw: Any) -> None:
        h.pids.append(pid)
        raise asyncio.CancelledError  # nothing after this point runs

    first, second = request(), request()
    with monkeypatch.context() as m:
        m.setattr(restorer.RestoreStep, "_running", dies_before_the_record)
        with pytest.raises(asyncio.CancelledError):
            await step.run(first, Progress())
    restored = copies(h)
    assert len(restored) == 1, restored

    outcome: Any
    try:
        outcome = await step.run(second, Progress())
        h.pids.append(outcome.pid)
    except SmrError as e:
        outcome = e
    running = copies(h)
    assert running == restored, \
        f"job {job.id} runs as {len(running)} copies ({running}): the second restore " \
        f"answered {getattr(outcome, 'status', outcome)} beside the first one's unrecorded " \
        f"process ({restored})"
    assert isinstance(outcome, TemporaryError) and outcome.code == "job-busy", outcome
    assert first.request_id in outcome.message, outcome.message

    if then == "recorded":
        recovered = await step.recover(first, {"state": "running"})
        assert recovered is not None and recovered.status == "succeeded", recovered
        with pytest.raises(SmrError) as refused:
            await step.run(second, Progress())
        assert refused.value.code == "job-running", refused.value
        assert copies(h) == restored
        return
    # The first one's process ended (it exited, or its recovery ended it):
    # nothing holds the job any more, and the second restore goes ahead.
    ident = ProcessIdentity.read_match(step.work_dir / first.request_id / IDENTITY)
    assert ident is not None
    os.kill(ident.pid, signal.SIGKILL)
    while ident.matches() or copies(h):
        reaper.reap()
        await asyncio.sleep(0.05)
    again = await step.run(second, Progress())
    h.pids.append(again.pid)
    assert again.status == "succeeded" and len(copies(h)) == 1, (again, copies(h))


@pytest.mark.parametrize("began,wrote", [(-10, -5), (2, 4)],
                         ids=["took-the-pid-after-the-pidfile", "held-the-pid-before-criu"])
async def test_a_restore_recovery_with_only_criu_s_pidfile_never_adopts_another_process(
        h: Harness, bystander: subprocess.Popen[bytes], began: float, wrote: float) -> None:
    """Only CRIU's pidfile is left (its worker died before naming the
    process), and the PID is held by a process that did not start while
    CRIU restored: one that took the number once the restored process
    ended, or one that held it all along. Nothing is adopted: the restore
    counts as not done."""
    from services.restorer.step import BEGUN, RestoreStep

    step = h.node.workers[1].step
    assert isinstance(step, RestoreStep)
    job = await h.start(8)
    assert (await h.checkpoint(job.id)).status == "succeeded"
    rr = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                          target=Target.job(job.id), node=h.settings.node)
    work = step.work_dir / rr.request_id
    work.mkdir(parents=True)
    (work / "restored.pid").write_text(str(bystander.pid))
    ident = ProcessIdentity.of(bystander.pid)
    assert ident is not None
    started = booted_at() + ident.start_ticks / os.sysconf("SC_CLK_TCK")
    # When CRIU began and when it wrote the pidfile, against the bystander's start.
    (work / BEGUN).touch()
    os.utime(work / BEGUN, (started + began, started + began))
    os.utime(work / "restored.pid", (started + wrote, started + wrote))

    assert await step.recover(rr, {"state": "running"}) is None
    record, _ = await h.jobs.get(job.id)
    assert record.pid != bystander.pid and bystander.poll() is None


async def test_a_restore_never_overwrites_a_job_record_written_while_it_ran(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer (a `smr exec` of the same id) records a process while a
    restore of that id runs: the restore does not overwrite that record. It
    fails, and the process it restored is ended, so one process is the job
    and the registry knows it."""
    from services.restorer.step import RestoreStep

    job = await h.start(8)
    assert (await h.checkpoint(job.id)).status == "succeeded"
    real = RestoreStep._running
    other: list[Job] = []

    mine: list[Job] = []

    async def exec_meanwhile(self: RestoreStep, pid: int, *args: Any, **kw: Any) -> None:
        await real(self, pid, *args, **kw)
        mine.append(Job(id=job.id, cmd=[], cwd="", log="", node="", pid=pid,
                        start_ticks=proc_start_ticks(pid) or 0))
        started = launch(job.id, ["sleep", "600"], log=h.tmp / "other.log", cwd=h.tmp,
                         node=h.settings.node)
        h.pids.append(started.pid)
        other.append(started)
        await h.jobs.put(started)

    monkeypatch.setattr(RestoreStep, "_running", exec_meanwhile)
    restored = await h.restore(job.id)
    record, _ = await h.jobs.get(job.id)
    assert record.pid == other[0].pid, \
        f"the restore overwrote the record written meanwhile (now pid {record.pid})"
    assert restored.status == "failed" and restored.error, restored
    assert restored.error["code"] == "job-running", restored.error
    assert record.alive()
    assert await _gone(mine[0]), "the restored process runs on unrecorded"


async def test_smr_exec_never_overwrites_a_job_record_a_restore_wrote_meanwhile(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore records its process for an id while `smr exec` of that id
    starts its command: exec does not overwrite that record; it fails and
    ends the command it started."""
    from smrctl import cli

    job_id = f"job-{uuid.uuid4().hex[:6]}"
    restored = launch(job_id, ["sleep", "600"], log=h.tmp / "restored.log", cwd=h.tmp,
                      node=h.settings.node)
    h.pids.append(restored.pid)
    restored.restored_by = "a-restore"
    mine: list[Job] = []

    def launch_while_a_restore_records(*args: Any, **kw: Any) -> Job:
        started = launch(*args, **kw)
        h.pids.append(started.pid)
        mine.append(started)

        async def record() -> None:  # the restore, on its own connection
            bus = await reach.connect(h.settings)
            try:
                await JobRegistry(bus.kv(KV_JOBS), job_key(h.settings.job_key_path)).put(
                    restored)
            finally:
                await bus.close()

        t = threading.Thread(target=asyncio.run, args=(record(),))
        t.start()
        t.join()
        return started

    # smr.jobs's: `smr exec` imports its parts when it runs (smrctl/cli.py).
    monkeypatch.setattr(smr.jobs, "launch", launch_while_a_restore_records)
    args = argparse.Namespace(id=job_id, cmd=["sleep", "600"], log=None, gpu=False,
                              gpus=None, tcp="auto")
    err: SmrError | None = None
    try:
        await cli.cmd_exec(h.settings, args)
    except SmrError as e:
        err = e
    record, _ = await h.jobs.get(job_id)
    assert record.pid == restored.pid, \
        f"smr exec overwrote the record the restore wrote (now pid {record.pid})"
    assert err is not None and err.code == "job-exists", err
    assert await _gone(mine[0]), "the command smr exec started runs on unrecorded"


async def _gone(job: Job, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not job.alive():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_gpu_checkpoint_is_refused_where_it_cannot_be_restored(h: Harness) -> None:
    """A generation holding GPU state for a GPU this node lacks (here: no
    checkpoint API, or another model) is refused before any download, and the
    refusal leaves nothing running and nothing locked."""
    job = await h.start(16)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    manifest = (h.settings.storage_root / LOCAL_NAMESPACE / job.id
                / f"{done.generation:08d}" / "manifest.json")
    doc = json.loads(manifest.read_text())
    doc["gpu"] = {"model": "NVIDIA A100-SXM4-40GB", "count": 1, "used_bytes": 8 << 30}
    manifest.write_text(json.dumps(doc))

    restored = await h.restore(job.id)
    assert restored.status == "failed" and restored.error, restored
    assert restored.error["code"] == "gpu-mismatch", restored.error
    assert "A100" in restored.error["message"] + restored.error.get("hint", "")
    work_dir: Path = h.node.workers[1].step.work_dir  # type: ignore[attr-defined]
    assert not (work_dir / restored.request_id).exists(), "refused only after a download"
    record, _ = await h.jobs.get(job.id)
    assert not record.alive()
    await assert_unlocked(h, job.id)


async def test_a_failed_criu_run_says_why_in_criu_own_words(criu_binary: str,
                                                           tmp_path: Path) -> None:
    """Not only "criu dump failed (exit 1)": the message quotes CRIU's first
    error line, the detail keeps it whole, the hint points at a kept copy of
    the log (the step removes its work directory, and the log with it)."""
    from smr.process.criu import CriuError

    gone = launch("gone", [sys.executable, "-c", "pass"], log=tmp_path / "gone.log",
                  cwd=tmp_path, node="n", own_pid_namespace=False)
    for _ in range(100):  # reaped: the pid no longer names a process
        if proc_start_ticks(gone.pid) is None:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(CriuError) as caught:
        await Criu(criu_binary, kept_logs=tmp_path / "kept").dump(gone.pid, tmp_path / "images")
    e = caught.value
    assert e.message.startswith("criu dump failed (exit 1): ")
    assert str(gone.pid) in e.message and "Error (" not in e.message
    assert "Error (" in e.detail and e.message.split(": ", 1)[1] in e.detail
    shutil.rmtree(tmp_path / "images")  # as the step does
    kept = e.hint.split("full log: ", 1)[1].strip()
    assert Path(kept).parent == tmp_path / "kept" and "Error (" in Path(kept).read_text()


def test_local_init_runs_the_command_forwards_signals_and_exits_with_its_status(
        tmp_path: Path) -> None:
    """smr-init --local, PID 1 of every local job's namespace: the job's exit
    is its command's, and a signal to the job reaches the command."""
    init = config.load({}).init_binary()
    done = subprocess.run([init, "--local", "--", "sh", "-c", "exit 7"], timeout=10)
    assert done.returncode == 7
    marker = tmp_path / "got"
    proc = subprocess.Popen([init, "--local", "--", "sh", "-c",
                             f"trap 'echo term > {marker}; exit 3' TERM; "
                             "while :; do sleep 0.05; done"])
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 3 and marker.read_text() == "term\n"


async def test_a_service_that_ends_cancelled_as_the_node_starts_is_a_start_failure(
        criu_binary: str, nats_server: NatsServer, tmp_path: Path, node: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`smr up` says which service did not start and exits 2; a service whose
    task ended cancelled (a cancel a library handed back) made the check of
    its error raise that CancelledError instead: a traceback and exit 1."""
    from services.storage.service import StorageService
    from smr.contract.errors import SmrError

    async def cancelled(self: StorageService) -> None:
        raise asyncio.CancelledError

    monkeypatch.setattr(StorageService, "run", cancelled)
    s = config.load({}).replace(nats_url=nats_server.url, node_name=node,
                                data_dir=str(tmp_path / "data"), criu=criu_binary)
    with pytest.raises(SmrError) as failed:
        async with EmbeddedNode(s):
            pass
    assert failed.value.code == "start-failed" and "cancelled" in failed.value.message


# -- the CLI on a NATS several machines share ------------------------------------------

async def smr_cli(h: Harness, *args: str) -> tuple[int, str]:
    """``smr ARGS`` on the node's machine, logged in as the node's `smr up`
    is (SMR_NATS_USER, its node's user): a process of its own, so the node
    serving it (in this event loop) runs on."""
    s = h.settings
    env = {**os.environ, "SMR_NATS_URL": s.nats_url, "SMR_NATS_USER": s.values["NATS_USER"],
           "SMR_NATS_PASSWORD": s.values["NATS_PASSWORD"], "SMR_NATS_SETUP": "false",
           "SMR_NODE_NAME": s.node, "SMR_DATA_DIR": str(s.data_path),
           "SMR_STORAGE_PATH": str(s.storage_root), "SMR_METRICS_PORT": "0"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smrctl.cli", *args, env=env, cwd=h.tmp,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode or 0, out.decode(errors="replace")


async def test_the_operator_makes_a_shared_nats_machines_consumers(
        nats_users: nats_auth.SecuredNats, admin_bus: Bus, node: str, tmp_path: Path) -> None:
    """`smr node-consumers NODE` as smr-admin: the operator's step on adding a
    machine's user, which may create no consumer (docs/security.md). It makes
    the machine's request durables and their max-deliveries ones, with the
    windows of that machine's workers (its settings); its `smr up` then finds them."""
    other = f"{node}-b"
    nats_users.node_user(other)
    env = {**os.environ, "SMR_NATS_URL": nats_users.url, "SMR_NATS_USER": "smr-admin",
           "SMR_NATS_PASSWORD": nats_users.passwords["smr-admin"], "SMR_RESTORES_PER_NODE": "3",
           "SMR_DATA_DIR": str(tmp_path / "data"), "SMR_METRICS_PORT": "0"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smrctl.cli", "node-consumers", other, env=env, cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out.decode(errors="replace")
    for kind, window in (("ckpt.requested", 1), ("restore.requested", 3)):
        name = f"{kind.replace('.', '-')}-{other}"
        info = await admin_bus.js.consumer_info("SMR_REQUESTS", name)
        assert info.config.max_ack_pending == window
        assert info.config.deliver_subject is None  # a pull durable
        assert await admin_bus.js.consumer_info("SMR_EXHAUSTED", f"exhausted-{name}")


async def test_smr_demo_on_a_shared_nats_runs_as_its_nodes_user(h: Harness) -> None:
    """`smr demo`, `smr exec`, `smr checkpoint`, `smr restore`, `smr ps` and
    `smr kill` on a machine whose `smr up` runs on a shared NATS as its node's
    user: they log in as that user and use the running node, refused nothing
    (the ``nats_users`` fixture fails the test on any refusal)."""
    rc, out = await smr_cli(h, "demo", "--mib", "16")
    assert rc == 0, out
    assert "starting an embedded node" not in out, f"it did not reach the running node:\n{out}"
    assert "demo passed" in out, out
    job_id = f"cli-{uuid.uuid4().hex[:6]}"
    for args in (["exec", "-i", job_id, "--", sys.executable, "-m", "smrctl.demo_counter",
                  "--mib", "8", "--interval", "0.05", "--digest-every", "1"],
                 ["checkpoint", job_id], ["restore", job_id], ["ps"], ["kill", job_id]):
        rc, out = await smr_cli(h, *args)
        assert rc == 0, f"smr {args[0]}: {out}"
        if args[0] == "exec":
            record, _ = await h.jobs.get(job_id)
            h.pids.append(record.pid)
            await h.wait_step(record, 3)
        if args[0] == "ps":
            assert job_id in out, out


async def test_a_jobs_lock_stays_with_a_live_step_whose_heartbeats_lag(h: Harness) -> None:
    """A step of a local job holds the job's lock; its worker is alive (this
    node's step lock held) but its heartbeat is old (its event loop stalled,
    NATS away for it). Another step of the job waits instead of taking the
    lock over and freezing or killing the job beside it; once the holder's
    worker is gone, the lock is taken over."""
    step = h.node.workers[0].step
    lock = step.lock  # type: ignore[attr-defined]
    key, holder = f"job-{uuid.uuid4().hex[:6]}", f"slow-{uuid.uuid4().hex}"
    await h.bus.kv(KV_STEPS).put(holder, json.dumps(
        {"state": "running", "heartbeat": time.time() - 3600}).encode())
    with StepLocks(h.settings.step_lock_path).hold(holder) as ours:
        assert ours
        await lock.acquire(key, holder)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(lock.acquire(key, "next"), 3)
        assert await lock.holder(key) == holder, "the lock was taken from a live step"
    await asyncio.wait_for(lock.acquire(key, "next"), 10)  # its worker gone
    assert await lock.holder(key) == "next"
