"""kubectl drain cordons, then evicts: the final request of a pod whose cordon
dump is in flight takes that dump over (services/checkpointer/takeover)
instead of waiting for it and dumping again. Real containerd, runc, CRIU,
nats-server and moto; the kubelet and API server are the repo's fakes.

The workload holds BALLAST_MIB of memory, every page written and checked.
The test evicts once the cordon's dump has frozen it (its processes in
CRIU's tracing stop). On this shared machine the final request can reach the
agent seconds after the eviction (every service shares one process here),
so ``in_order`` makes the order certain: the cordon dump's captures (the
tree still frozen) wait until the final request's step has started on the
agent. Nothing is faked: the real functions run, only later."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from nats.js.errors import KeyNotFoundError

from services import timings
from services.checkpointer import dumpstamp, pod_dump
from services.checkpointer.pod import PodCheckpointStep
from services.checkpointer.pod_capture import CONTAINER_FILE
from services.containers.host import Shim
from services.storage.backend import StorageError
from smr.aio import wait_event
from smr.bus import KV_LOCKS, KV_STEPS, KV_TIMINGS
from smr.contract.messages import CkptRequested, Target
from smr.jobs import proc_start_ticks, signal_tree
from tests.agent.cluster import Cluster, assert_continues, steps, store_puts_through, workload
from tests.agent.test_kubelet import evict, hook_said, seconds_between
from tests.agent.test_restore_memory import build_ballast_image
from tests.helpers.live import live
from tests.helpers.steplocks import hold_lock

IMAGE = "smr.test/ballast-drain:1"
BALLAST_MIB = 384
NODE_RESTORE = {"smr.dev/node-restore": "true"}


@pytest.fixture(scope="module")
def drain_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_ballast_image(tmp_path_factory.mktemp("ballast-drain"), IMAGE, BALLAST_MIB)


def _ballast_pids(cluster: Cluster | None = None) -> list[int]:
    """The ballast processes on this machine; with ``cluster``, only those in
    its kubelets' containers (one a test before left, still being killed,
    is not this test's)."""
    ids = {r.id for k in cluster.kubelets.values() for st in k.pods.values()
           for r in st.containers.values()} if cluster else None
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "cmdline").read_bytes().split(b"\0")[:2] != \
                        [b"/bin/ballast", str(BALLAST_MIB).encode()]:
                    continue
                if ids is not None and not any(i in (p / "cgroup").read_text() for i in ids):
                    continue
                found.append(int(p.name))
            except OSError:
                continue
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


