"""The bus against a real nats-server: topology, routing, dedupe, crash
recovery, dead letters, raw JSON as a user publishes it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest
from nats.js.kv import KeyValue

from services.checkpointer import takeover
from services.checkpointer.admission import CheckpointAdmission
from services.checkpointer.pod import PodCheckpointStep
from smr.bus import (
    KV_JOBS,
    KV_LOCKS,
    KV_STEPS,
    STREAM_DLQ,
    STREAM_EXHAUSTED,
    STREAM_REQUESTS,
    Bus,
    Progress,
    Worker,
    node_filter,
    subject,
)
from smr.bus.topology import message_subject, request_consumer
from smr.contract.messages import CkptDone, CkptRequested, DeadLetter, Target
from smr.natsserver import NatsServer
from tests.helpers.steplocks import node_locks

REPO = Path(__file__).resolve().parent.parent


class CountingStep:
    """Records each request it executes."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.seen.append(req.request_id)
        return CkptDone.for_request(req, status="succeeded", generation=len(self.seen))

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


def request(node: str, rid: str = "r-1", job: str = "j", target: Target | None = None,
            **kw: Any) -> CkptRequested:
    return CkptRequested(
        request_id=rid, checkpoint_id="ck", target=target or Target.job(job), node=node, **kw
    )


async def run_worker(bus: Bus, step: Any, node: str) -> tuple[Worker, asyncio.Task[None]]:
    w = Worker(bus, step, node, service="test", locks=node_locks(node))
    task = asyncio.create_task(w.run())
    await asyncio.wait_for(w.idle.wait(), 10)
    return w, task


async def stop(w: Worker, task: asyncio.Task[None]) -> None:
    w.stop()
    await asyncio.wait_for(task, 10)


async def stored(bus: Bus, subj: str, stream: str, cls: Any, wait: float = 1) -> list[Any]:
    """Every message ``stream`` holds on ``subj``, as ``cls``, in order."""
    out = []
    sub = await bus.js.subscribe(subj, stream=stream, ordered_consumer=True)
    try:
        while True:
            try:
                m = await sub.next_msg(timeout=wait)
            except TimeoutError:
                break
            out.append(cls.from_payload(m.data))
    finally:
        await sub.unsubscribe()
    return out


async def zero_estimate(req: CkptRequested) -> int:
    """An admission's estimate where the room is not what a test is about."""
    return 0


def LOCAL_REQUESTS(node: str) -> str:
    return subject("ckpt.requested", node, "local")


async def dlq_messages(bus: Bus, subj: str) -> list[DeadLetter]:
    return await stored(bus, f"dlq.{subj}", STREAM_DLQ, DeadLetter)


async def test_topology_is_idempotent(bus: Bus, node: str) -> None:
    await bus.ensure()
    await bus.ensure()
    a = await bus.ensure_consumer("ckpt.requested", node)
    b = await bus.ensure_consumer("ckpt.requested", node)
    assert a == b
    info = await bus.js.consumer_info(STREAM_REQUESTS, a)
    assert info.config.filter_subject == node_filter("ckpt.requested", node)
    assert info.config.max_deliver == bus.config.max_deliver
    for bucket in (KV_STEPS, KV_JOBS, KV_LOCKS):
        assert (await bus.kv(bucket).status()).bucket == bucket


async def test_request_reaches_only_its_nodes_consumer(bus: Bus) -> None:
    a_step, b_step = CountingStep(), CountingStep()
    wa, ta = await run_worker(bus, a_step, "node-a1")
    wb, tb = await run_worker(bus, b_step, "node-b1")
    try:
        await bus.publish(request("node-a1", "for-a"))
        await bus.publish(request("node-b1", "for-b"))
        ra = await bus.wait_result("for-a", "ckpt.requested", timeout=10)
        rb = await bus.wait_result("for-b", "ckpt.requested", timeout=10)
    finally:
        await stop(wa, ta)
        await stop(wb, tb)
    assert (a_step.seen, b_step.seen) == (["for-a"], ["for-b"])
    assert ra.status == rb.status == "succeeded"


async def test_duplicate_publish_is_dropped(bus: Bus, node: str) -> None:
    first = await bus.publish(request(node, "dup-1"))
    second = await bus.publish(request(node, "dup-1"))
    assert not first.duplicate and second.duplicate
    step = CountingStep()
    w, t = await run_worker(bus, step, node)
    try:
        await bus.wait_result("dup-1", "ckpt.requested", timeout=10)
        # A third publish after completion is answered from the step state, not run.
        await bus.publish_raw(LOCAL_REQUESTS(node), request(node, "dup-1").to_payload())
        await asyncio.sleep(1.0)
        await asyncio.wait_for(w.idle.wait(), 5)
    finally:
        await stop(w, t)
    assert step.seen == ["dup-1"]


def spawn_slow_worker(url: str, node: str, markers: Path, *extra: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.slow_worker", url, node, str(markers), "30",
         *extra], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.stdout and p.stdout.readline().strip() == "ready"
    return p


async def wait_for_marker(markers: Path, name: str) -> None:
    for _ in range(200):
        if (markers / name).exists():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the step never started ({name})")


async def test_sigkilled_worker_redelivers_without_second_execution(
    nats_server: NatsServer, bus: Bus, node: str, tmp_path: Path
) -> None:
    def spawn() -> subprocess.Popen[str]:
        return spawn_slow_worker(nats_server.url, node, tmp_path)

    first = spawn()
    await bus.publish(request(node, "crash-1"))
    for _ in range(100):  # wait until the step has started executing
        if list(tmp_path.glob("crash-1.*")):
            break
        await asyncio.sleep(0.1)
    first.send_signal(signal.SIGKILL)
    first.wait()
    state, _ = await bus.step_state("crash-1")
    assert state and state["state"] == "running"

    second = spawn()
    try:
        result = await bus.wait_result("crash-1", "ckpt.requested", timeout=30)
    finally:
        second.kill()
        second.wait()
    assert [p.name for p in tmp_path.glob("crash-1.*")] == ["crash-1.0"]  # ran once
    assert result.status == "failed" and result.error and result.error["code"] == "interrupted"


async def test_worker_dying_on_every_delivery_ends_in_a_dead_letter(
    nats_server: NatsServer, bus: Bus, node: str, tmp_path: Path
) -> None:
    """Killed on its last delivery, a request must not vanish: the next worker
    on the node answers it as failed and dead-letters it, without running it."""
    for attempt in range(2):  # max_deliver = 2, each attempt SIGKILLed mid-step
        p = spawn_slow_worker(nats_server.url, node, tmp_path, "2", "rerun")
        if attempt == 0:
            await bus.publish(request(node, "doomed-1"))
        await wait_for_marker(tmp_path, f"doomed-1.{attempt}")
        p.kill()
        p.wait()
    await asyncio.sleep(2.5)  # the last delivery's ack wait runs out: JetStream gives up
    step = CountingStep()
    bus.config.max_deliver = 2
    w, t = await run_worker(bus, step, node)
    try:
        result = await bus.wait_result("doomed-1", "ckpt.requested", timeout=15)
    finally:
        await stop(w, t)
    assert step.seen == [], "an exhausted request must not run again"
    assert result.status == "failed" and result.error
    assert result.error["code"] == "deliveries-exhausted"
    letters = await dlq_messages(bus, LOCAL_REQUESTS(node))
    assert [x.request_id for x in letters] == ["doomed-1"]


