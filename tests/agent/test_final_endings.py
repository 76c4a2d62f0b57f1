"""A pod's final checkpoint whose ``latest`` write landed unbeknown to its
step (the answer lost, storage then away past the commit deadline), so that
its workload ran on past it: no recovery, re-run, takeover or second agent
of the node answers ``succeeded`` with that generation, or ends the workload
by it; a final that did end its workload is still the answer of the node's
other agent (services/checkpointer/endings.py). Real containerd, runc, CRIU,
nats-server and moto; the kubelet and API server are the repo's fakes. The
agent dying is a step's ``run`` left unanswered, then its ``recover``. And
the other way round: a final stored before its agent died, its workload held
until the kubelet ended it, is every request's answer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from services.agent.service import NodeAgent
from services.checkpointer import endings
from services.checkpointer import pod as pod_module
from services.checkpointer.pod import PodCheckpointStep
from services.containers import host
from smr.bus import Progress
from smr.contract.errors import SmrError
from smr.contract.messages import CkptDone, CkptRequested, Target
from tests.agent.cluster import Cluster, container_id, steps
from tests.agent.test_data_path_attacks import final, latest_lands_then_storage_down, running
from tests.agent.test_pod_recovery_order import dying_after_dump
from tests.helpers.live import live


def step_of(agent: NodeAgent) -> PodCheckpointStep:
    return next(w.step.step for w in agent.workers
                if isinstance(getattr(w.step, "step", None), PodCheckpointStep))


async def outcome(coro: Any) -> Any:
    try:
        r = await coro
    except SmrError as e:
        return ("raised", e.code)
    assert isinstance(r, CkptDone) or r is None
    return r if r is None else (r.status, r.generation, (r.error or {}).get("code"))


async def storage_unavailable_final(cluster: Cluster, step: PodCheckpointStep, name: str,
                                    a: str, ckpt: str) -> tuple[Any, int, int]:
    """Final R fails storage-unavailable with latest on its generation; the
    workload runs on. Its agent dies before the failure is answered (the
    step's exception is never recorded). Returns R, gen1, steps at SIGCONT."""
    for s in live(PodCheckpointStep):
        s.commit_deadline = 4.0
    r = final(ckpt, a, name)
    with latest_lands_then_storage_down(cluster):
        got = await outcome(step.run(r, Progress()))
    assert got == ("raised", "storage-unavailable"), got
    latest = await cluster.store.latest("default", ckpt)
    assert latest is not None and latest.manifest.get("leave_running") is False
    at = len(steps(cluster.log(name, a)))
    await cluster.until_steps(name, a, at + 8)  # it runs on past gen1
    return r, latest.number, at


async def test_a_final_whose_agent_died_after_letting_it_run_on_is_recovered_failed(
        cluster: Cluster) -> None:
    """Final R fails after ``latest`` moved to its dump unbeknown to it; its
    workload runs on, and its agent dies before answering. R's recovery
    answers failed (ran-on), leaves the workload running and makes no new
    generation: run again under R's id, its idempotent commit would come back
    with the generation the workload ran past, and end the workload by it."""
    a, ckpt = await running(cluster, "rerun")
    step = step_of(cluster.agents[a])
    r, gen1, _ = await storage_unavailable_final(cluster, step, "rerun", a, ckpt)
    rec = await outcome(step.recover(r, {"state": "running", "heartbeat": 0}))
    assert rec == ("failed", None, "ran-on"), rec
    n = len(steps(cluster.log("rerun", a)))
    await cluster.until_steps("rerun", a, n + 5)  # still running
    assert [g.number for g in await cluster.store.generations("default", ckpt)] == [gen1]


async def test_a_final_run_past_is_recovered_failed_by_a_new_agent_pod(
        cluster: Cluster, tmp_path: Path) -> None:
    """As above, but a rollout's new agent recovers R: its work directory is
    its pod's own (an emptyDir, deploy/kustomize), without the old one's
    dump or mark. Nothing there says the workload was held since the dump:
    answered failed, not succeeded with it, the workload left running."""
    a, ckpt = await running(cluster, "newpod")
    old = cluster.agents[a]
    new = NodeAgent(old.starts.bus, old.pods.core.api_client, cluster.store,
                    old.s.replace(work_dir=str(tmp_path / "work-new-agent-pod")))
    r, gen1, _ = await storage_unavailable_final(cluster, step_of(old), "newpod", a, ckpt)
    rec = await outcome(step_of(new).recover(r, {"state": "running", "heartbeat": 0}))
    n1 = len(steps(cluster.log("newpod", a)))
    await asyncio.sleep(1.5)
    n2 = len(steps(cluster.log("newpod", a)))
    assert rec == ("failed", None, "final-unconfirmed"), (
        f"the new agent's recovery answered R {rec} (generation {gen1} was run past; "
        f"steps {n1}->{n2})")
    assert n2 > n1, "the workload stopped"


async def test_a_final_that_ended_the_workload_is_the_other_agent_pods_answer_too(
        cluster: Cluster, tmp_path: Path) -> None:
    """A rollout's surge: two agent pods on the node, each with a work
    directory of its own, sharing the node's directory. The old agent's final
    ends the workload; a second final request of the container (the watcher's
    other reason, the hook retried) taken by the new agent is answered with
    that generation too, as by the old one."""
    a, ckpt = await running(cluster, "surge")
    old = cluster.agents[a]
    new = NodeAgent(old.starts.bus, old.pods.core.api_client, cluster.store,
                    old.s.replace(work_dir=str(tmp_path / "work-new-agent-pod")))
    uid = cluster.kube.get("pods", "surge", "default")["metadata"]["uid"]  # type: ignore[index]
    first = await outcome(step_of(old).run(final(ckpt, a, "surge", uid), Progress()))
    assert first[0] == "succeeded", first
    shim = host.find_shim(container_id(cluster, "surge"))
    deadline = time.monotonic() + 10
    while shim is not None and shim.workload() is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    by_old = await outcome(step_of(old).run(final(ckpt, a, "surge", uid), Progress()))
    by_new = await outcome(step_of(new).run(final(ckpt, a, "surge", uid), Progress()))
    assert by_old == first, by_old
    assert by_new == first, (
        f"the other agent pod answered {by_new}; the first final {first} did end the "
        "workload")


async def test_a_final_whose_taken_over_dump_was_run_past_is_recovered_from_its_own_dump(
        cluster: Cluster, monkeypatch: Any) -> None:
    """Heartbeat H is frozen when final F comes: F takes H's dump over. H's
    ``latest`` write lands, its answer is lost, storage stays away past the
    deadline: H fails and its workload runs on. F dumps the running workload
    itself (storage back), and its agent dies after that dump, before storing
    it. F's recovery stores F's own dump and ends the workload by it; H's
    generation (which names F its final request) is run past, never the answer."""
    import uuid

    from services.checkpointer import dumpstamp, endings
    from smr.contract.messages import CkptRequested, Target
    from tests.agent.test_data_path_attacks import frozen as frozen_dump
    from tests.agent.test_drain_takeover import in_order

    a, ckpt = await running(cluster, "tko")
    for s in live(PodCheckpointStep):
        s.commit_deadline = 4.0
    step = step_of(cluster.agents[a])
    target = Target(kind="pod", namespace="default", pod="tko", container="main")
    h = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=a,
                      reason="drain", leave_running=True, target=target)
    f = final(ckpt, a, "tko")
    backend: Any = cluster.store.backend
    real = backend.put_bytes, backend.get_bytes, backend.list
    marks: dict[str, int] = {}

    real_note = endings.note_ran_on

    async def note(work_dir: Path, rid: str) -> None:
        backend.put_bytes, backend.get_bytes, backend.list = real  # storage back
        marks["sigcont"] = len(steps(cluster.log("tko", a)))
        await real_note(work_dir, rid)

    monkeypatch.setattr(endings, "note_ran_on", note)
    real_take = dumpstamp.take

    async def take(lock: Any, key: str, request_id: str) -> Any:
        if request_id == f.request_id:  # F's own dump: let the workload run on a bit
            n = len(steps(cluster.log("tko", a)))
            await cluster.until_steps("tko", a, n + 5)
            marks["f_dump"] = len(steps(cluster.log("tko", a)))
        return await real_take(lock, key, request_id)

    monkeypatch.setattr(dumpstamp, "take", take)
    real_commit = step.store.commit
    monkeypatch.setattr(step.store, "commit", dying_after_dump(step, f.request_id))
    with latest_lands_then_storage_down(cluster):
        async with in_order(cluster, a, "tko"):
            h_task = asyncio.create_task(step.run(h, Progress()))
            await frozen_dump(cluster, a, target)
            f_task = asyncio.create_task(step.run(f, Progress()))
            h_out = await outcome(h_task)
            try:
                f_out: Any = await f_task
            except asyncio.CancelledError:
                f_out = "agent died after F's dump"
    monkeypatch.setattr(step.store, "commit", real_commit)
    latest = await cluster.store.latest("default", ckpt)
    assert h_out == ("raised", "storage-unavailable"), h_out
    assert f_out == "agent died after F's dump", f_out
    assert latest is not None and latest.manifest.get("final_request_id") == f.request_id
    rec = await outcome(step.recover(f, {"state": "running", "heartbeat": 0}))
    gens = [(g.number, g.manifest["request_id"]) for g in
            await cluster.store.generations("default", ckpt)]
    h_gen = next(n for n, rid in gens if rid == h.request_id)
    f_gen = next((n for n, rid in gens if rid == f.request_id), None)
    assert f_gen is not None and rec == ("succeeded", f_gen, None), (
        f"F's recovery answered {rec}, not with its own dump; H's generation {h_gen} "
        f"was run past ({marks}); stored: {gens}")


