"""A tenant's container against the agent that replaces its node's agent (a
DaemonSet rollout, a restart: tests/agent/test_rollout_pods.py). The new
agent knows nothing of the starts the old one answered, and everything in the
container's /smr is the workload's to write. A container the old agent
restored rewrites smr-init's files there as if its start were still
unanswered; the new agent must neither restore it a second time nor post a
Warning Event saying that it started fresh over its checkpoint.

Real parts: containerd, runc, smr-runtime, smr-init, CRIU and two agents of
one node, one after the other (tests/agent/cluster.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from services.agent import unanswered
from services.agent.starts import SCAN_S, StartRestores
from services.containers import host
from services.containers.pods import runtime_id
from smr.contract.messages import CkptRequested, Target
from smr.jobs import proc_start_ticks
from tests.agent.cluster import Cluster, assert_continues, steps
from tests.agent.test_rollout_pods import (
    another_agent,
    checkpointed,
    create_opted_in,
    stopped,
)


async def restored(cluster: Cluster, name: str, node: str) -> tuple[host.Shim, Path]:
    """Pod ``name`` on ``node``, resumed from a checkpoint taken on the other
    node: its smr-init, and its /smr/main as the workload sees it."""
    a, b = list(cluster.kubelets)
    other = b if node == a else a
    ckpt = f"{name}-{uuid.uuid4().hex[:6]}"
    before = await checkpointed(cluster, f"{name}-src", other, ckpt)
    await create_opted_in(cluster, name, node, ckpt)
    after = await cluster.until_steps(name, node, 3, timeout=60)
    assert_continues(before, after, before[-1][0])
    st = cluster.kube.get("pods", name, "default")
    assert st is not None
    shim = host.find_shim(runtime_id(st["status"]["containerStatuses"][0]["containerID"]))
    assert shim is not None
    return shim, Path(f"/proc/{shim.pid}/root/smr/main")


async def looked_at(starts: StartRestores, shim: host.Shim) -> None:
    """Until the agent's start scan has dealt with ``shim``: answered it,
    refused it or looked for its ``unanswered``, and what it spawned ended."""
    key = (shim.pid, proc_start_ticks(shim.pid) or 0)
    deadline = time.monotonic() + 60
    while key not in starts._done | starts._checked:
        assert time.monotonic() < deadline, "the new agent never looked at the container"
        await asyncio.sleep(0.1)
    await asyncio.sleep(3 * SCAN_S)  # the scan that saw it spawns its tasks
    while starts._tasks or starts._busy:
        assert time.monotonic() < deadline, "the new agent's answer never ended"
        await asyncio.sleep(0.1)


async def replaced_agent_looks_at(cluster: Cluster, node: str, shim: host.Shim) -> None:
    """The node's agent replaced (stopped, then its successor up), and the
    successor's look at ``shim``'s container start done."""
    old = cluster.agents[node]
    await stopped(old)
    async with another_agent(old, cluster) as new:
        await asyncio.wait_for(new.ready.wait(), 60)
        await looked_at(new.starts, shim)


async def test_a_restored_container_claiming_it_started_unanswered_gets_no_warning(
        cluster: Cluster) -> None:
    """The workload writes ``unanswered`` (its /smr is its own) after the old
    agent restored it; the new agent does not post StartedWithoutAgent
    ("checkpoint ... was NOT restored") on a container that was restored."""
    a, _ = list(cluster.kubelets)
    shim, smr = await restored(cluster, "lie", a)
    (smr / "unanswered").write_text("no answer from the smr node agent\n")
    await replaced_agent_looks_at(cluster, a, shim)
    lies = [e["message"] for e in cluster.events("StartedWithoutAgent")
            if e["involvedObject"]["name"] == "lie"]
    assert not lies, f"a restored container was reported as started fresh: {lies}"


async def test_a_restored_container_asking_again_is_not_restored_twice(
        cluster: Cluster) -> None:
    """The workload rewrites its status to ``waiting`` after the old agent
    restored it: the new agent answers from the restore already done (the
    same request, derived from the container's ID) and restores nothing
    again; the workload goes on from where it is."""
    a, _ = list(cluster.kubelets)
    shim, smr = await restored(cluster, "again", a)
    (smr / "status").write_text(f"waiting {shim.pid}\n")
    seen = steps(cluster.log("again", a))
    old = cluster.agents[a]
    await stopped(old)
    async with another_agent(old, cluster) as new:
        await asyncio.wait_for(new.ready.wait(), 60)
        await looked_at(new.starts, shim)
        later = await cluster.until_steps("again", a, len(seen) + 3, timeout=60)
    numbers = [n for n, _, _ in later]
    assert numbers == sorted(set(numbers)), \
        f"the workload went back to an earlier step (restored again): {later}"
    assert len({born for _, _, born in later}) == 1, "a second copy of the workload ran"


async def test_a_container_checkpointed_after_its_start_is_never_said_to_have_lost_it(
        cluster: Cluster) -> None:
    """An agent answered the start (nothing to resume yet: a fresh start);
    the container then stored its own first checkpoint. Its workload writes
    ``unanswered`` and the node's agent is replaced: no Event says that
    checkpoint was not restored, since it did not exist when the container
    started."""
    a, _ = list(cluster.kubelets)
    ckpt = f"own-{uuid.uuid4().hex[:6]}"
    await create_opted_in(cluster, "own", a, ckpt)
    first = await cluster.until_steps("own", a, 3, timeout=60)
    assert first[0][0] == 1, "it had nothing to resume, yet it did not start fresh"
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="own", container="main")),
        timeout=60)
    assert done.status == "succeeded", done
    st = cluster.kube.get("pods", "own", "default")
    assert st is not None
    cid = runtime_id(st["status"]["containerStatuses"][0]["containerID"])
    shim = host.find_shim(cid)
    assert shim is not None
    # How the agent knows it for the container's own, whatever the clocks say
    # (the kubelet's startedAt is in whole seconds, and it may have been
    # stored within the second the container started): its manifest.
    latest = await cluster.agents[a].starts._latest(ckpt, "default")
    assert latest is not None
    assert await unanswered._taken_of(cluster.agents[a].starts, "default", ckpt, latest) == cid
    (Path(f"/proc/{shim.pid}/root/smr/main") / "unanswered").write_text("no answer\n")
    await replaced_agent_looks_at(cluster, a, shim)
    lies = [e["message"] for e in cluster.events("StartedWithoutAgent")
            if e["involvedObject"]["name"] == "own" and "NOT restored" in e["message"]]
    assert not lies, f"its own later checkpoint was said not to be restored: {lies}"