async def test_invalid_message_is_dead_lettered_and_worker_continues(bus: Bus, node: str) -> None:
    step = CountingStep()
    w, t = await run_worker(bus, step, node)
    subj = LOCAL_REQUESTS(node)
    try:
        bad = request(node, "bad-1").to_dict()
        bad["reason"] = "whim"
        await bus.publish_raw(subj, orjson.dumps(bad))
        await bus.publish_raw(subj, b"{not json")
        await bus.publish(request(node, "good-after-bad"))
        good = await bus.wait_result("good-after-bad", "ckpt.requested", timeout=10)
    finally:
        await stop(w, t)
    assert good.status == "succeeded" and step.seen == ["good-after-bad"]
    letters = await dlq_messages(bus, subj)
    assert [letter.error["code"] for letter in letters] == ["schema-invalid", "json-invalid"]
    assert "reason" in letters[0].error["message"] and letters[0].request_id == "bad-1"
    assert letters[1].payload == "{not json"


async def test_raw_json_as_a_user_publishes_it(bus: Bus, node: str) -> None:
    """What `nats pub ckpt.requested.<node> '{...}'` sends: no headers at all."""
    step = CountingStep()
    w, t = await run_worker(bus, step, node)
    raw = (b'{"schema_version": 1, "request_id": "by-hand-1", "checkpoint_id": "train",'
           b' "target": {"kind": "job", "job_id": "train"}, "node": "' + node.encode()
           + b'", "reason": "api"}')
    try:
        await bus.nc.publish(LOCAL_REQUESTS(node), raw)
        await bus.nc.publish(LOCAL_REQUESTS(node), raw.replace(b'"job_id"', b'"jobid"'))
        result = await bus.wait_result("by-hand-1", "ckpt.requested", timeout=10)
        await asyncio.sleep(0.5)
    finally:
        await stop(w, t)
    assert result.status == "succeeded" and step.seen == ["by-hand-1"]
    letters = await dlq_messages(bus, LOCAL_REQUESTS(node))
    assert len(letters) == 1 and "target" in letters[0].error["message"]


async def test_request_for_another_node_is_refused(bus: Bus, node: str) -> None:
    step = CountingStep()
    w, t = await run_worker(bus, step, node)
    try:
        await bus.publish(request("elsewhere", "misrouted"), LOCAL_REQUESTS(node))
        await asyncio.sleep(1.0)
    finally:
        await stop(w, t)
    assert step.seen == []
    letters = await dlq_messages(bus, LOCAL_REQUESTS(node))
    assert letters and letters[0].error["code"] == "wrong-node"


async def test_request_for_a_pod_of_another_namespace_than_its_subject_is_refused(
        bus: Bus, node: str) -> None:
    """A tenant's NATS user may publish on ckpt.requested.*.<its namespace>
    only; a request there naming another namespace's pod is not run."""
    step = CountingStep()
    w, t = await run_worker(bus, step, node)
    theirs = CkptRequested(request_id="crafted", checkpoint_id="ck", node=node,
                           target=Target(kind="pod", namespace="team-b", pod="p", container="c"))
    mine = subject("ckpt.requested", node, "team-a")
    try:
        await bus.publish(theirs, mine)
        await bus.publish(request(node, "a-job"), mine)  # a job is in `local`, not team-a
        await asyncio.sleep(1.0)
    finally:
        await stop(w, t)
    assert step.seen == []
    letters = await dlq_messages(bus, mine)
    assert sorted((lt.request_id, lt.error["code"]) for lt in letters) == [
        ("a-job", "wrong-namespace"), ("crafted", "wrong-namespace")]
    assert (await bus.step_state("crafted"))[0] is None


class FlakyStep(CountingStep):
    """Fails for now twice, then succeeds."""

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        from smr.contract.errors import TemporaryError

        self.seen.append(req.request_id)
        if len(self.seen) < 3:
            raise TemporaryError("storage unreachable")
        return CkptDone.for_request(req, status="succeeded", generation=1)


async def test_temporary_failure_is_retried_with_backoff(bus: Bus, node: str) -> None:
    step = FlakyStep()
    w, t = await run_worker(bus, step, node)
    try:
        await bus.publish(request(node, "flaky-1"))
        result = await bus.wait_result("flaky-1", "ckpt.requested", timeout=20)
    finally:
        await stop(w, t)
    assert result.status == "succeeded" and len(step.seen) == 3


class AlwaysDown(CountingStep):
    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        from smr.contract.errors import TemporaryError

        self.seen.append(req.request_id)
        raise TemporaryError("storage unreachable", hint="check the S3 endpoint")


async def test_exhausted_deliveries_fail_and_dead_letter(bus: Bus, node: str) -> None:
    step = AlwaysDown()
    w, t = await run_worker(bus, step, node)
    try:
        await bus.publish(request(node, "down-1"))
        result = await bus.wait_result("down-1", "ckpt.requested", timeout=30)
    finally:
        await stop(w, t)
    assert len(step.seen) == bus.config.max_deliver
    assert result.status == "failed" and "storage unreachable" in result.error["message"]
    letters = await dlq_messages(bus, LOCAL_REQUESTS(node))
    assert letters[-1].error["code"] == "deliveries-exhausted"
    state, _ = await bus.step_state("down-1")
    assert state and state["state"] == "failed"


async def test_the_exhausted_handler_outlives_its_durable_made_again(
        bus: Bus, node: str) -> None:
    """The watcher makes a node's max-deliveries durable again when it is
    missing (deleted, its stream made again: services/watcher/durables.py).
    Meanwhile the worker's pulls on it fail (no responders: nats-py raises an
    APIError, not a timeout). Its handler must go on once the durable is back,
    not end for good: a request JetStream gives up on later would be left
    unanswered, its caller waiting for ever."""
    from smr.bus.topology import EXHAUSTED_PREFIX, exhausted_consumer

    w, t = await run_worker(bus, CountingStep(), node)
    try:
        durable = request_consumer("ckpt.requested", node, bus.config).durable_name or ""
        await bus.js.delete_consumer(
            STREAM_EXHAUSTED, exhausted_consumer(durable, bus.config).durable_name or "")
        await asyncio.sleep(2.5)  # the handler's next pulls find no durable
        await bus.make_node_consumers(node, {"ckpt.requested": w.concurrency + w.ahead})
        # A request answered and stored whose worker died before publishing
        # it on its last delivery: JetStream's advisory is all that is left.
        # (Its request published for a node no worker serves here, so only
        # the handler can answer it.)
        req = request(f"{node}-x", "regone-1")
        ack = await bus.publish(req)
        done = CkptDone.for_request(req, status="succeeded", generation=7)
        await bus.kv(KV_STEPS).put("regone-1", orjson.dumps(
            {"state": "done", "kind": "ckpt.requested", "result": done.to_dict(),
             "finished": time.time()}))
        await bus.nc.publish(f"{EXHAUSTED_PREFIX}.{durable}", orjson.dumps(
            {"stream": STREAM_REQUESTS, "consumer": durable, "stream_seq": ack.seq,
             "deliveries": bus.config.max_deliver}))
        done_subj = subject("ckpt.done", f"{node}-x", "local")
        published: list[CkptDone] = []
        for _ in range(20):  # the handler pulls each second
            if published := await stored(bus, done_subj, "SMR_EVENTS", CkptDone, wait=0.5):
                break
        assert [d.generation for d in published] == [7], \
            "the exhausted handler ended when its durable was made again"
    finally:
        await stop(w, t)



# -- a step that ends while NATS is away (the fault campaign's stuck workers) -------

class FreezesNats(CountingStep):
    """Stops nats-server (SIGSTOP: a restart's pause, without the restart)
    mid-step, and ends while the worker's keepalive waits on its KV write."""

    def __init__(self, pid: int, keepalive: float) -> None:
        super().__init__()
        self.pid = pid
        self.keepalive = keepalive
        self.ended = asyncio.Event()

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.seen.append(req.request_id)
        if len(self.seen) == 1:
            os.kill(self.pid, signal.SIGSTOP)
            await asyncio.sleep(self.keepalive * 1.6)  # a keepalive is now inside its write
            self.ended.set()
        return CkptDone.for_request(req, status="succeeded", generation=1)