class Died(BaseException):
    """The agent killed (SIGKILL): nothing after this point runs."""


async def kubelet_kills(cluster: Cluster, name: str) -> None:
    """The grace period over: the container ends, its held workload with it."""
    cid = container_id(cluster, name)
    shim = host.find_shim(cid)
    if shim is not None:  # else ended already
        os.kill(shim.pid, signal.SIGKILL)  # pid 1 of the container: the whole container ends
    deadline = time.monotonic() + 20
    while host.find_shim(cid) is not None or host.pids_of(cid):
        assert time.monotonic() < deadline, "the container did not end"
        await asyncio.sleep(0.1)


def die_before_record(monkeypatch: Any, step: PodCheckpointStep,
                      rid_of_dump: str) -> dict[str, Any]:
    """The agent SIGKILLed once the final dump of ``rid_of_dump`` is stored
    and ``latest`` moved, before it records the ending and kills: nothing
    after runs, its work directory stays."""
    seen: dict[str, Any] = {}
    real_drop = step._drop
    real_sig = pod_module.signal_tree

    def sig(pid: int, signum: int) -> None:
        # The agent dies after the commit, before its record and the kill.
        if signum == signal.SIGKILL and not seen.get("dying"):
            seen["dying"] = True
            raise Died
        real_sig(pid, signum)

    async def drop(work: Path) -> None:
        if seen.get("dying") and work.name == rid_of_dump:
            return  # a SIGKILLed agent leaves its work directory
        await real_drop(work)

    real_note = endings.note_end

    async def note_end(node_dir: Path, ns: str, ckpt: str, gen: int) -> None:
        return None  # died before it
    monkeypatch.setattr(endings, "note_end", note_end)
    monkeypatch.setattr(pod_module, "signal_tree", sig)
    monkeypatch.setattr(step, "_drop", drop)

    def undo() -> None:
        monkeypatch.setattr(endings, "note_end", real_note)
        monkeypatch.setattr(pod_module, "signal_tree", real_sig)
        monkeypatch.setattr(step, "_drop", real_drop)
    seen["undo"] = undo
    return seen


