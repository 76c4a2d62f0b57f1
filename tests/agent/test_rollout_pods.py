"""The node agent replaced under running pods, as a DaemonSet rollout does it
(tests/agent/cluster.py): a container that starts while its node has no
agent waits for the next one and resumes; with ``maxSurge`` the old and the
new agent run side by side, and only one of them answers a container start."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.agent.alive import StartsTurn
from services.agent.service import NodeAgent
from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import IMAGE, Cluster, assert_continues, steps, workload
from tests.fake_apiserver import pod

INIT_TIMEOUT_S = 3  # smr-init's own start timeout here (30 s by default)
AGENT_WAIT_S = 120  # SMR_AGENT_WAIT here (600 s by default)


@contextlib.contextmanager
def agent_wait(smr_runtime: Path, seconds: int) -> Iterator[None]:
    """smr-runtime.env with AGENT_WAIT, as the agent's install writes it on a node."""
    env = smr_runtime.parent / "smr-runtime.env"
    before = env.read_text()
    env.write_text(before + f"AGENT_WAIT={seconds}\n")
    try:
        yield
    finally:
        env.write_text(before)


@contextlib.asynccontextmanager
async def another_agent(old: NodeAgent, cluster: Cluster) -> AsyncIterator[NodeAgent]:
    """A second agent for ``old``'s node, with its settings (the DaemonSet's
    new pod), running until the block ends."""
    new = NodeAgent(old.starts.bus, old.pods.core.api_client, cluster.store, old.s)
    task = asyncio.create_task(new.run())
    try:
        yield new
    finally:
        new.stop()
        await asyncio.wait_for(task, 60)


async def stopped(agent: NodeAgent, beside: NodeAgent | None = None) -> None:
    """Stop ``agent`` and wait until it no longer answers container starts:
    it let go of the node's starts lock, and the lock is free, or ``beside``
    (another agent of the node, waiting for it) took it first. Past the 30 s
    an agent that stops gives each of its workers to end a step in flight
    (services/agent/service.py), not at it."""
    agent.stop()
    deadline = time.monotonic() + 45
    while True:
        if not agent.starts.answering:
            if beside is not None and beside.starts.answering:
                return
            turn = StartsTurn(agent.s.step_lock_path)
            if turn._try():
                turn.release()
                return
        assert time.monotonic() < deadline, (
            "the old agent still answers container starts" if agent.starts.answering
            else "the node's starts lock is still held, though its agent let go")
        await asyncio.sleep(0.1)


async def answered(agent: NodeAgent, failure: str) -> None:
    """Until ``agent`` counts a container start as answered. It counts it once
    the restore it asked for is over, and the bus's answer can reach it after
    the restored workload has printed its first steps (a loaded machine)."""
    deadline = time.monotonic() + 30
    while not agent.starts._done:
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.1)


async def checkpointed(cluster: Cluster, name: str, node: str, ckpt: str
                       ) -> list[tuple[int, int, str]]:
    """Pod ``name`` on ``node``, resuming from ``ckpt``, checkpointed once."""
    cluster.kube.put("pods", workload(name, node, env={"SMR_CHECKPOINT": ckpt},
                                      owner=ckpt, restart="Never"))
    await cluster.until_steps(name, node, 5)
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=node,
        target=Target(kind="pod", namespace="default", pod=name, container="main")),
        timeout=60)
    assert done.status == "succeeded", done
    return steps(cluster.log(name, node))


async def create_opted_in(cluster: Cluster, name: str, node: str, ckpt: str) -> None:
    """Through the API server and the webhook: the smr RuntimeClass, so
    smr-runtime creates the container (and tells smr-init about the agent)."""
    body = pod(name, node, env={"SMR_CHECKPOINT": ckpt,
                                "SMR_INIT_TIMEOUT": str(INIT_TIMEOUT_S)})
    body["spec"]["containers"][0].update(image=IMAGE, command=["/bin/counter"])
    body["spec"]["restartPolicy"] = "Never"
    body.pop("status")
    await cluster.core.create_namespaced_pod("default", body)
    stored = cluster.kube.get("pods", name, "default")
    assert stored is not None and stored["spec"].get("runtimeClassName") == "smr", \
        cluster.kube.admission_log
    cluster.kube.put("pods", {**stored, "status": {"phase": "Pending"}})


