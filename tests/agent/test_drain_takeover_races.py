"""Sequences around a final request taking over a leave-running dump in flight
(services/checkpointer/takeover) that must still leave the pod's lineage
with a durable final checkpoint, the replacement resuming from it. Real
containerd, runc, CRIU, nats-server and moto; the kubelet and API server are
the repo's fakes. ``in_order`` (tests/agent/test_drain_takeover.py) makes
the order certain: the leave-running dump's captures wait, its tree frozen,
until the final request's step has started."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.checkpointer import pod_dump, takeover
from services.checkpointer.pod import PodCheckpointStep
from services.storage.backend import StorageError
from services.storage.layout import template_id
from smr.bus import Progress
from smr.contract.errors import PermanentError
from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import Cluster, assert_continues, steps, workload
from tests.agent.test_drain_takeover import (
    _ballast_pids,
    _state,
    drain,
    drain_image,  # noqa: F401  (a fixture)
    in_order,
    records,
    resumes_intact,
    start,
    until_frozen,
)
from tests.agent.test_kubelet import evict, hook_said
from tests.helpers.live import live

NODE_RESTORE = {"smr.dev/node-restore": "true"}


def template_request(cluster: Cluster, pod: str, node: str, template: str) -> CkptRequested:
    """A snapshot-when-ready template dump of ``pod``'s container, as the
    watcher asks for one: leave-running, into the template's own lineage."""
    p = cluster.kube.get("pods", pod, "default")
    assert p is not None, f"pod {pod} is not there"
    return CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=template, node=node, reason="template",
        leave_running=True,
        target=Target(kind="pod", namespace="default", pod=pod, container="main",
                      pod_uid=p["metadata"]["uid"]))


async def test_a_final_during_a_template_dump_of_another_lineage_stores_the_pods_final(
        cluster: Cluster, drain_image: Path) -> None:  # noqa: F811
    """A snapshot-when-ready template dump (leave-running, its own checkpoint
    id) is frozen when the pod is evicted: the final checkpoint must land in
    the pod's own lineage, where its replacement restores from, not in the
    template's."""
    a, b = list(cluster.kubelets)
    await start(cluster, drain_image, "templated", a)
    tmpl = template_id("warm", "main")
    req = template_request(cluster, "templated", a, tmpl)

    async with in_order(cluster, a, "templated"):
        await cluster.bus.publish(req)
        await until_frozen(cluster)
        await evict(cluster, "templated")
        await cluster.recreated("templated", timeout=120)

    assert "final checkpoint done" in hook_said(cluster, a, "templated")
    own = await cluster.store.generations("default", "templated.main")
    shared = await cluster.store.generations("default", tmpl)
    assert [(r, lr) for _, r, lr in records(own)] == [("drain", False)], \
        f"the pod's lineage holds {records(own)}; the template's {records(shared)}"
    await resumes_intact(cluster, "templated", a, b)