async def test_a_final_stored_before_its_agent_died_answers_a_second_final_before_its_recovery(
        cluster: Cluster, monkeypatch: Any) -> None:
    """F1 is stored and ``latest`` moved; its agent dies before it records
    the ending and kills; the kubelet ends the held container. F2, a second
    final request, comes before F1's recovery (F1's lock is free at once, its
    redelivery waits): the workload was held from F1's dump to its end, so F2
    is answered with F1's generation, as are F1's recovery and a later F3."""
    a, ckpt = await running(cluster, "dbr")
    step = step_of(cluster.agents[a])
    uid = cluster.kube.get("pods", "dbr", "default")["metadata"]["uid"]  # type: ignore[index]
    f1 = final(ckpt, a, "dbr", uid)
    seen = die_before_record(monkeypatch, step, f1.request_id)
    try:
        await step.run(f1, Progress())
        raise AssertionError("F1 did not die")
    except Died:
        pass
    seen["undo"]()
    latest = await cluster.store.latest("default", ckpt)
    assert latest is not None
    seen["gen"] = latest.number
    assert (step.work(f1.request_id) / "images").is_dir(), "work dir kept"
    await kubelet_kills(cluster, "dbr")  # the grace period ran out meanwhile
    f2 = final(ckpt, a, "dbr", uid)
    by_f2 = await outcome(step.run(f2, Progress()))
    rec_f1 = await outcome(step.recover(f1, {"state": "running", "heartbeat": 0}))
    f3 = final(ckpt, a, "dbr", uid)
    by_f3 = await outcome(step.run(f3, Progress()))
    gens = [g.number for g in await cluster.store.generations("default", ckpt)]
    assert by_f2 == ("succeeded", seen["gen"], None), (
        f"F2 answered {by_f2}; generation {seen['gen']} ended the workload "
        f"(F1's recovery then answered {rec_f1}, F3 {by_f3})")
    assert rec_f1 == by_f3 == by_f2, (rec_f1, by_f3)
    assert gens == [seen["gen"]], gens