async def until_frozen(cluster: Cluster, timeout: float = 60) -> None:
    """Until the ballast (the only one in ``cluster``) is in CRIU's stop: its dump began."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _ballast_pids(cluster)
        if pids and all(_state(p) in ("t", "T") for p in pids):
            return
        assert time.monotonic() < deadline, (
            f"no dump of the ballast began: the cluster's ballasts {pids} are in states "
            f"{[_state(p) for p in pids]}; on this machine: "
            f"{[(q, _state(q)) for q in _ballast_pids()]}")
        await asyncio.sleep(0.005)


async def start(cluster: Cluster, image: Path, name: str, node: str) -> None:
    for n, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(n, image)
    p = workload(name, node, image=IMAGE, labels=NODE_RESTORE, final_wait=80, grace=90)
    p["spec"]["containers"][0]["command"] = ["/smr/smr-init", "--", "/bin/start"]
    cluster.kube.put("pods", p)
    await cluster.until_steps(name, node, 5, timeout=60)
    deadline = time.monotonic() + 30
    while "ballast 0 intact" not in cluster.log(name, node):
        assert time.monotonic() < deadline, "the ballast never checked its memory"
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def in_order(cluster: Cluster, node: str, name: str, wait_s: float = 60,
                   before_freeze: bool = False) -> AsyncIterator[None]:
    """The captures of ``name``'s leave-running dumps on ``node`` (or, with
    ``before_freeze``, the step before it freezes anything: its dump's place
    in the order, taken under the lock) wait (at most ``wait_s``, then go
    on) until a final request for it has started there."""
    agent = cluster.agents[node]
    step = next(w.step.step for w in agent.workers  # the worker's Fresh(step)
                if isinstance(getattr(w.step, "step", None), PodCheckpointStep))
    final_started = asyncio.Event()
    leave_running: set[str] = set()
    real_run, real_capture, real_take = step.run, pod_dump.capture, dumpstamp.take

    async def run(req: CkptRequested, progress: Any) -> Any:
        if req.target.pod == name:
            if req.leave_running:
                leave_running.add(req.request_id)
            else:
                final_started.set()
        return await real_run(req, progress)

    async def capture(shim: Any, work: Path, *a: Any) -> None:
        if work.name in leave_running:
            await wait_event(final_started, wait_s)
        await real_capture(shim, work, *a)

    async def take(lock: Any, key: str, request_id: str) -> Any:
        if request_id in leave_running:
            await wait_event(final_started, wait_s)
        return await real_take(lock, key, request_id)

    step.run = run  # type: ignore[method-assign]
    if before_freeze:
        dumpstamp.take = take
    else:
        pod_dump.capture = capture
    try:
        yield
    finally:
        step.run, pod_dump.capture, dumpstamp.take = real_run, real_capture, real_take  # type: ignore[method-assign]


async def drain(cluster: Cluster, node: str, name: str) -> None:
    """``kubectl drain node`` as these tests play it: the node cordoned, until
    the cordon's checkpoint has frozen the pod, then the pod evicted; returns
    once its replacement is created."""
    await cluster.core.patch_node(node, {"spec": {"unschedulable": True}})
    await until_frozen(cluster)
    await evict(cluster, name)
    await cluster.recreated(name, timeout=120)


def records(gens: list[Any]) -> list[tuple[int, str, bool]]:
    return [(g.number, g.manifest["reason"], g.manifest["leave_running"]) for g in gens]


async def resumes_intact(cluster: Cluster, name: str, a: str, b: str) -> None:
    """Restored on ``b``: the next step after the last on ``a``, its ballast intact."""
    before = steps(cluster.log(name, a))
    cluster.schedule(name, b)
    after = await cluster.until_steps(name, b, 5, timeout=90)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, f"{name}: steps lost after the final checkpoint"
    deadline = time.monotonic() + 30
    while not (checks := re.findall(r"^ballast \d+ (\w+)$", cluster.log(name, b), re.M)):
        assert time.monotonic() < deadline, "the restored ballast never checked its memory"
        await asyncio.sleep(0.2)
    assert set(checks) == {"intact"}, checks


async def test_a_drain_dumps_a_pod_whose_cordon_dump_is_in_flight_once(
        cluster: Cluster, drain_image: Path) -> None:
    """The eviction's final request comes while the cordon's dump holds the
    tree frozen: that dump becomes the final checkpoint, the only one; the
    replacement resumes from it at the next step, its memory intact."""
    a, b = list(cluster.kubelets)
    await start(cluster, drain_image, "drained", a)

    async with in_order(cluster, a, "drained"):
        await drain(cluster, a, "drained")

    gens = await cluster.store.generations("default", "drained.main")
    assert len(gens) == 1, f"the drain dumped the pod {len(gens)} times: {records(gens)}"
    assert "final checkpoint done" in hook_said(cluster, a, "drained")
    m = gens[0].manifest
    assert (m["reason"], m["leave_running"]) == ("drain", False), records(gens)
    assert m.get("final_request_id"), m
    latest = await cluster.store.latest("default", "drained.main")
    assert latest is not None and latest.number == gens[0].number
    # Timings to read, not to assert: the hook, and what one dump of it took
    # (two dumps would take about twice that, and more on a shared link).
    entry = await cluster.bus.kv(KV_TIMINGS).get(timings.key("default", "drained.main"))
    one = float(orjson.loads(entry.value or b"{}").get("seconds", 0.0))
    print(f"\ndrain while the cordon dump is frozen: preStop hook "
          f"{seconds_between(cluster, a, 'drained', 'prestop', 'prestop-done'):.2f}s; "
          f"one dump (freeze to stored) {one:.2f}s, two dumps about {2 * one:.2f}s")
    await resumes_intact(cluster, "drained", a, b)


async def test_a_taken_over_cordon_dump_that_cannot_be_stored_gets_its_own_final_dump(
        cluster: Cluster, drain_image: Path) -> None:
    """The cordon's dump, taken over by the final request, cannot be stored
    (its manifest refused until the commit deadline): its tree runs on, and
    the final request dumps it itself, within the grace; the replacement
    resumes from that final checkpoint."""
    a, b = list(cluster.kubelets)
    await start(cluster, drain_image, "refused", a)
    for o in live(PodCheckpointStep):  # the agents' steps: a short deadline for the test
        o.commit_deadline = 3.0

    async def failing(real: Any, key: str, data: bytes, **kw: Any) -> str:
        # The manifest of the cordon's dump (taken over: its reason is the
        # final's, its request the cordon's) is refused; the final's own passes.
        if key.endswith("manifest.json") and b'"final_request_id"' in data:
            raise StorageError(f"injected: S3 500 on {key}", hint="a test fault")
        return str(await real(key, data, **kw))

    with store_puts_through(cluster, failing):
        async with in_order(cluster, a, "refused"):
            await drain(cluster, a, "refused")

    assert "final checkpoint done" in hook_said(cluster, a, "refused")
    assert not cluster.kubelets[a].did("refused", "KILL"), "it outlived its grace period"
    gens = await cluster.store.generations("default", "refused.main")
    assert [(r, lr) for _, r, lr in records(gens)] == [("drain", False)], records(gens)
    assert "final_request_id" not in gens[0].manifest, "the refused dump was stored"
    await resumes_intact(cluster, "refused", a, b)


async def test_a_final_request_rides_on_its_cordon_dump_when_every_slot_is_taken(
        cluster: Cluster, drain_image: Path) -> None:
    """One checkpoint slot (SMR_CHECKPOINTS_PER_NODE=1), taken by the
    cordon's dump: the final request still starts at once, outside the
    slots, and takes that dump over (waiting for the slot, it would find the
    dump over and dump again). ``in_order`` waits at most 20 s for it."""
    a, b = list(cluster.kubelets)
    worker = next(w for w in cluster.agents[a].workers
                  if isinstance(getattr(w.step, "step", None), PodCheckpointStep))
    worker.concurrency = 1
    await start(cluster, drain_image, "one-slot", a)
    async with in_order(cluster, a, "one-slot", wait_s=20):
        await drain(cluster, a, "one-slot")
    gens = await cluster.store.generations("default", "one-slot.main")
    assert len(gens) == 1, f"the drain dumped the pod {len(gens)} times: {records(gens)}"
    assert (gens[0].manifest["reason"], gens[0].manifest["leave_running"]) == ("drain", False)
    assert "final checkpoint done" in hook_said(cluster, a, "one-slot")
    await resumes_intact(cluster, "one-slot", a, b)


async def test_a_taken_over_dump_left_unstored_by_its_step_is_stored_as_the_final_one(
        cluster: Cluster, drain_image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cordon's step ends (cancelled from inside, as a library's given-up
    call ends it: the worker has it redelivered) after the takeover and the
    dump, before its manifest is stored: its work directory and the marker
    naming the final request stay. The final request, under the lock, stores
    that dump as the final checkpoint, ends the workload and answers the
    hook; the cordon's redelivery stores nothing again. One generation.
    The outcome reaches the hook a second after the workload ends (an agent
    on a loaded node): smr-init, held, waits for it rather than end the
    container and the hook with it."""
    a, b = list(cluster.kubelets)
    await start(cluster, drain_image, "cut", a)
    cut: list[str] = []
    real_final = Shim.final

    def late_final(self: Shim, outcome: str) -> None:
        time.sleep(1)
        real_final(self, outcome)

    monkeypatch.setattr(Shim, "final", late_final)

    async def cut_once(real: Any, key: str, data: bytes, **kw: Any) -> str:
        if key.endswith("manifest.json") and b'"final_request_id"' in data and not cut:
            cut.append(key)
            raise asyncio.CancelledError  # the step ends here, its dump on disk
        return str(await real(key, data, **kw))

    with store_puts_through(cluster, cut_once):
        async with in_order(cluster, a, "cut"):
            await drain(cluster, a, "cut")

    assert cut, "the taken-over dump's manifest was never put"
    gens = await cluster.store.generations("default", "cut.main")
    assert len(gens) == 1, f"the drain stored {len(gens)} generations: {records(gens)}"
    m = gens[0].manifest
    assert (m["reason"], m["leave_running"]) == ("drain", False), records(gens)
    assert "final checkpoint done" in hook_said(cluster, a, "cut")
    await resumes_intact(cluster, "cut", a, b)