async def test_a_step_that_ends_while_nats_is_away_is_still_answered(
        tmp_path: Path, nats_server: NatsServer, bus_config: Any, node: str) -> None:
    """The keepalive is cancelled inside a KV write that waits on a paused
    server; it must end there, and the worker answer once NATS is back, not
    wait on it for ever and stop serving its node."""
    srv = NatsServer(nats_server.binary, tmp_path / "nats").start()
    assert srv.proc
    bus = await Bus.connect(srv.url, name="test", config=bus_config)
    try:
        step = FreezesNats(srv.proc.pid, bus.config.keepalive)
        w, t = await run_worker(bus, step, node)
        await bus.publish(request(node, "away-1"))
        await asyncio.wait_for(step.ended.wait(), 20)
        await asyncio.sleep(0.5)
        os.kill(srv.proc.pid, signal.SIGCONT)
        result = await bus.wait_result("away-1", "ckpt.requested", timeout=20)
        assert result.status == "succeeded"
        # And the node is still served: the next request runs too.
        await bus.publish(request(node, "away-2"))
        assert (await bus.wait_result("away-2", "ckpt.requested", timeout=20)).generation == 1
        assert step.seen == ["away-1", "away-2"]
        await stop(w, t)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        await bus.close()
        srv.stop()


async def test_quietly_never_swallows_its_callers_cancellation() -> None:
    from smr.aio import quietly

    entered = asyncio.Event()

    async def slow() -> None:
        entered.set()
        await asyncio.sleep(30)

    async def loop() -> None:  # a keepalive: quiet calls, for ever
        while True:
            await quietly(slow())

    task = asyncio.create_task(loop())
    await entered.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert task in done and task.cancelled()


class DropsOneCancel:
    """Awaits as nats-py's ``Client._flush_pending`` does: a cancellation that
    arrives while it waits on the connection is caught and dropped. Only the
    first is dropped, so that a test that fails can still end."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.dropped = False

    async def wait(self) -> None:
        self.entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if self.dropped:
                raise
            self.dropped = True


async def test_stop_task_ends_a_task_whose_cancel_a_library_swallowed() -> None:
    """The fault campaign's stuck requests: a step had ended, and the worker
    waited for ever on its keepalive, whose cancel nats-py had dropped inside
    a publish. Stopping a task must end it even so."""
    from smr.aio import stop_task

    drops = DropsOneCancel()

    async def beats() -> None:
        while True:
            await drops.wait()
            await asyncio.sleep(5)

    task = asyncio.create_task(beats())
    await drops.entered.wait()
    stopper = asyncio.create_task(stop_task(task, again_every=0.5))
    try:
        await asyncio.wait([stopper], timeout=10)
        assert stopper.done(), "stop_task waits for ever on a task whose cancel was dropped"
    finally:
        while not task.done():  # this test's own clean-up, whatever stop_task did
            task.cancel()
            await asyncio.wait([task], timeout=0.1)
        stopper.cancel()


async def test_a_keepalive_whose_cancel_nats_dropped_still_ends(
        bus: Bus, node: str, monkeypatch: Any) -> None:
    """The same, through a real worker: the keepalive's in_progress() loses the
    cancel (as nats-py does while NATS is away); the step's result must still
    be published and the node served."""
    from nats.aio.msg import Msg

    drops = DropsOneCancel()

    async def in_progress(self: Msg) -> None:
        await drops.wait()

    monkeypatch.setattr(Msg, "in_progress", in_progress)

    class WaitsForABeat(CountingStep):
        async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
            await drops.entered.wait()
            return await super().run(req, progress)

    step = WaitsForABeat()
    w, t = await run_worker(bus, step, node)
    try:
        await bus.publish(request(node, "beat-1"))
        result = await bus.wait_result("beat-1", "ckpt.requested", timeout=20)
        assert result.status == "succeeded"
    finally:
        await stop(w, t)


async def test_a_worker_keeps_serving_its_node_across_nats_restarts(
        tmp_path: Path, nats_server: NatsServer, bus_config: Any, node: str) -> None:
    """NATS restarted again and again (JetStream on disk kept), as the fault
    campaign does: whatever the fetches meet meanwhile, the worker is still
    there afterwards and runs the next request."""
    srv = NatsServer(nats_server.binary, tmp_path / "nats").start()
    bus = await Bus.connect(srv.url, name="test", config=bus_config)
    try:
        step = CountingStep()
        w, t = await run_worker(bus, step, node)
        for _ in range(6):
            await asyncio.to_thread(srv.stop)
            await asyncio.sleep(0.3)
            await asyncio.to_thread(srv.start)
            await asyncio.sleep(0.7)
        assert not t.done(), t.exception() if not t.cancelled() else "cancelled"
        await bus.publish(request(node, "after-restarts"))
        result = await bus.wait_result("after-restarts", "ckpt.requested", timeout=30)
        assert result.status == "succeeded" and step.seen == ["after-restarts"]
        await stop(w, t)
    finally:
        await bus.close()
        srv.stop()


class Gated:
    """Records the order requests start in, and how many run at once; each
    runs until the test opens its gate."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.started: list[str] = []
        self.running = 0
        self.most = 0
        self.gate = asyncio.Event()

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.started.append(req.request_id)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.gate.wait()
            await asyncio.sleep(0.2)  # overlapping, were they let run together
        finally:
            self.running -= 1
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


async def _served(bus: Bus, step: Gated, node: str, rids: list[str],
                  targets: dict[str, Target] | None = None, **kw: Any) -> None:
    """Each request for a job of its own, or its target in ``targets``."""
    w = Worker(bus, step, node, service="test", locks=node_locks(node), **kw)
    task = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        for rid in rids:
            await bus.publish(request(node, rid, job=rid, target=(targets or {}).get(rid),
                                      leave_running=not rid.startswith("final")))
            await asyncio.sleep(0.1)  # the first has started before the others come
        await asyncio.sleep(1)  # all fetched, waiting
        step.gate.set()
        for rid in rids:
            assert (await bus.wait_result(rid, "ckpt.requested", timeout=30)).status == \
                "succeeded"
    finally:
        await stop(w, task)


async def test_a_final_request_starts_before_leave_running_ones_queued_earlier(
        bus: Bus, node: str, tmp_path: Path) -> None:
    step = Gated()
    admission = CheckpointAdmission(tmp_path, zero_estimate)
    await _served(bus, step, node, ["lr-1", "lr-2", "lr-3", "final-1"],
                  ahead=8, admission=admission)
    assert step.started == ["lr-1", "final-1", "lr-2", "lr-3"]


