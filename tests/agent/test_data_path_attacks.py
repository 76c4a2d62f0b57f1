"""Sequences on the checkpoint data path that must neither lose, corrupt nor
double a checkpoint, nor answer a stored one failed. Real containerd, runc,
CRIU, nats-server and moto; the kubelet and API server are the repo's fakes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from services.checkpointer import takeover
from services.checkpointer.pod import PodCheckpointStep
from services.containers import host
from services.restorer import launcher
from services.restorer import pod as pod_module
from services.restorer.pod import PodRestoreStep
from services.storage.backend import StorageError
from smr.bus import KV_STEPS
from smr.bus.liveness import StepLocks
from smr.contract.messages import CkptDone, CkptRequested, Target
from smr.process.criu import Criu
from tests.agent.cluster import Cluster, container_id, netns_pid, steps, workload
from tests.agent.test_drain_takeover import in_order
from tests.agent.test_rollout_pods import another_agent
from tests.helpers.live import live


def final(ckpt: str, node: str, pod: str, uid: str | None = None) -> CkptRequested:
    """A final checkpoint request of ``pod``'s container, under its own id (the
    watcher derives one per reason: an eviction and the node's shutdown, or
    the preStop hook retried, each ask for the same container's final)."""
    return CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=node,
                         reason="drain", target=Target(kind="pod", namespace="default",
                                                       pod=pod, container="main",
                                                       pod_uid=uid))


def outcomes(results: list[CkptDone]) -> list[tuple[str, int | None, str | None]]:
    return [(r.status, r.generation, (r.error or {}).get("code")) for r in results]


@contextlib.contextmanager
def latest_lands_then_storage_down(cluster: Cluster) -> Iterator[None]:
    """The ``latest`` write of the store's backend lands, its answer is lost,
    and storage is away from there on."""
    backend: Any = cluster.store.backend
    real = backend.put_bytes, backend.get_bytes, backend.list
    down = False

    def failing(call: Any) -> Any:
        async def storage(key: str, *args: Any, **kw: Any) -> Any:
            nonlocal down
            if down:
                raise StorageError(f"injected: storage down ({key})", hint="a test fault")
            got = await call(key, *args, **kw)
            if call is real[0] and key.rsplit("/", 1)[-1].startswith("latest"):
                down = True
                raise StorageError(f"injected: answer lost ({key})", hint="a test fault")
            return got
        return storage

    backend.put_bytes, backend.get_bytes, backend.list = (failing(c) for c in real)
    try:
        yield
    finally:
        backend.put_bytes, backend.get_bytes, backend.list = real


async def frozen(cluster: Cluster, node: str, target: Target) -> None:
    """Until the leave-running dump of ``target`` in flight on ``node`` holds
    its tree frozen (held stopped for CRIU; its captures wait in ``in_order``)."""
    step = next(w.step.step for w in cluster.agents[node].workers
                if isinstance(getattr(w.step, "step", None), PodCheckpointStep))
    deadline = time.monotonic() + 60
    while (f := step.flights.flight(takeover.key(target))) is None or f.phase != "frozen":
        assert time.monotonic() < deadline, f"the dump never froze its tree: {f}"
        await asyncio.sleep(0.01)


async def running(cluster: Cluster, name: str) -> tuple[str, str]:
    """Pod ``name`` on node a, counting; its node and checkpoint id."""
    a, _ = list(cluster.kubelets)
    ckpt = f"{name}-{uuid.uuid4().hex[:6]}"
    cluster.kube.put("pods", workload(name, a, env={"SMR_CHECKPOINT": ckpt}, owner=ckpt,
                                      restart="Never"))
    await cluster.until_steps(name, a, 3)
    return a, ckpt


