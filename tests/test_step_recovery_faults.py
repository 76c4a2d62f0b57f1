"""Nothing lost when an answer or a write goes missing: sequences of events
around a step's keepalive, its records and its recovery, each tried against
the real parts (a real nats-server, real CRIU, the real embedded node). Faults are
injected where the real system meets them: at the NATS client's call, as a
reply that never came back though the server carried the write out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from services.restorer.step import IDENTITY
from smr.bus import KV_STEPS, Bus, Progress, Worker
from smr.contract.messages import CkptDone, CkptRequested, RestoreRequested, Target
from smr.identity import ProcessIdentity
from tests import nats_auth
from tests.helpers.steplocks import hold_lock, node_locks
from tests.test_local_smr import Harness, running


class LostAnswer:
    """``kv.update`` for ``key`` is carried out by the server, and its reply
    is lost ``times`` times: nats-py raises TimeoutError, as it does when
    NATS restarts right after it stored the write, or answers too late."""

    def __init__(self, kv: Any, key: str, times: int = 1) -> None:
        self.kv, self.key, self.left = kv, key, times
        self.real = kv.update
        self.fired = 0
        kv.update = self.update

    async def update(self, key: str, value: bytes, last: int | None = None,
                     **kw: Any) -> int:
        rev = await self.real(key, value, last=last, **kw)
        if key == self.key and self.left > 0:
            self.left -= 1
            self.fired += 1
            raise nats.errors.TimeoutError
        return int(rev)

    def restore(self) -> None:
        self.kv.update = self.real


class Overlapping:
    """A step that takes ``seconds`` and records every entry (run or
    recover) of a request while an earlier entry of it still runs."""

    kind = "ckpt.requested"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = asyncio.Event()
        self.running: dict[str, int] = {}
        self.overlaps: list[str] = []
        self.entries: list[str] = []

    def _enter(self, rid: str, what: str) -> None:
        self.entries.append(what)
        if self.running.get(rid):
            self.overlaps.append(f"{what} of {rid} while its first run still ran")

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self._enter(req.request_id, "run")
        self.running[req.request_id] = self.running.get(req.request_id, 0) + 1
        self.started.set()
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.running[req.request_id] -= 1
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        self._enter(req.request_id, "recover")
        return None


# -- a keepalive whose own write's answer was lost ------------------------------------

@pytest.mark.parametrize("concurrency", [1, 2])
async def test_a_lost_keepalive_answer_neither_stops_the_heartbeat_nor_reruns_the_step(
        bus: Bus, node: str, concurrency: int) -> None:
    """One keepalive write goes through but its answer is lost (NATS
    restarting right after it stored it). The worker must go on beating for
    its step: otherwise its heartbeat goes stale while the step runs, the
    job's lock can be taken over by another request, and the request is
    redelivered (no more in_progress) and run a second time beside the
    first by a worker that serves several at once (the restorer)."""
    k = bus.config.keepalive
    step = Overlapping(seconds=bus.config.ack_wait + bus.config.stale_after + 6 * k)
    w = Worker(bus, step, node, service="test", locks=node_locks(node),
               concurrency=concurrency)
    rid = f"lost-{uuid.uuid4().hex[:6]}"
    lost = LostAnswer(bus.kv(KV_STEPS), rid)
    task = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        await bus.publish(CkptRequested(request_id=rid, checkpoint_id="ck",
                                        target=Target.job("j"), node=node))
        await asyncio.wait_for(step.started.wait(), 10)
        stale = []
        deadline = time.monotonic() + step.seconds - k
        while time.monotonic() < deadline:
            await asyncio.sleep(k / 2)
            state, _ = await bus.step_state(rid)
            if state and state["state"] == "running":
                age = time.time() - float(state["heartbeat"])
                if age >= bus.config.stale_after:
                    stale.append(round(age, 1))
        result = await bus.wait_result(rid, "ckpt.requested", timeout=30)
    finally:
        lost.restore()
        w.stop()
        await asyncio.wait_for(task, 30)
    assert lost.fired == 1, "the fault never fired"
    assert result.status == "succeeded"
    assert not step.overlaps, step.overlaps
    assert not stale, f"the running step's heartbeat went stale (ages {stale[:5]} s)"


# -- the same restore run twice at once -------------------------------------------------


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with on_node(criu_binary, nats_users, tmp_path, node) as harness:
        yield harness


@pytest.fixture
async def h_two_deliveries(criu_binary: str, nats_users: nats_auth.SecuredNats,
                           tmp_path: Path, node: str) -> AsyncIterator[Harness]:
    """A node whose requests are delivered twice at most: a fault lasting
    past every delivery is reached in two retry budgets, not five."""
    async with on_node(criu_binary, nats_users, tmp_path, node, max_deliver=2) as harness:
        yield harness


@contextlib.asynccontextmanager
async def on_node(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path,
                  node: str, **settings: Any) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       **settings) as harness:
        try:
            yield harness
        finally:
            for pid in copies(tmp_path):  # copies the harness never heard of
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def copies(cwd: Path) -> list[int]:
    """The running copies of a job in ``cwd``, each by its root: the counter
    workload, or the smr-init ``--local`` that is its PID namespace's init
    (what a job's pid names)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            args = (p / "cmdline").read_bytes().split(b"\0")
            here = os.readlink(p / "cwd") == str(cwd)
            fields = (p / "stat").read_text().split(")")[1].split()
        except OSError:
            continue
        if not here or b"smrctl.demo_counter" not in args or fields[0] in ("Z", "X") \
                or args[0].endswith(b"smr-init"):
            continue
        parent = Path(f"/proc/{fields[1]}/cmdline")
        try:
            under_init = parent.read_bytes().split(b"\0")[0].endswith(b"smr-init")
        except OSError:
            under_init = False
        found.append(int(fields[1]) if under_init else int(p.name))
    return found


@pytest.mark.criu
async def test_a_restore_whose_keepalive_answer_was_lost_runs_the_job_once(
        h: Harness) -> None:
    """A restore waits for its job's lock (a long step holds it); one of its
    keepalive writes loses its answer. Its heartbeat must stay fresh: else
    the request is redelivered to the restorer (which serves several at
    once), recovered as dead, and run again beside the first attempt; once
    the lock is free both restore the job: two copies of it run."""
    job = await h.start(128)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    frozen = int(h.lines(job)[-1]["step"])
    assert copies(h.tmp) == []
    stop = asyncio.Event()
    holder = asyncio.create_task(hold_lock(h.bus, job.id, "long-step", stop))
    rid = uuid.uuid4().hex
    lost = LostAnswer(h.node_bus.kv(KV_STEPS), rid)
    step = h.node.workers[1].step
    real_run = step.run
    attempts: list[str] = []  # how each run of the step ended

    async def run(req: Any, progress: Any) -> Any:
        try:
            r = await real_run(req, progress)
        except BaseException as e:
            attempts.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
            raise
        attempts.append(f"{r.status} (pid {r.pid})")
        return r

    step.run = run  # type: ignore[method-assign]
    try:
        await h.bus.publish(RestoreRequested(request_id=rid, checkpoint_id=job.id,
                                             target=Target.job(job.id), node=h.settings.node))
        cfg = h.bus.config
        # Past a redelivery (ack wait) and a stale heartbeat, and a little more.
        await asyncio.sleep(cfg.ack_wait + cfg.stale_after + 3 * cfg.keepalive)
    finally:
        stop.set()
        await holder
        lost.restore()
    first = await h.bus.wait_result(rid, "restore.requested", timeout=120)
    assert lost.fired == 1, "the fault never fired"
    await h.wait_step(job, frozen + 3)
    await asyncio.sleep(3)  # a second attempt, if any, ends meanwhile
    now = copies(h.tmp)
    twice = [ln for ln in h.lines(job) if int(ln["step"]) == frozen + 2]
    state, _ = await h.bus.step_state(rid)
    assert state is not None
    recorded = state["result"]
    assert len(attempts) == 1 and len(now) == 1 and len(twice) == 1 and \
        state["state"] == "done" and recorded["pid"] == now[0], (
        f"one restore request ran {len(attempts)} times at once ({attempts}); "
        f"{len(now)} copies of the job run (pids {now}), step {frozen + 2} printed "
        f"{len(twice)} times; answered first {first.status} (pid {first.pid}), the "
        f"request's recorded answer is now {state['state']} "
        f"{recorded.get('pid') or recorded.get('error', {}).get('code')}")


# -- a checkpoint's recovery and a restore that came in between --------------------------

class AnswerLost:
    """The step-state write of a step's answer (``done`` or ``failed``) for
    ``key`` fails once, as NATS restarting at that moment makes it fail; it
    fails only once ``go`` is set (the test's other events first)."""

    def __init__(self, kv: Any, key: str, go: asyncio.Event) -> None:
        self.kv, self.key, self.go = kv, key, go
        self.real = kv.put
        self.fired = 0
        kv.put = self.put

    async def put(self, key: str, value: bytes, **kw: Any) -> int:
        if key == self.key and not self.fired and \
                orjson.loads(value).get("state") in ("done", "failed"):
            self.fired += 1
            await self.go.wait()
            raise nats.errors.TimeoutError
        return int(await self.real(key, value, **kw))

    def restore(self) -> None:
        self.kv.put = self.real


@pytest.mark.criu
async def test_the_recovery_of_a_checkpoint_never_kills_the_restore_made_after_it(
        h: Harness) -> None:
    """A final checkpoint is committed and its job ended, but the answer
    cannot be recorded (NATS away at that moment): the request is
    redelivered, and recovered once its heartbeat is stale. Meanwhile the
    job (checkpointed, says `smr ps`) is restored from that checkpoint. The
    recovery must not end the restored job: it is not the process that was
    dumped."""
    job = await h.start(32)
    rid = uuid.uuid4().hex
    restored = asyncio.Event()
    lost = AnswerLost(h.node_bus.kv(KV_STEPS), rid, restored)
    try:
        ask = asyncio.create_task(h.bus.request(CkptRequested(
            request_id=rid, checkpoint_id=job.id, target=Target.job(job.id),
            node=h.settings.node), timeout=120))
        deadline = time.monotonic() + 60
        while not lost.fired:  # the checkpoint is done; its answer hangs
            assert time.monotonic() < deadline, "the checkpoint never answered"
            await asyncio.sleep(0.1)
        record, _ = await h.jobs.get(job.id)
        assert record.state == "checkpointed" and not record.alive()
        frozen = int(h.lines(job)[-1]["step"])
        again = await h.restore(job.id)
        assert again.status == "succeeded", again.error
        restored.set()
        done = await ask
    finally:
        restored.set()
        lost.restore()
    assert done.status == "succeeded", done.error  # type: ignore[union-attr]
    await asyncio.sleep(1)
    record, _ = await h.jobs.get(job.id)
    assert record.pid == again.pid and record.alive() and record.state == "running", (
        f"the job restored after the checkpoint (pid {again.pid}) was ended by the "
        f"checkpoint's recovery: the registry says {record.state}, pid {record.pid}, "
        f"alive {record.alive()}")
    await h.wait_step(job, frozen + 2)


# -- a second checkpoint of a job held stopped for an unfinished one --------------------

@pytest.mark.criu
async def test_a_checkpoint_never_dumps_a_job_held_stopped_for_another_checkpoint(
        h: Harness) -> None:
    """`smr up` is stopped while a final checkpoint uploads after its dump:
    the job is left stopped and its dump on disk, for recovery. After the
    restart, another checkpoint of the job comes first (the user asked
    again). It must not dump the stopped job: that image restores a job
    that never runs again, and it becomes `latest` (its number is past the
    one the first checkpoint claimed)."""
    from services.storage.layout import LOCAL_NAMESPACE
    from tests.test_local_smr import assert_continues
    from tests.test_nothing_lost import ckpt_step, proc_state, stopped_mid_commit

    step = ckpt_step(h)
    job = await h.start(32)
    first = CkptRequested(request_id=f"first-{job.id}", checkpoint_id=job.id,
                          target=Target.job(job.id), node=h.settings.node)
    await stopped_mid_commit(step, first)  # smr up stopping
    assert proc_state(job.pid) == "T"
    frozen = int(h.lines(job)[-1]["step"])

    second = await h.checkpoint(job.id)  # after the restart, before the recovery
    recovered = await step.recover(first, {"state": "running"})
    assert recovered is not None and recovered.status == "succeeded", recovered
    latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await asyncio.sleep(2)
    assert restored.pid and proc_state(restored.pid) != "T", (
        f"latest (generation {latest.number}, by {latest.manifest['request_id']}) restores a "
        f"stopped job; the second checkpoint answered {second.status} generation "
        f"{second.generation}, the recovered first one generation {recovered.generation}")
    await h.wait_step(job, frozen + 2)
    assert_continues(h.lines(job), frozen, 32)


# -- a restore whose job record cannot be written at once ---------------------------------

class FailsOnce:
    """A write of ``key`` (put, create or compare-and-set update) fails
    ``times`` times without being carried out, as it does while NATS
    restarts (nats-py raises TimeoutError)."""

    METHODS = ("put", "create", "update")

    def __init__(self, kv: Any, key: str, times: int = 1) -> None:
        self.kv, self.key, self.times = kv, key, times
        self.real = {m: getattr(kv, m) for m in self.METHODS}
        self.fired = 0
        for m in self.METHODS:
            setattr(kv, m, self._failing(m))

    def _failing(self, method: str) -> Any:
        async def write(key: str, value: bytes, *args: Any, **kw: Any) -> int:
            if key == self.key and self.fired < self.times:
                self.fired += 1
                raise nats.errors.TimeoutError
            return int(await self.real[method](key, value, *args, **kw))
        return write

    def restore(self) -> None:
        for m, real in self.real.items():
            setattr(self.kv, m, real)


@pytest.mark.criu
@pytest.mark.parametrize("times", [1, 1000])
async def test_a_restore_whose_record_write_fails_leaves_no_unknown_copy(
        h_two_deliveries: Harness, times: int) -> None:
    """CRIU has restored the job; the registry write that records it fails
    (NATS restarting; once, or for good). The restored process must not run on unknown to
    the registry, with the restore answered failed: `smr restore` again (the
    registry says the job is not running) would start a second copy."""
    from smr.bus import KV_JOBS

    h = h_two_deliveries
    job = await h.start(32)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    fault = FailsOnce(h.node_bus.kv(KV_JOBS), job.id, times)
    try:
        # NATS away for good: each delivery retries its writes for ~20 s
        # (the NATS retry budget) before the step gives up, until
        # deliveries (two here) run out.
        first = await h.restore(job.id, timeout=900)
    finally:
        fault.restore()
    assert fault.fired, "the fault never fired"
    record, _ = await h.jobs.get(job.id)
    running_now = copies(h.tmp)
    known = [record.pid] if record.alive() else []
    assert running_now == known, (
        f"the restore answered {first.status} ({(first.error or {}).get('code')}); copies "
        f"running {running_now}, the registry knows {known}")
    if first.status != "succeeded":
        again = await h.restore(job.id)
        assert again.status == "succeeded", again.error
        await asyncio.sleep(1)
        assert len(copies(h.tmp)) == 1, f"{len(copies(h.tmp))} copies of the job run"


# -- a worker that died after the dump, recovered while storage is away ------------------

class StorageAway:
    """Every call of the storage backend fails (past the client's retries)
    until ``back`` is called: an S3 endpoint unreachable for a while."""

    CALLS = ("list", "get_bytes", "put_bytes", "get_range", "start_upload", "delete")

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.real = {name: getattr(backend, name) for name in self.CALLS}
        self.failed = 0
        for name in self.CALLS:
            setattr(backend, name, self._failing(name))

    def _failing(self, name: str) -> Any:
        def fail(*a: Any, **kw: Any) -> Any:
            from services.storage.backend import StorageError
            self.failed += 1
            raise StorageError(f"injected: storage unreachable ({name})", hint="a test fault")

        async def afail(*a: Any, **kw: Any) -> Any:
            return fail(*a, **kw)

        return fail if name == "start_upload" else afail

    def back(self) -> None:
        for name, fn in self.real.items():
            setattr(self.backend, name, fn)


@pytest.mark.criu
async def test_a_dump_left_by_a_dead_worker_outlives_storage_away_at_its_recovery(
        h: Harness) -> None:
    """The worker died right after CRIU dumped a final checkpoint (the job
    held stopped, the dump on disk). When the request is redelivered,
    storage is unreachable for a while, far shorter than
    SMR_COMMIT_DEADLINE. The recovery must store the dump once storage is
    back (the promise: retried with backoff until the deadline), not give
    up after a few quick deliveries, leaving the job stopped for good and
    its dump on disk for ever."""
    from services.storage.layout import LOCAL_NAMESPACE
    from smr.bus import KV_LOCKS
    from tests.test_nothing_lost import ckpt_step, proc_state

    step = ckpt_step(h)
    job = await h.start(32)
    req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                        target=Target.job(job.id), node=h.settings.node)
    # As run() leaves things when its worker is SIGKILLed after the dump:
    await h.bus.kv(KV_LOCKS).put(job.id, orjson.dumps({"request_id": req.request_id,
                                                       "at": time.time()}))
    await h.bus.kv(KV_STEPS).put(req.request_id, orjson.dumps(
        {"state": "running", "owner": "dead-worker", "heartbeat": time.time() - 60,
         "subject": f"ckpt.requested.{h.settings.node}", "checkpoint_id": job.id}))
    work = step._work(req)
    _, tcp = await step._prepare(req, await h.jobs.find(job.id), work)  # type: ignore[arg-type]
    await step.criu.dump(job.pid, work / "images", leave_stopped=True, tcp=tcp)
    assert proc_state(job.pid) == "T"
    frozen = int(h.lines(job)[-1]["step"])

    away = StorageAway(step.store.backend)
    try:
        asked = asyncio.create_task(h.bus.request(req, timeout=120))  # the redelivery
        await asyncio.sleep(20)  # storage away for 20 s
    finally:
        away.back()
    assert away.failed, "the fault never fired"
    done = await asked
    state = proc_state(job.pid)
    left = work.exists()
    assert done.status == "succeeded" and state == "gone" and not left, (  # type: ignore[union-attr]
        f"answered {done.status} ({(done.error or {}).get('code')}); the job is now "  # type: ignore[union-attr]
        f"{state}{' (stopped for good)' if state == 'T' else ''}; its dump "
        f"{'is still on disk' if left else 'is gone'}")
    latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
    assert latest is not None and latest.manifest["request_id"] == req.request_id
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(job, frozen + 2)