async def created(cluster: Cluster, name: str) -> dict[str, Any]:
    """The pod once the kubelet reports its container."""
    deadline = time.monotonic() + 60
    while True:
        p = cluster.kube.get("pods", name, "default")
        statuses = (p or {}).get("status", {}).get("containerStatuses") or []
        if statuses and statuses[0].get("containerID"):
            assert p is not None
            return p
        assert time.monotonic() < deadline, f"pod {name} was never started: {p}"
        await asyncio.sleep(0.1)


async def test_a_pod_starting_while_its_nodes_agent_is_replaced_resumes_once_the_new_one_is_up(
        cluster: Cluster, smr_runtime: Path) -> None:
    """The agent of node a is stopped (a DaemonSet rollout with maxUnavailable,
    an agent restart). A pod that resumes from a checkpoint starts there
    meanwhile. The new agent comes up only after several times smr-init's own
    start timeout (3 s here, 30 s by default): smr-init, told by smr-runtime
    that an agent ran here a moment ago, keeps waiting for it, and the pod
    resumes (the next step, its memory intact), not fresh."""
    a, b = list(cluster.kubelets)
    ckpt = f"roll-{uuid.uuid4().hex[:6]}"
    before = await checkpointed(cluster, "roll-x1", b, ckpt)
    old = cluster.agents[a]
    with agent_wait(smr_runtime, AGENT_WAIT_S):
        await stopped(old)
        await create_opted_in(cluster, "roll-x2", a, ckpt)
        await created(cluster, "roll-x2")
        # No agent on node a for three times smr-init's own timeout.
        gap_until = time.monotonic() + 3 * INIT_TIMEOUT_S
        while time.monotonic() < gap_until:
            log = cluster.log("roll-x2", a)
            assert steps(log) == [], \
                f"it started fresh while its node's agent was being replaced: {log[-400:]!r}"
            await asyncio.sleep(0.2)
        async with another_agent(old, cluster):
            after = await cluster.until_steps("roll-x2", a, 5, timeout=60)
    assert_continues(before, after, before[-1][0])
    assert not cluster.events("StartedWithoutAgent")


async def test_a_pod_no_agent_answers_starts_fresh_with_a_warning_event(
        cluster: Cluster, smr_runtime: Path) -> None:
    """No agent came within SMR_AGENT_WAIT (3 s here) of the last one: the pod
    is not left waiting for ever; smr-init starts it fresh, and the agent
    that comes later says so in a Warning Event naming the checkpoint that
    was not restored."""
    a, b = list(cluster.kubelets)
    ckpt = f"gone-{uuid.uuid4().hex[:6]}"
    await checkpointed(cluster, "gone-x1", b, ckpt)
    old = cluster.agents[a]
    with agent_wait(smr_runtime, INIT_TIMEOUT_S):
        await stopped(old)
        await create_opted_in(cluster, "gone-x2", a, ckpt)
        after = await cluster.until_steps("gone-x2", a, 3, timeout=60)
        assert after[0][0] == 1, "no agent ran, yet it did not start fresh"
        assert "no answer from the smr node agent" in cluster.log("gone-x2", a)
        async with another_agent(old, cluster):
            event = await cluster.event("StartedWithoutAgent", "gone-x2", timeout=30)
    assert event["type"] == "Warning"
    assert f"checkpoint {ckpt} generation" in event["message"], event
    assert "was NOT restored" in event["message"], event