async def test_final_checkpoints_asked_for_together_are_all_answered_with_the_one_stored(
        cluster: Cluster) -> None:
    """Three final requests of one container under different ids, sent at
    once: one dumps and ends the workload; the others are answered with that
    same generation, not failed (the final state is stored), and no second
    generation is made."""
    a, ckpt = await running(cluster, "finals")
    results = await asyncio.gather(*(cluster.bus.request(final(ckpt, a, "finals"), timeout=120)
                                     for _ in range(3)))
    gens = await cluster.store.generations("default", ckpt)
    assert outcomes(results) == [("succeeded", 1, None)] * 3, outcomes(results)
    assert [g.number for g in gens] == [1], [g.manifest for g in gens]


async def test_a_final_checkpoint_asked_for_again_after_it_ended_the_workload_is_answered_with_it(
        cluster: Cluster) -> None:
    """A second final request of a container whose final checkpoint is stored
    and whose workload it ended (its smr-init gone, the container exited)
    is answered with that generation, not failed for want of a workload."""
    a, ckpt = await running(cluster, "again")
    first = await cluster.bus.request(final(ckpt, a, "again"), timeout=120)
    assert first.status == "succeeded", first
    second = await cluster.bus.request(final(ckpt, a, "again"), timeout=120)
    assert outcomes([second]) == [("succeeded", first.generation, None)], second
    assert [g.number for g in await cluster.store.generations("default", ckpt)] == \
        [first.generation]