@pytest.mark.criu
async def test_a_restore_left_by_a_dead_worker_and_storage_away_leaves_no_unknown_copy(
        h: Harness) -> None:
    """The worker died after CRIU restored the job, before it recorded it.
    When the request is redelivered, storage is unreachable for a while.
    However the request ends, the restored process must not run on unknown
    to the registry: the next `smr restore` would start a second copy."""
    from tests.test_nothing_lost import restore_step

    job = await h.start(32)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    rs = restore_step(h)
    gen = await rs.store.latest("local", job.id)
    assert gen is not None
    req = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                           target=Target.job(job.id), node=h.settings.node)
    # As run() leaves things when its worker is SIGKILLed after CRIU restored:
    work = rs.work_dir / req.request_id
    await rs.store.fetch(gen, work)
    fd = os.open(job.log, os.O_WRONLY | os.O_APPEND)
    try:
        await rs.criu.restore(work / "images", pidfile=work / "restored.pid",
                              inherit={job.log: fd}, tcp="keep")
    finally:
        os.close(fd)
    ident = ProcessIdentity.of(int((work / "restored.pid").read_text()))
    assert ident is not None
    ident.write(work / IDENTITY)  # written the moment CRIU returns
    await h.bus.kv(KV_STEPS).put(req.request_id, orjson.dumps(
        {"state": "running", "owner": "dead-worker", "heartbeat": time.time() - 60,
         "subject": f"restore.requested.{h.settings.node}", "checkpoint_id": job.id}))
    assert len(copies(h.tmp)) == 1

    away = StorageAway(rs.store.backend)
    try:
        asked = asyncio.create_task(h.bus.request(req, timeout=120))  # the redelivery
        await asyncio.sleep(20)
    finally:
        away.back()
    assert away.failed, "the fault never fired"
    first = await asked
    record, _ = await h.jobs.get(job.id)
    now = copies(h.tmp)
    known = [record.pid] if record.alive() else []
    assert now == known, (
        f"the restore answered {first.status} ({(first.error or {}).get('code')}); copies "
        f"running {now}, the registry knows {known}")