@pytest.mark.parametrize("first", ["final", "leave-running"])
async def test_an_agent_dying_after_a_takeover_stores_one_final_whichever_request_comes_back_first(
        cluster: Cluster, drain_image: Path, first: str) -> None:  # noqa: F811
    """The final request has taken over the frozen leave-running dump (its
    marker written); the agent dies before storing it, both steps cut off.
    Redelivered (the worker's recover(), then run() where that answers
    nothing), in either order: one generation, the final one, both requests
    answered with it, the workload ended."""
    a = next(iter(cluster.kubelets))
    await start(cluster, drain_image, "crashed", a)
    [step] = [o for o in live(PodCheckpointStep) if o.node == a]
    p = cluster.kube.get("pods", "crashed", "default")
    assert p is not None
    target = Target(kind="pod", namespace="default", pod="crashed", container="main",
                    pod_uid=p["metadata"]["uid"])
    lr = CkptRequested(request_id=f"cordon-{uuid.uuid4().hex[:8]}", checkpoint_id="crashed.main",
                       node=a, reason="cordon", leave_running=True, target=target)
    final = CkptRequested(request_id=f"final-{uuid.uuid4().hex[:8]}",
                          checkpoint_id="crashed.main", node=a, reason="drain",
                          leave_running=False, target=target)
    final_started = asyncio.Event()
    real_capture, real_commit = pod_dump.capture, step.store.commit
    final_task: asyncio.Task[Any] | None = None

    async def capture(shim: Any, work: Path, *args: Any) -> None:
        if work.name == lr.request_id:
            await asyncio.wait_for(final_started.wait(), 60)
        await real_capture(shim, work, *args)

    async def die_after_dump(ns: str, ckpt: str, src: Path, meta: dict[str, Any], *,
                             writer: Any = None, on_bytes: Any = None) -> Any:
        if meta["request_id"] == lr.request_id:
            await writer
            assert final_task is not None
            final_task.cancel()  # the agent dies: both steps end here
            raise asyncio.CancelledError
        return await real_commit(ns, ckpt, src, meta, writer=writer, on_bytes=on_bytes)

    pod_dump.capture, step.store.commit = capture, die_after_dump  # type: ignore[method-assign]
    try:
        leave = asyncio.create_task(step.run(lr, Progress()))
        await until_frozen(cluster)
        dumped = _ballast_pids(cluster)
        final_task = asyncio.create_task(step.run(final, Progress()))
        await asyncio.sleep(0.5)  # its step has started: it sees the dump frozen
        final_started.set()
        for t in (leave, final_task):
            with pytest.raises(asyncio.CancelledError):
                await t
    finally:
        pod_dump.capture, step.store.commit = real_capture, real_commit  # type: ignore[method-assign]

    state = {"state": "running", "heartbeat": 0}

    async def redeliver(req: CkptRequested) -> tuple[str, int | None]:
        try:  # as the worker answers it
            d = await step.recover(req, state) or await step.run(req, Progress())
        except PermanentError as e:
            return f"failed {e.code}: {e}", None
        return d.status, d.generation

    got: dict[str, tuple[str, int | None]] = {}
    if first == "final":
        got[final.request_id] = await redeliver(final)
        got[lr.request_id] = await redeliver(lr)
    else:
        got[lr.request_id] = await redeliver(lr)
        # Its hook told done, the kubelet ends the pod (as after an
        # eviction) before the final request comes back.
        cluster.kube.remove("pods", "crashed", "default")
        got[final.request_id] = await redeliver(final)
    gens = await cluster.store.generations("default", "crashed.main")
    assert [(r, lr_) for _, r, lr_ in records(gens)] == [("drain", False)], records(gens)
    assert gens[0].manifest.get("final_request_id") == final.request_id, gens[0].manifest
    assert got == {final.request_id: ("succeeded", gens[0].number),
                   lr.request_id: ("succeeded", gens[0].number)}, got
    # The dumped tree ended (the kubelet may start the container again
    # meanwhile: no eviction holds it here).
    deadline = time.monotonic() + 30  # a SIGKILLed tree of 384 MiB takes a moment
    while True:
        alive = [pid for pid in dumped if Path(f"/proc/{pid}").exists()]
        if not alive or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert not alive, ("the dumped workload outlived its final checkpoint: "
                       f"{[(pid, _state(pid)) for pid in alive]}")
    if first == "leave-running":
        # Delivered once more with no recovery (its container gone): run()
        # answers with the generation that names it, storing nothing more.
        d = await step.run(final, Progress())
        assert (d.status, d.generation) == ("succeeded", gens[0].number), d
        assert len(await cluster.store.generations("default", "crashed.main")) == 1