async def test_a_final_checkpoint_the_workload_ran_past_is_no_answer_once_the_workload_ended(
        cluster: Cluster) -> None:
    """A final checkpoint writes ``latest``, but that write's answer is lost
    and storage stays down past the commit deadline: its step answers failed
    and the workload runs on. Once the workload has ended by itself, a later
    final request of the container finds that generation as ``latest`` and no
    workload: it is not answered succeeded with a state the workload ran
    past (nor are the restores it would be taken for told so)."""
    a, ckpt = await running(cluster, "ranpast")
    for step in live(PodCheckpointStep):
        step.commit_deadline = 4.0
    with latest_lands_then_storage_down(cluster):
        first = await cluster.bus.request(final(ckpt, a, "ranpast"), timeout=120)
    assert outcomes([first]) == [("failed", None, "storage-unavailable")], first
    latest = await cluster.store.latest("default", ckpt)
    assert latest is not None and latest.manifest.get("leave_running") is False, latest
    at = len(steps(cluster.log("ranpast", a)))
    await cluster.until_steps("ranpast", a, at + 5)  # it runs on past that generation
    # It ends by itself (as at the kubelet's SIGTERM after the failed final).
    shim = host.find_shim(container_id(cluster, "ranpast"))
    assert shim is not None
    w = shim.workload()
    assert w is not None
    os.kill(w[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while shim.workload() is not None:
        assert time.monotonic() < deadline, "the workload did not end"
        await asyncio.sleep(0.05)
    second = await cluster.bus.request(final(ckpt, a, "ranpast"), timeout=120)
    assert second.status == "failed", (
        f"answered with generation {latest.number}, which the workload ran past: {second}")
    assert second.error and second.error["code"] in ("job-exited", "job-not-running"), \
        second.error


async def test_a_final_checkpoint_asked_for_again_after_its_pod_was_replaced_is_answered_with_it(
        cluster: Cluster) -> None:
    """The watcher's final requests name the pod by uid. One comes after
    the pod's final checkpoint ended it and the pod was replaced by a new one
    of its name (a bare pod recreated): it is answered with the final
    checkpoint of the pod it names, not failed as a stale request."""
    a, ckpt = await running(cluster, "gone")
    before = cluster.kube.get("pods", "gone", "default")
    assert before is not None
    uid = before["metadata"]["uid"]
    first = await cluster.bus.request(final(ckpt, a, "gone", uid), timeout=120)
    assert first.status == "succeeded", first
    cluster.kube.remove("pods", "gone", "default")
    cluster.kube.put("pods", workload("gone", None, env={"SMR_CHECKPOINT": ckpt}, owner=ckpt))
    second = await cluster.bus.request(final(ckpt, a, "gone", uid), timeout=120)
    assert outcomes([second]) == [("succeeded", first.generation, None)], second
    assert [g.number for g in await cluster.store.generations("default", ckpt)] == \
        [first.generation]


async def test_two_final_requests_during_a_takeover_are_both_answered_with_the_taken_over_dump(
        cluster: Cluster) -> None:
    """A leave-running dump of the container is frozen (its captures wait)
    when two final requests of it come, under different ids: the dump is
    finished as the final checkpoint, once; both are answered with it, and
    the lineage holds that dump and no other."""
    a, ckpt = await running(cluster, "twice")
    cordon = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=a,
                           reason="drain", leave_running=True,
                           target=Target(kind="pod", namespace="default", pod="twice",
                                         container="main"))
    async with in_order(cluster, a, "twice"):
        leave = asyncio.create_task(cluster.bus.request(cordon, timeout=120))
        await frozen(cluster, a, cordon.target)
        finals = await asyncio.gather(*(cluster.bus.request(final(ckpt, a, "twice"),
                                                            timeout=120) for _ in range(2)))
        await leave
    gens = await cluster.store.generations("default", ckpt)
    assert outcomes(finals) == [("succeeded", 1, None)] * 2, outcomes(finals)
    assert [(g.number, g.manifest["request_id"], g.manifest["leave_running"]) for g in gens] \
        == [(1, cordon.request_id, False)], [g.manifest for g in gens]


async def test_a_containers_lock_stays_with_a_live_step_whose_heartbeats_lag(
        cluster: Cluster) -> None:
    """A step of a pod container holds the container's lock; its worker is
    alive (its node's step lock held) but its heartbeat is old (its event
    loop stalled, NATS away for it). Another step of that container waits:
    taking the lock over would dump, or kill, the container beside it (a
    second final generation, or a final failed job-exited). Once the
    holder's worker is gone, the lock is taken over."""
    a, _ = list(cluster.kubelets)
    agent = cluster.agents[a]
    step = next(w.step.step for w in agent.workers
                if isinstance(getattr(w.step, "step", None), PodCheckpointStep))
    key, holder = f"pod.{uuid.uuid4()}.main", f"slow-{uuid.uuid4().hex}"
    await cluster.bus.kv(KV_STEPS).put(holder, orjson.dumps(
        {"state": "running", "heartbeat": time.time() - 3600}))
    with StepLocks(agent.s.step_lock_path).hold(holder) as ours:
        assert ours
        await step.lock.acquire(key, holder)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(step.lock.acquire(key, "next"), 3)
        assert await step.lock.holder(key) == holder, "the lock was taken from a live step"
    await asyncio.wait_for(step.lock.acquire(key, "next"), 10)  # its worker gone
    assert await step.lock.holder(key) == "next"


def criu_dumps_in(pid_ns: str) -> int:
    """CRIU dumps running now in the PID namespace ``pid_ns`` (a container's:
    the agent runs its CRIU there)."""
    n = 0
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, UnicodeDecodeError):
            argv = (p / "cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode()).name == "criu" and b"dump" in argv[1:2] \
                    and os.readlink(p / "ns" / "pid") == pid_ns:
                n += 1
    return n


async def test_two_agents_of_one_node_dump_one_container_once_for_finals_sent_together(
        cluster: Cluster) -> None:
    """maxSurge: the old and the new agent of node a both take checkpoint
    requests. Three final requests of one container sent together, in rounds
    (later rounds find it ended): CRIU never dumps it twice at once, one
    generation is stored, and every request is answered with it."""
    a, ckpt = await running(cluster, "both")
    pid_ns = os.readlink(f"/proc/{netns_pid(cluster, 'both')}/ns/pid")
    async with another_agent(cluster.agents[a], cluster) as new:
        await asyncio.wait_for(new.ready.wait(), 60)
        most = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal most
            while not done.is_set():
                most = max(most, criu_dumps_in(pid_ns))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            results = []
            for _ in range(3):
                results += await asyncio.gather(*(cluster.bus.request(
                    final(ckpt, a, "both"), timeout=120) for _ in range(3)))
        finally:
            done.set()
            await watcher
    assert outcomes(results) == [("succeeded", 1, None)] * 9, outcomes(results)
    assert [g.number for g in await cluster.store.generations("default", ckpt)] == [1]
    assert most <= 1, f"{most} CRIU dumps of one container ran at once"


async def test_a_pod_restore_cancelled_as_criu_returns_is_adopted_not_run_again(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent stops (a rollout's old agent, past its grace) as CRIU returns
    from a pod's restore: the step is cancelled with the tree already back in
    the container (a CRIU that outlives its step, which nothing kills, ends
    so too). The redelivered request's recovery adopts that tree: the pod
    goes on from its next step, one copy, never restored a second time."""
    _, b, env, before = await restored_pod(cluster, "cancelled")
    cancelled: list[str] = []
    restores = 0  # CRIU restores begun
    real_criu = Criu.restore  # streamed or from files, the restore comes here

    async def cancelled_as_it_returns(run: Any) -> Any:
        nonlocal restores
        restores += 1
        result = await run
        task = asyncio.current_task()
        assert task is not None
        if not cancelled:
            cancelled.append(task.get_name())
            task.cancel()  # the agent's stop reaches the step here
            await asyncio.sleep(0)
        return result

    monkeypatch.setattr(Criu, "restore", lambda self, *a, **kw: cancelled_as_it_returns(
        real_criu(self, *a, **kw)))
    cluster.kube.put("pods", workload("cx-2", b, env=env, owner="cx", restart="Never"))
    after = await cluster.until_steps("cx-2", b, 5, timeout=90)
    assert cancelled, "the restore was never cancelled: the test proves nothing"
    assert after[0][0] == before[-1][0] + 1, (
        f"not resumed once from step {before[-1][0]}: {after[:3]} (restored again beside "
        "the tree the cancelled step's CRIU brought back, or started over)")
    # One copy: every step once, in order, in the container's log.
    numbers = [s[0] for s in after]
    assert numbers == sorted(set(numbers)), f"two copies ran in the container: {numbers[:20]}"
    # smr-init adopts the tree the recovery found (30 s bounds a hang), and
    # no second restore was ever begun for the container.
    shim = await restoring_shim(b)
    for _ in range(300):
        status = await asyncio.to_thread(shim.status)
        if status[:1] == ["running"] or restores > 1:
            break
        await asyncio.sleep(0.1)
    assert restores == 1, f"the pod was restored {restores} times (smr-init: {status})"
    assert status[:1] == ["running"], f"smr-init was never told of the tree: {status}"


async def restored_pod(cluster: Cluster, prefix: str) -> tuple[str, str, dict[str, str],
                                                                 list[tuple[int, int, str]]]:
    """A pod on the first node with a final checkpoint: what the second
    node's pod restores; its steps before the checkpoint."""
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": f"{prefix}-{uuid.uuid4().hex[:6]}"}
    cluster.kube.put("pods", workload("cx-1", a, env=env, owner="cx", restart="Never"))
    await cluster.until_steps("cx-1", a, 5)
    done = await cluster.bus.request(final(env["SMR_CHECKPOINT"], a, "cx-1"), timeout=60)
    assert done.status == "succeeded", done
    return a, b, env, steps(cluster.log("cx-1", a))


async def restoring_shim(node: str) -> Any:
    [step] = [o for o in live(PodRestoreStep) if o.node == node]
    return step.shim_of(await step.pods.container(
        Target(kind="pod", namespace="default", pod="cx-2", container="main")))


async def test_a_pod_restore_cancelled_after_it_began_but_before_criu_ran_restores_once(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent stops after the restore marked its start but before any
    CRIU ran (no tree in the container, the work directory kept): the
    redelivered request restores the pod once and it goes on, one copy."""
    _, b, env, before = await restored_pod(cluster, "began")
    cancelled: list[str] = []
    criu_runs = 0  # CRIU restores that ran
    real_criu = Criu.restore

    async def cancelled_before_criu(run: Any) -> Any:
        nonlocal criu_runs
        task = asyncio.current_task()
        assert task is not None
        if not cancelled:
            cancelled.append(task.get_name())
            run.close()  # no CRIU: nothing comes back into the container
            task.cancel()
            await asyncio.sleep(0)
        criu_runs += 1
        return await run

    monkeypatch.setattr(Criu, "restore", lambda self, *a, **kw: cancelled_before_criu(
        real_criu(self, *a, **kw)))
    cluster.kube.put("pods", workload("cx-2", b, env=env, owner="cx", restart="Never"))
    after = await cluster.until_steps("cx-2", b, 5, timeout=90)
    assert cancelled, "the restore was never cancelled: the test proves nothing"
    assert after[0][0] == before[-1][0] + 1, f"not resumed from step {before[-1][0]}: {after[:3]}"
    numbers = [s[0] for s in after]
    assert numbers == sorted(set(numbers)), f"two copies ran in the container: {numbers[:20]}"
    shim = await restoring_shim(b)
    for _ in range(300):
        status = await asyncio.to_thread(shim.status)
        if status[:1] == ["running"]:
            break
        await asyncio.sleep(0.1)
    assert criu_runs == 1, f"CRIU restored the pod {criu_runs} times (smr-init: {status})"
    assert status[:1] == ["running"], f"smr-init was never told of the tree: {status}"


async def test_a_pod_restore_recovery_leaves_the_tenants_own_process_named_criu_alone(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A process of the tenant's in its container is named ``criu`` (its own
    tool, or one run by kubectl exec) as the agent stops mid-restore: the
    recovery, which waits for the agent's own CRIU to end, neither waits for
    it (a name proves nothing) nor kills it (it is the tenant's)."""
    _, b, env, before = await restored_pod(cluster, "named")
    cancelled: list[str] = []
    tenant: list[subprocess.Popen[bytes]] = []
    named = tmp_path / "criu"  # the tenant's program, called criu
    named.symlink_to("/bin/sleep")
    real_criu = Criu.restore
    recovered: list[str] = []  # what each recovery answered
    real_recover = PodRestoreStep.recover

    async def recovery(self: PodRestoreStep, req: Any, state: Any) -> Any:
        result = await real_recover(self, req, state)
        recovered.append(str(result and result.status))
        return result

    monkeypatch.setattr(PodRestoreStep, "recover", recovery)

    async def cancelled_as_it_returns(run: Any) -> Any:
        result = await run
        task = asyncio.current_task()
        assert task is not None
        if not cancelled:
            cancelled.append(task.get_name())
            shim = await restoring_shim(b)
            tenant.append(await asyncio.to_thread(run_in_pid_ns, shim.pid, named))
            for _ in range(50):  # until it runs in the container's PID namespace
                if any(tenant_named_criu(shim.pid)):
                    break
                await asyncio.sleep(0.1)
            task.cancel()
            await asyncio.sleep(0)
        return result

    monkeypatch.setattr(Criu, "restore", lambda self, *a, **kw: cancelled_as_it_returns(
        real_criu(self, *a, **kw)))
    try:
        cluster.kube.put("pods", workload("cx-2", b, env=env, owner="cx", restart="Never"))
        after = await cluster.until_steps("cx-2", b, 5, timeout=90)
        assert cancelled, "the restore was never cancelled: the test proves nothing"
        assert after[0][0] == before[-1][0] + 1, f"not resumed once: {after[:3]}"
        shim = await restoring_shim(b)
        for _ in range(300):  # the redelivery's recovery (after stale_after), 30 s
            if recovered:
                break
            await asyncio.sleep(0.1)
        assert recovered, ("no recovery answered within 30 s beside the tenant's own process "
                           "named criu (a wait for it would hold SMR_CRIU_TIMEOUT, 600 s)")
        assert tenant_named_criu(shim.pid), (
            "the agent killed the tenant's own process named criu in its container "
            f"(nsenter's exit: {tenant[0].poll()}; the recovery answered {recovered})")
    finally:
        for p in tenant:
            with contextlib.suppress(ProcessLookupError):
                for q in tenant_named_criu_pids():
                    os.kill(q, 9)
                p.kill()
            p.wait()


def agents_criu_restoring(pid: int) -> list[int]:
    """The agent's CRIU restoring into the container of ``pid`` (its
    smr-init): run by the dynamic loader through /proc/self/fd, as
    services.containers.incontainer runs it, so named by no ``criu``."""
    ns = os.readlink(f"/proc/{pid}/ns/pid")
    found = []
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if not p.name.isdigit() or os.readlink(p / "ns" / "pid") != ns:
                continue
            argv = (p / "cmdline").read_bytes().split(b"\0")
            if argv[0].startswith(b"/proc/self/fd/") and b"restore" in argv:
                found.append(int(p.name))
    return found


async def test_a_pod_restore_cancelled_while_criu_runs_is_waited_for_not_restored_again(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent stops while CRIU restores a pod (the step is cancelled; its
    CRIU, which nothing kills, runs on, here held stopped for a few seconds,
    as a loaded node or a large image makes it). The redelivered request's
    recovery must wait for that CRIU (by the process the agent ran it
    through) and adopt its tree;
    it must not find "no tree" at once and restore a second time beside it."""
    _, b, env, _ = await restored_pod(cluster, "midcriu")
    cancelled: list[int] = []  # the agent's CRIU, held stopped
    restores = 0
    at_wait_end: list[list[int]] = []  # the agent's CRIU still there as a wait returned
    held: list[tuple[Path, bytes]] = []  # the image CRIU waits on, and its bytes
    real_criu = Criu.restore
    real_wait = launcher.wait_exit

    def feed(fifo: Path, data: bytes) -> None:
        with open(fifo, "wb") as f:  # CRIU's open of it returns
            f.write(data)
        kept = fifo.with_name("held-" + fifo.name)
        kept.write_bytes(data)
        os.replace(kept, fifo)  # a second open finds the file itself

    def go_on() -> None:
        for q in cancelled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(q, signal.SIGCONT)
        if held:  # once: a second feed would find the images gone with the restore
            threading.Thread(target=feed, args=held.pop(), daemon=True).start()

    async def waited(launcher: int, ticks: int, timeout: float) -> bool:
        asyncio.get_running_loop().call_later(5, go_on)  # CRIU runs on 5 s on
        shim = await restoring_shim(b)
        gone = await real_wait(launcher, ticks, min(timeout, 30.0))
        running = []
        with contextlib.suppress(OSError):
            running = agents_criu_restoring(shim.pid)
        at_wait_end.append([q for q in cancelled if q in running])
        return gone

    async def cancelled_mid_criu(images: Path, run: Any) -> Any:
        nonlocal restores
        restores += 1
        if not cancelled:
            # CRIU's first image a FIFO: CRIU is held in its open, mid-run,
            # however fast it would restore.
            image = images / "inventory.img"
            held.append((image, image.read_bytes()))
            image.unlink()
            os.mkfifo(image)
        inner = asyncio.ensure_future(run)
        task = asyncio.current_task()
        assert task is not None
        if not cancelled:
            shim = await restoring_shim(b)
            for _ in range(3000):
                if (pids := agents_criu_restoring(shim.pid)) or inner.done():
                    break
                await asyncio.sleep(0.01)
            assert pids, f"no CRIU was seen restoring: the test proves nothing ({inner})"
            # The step's wait for CRIU ends first (and with it unstop's
            # watch, which would continue a CRIU held stopped).
            inner.cancel()
            await asyncio.wait([inner])
            for q in pids:
                os.kill(q, signal.SIGSTOP)
            cancelled.extend(pids)
            task.cancel()  # the agent's stop reaches the step mid-CRIU
            await asyncio.sleep(0)
        return await inner

    monkeypatch.setattr(launcher, "wait_exit", waited)
    # From files: a streamed CRIU reads pipes the cancelled step's streamer
    # fed, which an agent that stops closes as it exits (this one lives on).
    monkeypatch.setattr(pod_module, "streamable", lambda manifest: False)
    monkeypatch.setattr(Criu, "restore", lambda self, images, *a, **kw: cancelled_mid_criu(
        images, real_criu(self, images, *a, **kw)))
    try:
        cluster.kube.put("pods", workload("cx-2", b, env=env, owner="cx", restart="Never"))
        for _ in range(900):  # the redelivery's recovery (after stale_after)
            if at_wait_end or restores > 1:
                break
            await asyncio.sleep(0.1)
        assert cancelled, "the restore was never cancelled mid-CRIU: the test proves nothing"
        assert at_wait_end, (
            f"no recovery waited for the cancelled step's CRIU; CRIU restores begun: {restores}")
        assert not at_wait_end[0], (
            f"the recovery stopped waiting while the cancelled step's CRIU {at_wait_end[0]} "
            "was still restoring")
        assert restores == 1, f"the pod was restored {restores} times"
    finally:
        go_on()


def run_in_pid_ns(pid: int, program: Path) -> subprocess.Popen[bytes]:
    """``program`` in the PID namespace of ``pid``, as kubectl exec runs one."""
    return subprocess.Popen(["nsenter", "-t", str(pid), "-p", "--", str(program), "600"])


def tenant_named_criu(pid: int) -> list[int]:
    ns = os.readlink(f"/proc/{pid}/ns/pid")
    return [q for q in tenant_named_criu_pids() if os.readlink(f"/proc/{q}/ns/pid") == ns]


def tenant_named_criu_pids() -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if p.name.isdigit() and (p / "cmdline").read_bytes().split(b"\0")[0].endswith(
                    b"/criu") and (p / "cmdline").read_bytes().split(b"\0")[1] == b"600":
                found.append(int(p.name))
    return found


async def test_a_pod_deleted_after_its_restore_was_cancelled_mid_criu_leaves_no_work_directory(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent stops as CRIU returns from a pod's restore (its work
    directory kept for the recovery), and the pod is deleted before the
    redelivery: the recovery finds no container, and the directory (the
    pod's writable layer) must not stay on the node for ever."""
    _, b, env, _ = await restored_pod(cluster, "deleted")
    cancelled: list[Path] = []
    recovered: list[str] = []
    real_criu = Criu.restore
    real_recover = PodRestoreStep.recover

    async def recovery(self: PodRestoreStep, req: Any, state: Any) -> Any:
        try:
            result = await real_recover(self, req, state)
        except BaseException as e:
            recovered.append(type(e).__name__)
            raise
        recovered.append(str(result and result.status))
        return result

    async def cancelled_as_it_returns(run: Any, images: Path) -> Any:
        result = await run
        task = asyncio.current_task()
        assert task is not None
        if not cancelled:
            cancelled.append(images.parent)
            task.cancel()
            await asyncio.sleep(0)
        return result

    monkeypatch.setattr(PodRestoreStep, "recover", recovery)
    monkeypatch.setattr(Criu, "restore", lambda self, images, *a, **kw: cancelled_as_it_returns(
        real_criu(self, images, *a, **kw), Path(images)))
    cluster.kube.put("pods", workload("cx-2", b, env=env, owner="cx", restart="Never"))
    for _ in range(600):
        if cancelled:
            break
        await asyncio.sleep(0.1)
    assert cancelled, "the restore was never cancelled: the test proves nothing"
    cluster.kube.remove("pods", "cx-2", "default")
    for _ in range(900):  # the redelivery's recovery (after stale_after)
        if recovered:
            break
        await asyncio.sleep(0.1)
    assert recovered, "the request was never recovered: the test proves nothing"
    await asyncio.sleep(1)
    work = cancelled[0]
    assert not work.exists(), (
        f"the deleted pod's restore work directory stays on the node after its recovery "
        f"answered {recovered}: {work} holds {sorted(p.name for p in work.iterdir())}")