async def test_two_agents_of_one_node_never_answer_one_start_twice(
        cluster: Cluster, smr_runtime: Path) -> None:
    """maxSurge: the new agent of node a runs beside the old one. A pod that
    resumes starts there: only the agent holding the node's starts lock (the
    old one) answers it; the new one waits its turn and takes over once the
    old one ends, answering the next start (which resumes, not starts fresh).
    AGENT_WAIT as the agent's install writes it: smr-init waits for an agent
    while the node's mark is fresh, not only its own 3 s here, which a loaded
    machine can spend before the new agent's first scan."""
    a, b = list(cluster.kubelets)
    ckpt = f"surge-{uuid.uuid4().hex[:6]}"
    before = await checkpointed(cluster, "surge-x1", b, ckpt)
    old = cluster.agents[a]
    with agent_wait(smr_runtime, AGENT_WAIT_S):
        async with another_agent(old, cluster) as new:
            await asyncio.wait_for(new.ready.wait(), 60)
            await create_opted_in(cluster, "surge-x2", a, ckpt)
            after = await cluster.until_steps("surge-x2", a, 5, timeout=60)
            assert_continues(before, after, before[-1][0])
            await answered(old, "the old agent did not answer the start")
            assert new.starts._done == set() and new.starts._busy == set(), \
                "the surge agent answered a start the old agent answers"
            await stopped(old, beside=new)
            await create_opted_in(cluster, "surge-x3", a, ckpt)
            again = await cluster.until_steps("surge-x3", a, 3, timeout=60)
            assert_continues(before, again, before[-1][0])
            await answered(new, "the new agent did not take over the node's starts")


@pytest.mark.parametrize(("stored", "named"), [
    ("2026-11-29T04:00:00.700Z", True),  # the second the container started in
    ("2026-11-29T03:59:59.999Z", True),
    ("2026-11-29T04:00:01.000Z", False),  # after it: the container's own
])
async def test_the_checkpoint_named_lost_is_judged_by_the_kubelets_whole_seconds(
        stored: str, named: bool) -> None:
    """The kubelet writes startedAt in whole seconds: a generation stored
    earlier within that second (a pod created at once after a checkpoint) is
    the one the container would have resumed from, and the Warning names it."""
    from services.agent import unanswered
    from smr.contract.errors import SmrError

    class Unreadable:
        async def get(self, namespace: str, ckpt: str, generation: int) -> Any:
            raise SmrError("storage unreachable", code="storage-error")

    class Starts:
        store = Unreadable()  # no manifest to read: the times decide

        async def _latest(self, ckpt: str, namespace: str) -> dict[str, Any]:
            return {"generation": 3, "created_at": stored}

    status = {"state": {"running": {"startedAt": "2026-11-29T04:00:00Z"}}}
    gen = await unanswered._before_start(Starts(), "c", "default", status)  # type: ignore[arg-type]
    assert (gen is not None) == named, gen


async def test_a_containers_own_checkpoint_is_never_named_lost_however_soon_it_came() -> None:
    """A generation taken of this very container (its manifest names the
    container) was stored after it started, even within the second the
    kubelet's startedAt rounds it to: it is never named as not restored."""
    from types import SimpleNamespace

    from services.agent import unanswered

    class Store:
        async def get(self, namespace: str, ckpt: str, generation: int) -> Any:
            return SimpleNamespace(manifest={"container": {"container_id": "abc123"}})

    class Starts:
        store = Store()

        async def _latest(self, ckpt: str, namespace: str) -> dict[str, Any]:
            return {"generation": 1, "created_at": "2026-11-29T04:00:00.700Z"}

    mine = {"containerID": "containerd://abc123",
            "state": {"running": {"startedAt": "2026-11-29T04:00:00Z"}}}
    other = {**mine, "containerID": "containerd://def456"}
    assert await unanswered._before_start(Starts(), "c", "default", mine) is None  # type: ignore[arg-type]
    assert await unanswered._before_start(Starts(), "c", "default", other) is not None  # type: ignore[arg-type]