async def test_a_storage_blip_before_a_final_dump_does_not_fail_the_final(
        cluster: Cluster) -> None:
    """An eviction with no dump in flight: one read of the store fails (an S3
    503) as the final request starts. Nothing is frozen yet and the store is
    back at once: the final checkpoint is still taken and stored within the
    grace (a dump's own storage errors are retried until the commit
    deadline), and the replacement resumes from it."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("blip", a, labels=NODE_RESTORE, final_wait=25, grace=30))
    await cluster.until_steps("blip", a, 3)
    [step] = [o for o in live(PodCheckpointStep) if o.node == a]
    real = step.store.latest
    failed: list[str] = []

    async def blip(namespace: str, checkpoint_id: str) -> Any:
        if not failed and any(f.function == "_taken_over" for f in inspect.stack()):
            failed.append(checkpoint_id)
            raise StorageError(f"injected: S3 503 reading latest of {checkpoint_id}",
                               hint="a test fault")
        return await real(namespace, checkpoint_id)

    step.store.latest = blip  # type: ignore[method-assign]
    try:
        await evict(cluster, "blip")
        await cluster.recreated("blip", timeout=90)
    finally:
        step.store.latest = real  # type: ignore[method-assign]

    assert failed, "the final request never read latest: the fault was not injected"
    said = hook_said(cluster, a, "blip")
    gens = await cluster.store.generations("default", "blip.main")
    assert "final checkpoint done" in said, f"{failed}: the hook said {said!r}; {records(gens)}"
    before = steps(cluster.log("blip", a))
    cluster.schedule("blip", b)
    after = await cluster.until_steps("blip", b, 5, timeout=90)
    assert_continues(before, after, before[-1][0])


async def test_a_cordon_dump_stepping_aside_before_its_freeze_leaves_one_final(
        cluster: Cluster) -> None:
    """kubectl drain: the cordon's dump holds the container's lock, not yet
    frozen, when the eviction's final request starts. It steps aside
    (``taken-over``); the final request dumps, once; the replacement
    resumes from that final checkpoint at the next step."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("aside", a, labels=NODE_RESTORE, final_wait=25,
                                      grace=30))
    await cluster.until_steps("aside", a, 3)
    [step] = [o for o in live(PodCheckpointStep) if o.node == a]
    final_started, waited = asyncio.Event(), asyncio.Event()
    real_run, real_estimate = step.run, step.estimate
    answers: dict[str, Any] = {}

    async def run(req: CkptRequested, progress: Any) -> Any:
        if req.target.pod == "aside" and not req.leave_running:
            final_started.set()
        try:
            done = await real_run(req, progress)
        except Exception as e:
            answers[req.request_id] = (req.leave_running, f"failed {getattr(e, 'code', e)}")
            raise
        answers[req.request_id] = (req.leave_running, done.status)
        return done

    async def estimate(req: CkptRequested) -> int:
        if req.target.pod == "aside" and req.leave_running:
            waited.set()  # under the lock, before anything is frozen
            await asyncio.wait_for(final_started.wait(), 60)
        return await real_estimate(req)

    step.run, step.estimate = run, estimate  # type: ignore[method-assign]
    try:
        await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
        await asyncio.wait_for(waited.wait(), 60)
        await evict(cluster, "aside")
        await cluster.recreated("aside", timeout=90)
    finally:
        step.run, step.estimate = real_run, real_estimate  # type: ignore[method-assign]

    assert "final checkpoint done" in hook_said(cluster, a, "aside")
    gens = await cluster.store.generations("default", "aside.main")
    assert [(r, lr) for _, r, lr in records(gens)] == [("drain", False)], \
        f"{records(gens)}; answers {answers}"
    assert sorted(answers.values()) == [(False, "succeeded"), (True, "failed taken-over")], \
        answers
    before = steps(cluster.log("aside", a))
    cluster.schedule("aside", b)
    after = await cluster.until_steps("aside", b, 5, timeout=90)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "steps lost after the final checkpoint"


async def test_a_final_that_finds_the_dump_already_held_for_it_answers_with_that_one(
        cluster: Cluster, drain_image: Path) -> None:  # noqa: F811
    """The final request is known to the step (so the cordon's dump, ending,
    is held for it) but looks at that dump only after: it must not dump
    again, and both requests are answered with the one generation."""
    a, b = list(cluster.kubelets)
    await start(cluster, drain_image, "held", a)
    [step] = [o for o in live(PodCheckpointStep) if o.node == a]
    final_started, held = asyncio.Event(), asyncio.Event()
    real_run, real_capture, real_hold = step.run, pod_dump.capture, step._hold_for_final
    real_container = step.pods.container
    answers: dict[str, Any] = {}
    mine: set[str] = set()
    seen: list[str] = []  # the dump's phase as the final request looks at it

    async def run(req: CkptRequested, progress: Any) -> Any:
        if req.target.pod == "held":
            mine.add(req.request_id)
            if not req.leave_running:
                final_started.set()
        done = await real_run(req, progress)
        answers[req.request_id] = (req.leave_running, done.status, done.generation)
        return done

    async def capture(shim: Any, work: Path, *args: Any) -> None:
        if work.name in mine:
            await asyncio.wait_for(final_started.wait(), 60)
        await real_capture(shim, work, *args)

    def hold_for_final(*args: Any) -> bool:
        try:
            return real_hold(*args)
        finally:
            held.set()

    async def container(target: Any) -> Any:
        if target.pod == "held" and final_started.is_set() and not held.is_set():
            await asyncio.wait_for(held.wait(), 60)  # the final looks after the hold
            flight = step.flights.flight(takeover.key(target))
            seen.append(flight.phase if flight else "none")
        return await real_container(target)

    step.run, pod_dump.capture = run, capture  # type: ignore[method-assign]
    step._hold_for_final, step.pods.container = hold_for_final, container  # type: ignore
    try:
        await drain(cluster, a, "held")
    finally:
        step.run, pod_dump.capture = real_run, real_capture  # type: ignore[method-assign]
        step._hold_for_final, step.pods.container = real_hold, real_container  # type: ignore

    assert seen == ["taken"], f"the order was not the one meant: {seen}"
    assert "final checkpoint done" in hook_said(cluster, a, "held")
    gens = await cluster.store.generations("default", "held.main")
    assert [(r, lr) for _, r, lr in records(gens)] == [("drain", False)], \
        f"{records(gens)}; answers {answers}"
    assert sorted(answers.values()) == [(False, "succeeded", gens[0].number),
                                        (True, "succeeded", gens[0].number)], answers
    await resumes_intact(cluster, "held", a, b)