async def test_a_cordon_dump_not_yet_frozen_steps_aside_for_the_final_one(
        cluster: Cluster, drain_image: Path) -> None:
    """The final request starts while the cordon's step holds the lock and
    has frozen nothing yet: the cordon's step ends without a dump
    (`taken-over`), and the final request dumps, once."""
    a, b = list(cluster.kubelets)
    await start(cluster, drain_image, "aside", a)
    async with in_order(cluster, a, "aside", before_freeze=True):
        await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
        # The cordon's step holds the lock once its work directory is made.
        work_dir = cluster.agents[a].workers[0].step.step.work_dir
        deadline = time.monotonic() + 60
        while not any(p.is_dir() for p in work_dir.glob("*")):
            assert time.monotonic() < deadline, "the cordon's step never began"
            await asyncio.sleep(0.05)
        await evict(cluster, "aside")
        await cluster.recreated("aside", timeout=120)
    gens = await cluster.store.generations("default", "aside.main")
    assert len(gens) == 1, f"the drain dumped the pod {len(gens)} times: {records(gens)}"
    m = gens[0].manifest
    assert (m["reason"], m["leave_running"]) == ("drain", False), records(gens)
    assert "final_request_id" not in m, "the final request's own dump"
    assert "final checkpoint done" in hook_said(cluster, a, "aside")
    await resumes_intact(cluster, "aside", a, b)