async def test_a_final_request_does_not_wait_for_the_estimate_of_one_queued_before_it(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """The size estimate of the next leave-running request takes seconds (a
    large writable layer to walk on a loaded node): a final request fetched
    meanwhile takes the free slot as soon as its own estimate is made."""
    async def estimate(req: CkptRequested) -> int:
        if req.request_id == "slow-2":
            await asyncio.sleep(4)
        return 0

    step = Gated()
    await _served(bus, step, node, ["lr-est", "slow-2", "final-est"], concurrency=2, ahead=8,
                  admission=CheckpointAdmission(tmp_path, estimate))
    assert step.started.index("final-est") < step.started.index("slow-2"), step.started


async def test_an_estimate_cancelled_from_inside_does_not_stop_the_worker(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A library can hand a cancel back from a call it gave up (smr.aio): an
    estimate ending so is no estimate, and the node is still served."""
    async def estimate(req: CkptRequested) -> int:
        await asyncio.sleep(0.1)
        raise asyncio.CancelledError

    step = Gated()
    await _served(bus, step, node, ["handed-back-1", "handed-back-2"], ahead=4,
                  admission=CheckpointAdmission(tmp_path, estimate))
    assert step.started == ["handed-back-1", "handed-back-2"]


async def test_dumps_start_together_only_while_their_estimates_fit_the_scratch(
        bus: Bus, node: str, tmp_path: Path) -> None:
    async def estimate(req: CkptRequested) -> int:
        return 600

    fits = Gated()  # 3 x 600 within 2000: together
    await _served(bus, fits, node, ["a-1", "a-2", "a-3"], concurrency=3, ahead=4,
                  admission=CheckpointAdmission(tmp_path, estimate, limit=2000))
    assert fits.most == 3
    tight = Gated()  # 2 x 600 over 1000: one at a time; a final first still
    await _served(bus, tight, node, ["b-1", "b-2", "final-b"], concurrency=3, ahead=4,
                  admission=CheckpointAdmission(tmp_path, estimate, limit=1000))
    assert tight.most == 1
    assert tight.started == ["b-1", "final-b", "b-2"]


async def test_requests_for_one_job_wait_outside_the_slots(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """Leave-running requests queued for one container (a tenant's own, say)
    would each hold a slot only to wait for its lock: they wait outside the
    slots, one at a time, and another container's request takes the free
    slot before the second of them."""
    step = Gated()
    ones = ["one-1", "one-2", "one-3"]
    await _served(bus, step, node, [*ones, "other-1"],
                  targets=dict.fromkeys(ones, Target.job("one")),
                  concurrency=2, ahead=8, admission=CheckpointAdmission(tmp_path, zero_estimate))
    assert step.started == ["one-1", "other-1", "one-2", "one-3"], step.started
    assert step.most == 2


async def test_a_tenants_queue_for_many_containers_holds_another_namespace_back_one_dump(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A tenant queues requests for four of its containers, more than the
    slots; another namespace's request, queued after them, starts as soon as
    one of the tenant's dumps in flight ends, not after the tenant's queue."""
    def pod(ns: str, name: str) -> Target:
        return Target(kind="pod", namespace=ns, pod=name, container="main")

    queued = {f"evil-{c}-{i}": pod("evil", f"p{c}") for i in range(3) for c in range(4)}
    step = Gated()
    await _served(bus, step, node, [*queued, "good-1"],
                  targets={**queued, "good-1": pod("good", "p")},
                  concurrency=2, ahead=16, admission=CheckpointAdmission(tmp_path, zero_estimate))
    # The two first in flight end together: their slots go one to each namespace.
    assert step.started.index("good-1") in (2, 3), step.started


async def test_a_final_request_starts_while_leave_running_dumps_fill_every_slot(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """Every slot is taken by leave-running dumps of other containers (long
    ones, a tenant's): a final request (a drain's) starts beside them."""
    step = Gated()
    await _served(bus, step, node, ["lr-a", "lr-b", "final-beside"], concurrency=2, ahead=8,
                  admission=CheckpointAdmission(tmp_path, zero_estimate))
    assert step.most == 3, step.started


class RiderDumps(Gated):
    """A rider that dumps by itself (a final whose cordon dump stepped aside)
    runs until the gate opens; the others a moment."""

    def __init__(self, rider: str) -> None:
        super().__init__()
        self.rider = rider
        self.gate.set()
        self.rider_ends = asyncio.Event()

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        if req.request_id == self.rider:
            self.started.append(req.request_id)
            await self.rider_ends.wait()
            return CkptDone.for_request(req, status="succeeded", generation=1)
        return await super().run(req, progress)


async def test_a_request_over_the_room_waits_for_a_rider_dumping_by_itself(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A rider starts outside the slots, but once it dumps it is a dump in
    flight like any other: a request whose estimate does not fit the room
    beside it waits for it to end, and never starts beside it (its own step
    would refuse it at the kubelet's eviction threshold)."""
    rider, big = f"final-rider-{node}", f"final-big-{node}"

    async def estimate(req: CkptRequested) -> int:
        return 1000 if req.request_id == big else 0

    step = RiderDumps(rider)
    w = Worker(bus, step, node, service="test", locks=node_locks(node), concurrency=4,
               ahead=8, admission=CheckpointAdmission(
                   tmp_path, estimate, limit=500, rides=lambda r: r.request_id == rider))
    t = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        await bus.publish(request(node, rider, job=rider, leave_running=False))
        await bus.publish(request(node, big, job=big, leave_running=False))
        await asyncio.sleep(2)
        assert step.started == [rider], "a request over the room started beside a rider"
        step.rider_ends.set()
        for rid in (rider, big):
            assert (await bus.wait_result(rid, "ckpt.requested", timeout=30)).status == \
                "succeeded"
    finally:
        await stop(w, t)
    assert step.started == [rider, big]


def pod_request(node: str, rid: str, ns: str, pod: str, leave_running: bool) -> CkptRequested:
    return CkptRequested(request_id=f"{rid}-{node}", checkpoint_id=f"{pod}.main", node=node,
                         leave_running=leave_running,
                         target=Target(kind="pod", namespace=ns, pod=pod, container="main"))


class GivesWay:
    """The pod step's takeover with a stand-in dump: a final request runs
    until the test ends it; a leave-running request of its container asked
    meanwhile gives way (``taken-over``), the others dump, each container's
    under its own lock."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.flights = takeover.Flights()
        self.final_ends = asyncio.Event()
        self.y_ends = asyncio.Event()  # a long leave-running dump, of pod y
        self.locks: dict[Any, asyncio.Lock] = {}  # by container
        self.started: list[str] = []
        self.dumping = 0
        self.most = 0

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        if not req.leave_running:
            with self.flights.final(takeover.key(req.target), req):
                await self.final_ends.wait()
            return CkptDone.for_request(req, status="succeeded", generation=1)
        self.started.append(req.request_id)
        takeover.make_way(self.flights, req)
        async with self.locks.setdefault(takeover.key(req.target), asyncio.Lock()):
            self.dumping += 1
            self.most = max(self.most, self.dumping)
            try:
                await (self.y_ends.wait() if req.target.pod == "y" else asyncio.sleep(0.3))
            finally:
                self.dumping -= 1
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


async def test_a_tenants_requests_giving_way_to_its_final_one_do_not_hold_another_back(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A tenant's final request runs on its container, and it has asked for
    leave-running ones of that container: each gives way at once, but each
    takes its turn in a slot. Another namespace's leave-running request,
    queued among them while the slot is taken, starts first when it frees
    (it has none in flight), and no more leave-running dumps run at once
    than there are slots."""
    step = GivesWay()
    # Two slots: the final one's, and one other, taken by the tenant's pod y.
    w = Worker(bus, step, node, service="test", locks=node_locks(node), concurrency=2,
               ahead=32, admission=CheckpointAdmission(tmp_path, zero_estimate))
    t = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        await bus.publish(pod_request(node, "gives-way-final", "evil", "p", False))
        await until(lambda: step.flights.final_of(("evil", "p", "main"), "p.main"),
                    "the final request did not start")
        await bus.publish(pod_request(node, "gives-way-y", "evil", "y", True))
        await until(lambda: step.dumping == 1, "y's dump did not start")
        tenant = [pod_request(node, f"gives-way-{i}", "evil", "p", True) for i in range(12)]
        other = pod_request(node, "gives-way-other", "good", "q", True)
        for r in [*tenant[:6], other, *tenant[6:]]:
            await bus.publish(r)
        await asyncio.sleep(0.7)  # all fetched, waiting for the slot
        step.y_ends.set()
        done = await bus.wait_result(other.request_id, "ckpt.requested", timeout=30)
        results = [await bus.wait_result(r.request_id, "ckpt.requested", timeout=60)
                   for r in tenant]
        step.final_ends.set()
    finally:
        step.y_ends.set()
        await stop(w, t)
    assert done.status == "succeeded", done.error
    assert {(r.error or {}).get("code") for r in results} == {"taken-over"}, results
    after_y = step.started[step.started.index(f"gives-way-y-{node}") + 1:]
    assert after_y[0] == other.request_id, after_y
    assert step.most == 1, f"{step.most} leave-running dumps at once beside the final"


async def until(cond: Any, what: str, t: float = 5) -> None:
    deadline = time.monotonic() + t
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


class HeldDumps:
    """Each dump runs until the test ends it (``end(pod)``). A final request
    rides on its pod's leave-running dump in flight and takes it over (ends it)."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.lr_flying: set[str] = set()
        self.ends: dict[str, asyncio.Event] = {}

    def end(self, name: str) -> asyncio.Event:
        return self.ends.setdefault(name, asyncio.Event())

    def rides(self, req: CkptRequested) -> bool:
        return not req.leave_running and req.target.pod in self.lr_flying

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.started[req.request_id.removesuffix("-" + req.node)] = time.monotonic()
        pod = req.target.pod or ""
        if req.leave_running:
            self.lr_flying.add(pod)
            try:
                await self.end(pod).wait()
            finally:
                self.lr_flying.discard(pod)
        else:
            self.end(pod).set()  # its leave-running dump, taken over
            await self.end("final-" + pod).wait()
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


async def test_a_namespace_with_nothing_waiting_or_running_takes_its_turn_first_again(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """Namespaces take the slots in turns; a namespace whose requests have
    all ended has its turn forgotten. Its next request starts as soon as
    one dump of its kind in flight ends, before a tenant's next one."""
    step = HeldDumps()
    await bus.publish(pod_request(node, "turn-a1", "evil", "a1", True))
    await bus.publish(pod_request(node, "turn-a1x", "evil", "a1", True))  # held behind a1
    w = Worker(bus, step, node, service="test", locks=node_locks(node), concurrency=2,
               ahead=32, admission=CheckpointAdmission(tmp_path, zero_estimate))
    t = asyncio.create_task(w.run())
    try:
        await until(lambda: "turn-a1" in step.started, "a1 did not start")
        await bus.publish(pod_request(node, "turn-b0", "good", "b0", True))
        await until(lambda: "turn-b0" in step.started, "b0 did not start")
        for r in ("a2", "a3"):
            await bus.publish(pod_request(node, f"turn-{r}", "evil", r, True))
        await bus.publish(pod_request(node, "turn-c1", "third", "c1", True))
        await asyncio.sleep(0.7)
        step.end("b0").set()  # good has nothing waiting or running now
        await until(lambda: "turn-c1" in step.started, "c1 (none in flight) did not start")
        await bus.publish(pod_request(node, "turn-b1", "good", "b1", True))
        await asyncio.sleep(0.7)
        step.end("a1").set()  # a dump of evil's ends: good's turn
        await until(lambda: len(step.started) == 4, "nothing started after a1 ended")
        await asyncio.sleep(0.3)
        assert list(step.started)[3:] == ["turn-b1"], step.started
    finally:
        for e in [*step.ends.values(), *(step.end(p) for p in ("a1", "a2", "a3", "c1", "b1"))]:
            e.set()
        await stop(w, t)


async def test_finals_riding_on_their_cordon_dumps_take_no_final_slot(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A tenant's finals fill the final slots; its finals that then take
    over its pods' leave-running dumps in flight ride on those dumps' slots.
    Another namespace's final, waiting, starts once one of the tenant's
    final dumps in flight ends."""
    step = HeldDumps()
    w = Worker(bus, step, node, service="test", locks=node_locks(node), concurrency=2,
               ahead=32, admission=CheckpointAdmission(tmp_path, zero_estimate, rides=step.rides))
    t = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        for p in ("x1", "x2"):
            await bus.publish(pod_request(node, f"ride-lr-{p}", "evil", p, True))
        await until(lambda: len(step.lr_flying) == 2, "leave-running x1 x2 did not start")
        for p in ("y5", "y6"):
            await bus.publish(pod_request(node, f"ride-final-{p}", "evil", p, False))
        await until(lambda: {"ride-final-y5", "ride-final-y6"} <= set(step.started),
                    "finals y5 y6 did not start")
        await bus.publish(pod_request(node, "ride-good", "good", "v", False))
        await asyncio.sleep(0.7)
        assert "ride-good" not in step.started, "a final started beyond the final slots"
        for p in ("x1", "x2"):
            await bus.publish(pod_request(node, f"ride-final-{p}", "evil", p, False))
        await until(lambda: {"ride-final-x1", "ride-final-x2"} <= set(step.started),
                    "the riders did not start")
        step.end("final-y5").set()
        await until(lambda: "ride-good" in step.started,
                    "another namespace's final waited past the end of a final dump")
    finally:
        for e in [*step.ends.values(), *(step.end(f"final-{p}") for p in ("y6", "x1", "x2", "v"))]:
            e.set()
        await stop(w, t)


async def test_a_request_naming_another_namespaces_container_is_refused_at_once(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A tenant's request on its own subject that names a container of another
    namespace is dead-lettered as it arrives: it does not wait as that
    container's request while the container's own dump runs (filling the
    look-ahead for as long), nor take that namespace's turn."""
    step = HeldDumps()
    w = Worker(bus, step, node, service="test", locks=node_locks(node), concurrency=2,
               ahead=32, admission=CheckpointAdmission(tmp_path, zero_estimate))
    t = asyncio.create_task(w.run())
    evil = message_subject(pod_request(node, "x", "evil", "x", True))
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        await bus.publish(pod_request(node, "forge-v", "good", "v", True))
        await until(lambda: "forge-v" in step.started, "the victim's dump did not start")
        forged = pod_request(node, "forge-x", "good", "v", True)
        await bus.publish_raw(evil, forged.to_payload())
        deadline = time.monotonic() + 5
        while not (letters := await dlq_messages(bus, evil)):
            assert time.monotonic() < deadline, "the forged request waited behind the dump"
            await asyncio.sleep(0.1)
        assert [(d.request_id, d.error["code"]) for d in letters] == \
            [(f"forge-x-{node}", "wrong-namespace")]
        assert "v" in step.lr_flying and "forge-x" not in step.started
    finally:
        step.end("v").set()
        await stop(w, t)


class GateOnG:
    """Pod g's dump runs until the gate opens; the others end at once."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gate = asyncio.Event()

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.started.append(req.request_id)
        if req.target.pod == "g":
            await self.gate.wait()
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


async def test_a_final_published_after_the_stream_is_made_again_is_served_as_a_final(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """One slot. A leave-running dump (pod g) runs; another (pod h, stream
    sequence 2) waits for the slot. The requests stream is lost and made
    again (JetStream kept nothing). Two final requests follow: x (sequence
    1, served at once) and y (sequence 2). Expected: y starts at once, as x
    did (a final never waits for a leave-running slot). Found: y is taken
    for h's redelivery (same sequence): it replaces h's message and waits
    as h, a leave-running request, until g's dump ends; and h itself, which
    the worker held in memory and would serve (and answer) from there, is
    dropped: never started, never answered."""
    step = GateOnG()
    w = Worker(bus, step, node, service="test", locks=node_locks(node), concurrency=1,
               ahead=8, admission=CheckpointAdmission(tmp_path, zero_estimate))
    t = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        await bus.publish(pod_request(node, "rs-lr-g", "ns", "g", True))
        await until(lambda: f"rs-lr-g-{node}" in step.started, "g did not start")
        await bus.publish(pod_request(node, "rs-lr-h", "ns", "h", True))
        await asyncio.sleep(1)  # h fetched, waiting for the slot
        await bus.js.delete_stream(STREAM_REQUESTS)
        await bus.ensure()
        await bus.ensure_consumer("ckpt.requested", node, 1 + 8)
        await bus.publish(pod_request(node, "rs-final-x", "ns", "x", False))
        await until(lambda: f"rs-final-x-{node}" in step.started,
                    "the worker did not come back to the new stream", t=20)
        await bus.publish(pod_request(node, "rs-final-y", "ns", "y", False))
        await until(lambda: f"rs-final-y-{node}" in step.started,
                    "a final request waited behind a leave-running dump, as the request "
                    "of its sequence in the lost stream")
        step.gate.set()  # g ends: h (fetched before the stream was lost) is served next
        await until(lambda: f"rs-lr-h-{node}" in step.started,
                    "h, held by the worker, was never served")
    finally:
        step.gate.set()
        await stop(w, t)


class StepsAside:
    """The pod step's takeover, stand-in dumps: a leave-running dump spends
    its pre-freeze time in phase ``before`` until the test ends it; a final request of
    its container registered meanwhile makes it step aside (``taken-over``),
    and dumps by itself until the test ends it. Riding is the agent's rule
    (``PodCheckpointStep.rides``) on these flights."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.flights = takeover.Flights()
        self.before: set[str] = set()  # pods whose leave-running dump is pre-freeze
        self.started: list[str] = []
        self.finals_dumping = 0
        self.most_finals = 0
        self.gate = asyncio.Event()

    def rides(self, req: CkptRequested) -> bool:
        return PodCheckpointStep.rides(self, req)  # type: ignore[arg-type]

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        pod, key = req.target.pod or "", takeover.key(req.target)
        self.started.append(req.request_id.removesuffix("-" + req.node))
        if req.leave_running:
            flight = self.flights.begin(key, req, f"c-{pod}")
            self.before.add(pod)
            try:
                while not self.gate.is_set():  # before its freeze until the test ends it
                    takeover.make_way(self.flights, req)  # raises taken-over
                    await asyncio.sleep(0.05)
            finally:
                self.before.discard(pod)
                self.flights.end(key, flight, None)
            return CkptDone.for_request(req, status="succeeded", generation=1)
        with self.flights.final(key, req):
            flight = self.flights.flight_for(key, req)
            if flight is not None:
                await takeover.wait(flight, req, progress)  # None: it dumps itself
            self.finals_dumping += 1
            self.most_finals = max(self.most_finals, self.finals_dumping)
            try:
                await self.gate.wait()
            finally:
                self.finals_dumping -= 1
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


async def test_a_final_whose_leave_running_dump_steps_aside_dumps_in_a_final_slot(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """One slot (SMR_CHECKPOINTS_PER_NODE=1). A drain: pod a's final request
    makes a's cordon dump step aside before its freeze and dumps in a slot;
    pod b's final request, while a's final dump runs, waits for a slot: it
    does not ride on b's cordon dump before its freeze (which would step
    aside for it too) to dump beside a's outside every slot."""
    step = StepsAside()
    w = Worker(bus, step, node, service="test", locks=node_locks(node), concurrency=1,
               ahead=32, admission=CheckpointAdmission(tmp_path, zero_estimate,
                                                       rides=step.rides))
    t = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        for p in ("a", "b"):
            await bus.publish(pod_request(node, f"aside-lr-{p}", "ns", p, True))
        await until(lambda: "a" in step.before, "a's cordon dump did not start")
        await bus.publish(pod_request(node, "aside-final-a", "ns", "a", False))
        await until(lambda: step.finals_dumping == 1, "a's final did not dump")
        await asyncio.sleep(0.5)  # b's cordon dump starts beside a's final one if a slot is free
        await bus.publish(pod_request(node, "aside-final-b", "ns", "b", False))
        await asyncio.sleep(1)
        assert step.most_finals == 1, "two final dumps at once on a node of one final slot"
        step.gate.set()
        for p in ("a", "b"):
            result = await bus.wait_result(f"aside-final-{p}-{node}", "ckpt.requested",
                                           timeout=30)
            assert result.status == "succeeded", (p, result.error)
    finally:
        step.gate.set()
        await stop(w, t)


class FinalsBlock:
    """Final requests run until the test releases them; the others at once."""

    kind = "ckpt.requested"

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release = asyncio.Event()

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.started.append(req.request_id)
        if not req.leave_running:
            await self.release.wait()
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        return None


async def test_a_request_that_waited_through_agent_restarts_still_runs(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A request fetched ahead while its node is busy is nak'd when the agent
    stops, and JetStream counts each delivery, though it never ran. A busy
    node whose agent restarts max_deliver times must still run it (once),
    not answer it 'its worker died or stalled each time'."""
    step = FinalsBlock()

    async def agent() -> tuple[Worker, asyncio.Task[None]]:
        w = Worker(bus, step, node, service="test", locks=node_locks(node), ahead=4,
                   admission=CheckpointAdmission(tmp_path, zero_estimate))
        return w, asyncio.create_task(w.run())

    for i in range(bus.config.max_deliver):
        step.release = asyncio.Event()
        # The node is busy: a final checkpoint runs (published before the
        # agent starts, so that it is fetched with the waiting request).
        await bus.publish(request(node, f"final-{i}-{node}", leave_running=False))
        w, t = await agent()
        for _ in range(100):
            if f"final-{i}-{node}" in step.started:
                break
            await asyncio.sleep(0.1)
        assert step.started[-1] == f"final-{i}-{node}"
        if i == 0:
            await bus.publish(request(node, f"lr-1-{node}", leave_running=True))
        await asyncio.sleep(0.5)  # lr-1 fetched: it waits behind the final
        w.stop()
        step.release.set()
        await asyncio.wait_for(t, 10)
        assert f"lr-1-{node}" not in step.started
    w, t = await agent()
    try:
        result = await bus.wait_result(f"lr-1-{node}", "ckpt.requested", timeout=20)
    finally:
        await stop(w, t)
    assert result.status == "succeeded", result.error
    assert step.started.count(f"lr-1-{node}") == 1


async def test_a_request_published_twice_while_it_waits_runs_once_and_succeeds(
        bus: Bus, node: str, tmp_path: Path) -> None:
    """A user's retry of a waiting request (same request_id, published again
    after the dedupe window, or by hand without a message id) is a second
    message, not a redelivery: neither may be left without keepalives to spend
    its deliveries and be given up on while the other waits."""
    bus.config.max_deliver = 2  # given up on within seconds if left without keepalives
    step = FinalsBlock()
    w = Worker(bus, step, node, service="test", locks=node_locks(node), ahead=4,
               admission=CheckpointAdmission(tmp_path, zero_estimate))
    t = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 10)
        await bus.publish(request(node, f"final-1-{node}", leave_running=False))
        dup = request(node, f"dup-1-{node}", leave_running=True)
        await bus.publish(dup)
        await bus.publish_raw(LOCAL_REQUESTS(node), dup.to_payload(),
                              msg_id=f"dup-1-again-{node}")
        await asyncio.sleep(6 * bus.config.max_deliver * bus.config.ack_wait)
        step.release.set()
        result = await bus.wait_result(f"dup-1-{node}", "ckpt.requested", timeout=20)
        assert result.status == "succeeded", result.error
        assert step.started.count(f"dup-1-{node}") == 1
    finally:
        await stop(w, t)
    assert [x.request_id for x in await dlq_messages(bus, LOCAL_REQUESTS(node))] \
        == []


async def test_requests_waiting_across_nats_restarts_each_run_once(
        tmp_path: Path, nats_server: NatsServer, bus_config: Any, node: str) -> None:
    """NATS restarted (down past the ack wait, so every in_progress of the
    waiting requests and of the running step is lost) again and again while
    requests wait behind a running one: each still runs, once, and succeeds."""
    srv = NatsServer(nats_server.binary, tmp_path / "nats").start()
    bus_config.max_deliver = 2
    bus = await Bus.connect(srv.url, name="test", config=bus_config)
    try:
        step = FinalsBlock()
        w = Worker(bus, step, node, service="test", locks=node_locks(node), ahead=4,
                   admission=CheckpointAdmission(tmp_path, zero_estimate))
        t = asyncio.create_task(w.run())
        await asyncio.wait_for(w.idle.wait(), 10)
        await bus.publish(request(node, f"final-1-{node}", leave_running=False))
        for rid in (f"lr-1-{node}", f"lr-2-{node}"):
            await bus.publish(request(node, rid, leave_running=True))
        await asyncio.sleep(0.5)
        for _ in range(3):
            await asyncio.to_thread(srv.stop)
            await asyncio.sleep(1.5 * bus.config.ack_wait)
            await asyncio.to_thread(srv.start)
            await asyncio.sleep(2 * bus.config.ack_wait)
        step.release.set()
        # While NATS was away past max_deliver, the blocked final step may have
        # been answered deliveries-exhausted (its heartbeat could not be
        # written); its real success replaces that answer once it is released
        # (Bus.publish: a success after a recorded failure is not dropped).
        # What the caller is left with is the success.
        for rid in (f"final-1-{node}", f"lr-1-{node}", f"lr-2-{node}"):
            for _ in range(300):
                state, _ = await bus.step_state(rid)
                if state and state["state"] == "done":
                    break
                await asyncio.sleep(0.1)
            assert state and state["state"] == "done", (rid, state)
            assert state["result"]["status"] == "succeeded", (rid, state["result"])
        await stop(w, t)
        assert sorted(step.started) == [f"final-1-{node}", f"lr-1-{node}", f"lr-2-{node}"]
    finally:
        await bus.close()
        srv.stop()


class NatsAwayOnceStep(CountingStep):
    """Meets NATS away past its own retries the first time (a cluster
    restarting: the step's KV write finds no responders)."""

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.seen.append(req.request_id)
        if len(self.seen) == 1:
            raise nats.errors.NoRespondersError
        return CkptDone.for_request(req, status="succeeded", generation=len(self.seen))


async def test_a_step_that_meets_nats_away_is_retried_not_an_internal_error(
        bus: Bus, node: str) -> None:
    step = NatsAwayOnceStep()
    w, t = await run_worker(bus, step, node)
    try:
        await bus.publish(request(node, "nats-away"))
        result = await bus.wait_result("nats-away", "ckpt.requested", timeout=30)
    finally:
        await stop(w, t)
    assert (result.status, result.error) == ("succeeded", None)
    assert step.seen == ["nats-away", "nats-away"]


async def test_a_step_jetstream_gave_up_on_is_not_failed_while_its_worker_lives(
        bus: Bus, node: str, monkeypatch: Any, tmp_path: Path) -> None:
    """A running step whose beats cannot get through (NATS away for its
    worker) is redelivered until JetStream gives up. Its worker still runs it
    and will answer it: a restore it may still land, a process it may still
    resume. Answered "failed, deliveries-exhausted" meanwhile, the answer was
    then replaced by the step's success, after a caller had acted on the
    failure (the agent starting the pod fresh beside the restore that still
    landed; the watcher taking a template again for the next replica). The
    handler must leave a step a live worker holds, and every waiter must get
    the step's one answer."""
    async def no_beats(self: Worker, *a: Any) -> None:
        await asyncio.Event().wait()

    async def lost(self: Any) -> None:
        pass

    # NATS away for this worker, as it reaches it: neither its heartbeats nor
    # its in_progress get through; JetStream and the KV are up for the rest.
    monkeypatch.setattr(Worker, "_keepalive", no_beats)
    monkeypatch.setattr(nats.aio.msg.Msg, "in_progress", lost)
    bus.config.max_deliver = 2
    step = FinalsBlock()
    # Fetched ahead (a busy node): its redeliveries are counted while it runs.
    w = Worker(bus, step, node, service="test", locks=node_locks(node), ahead=4,
               admission=CheckpointAdmission(tmp_path, zero_estimate))
    t = asyncio.create_task(w.run())
    await asyncio.wait_for(w.idle.wait(), 10)
    rid = f"final-exhausted-{node}"
    handler = "exhausted-" + (request_consumer("ckpt.requested", node, bus.config).durable_name
                              or "")
    try:
        await bus.publish(request(node, rid, leave_running=False))
        waiter = asyncio.create_task(bus.wait_result(rid, "ckpt.requested", timeout=120))
        # JetStream gives up, and the handler of what it gave up on looks at
        # the request twice (at the advisory, and again ack_wait later), or
        # answers it.
        for _ in range(300):
            info = await bus.js.consumer_info(STREAM_EXHAUSTED, handler)
            state, _ = await bus.step_state(rid)
            if info.delivered.consumer_seq >= 2 or (state or {}).get("state") in ("done", "failed"):
                break
            await asyncio.sleep(0.1)
        assert state and state["state"] == "running", state
        assert info.delivered.consumer_seq >= 2, info.delivered
        assert step.started == [rid] and not waiter.done()
        step.release.set()  # the worker's step ends (NATS still away for its beats)
        got = await waiter
        state, _ = await bus.step_state(rid)
    finally:
        step.release.set()
        await stop(w, t)
    assert (got.status, got.error) == ("succeeded", None)
    assert state and state["state"] == "done", state
    assert step.started == [rid]
    assert [x.request_id for x in await dlq_messages(bus, LOCAL_REQUESTS(node))] == []


async def test_a_redelivery_never_runs_a_step_beside_its_live_worker(
        bus: Bus, node: str, monkeypatch: Any) -> None:
    """The same cut-off worker, and a second worker of the node (another agent
    process: the old pod finishing while its replacement starts). The
    redelivery that reaches the second finds a stale heartbeat, yet the first
    still runs the step: recovering or running it again beside it would
    restore or resume twice. It must wait for the live worker's answer."""
    async def no_beats(self: Worker, *a: Any) -> None:
        await asyncio.Event().wait()

    async def lost(self: Any) -> None:
        pass

    monkeypatch.setattr(Worker, "_keepalive", no_beats)
    monkeypatch.setattr(nats.aio.msg.Msg, "in_progress", lost)
    step = FinalsBlock()
    first, t1 = await run_worker(bus, step, node)
    rid = f"final-twice-{node}"
    second: Worker | None = None
    try:
        await bus.publish(request(node, rid, leave_running=False))
        for _ in range(100):
            if step.started:
                break
            await asyncio.sleep(0.1)
        assert step.started == [rid]
        second, t2 = await run_worker(bus, step, node)
        # Two ack waits: the request is redelivered, to the second worker
        # (the first serves one at a time), and its heartbeat is stale.
        await asyncio.sleep(2 * bus.config.ack_wait + 1)
        state, _ = await bus.step_state(rid)
        assert state and state["state"] == "running", state
        assert step.started == [rid], "the step ran again beside its live worker"
        assert time.time() - state["heartbeat"] > bus.config.stale_after
        step.release.set()
        got = await bus.wait_result(rid, "ckpt.requested", timeout=60)
    finally:
        step.release.set()
        await stop(first, t1)
        if second is not None:
            await stop(second, t2)
    assert (got.status, got.error) == ("succeeded", None)
    assert step.started == [rid]


async def test_a_live_workers_answer_is_stored_though_nats_fails_its_first_write(
        bus: Bus, node: str, monkeypatch: Any) -> None:
    """A step that succeeded on its last delivery (a restore that landed)
    whose answer's write meets NATS away for a moment (a JetStream leader
    being elected). Its worker is alive and holds the answer: it must store
    it. Before, the write's error let the request's lock go with no answer
    stored, and the handler of what JetStream then gave up on answered
    "failed, deliveries-exhausted" for a step that succeeded (the agent would
    start the pod fresh beside the restored one)."""
    rid = f"answer-lost-{node}"
    put = KeyValue.put
    refused: list[str] = []

    async def flaky_put(self: KeyValue, key: str, value: bytes, *a: Any, **kw: Any) -> int:
        if key == rid and orjson.loads(value).get("state") == "done" and not refused:
            refused.append(key)
            raise nats.errors.TimeoutError  # as a KV write that outlives a leader election
        return await put(self, key, value, *a, **kw)

    monkeypatch.setattr(KeyValue, "put", flaky_put)
    bus.config.max_deliver = 1  # its first delivery is its last
    step = CountingStep()
    w, t = await run_worker(bus, step, node)
    try:
        await bus.publish(request(node, rid))
        got = await bus.wait_result(rid, "ckpt.requested", timeout=60)
    finally:
        await stop(w, t)
    assert refused == [rid]
    assert (got.status, got.error) == ("succeeded", None)
    assert step.seen == [rid]



class LandedStep(CountingStep):
    """Its recover() looks at the world, as the restorer's does for a
    restored process: a marker written by slow_worker's step means the step's
    effect landed before its worker died."""

    def __init__(self, markers: Path) -> None:
        super().__init__()
        self.markers = markers

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        if list(self.markers.glob(f"{req.request_id}.*")):
            return CkptDone.for_request(req, status="succeeded", generation=1)
        return None


async def test_a_cut_off_worker_that_dies_after_its_deliveries_are_spent_is_recovered(
        nats_server: NatsServer, bus: Bus, node: str, tmp_path: Path) -> None:
    """A worker cut off from NATS for its beats (an old agent pod) runs a step
    whose effect lands (a restore). The node's other worker leaves each
    redelivery to it, as it must while it lives, so JetStream spends the
    request's deliveries and gives up. Then the cut-off worker dies (the old
    pod's grace period ends) before it answers. What it did must be found
    (the step's recover), as a redelivery would have: answered "failed,
    deliveries-exhausted", the agent starts the pod fresh beside the restore
    that landed."""
    rid = f"cutoff-{node}"
    a = spawn_slow_worker(nats_server.url, node, tmp_path, "2", "cutoff")
    w = t = None
    try:
        await bus.publish(request(node, rid))
        await wait_for_marker(tmp_path, f"{rid}.0")  # its effect landed; it sleeps on
        bus.config.max_deliver, bus.config.ack_wait = 2, 1.0  # as the cut-off worker's
        step = LandedStep(tmp_path)
        w, t = await run_worker(bus, step, node)
        handler = "exhausted-" + (request_consumer("ckpt.requested", node, bus.config)
                                  .durable_name or "")
        for _ in range(200):  # JetStream gives up; its handler leaves the live worker be
            info = await bus.js.consumer_info(STREAM_EXHAUSTED, handler)
            if info.delivered.consumer_seq >= 1:
                break
            await asyncio.sleep(0.1)
        state, _ = await bus.step_state(rid)
        assert state and state["state"] == "running", state
        assert info.delivered.consumer_seq >= 1, info.delivered
        a.kill()
        a.wait()
        got = await bus.wait_result(rid, "ckpt.requested", timeout=30)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
        if w is not None and t is not None:
            await stop(w, t)
    assert (got.status, got.error) == ("succeeded", None)
    assert step.seen == [], "the step ran again"


class RecordingStep(CountingStep):
    """Records the target of each request it runs or recovers."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[tuple[str, str | None]] = []

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        self.targets.append(("run", req.target.namespace))
        return await super().run(req, progress)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        self.targets.append(("recover", req.target.namespace))
        return None


def a_reuse(node: str, rid: str, *, claimed: bool = True
            ) -> tuple[CkptRequested, CkptRequested, dict[str, Any]]:
    """A step's own request (default/vic), a tenant's reusing its id and
    checkpoint id (evil/att), and the claim of a worker that has been silent
    in that step for a minute (with its target, unless not ``claimed``)."""
    def of(namespace: str, pod: str) -> CkptRequested:
        return CkptRequested(request_id=rid, checkpoint_id="ck", node=node,
                             target=Target(kind="pod", namespace=namespace, pod=pod,
                                           container="main"))

    victim, tenant = of("default", "vic"), of("evil", "att")
    claim = {"state": "running", "owner": "dead-worker", "claim": uuid.uuid4().hex,
             "heartbeat": time.time() - 60, "attempt": 1, "phase": "dump",
             "subject": message_subject(victim), "checkpoint_id": "ck"}
    if claimed:
        claim["target"] = victim.target.to_dict()
    return victim, tenant, claim


async def refused_then_recovered(bus: Bus, step: RecordingStep, victim: CkptRequested,
                                 tenant: CkptRequested, claim: dict[str, Any]) -> CkptDone:
    """The tenant's request (published) is refused and leaves the step as
    it was; then the step's own request recovers it: its answer."""
    letters: list[DeadLetter] = []
    deadline = time.monotonic() + 15
    while not letters and time.monotonic() < deadline:
        letters = await dlq_messages(bus, message_subject(tenant))
    assert [x.error["code"] for x in letters] == ["request-id-reused"], letters
    assert step.targets == [], "the tenant's request recovered or ran the step"
    state, _ = await bus.step_state(victim.request_id)
    assert state and state["claim"] == claim["claim"], "the step state was taken"
    await bus.publish_raw(message_subject(victim), victim.to_payload())
    got = await bus.wait_result(victim.request_id, "ckpt.requested", timeout=15)
    assert got.target == victim.target and got.status == "succeeded", got
    assert step.targets == [("recover", "default"), ("run", "default")]
    return got


@pytest.mark.parametrize("claimed", ["target", "subject only"])
async def test_a_request_of_another_namespace_reusing_an_interrupted_requests_id_is_refused(
        bus: Bus, node: str, claimed: str) -> None:
    """A request id is one key for every namespace, and a tenant may publish
    any id on its own namespace's subject. A step whose worker died midway
    (its dump kept for the recovery) must be recovered only by its own
    request: another namespace's request reusing its id and checkpoint id is
    refused, never recovers that step (its dump would be stored in the
    tenant's namespace, or a final one lost). ``subject only``: a claim
    written before claims named their target."""
    rid = f"reused-{node}-{claimed[0]}"
    # The claim of a worker that died in its step a minute ago, as it left it.
    victim, tenant, claim = a_reuse(node, rid, claimed=claimed == "target")
    await bus.kv(KV_STEPS).put(rid, orjson.dumps(claim))
    step = RecordingStep()
    w, t = await run_worker(bus, step, node)
    try:
        # As a tenant publishes: no Nats-Msg-Id, so no dedupe drops it.
        await bus.publish_raw(message_subject(tenant), tenant.to_payload())
        await refused_then_recovered(bus, step, victim, tenant, claim)
    finally:
        await stop(w, t)


async def test_a_reused_id_whose_deliveries_ran_out_is_refused_not_recovered(
        bus: Bus, node: str) -> None:
    """The same reuse, while the step's own worker lives on (it holds the
    request's lock): each delivery of the tenant's request is left to that
    worker until JetStream gives up on it. The worker then dies. The handler
    of the requests JetStream gave up on must refuse it too, never recover
    the step for it (found or not, the step's own request would then be
    refused as the reuse)."""
    rid = f"reused-exhausted-{node}"
    victim, tenant, claim = a_reuse(node, rid)
    await bus.kv(KV_STEPS).put(rid, orjson.dumps(claim))
    bus.config.max_deliver, bus.config.ack_wait = 2, 1.0
    step = RecordingStep()
    w = t = None
    try:
        with node_locks(node).hold(rid) as ours:  # the step's own worker, alive
            assert ours
            w, t = await run_worker(bus, step, node)
            await bus.publish_raw(message_subject(tenant), tenant.to_payload())
            handler = "exhausted-" + (request_consumer("ckpt.requested", node, bus.config)
                                      .durable_name or "")
            deadline = time.monotonic() + 30
            while (await bus.js.consumer_info(STREAM_EXHAUSTED, handler)
                   ).delivered.consumer_seq < 1:  # JetStream gave up on it
                assert time.monotonic() < deadline, "the tenant's deliveries never ran out"
                await asyncio.sleep(0.1)
        # That worker is gone (its lock with it).
        await refused_then_recovered(bus, step, victim, tenant, claim)
    finally:
        if w is not None and t is not None:
            await stop(w, t)