async def test_a_template_dump_does_not_step_aside_for_a_final_of_another_lineage(
        cluster: Cluster) -> None:
    """A snapshot-when-ready template dump holds the lock, not yet frozen,
    when the pod's final request starts: the final is not of its lineage
    and takes nothing of it, so the template is still stored, and the final
    checkpoint in the pod's lineage."""
    a = next(iter(cluster.kubelets))
    cluster.kube.put("pods", workload("tmpl", a, labels=NODE_RESTORE, final_wait=25,
                                      grace=30))
    await cluster.until_steps("tmpl", a, 3)
    [step] = [o for o in live(PodCheckpointStep) if o.node == a]
    tmpl = template_id("warm-tmpl", "main")
    req = template_request(cluster, "tmpl", a, tmpl)
    final_started, waited = asyncio.Event(), asyncio.Event()
    real_run, real_estimate = step.run, step.estimate

    async def run(r: CkptRequested, progress: Any) -> Any:
        if r.target.pod == "tmpl" and not r.leave_running:
            final_started.set()
        return await real_run(r, progress)

    async def estimate(r: CkptRequested) -> int:
        if r.request_id == req.request_id:
            waited.set()  # under the lock, before anything is frozen
            await asyncio.wait_for(final_started.wait(), 60)
        return await real_estimate(r)

    step.run, step.estimate = run, estimate  # type: ignore[method-assign]
    try:
        await cluster.bus.publish(req)
        await asyncio.wait_for(waited.wait(), 60)
        await evict(cluster, "tmpl")
        await cluster.recreated("tmpl", timeout=90)
        done = await cluster.bus.wait_result(req.request_id, "ckpt.requested", timeout=60)
    finally:
        step.run, step.estimate = real_run, real_estimate  # type: ignore[method-assign]

    own = await cluster.store.generations("default", "tmpl.main")
    shared = await cluster.store.generations("default", tmpl)
    assert [(r, lr) for _, r, lr in records(own)] == [("drain", False)], records(own)
    assert (done.status, [(r, lr) for _, r, lr in records(shared)]) == \
        ("succeeded", [("template", True)]), (done.status, done.error, records(shared))


class ReleaseCancelledFromInside:
    """STAND-IN for a container's JobLock whose release meets a cancel that
    nats-py hands back as NATS closes a request (JobLock.release catches
    Exception, not CancelledError)."""

    async def acquire(self, *a: Any, **kw: Any) -> None:
        return None

    async def release(self, job_id: str, request_id: str) -> None:
        raise asyncio.CancelledError()


async def test_a_dump_whose_cleanup_is_cut_short_still_answers_the_final_riding_on_it(
        tmp_path: Path) -> None:
    """A leave-running dump that failed after its freeze, whose cleanup is
    then cut short (its lock's release cancelled from inside): the final
    request riding on it learns at once that it must dump itself, and a
    later one finds no dump in flight; neither waits for it for ever."""
    step = PodCheckpointStep.__new__(PodCheckpointStep)  # only what _run's ends use
    step.flights = takeover.Flights()
    step.lock = ReleaseCancelledFromInside()  # type: ignore[assignment]
    step.work_dir = tmp_path / "pods"
    target = Target(kind="pod", namespace="ns", pod="p", container="main")
    lr = CkptRequested(request_id="cut-lr", checkpoint_id="p.main", node="n",
                       leave_running=True, target=target)
    final = CkptRequested(request_id="cut-final", checkpoint_id="p.main", node="n",
                          leave_running=False, target=target)
    riding: list[asyncio.Task[Any]] = []

    def shim_of(c: Any) -> Any:  # frozen, a final rides on it, then the dump fails
        flight = step.flights.flight(takeover.key(target))
        assert flight is not None
        flight.phase = "frozen"
        riding.append(asyncio.create_task(takeover.wait(flight, final, Progress())))
        raise RuntimeError("the dump failed after its freeze")

    step.shim_of = shim_of  # type: ignore[method-assign]
    container = SimpleNamespace(lock_key=lambda: "pod.uid.main", container_id="c1")
    with pytest.raises(asyncio.CancelledError):
        await step._run(lr, Progress(), container, "now", time.monotonic())  # type: ignore[arg-type]
    assert await asyncio.wait_for(riding[0], 5) is None  # it dumps itself
    assert step.flights.flight_for(takeover.key(target), final) is None