@dataclasses.dataclass
class Held:
    uid: str  # the pod's
    holder: str  # the request that holds its container's lock


@contextlib.asynccontextmanager
async def held_elsewhere(cluster: Cluster, name: str, node: str) -> AsyncIterator[Held]:
    """Pod ``name`` running on ``node``, its container's lock held by a step
    alive elsewhere (its state running, its heartbeat fresh) until the
    context ends; then that step is over and the lock free."""
    cluster.kube.put("pods", workload(name, node, labels=NODE_RESTORE, final_wait=80,
                                      grace=90))
    await cluster.until_steps(name, node, 3)
    pod = cluster.kube.get("pods", name, "default")
    assert pod is not None
    held = Held(pod["metadata"]["uid"], uuid.uuid4().hex)
    key, released = f"pod.{held.uid}.main", asyncio.Event()
    locks, states = cluster.bus.kv(KV_LOCKS), cluster.bus.kv(KV_STEPS)
    beating = asyncio.create_task(hold_lock(cluster.bus, key, held.holder, released))
    try:
        deadline = time.monotonic() + 10
        while await holder_of(cluster, key) != held.holder:
            assert time.monotonic() < deadline, f"{held.holder} never held {key}"
            await asyncio.sleep(0.05)
        yield held
    finally:
        released.set()
        await beating
    await states.put(held.holder, orjson.dumps({"state": "done", "finished": time.time()}))
    await locks.delete(key)


async def holder_of(cluster: Cluster, key: str) -> str | None:
    with contextlib.suppress(KeyNotFoundError):
        value = (await cluster.bus.kv(KV_LOCKS).get(key)).value
        return orjson.loads(value).get("request_id") if value else None
    return None


def heartbeat_of(name: str, node: str, uid: str) -> CkptRequested:
    return CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=f"{name}.main", node=node,
        reason="heartbeat", leave_running=True,
        target=Target(kind="pod", namespace="default", pod=name, container="main",
                      pod_uid=uid))


async def test_a_leave_running_request_waiting_for_the_lock_gives_way_to_the_final_one(
        cluster: Cluster) -> None:
    """A heartbeat's request waits for its container's lock (a live step of
    another agent holds it), and the pod is evicted: its final request waits
    for the same lock. The lock serves its waiters in no order, so the
    heartbeat must not wait on to take it first and make the final one wait
    again, as on a busy node in a drain: it is answered ``taken-over`` while
    the lock is still held, having frozen nothing, and once the lock is free
    the final request dumps the pod, once."""
    a, _ = list(cluster.kubelets)
    async with held_elsewhere(cluster, "waits", a) as held:
        hb = heartbeat_of("waits", a, held.uid)
        await cluster.bus.publish(hb)
        deadline = time.monotonic() + 60
        while ((await cluster.bus.step_state(hb.request_id))[0] or {}).get("phase") \
                != "waiting":
            assert time.monotonic() < deadline, "the heartbeat never waited for the lock"
            await asyncio.sleep(0.2)
        await evict(cluster, "waits")
        done = await cluster.bus.wait_result(hb.request_id, "ckpt.requested", timeout=60)
        assert done.status == "failed" and (done.error or {}).get("code") == "taken-over", \
            done.error
        assert await holder_of(cluster, f"pod.{held.uid}.main") == held.holder, \
            "the lock changed hands before the heartbeat gave way"
    await cluster.recreated("waits", timeout=120)
    assert "final checkpoint done" in hook_said(cluster, a, "waits")
    gens = await cluster.store.generations("default", "waits.main")
    assert records(gens) == [(1, "drain", False)], records(gens)