async def test_a_final_whose_taken_over_dump_ended_the_workload_is_recovered_with_it(
        cluster: Cluster, monkeypatch: Any) -> None:
    """Heartbeat H is frozen when final F takes its dump over; H's step
    stores it (``final_request_id`` F), and the agent dies before it records
    the ending and kills; the kubelet ends the held container. F's recovery,
    before H's, answers with that generation: the workload was held from
    the dump to its end."""
    from tests.agent.test_data_path_attacks import frozen as frozen_dump
    from tests.agent.test_drain_takeover import in_order

    a, ckpt = await running(cluster, "tkd")
    step = step_of(cluster.agents[a])
    uid = cluster.kube.get("pods", "tkd", "default")["metadata"]["uid"]  # type: ignore[index]
    target = Target(kind="pod", namespace="default", pod="tkd", container="main",
                    pod_uid=uid)
    h = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=a,
                      reason="drain", leave_running=True, target=target)
    f = final(ckpt, a, "tkd", uid)
    seen = die_before_record(monkeypatch, step, h.request_id)
    async with in_order(cluster, a, "tkd"):
        h_task = asyncio.create_task(step.run(h, Progress()))
        await frozen_dump(cluster, a, target)
        f_task = asyncio.create_task(step.run(f, Progress()))
        while not seen.get("dying"):
            await asyncio.sleep(0.01)
            if h_task.done():
                break
        f_task.cancel()  # the agent died: F's step with it
        try:
            await h_task
        except Died:
            pass
        with contextlib.suppress(BaseException):
            await f_task
    seen["undo"]()
    latest = await cluster.store.latest("default", ckpt)
    assert latest is not None and latest.manifest.get("final_request_id") == f.request_id, \
        latest and latest.manifest
    seen["gen"] = latest.number
    await kubelet_kills(cluster, "tkd")
    rec_f = await outcome(step.recover(f, {"state": "running", "heartbeat": 0}))
    run_f = await outcome(step.run(f, Progress())) if rec_f is None else None
    rec_h = await outcome(step.recover(h, {"state": "running", "heartbeat": 0}))
    assert rec_f == ("succeeded", seen["gen"], None) or \
        run_f == ("succeeded", seen["gen"], None), (
        f"F (whose takeover dump, generation {seen['gen']}, ended the workload) answered "
        f"recover={rec_f} run={run_f}; H's recovery then {rec_h}")