async def test_a_redelivered_heartbeat_giving_way_leaves_no_unfinished_dump_behind(
        cluster: Cluster) -> None:
    """A heartbeat's first delivery died mid-dump (an agent killed there): its
    work directory holds an unfinished dump. It is delivered again while the
    pod's final request waits for the container's lock, and gives way to it:
    nothing of that dump may stay in the agent's work directory, whose free
    space bounds the dumps that may run."""
    a, _ = list(cluster.kubelets)
    step = cluster.agents[a].workers[0].step.step
    states = cluster.bus.kv(KV_STEPS)
    async with held_elsewhere(cluster, "rv", a) as held:
        await evict(cluster, "rv")
        deadline = time.monotonic() + 60
        while step.flights.final_of(("default", "rv", "main"), "rv.main") is None:
            assert time.monotonic() < deadline, "the final request never started"
            await asyncio.sleep(0.1)
        hb = heartbeat_of("rv", a, held.uid)
        work = step.work(hb.request_id)
        (work / "images").mkdir(parents=True)
        (work / "images" / "pages-1.img").write_bytes(b"\0" * (1 << 20))
        await states.put(hb.request_id, orjson.dumps({
            "state": "running", "owner": "dead@x/1/0", "claim": "c", "heartbeat": 0.0,
            "attempt": 1, "subject": "", "phase": "dump", "checkpoint_id": "rv.main"}))
        await cluster.bus.publish(hb)
        # Its recovery settles, under the lock, what the dead delivery left.
        deadline = time.monotonic() + 60
        while ((await states.get(hb.request_id)).value or b"").find(b"dead@x") >= 0:
            assert time.monotonic() < deadline, "the heartbeat was never delivered again"
            await asyncio.sleep(0.2)
    done = await cluster.bus.wait_result(hb.request_id, "ckpt.requested", timeout=60)
    await cluster.recreated("rv", timeout=120)
    # Given way (the lock's next holder the recovery), or its pod found ended.
    assert done.status == "failed" and (done.error or {}).get("code") in \
        ("taken-over", "job-exited", "pod-not-found", "stale-request"), done.error
    assert "final checkpoint done" in hook_said(cluster, a, "rv")
    assert records(await cluster.store.generations("default", "rv.main")) == \
        [(1, "drain", False)]
    assert not work.exists(), "the unfinished dump was left in the agent's work directory"


async def test_a_hold_left_by_a_step_that_died_after_its_kill_ends_at_the_recovery(
        cluster: Cluster, tmp_path: Path) -> None:
    """A final dump's step that died between killing the workload and
    letting go of smr-init's hold (an agent killed there) leaves smr-init
    waiting on the hold for its minute. The redelivery's recovery, finding
    the workload ended, tells the hook the outcome and lets go of the hold:
    the container ends at once, not a minute later."""
    a, _ = list(cluster.kubelets)
    cluster.kube.put("pods", workload("held", a, final_wait=80, grace=90))
    await cluster.until_steps("held", a, 3, timeout=60)
    step = next(w.step.step for w in cluster.agents[a].workers
                if isinstance(getattr(w.step, "step", None), PodCheckpointStep))
    target = Target(kind="pod", namespace="default", pod="held", container="main")
    c = await step.pods.container(target)
    shim = step.shim_of(c)
    ticks = proc_start_ticks(shim.pid)
    # What the dead step did: the hold taken, the workload killed.
    await asyncio.to_thread(shim.hold, True)
    running = await asyncio.to_thread(shim.workload)
    assert running is not None
    signal_tree(running[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while await asyncio.to_thread(shim.workload) is not None:
        assert time.monotonic() < deadline, "the workload outlived its SIGKILL"
        await asyncio.sleep(0.1)
    work = tmp_path / "work"
    work.mkdir()
    (work / CONTAINER_FILE).write_bytes(orjson.dumps({"container_id": c.container_id}))
    req = CkptRequested(request_id="r1", checkpoint_id="held.main", node=a, target=target,
                        reason="drain", leave_running=False)
    await step._settle_held(req, c, shim, work, signal.SIGKILL, "done 7")
    t0 = time.monotonic()
    while proc_start_ticks(shim.pid) == ticks:
        assert time.monotonic() - t0 < 20, \
            "smr-init still waits on the hold the dead step left (for its minute)"
        await asyncio.sleep(0.1)
