"""A pod's /dev/shm carried with its checkpoint (as devshm.tar), through
agent deaths and recoveries: sequences that must neither tear nor lose the
/dev/shm a checkpoint carries. Real containerd, runc, CRIU and S3 (moto);
the harness is tests/agent/cluster.py.

The workload keeps one number twice: in its memory (a shell variable) and in
/dev/shm/c, and checks before each step that they agree; a restored copy
whose /dev/shm is not the one its memory was saved with says "torn".
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.checkpointer.pod import PodCheckpointStep
from services.containers import host, rootfs
from services.containers.host import Shim
from services.restorer.pod import IDENTITY, PodRestoreStep
from smr.contract.messages import CkptDone, CkptRequested, RestoreRequested, Target
from smr.gpu import frozen
from smr.identity import ProcessIdentity
from tests import oci_image
from tests.agent.cluster import CMD, Cluster, steps, workload
from tests.helpers.live import live

SHM_IMAGE = "smr.test/shm-counter:1"
SHM_COUNTER = b"""#!/bin/sh
test -f /data/born || echo "born-$$-$(cat /proc/sys/kernel/random/uuid)" > /data/born
i=0; sum=0
echo 0 > /dev/shm/c
while true; do
  c=$(cat /dev/shm/c 2>/dev/null)
  test "$c" = "$i" || echo "torn: /dev/shm/c holds '$c', memory $i"
  i=$((i+1)); sum=$((sum+i*i))
  echo $i > /dev/shm/c
  echo "step $i sum $sum born $(cat /data/born)"
  sleep 0.02
done
"""
# The counter beside a child that has ended and is never reaped (busybox's
# sleep never waits for the child it inherits): a zombie in every dump of its
# tree, as a shell's `$(cat ...)` is when frozen between its exit and the wait.
WITH_ZOMBIE = b"""#!/bin/sh
/bin/counter &
sleep 0.2 &
exec sleep 1000000
"""


@pytest.fixture(scope="module")
def shm_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("shm")
    return oci_image.build(d / "shm.tar", SHM_IMAGE, files={"/bin/counter": SHM_COUNTER,
                                                                "/bin/with-zombie": WITH_ZOMBIE})


@pytest.fixture
async def shm(cluster: Cluster, shm_image: Path) -> Cluster:
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, shm_image)
    return cluster


def shm_pod(name: str, node: str, ckpt: str, run: str = "/bin/counter") -> dict[str, Any]:
    p = workload(name, node, image=SHM_IMAGE, owner="shm", restart="Never",
                 env={"SMR_CHECKPOINT": ckpt})
    p["spec"]["containers"][0]["command"] = [*CMD[:-1], run]  # CMD itself is shared
    return p


def torn(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.startswith("torn")]


async def stored_file(cluster: Cluster, gen: Any, path: str) -> bytes | None:
    if path not in {f["path"] for f in gen.manifest["files"]}:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "gen"
        await cluster.store.fetch(gen, d, only=lambda p: p == path)
        return (d / path).read_bytes()


def shm_counter(tar: bytes | None) -> str | None:
    if tar is None:
        return None
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        f = t.extractfile("dev/shm/c")
        return f.read().decode().strip() if f else None


async def test_a_pod_heartbeat_saves_dev_shm_as_its_memory_saw_it(
        shm: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leave-running checkpoint: the workload must not run between its
    memory dump and the capture of its /dev/shm, else the restored copy gets
    a /dev/shm from later than its memory (a shared-memory counter ahead of
    the process that writes it: PostgreSQL's dynamic shared memory, a
    multiprocessing.shared_memory block)."""
    a, b = list(shm.kubelets)
    real = rootfs.capture

    async def a_large_layer(upper: Path, out: Path, budget: rootfs.Budget) -> None:
        await real(upper, out, budget)
        await asyncio.sleep(1)  # as long as a layer of a few hundred MiB takes

    monkeypatch.setattr(rootfs, "capture", a_large_layer)
    shm.kube.put("pods", shm_pod("hb-1", a, "hb"))
    await shm.until_steps("hb-1", a, 10, timeout=60)
    done = await shm.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="hb", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="hb-1", container="main")),
        timeout=120)
    assert isinstance(done, CkptDone) and done.status == "succeeded", done.error
    shm.kube.put("pods", shm_pod("hb-2", b, "hb"))
    after = await shm.until_steps("hb-2", b, 5, timeout=60)
    assert after[0][0] > 1, "it started over instead of being restored"
    assert not torn(shm.log("hb-2", b)), (
        f"restored from a heartbeat, /dev/shm is not what its memory saw: "
        f"{torn(shm.log('hb-2', b))[:1]} (it ran on between its dump and the capture)")
    assert not torn(shm.log("hb-1", a)), "the heartbeat tore the running workload itself"


def steps_of(node: str) -> list[PodCheckpointStep]:
    return [o for o in live(PodCheckpointStep) if o.node == node]


def tree_states(shim: Shim) -> list[str]:
    """The state letter of each process of the container's workload tree."""
    running = shim.workload()
    return [frozen.state(p) for p in host.tree(running[0])] if running else []


def agent_dies_in_capture_shm(
        monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """The agent's capture of /dev/shm replaced by its death: ``entered`` is
    set as a step gets there, which then waits for ``crash`` and fails as a
    SIGKILL would have ended it."""
    entered, crash = asyncio.Event(), asyncio.Event()

    async def dies_here(pid: int, out: Path, budget: rootfs.Budget) -> None:
        entered.set()
        await crash.wait()  # the agent's last moment: SIGKILL comes here
        raise RuntimeError("the agent was killed (test)")

    monkeypatch.setattr(rootfs, "capture_shm", dies_here)
    return entered, crash


@dataclass
class HeldRestore:
    """A pod restore on node ``b`` whose agent is held the moment CRIU has
    restored the tree: its step and the request it runs."""
    a: str
    b: str
    step: PodRestoreStep
    req: RestoreRequested


@contextlib.asynccontextmanager
async def restore_held_after_criu(shm: Cluster, monkeypatch: pytest.MonkeyPatch,
                                  name: str) -> AsyncIterator[HeldRestore]:
    """Pod ``NAME-1`` runs on the first node and is drained (a final
    checkpoint); ``NAME-2`` is restored on the second, its agent held as CRIU
    returns (as if killed there: the held step fails once released, at the
    end of the block). What the test then does is the next agent's recovery."""
    a, b = list(shm.kubelets)
    shm.kube.put("pods", shm_pod(f"{name}-1", a, name))
    await shm.until_steps(f"{name}-1", a, 10, timeout=60)
    drain = await shm.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=name, node=a, reason="drain",
        target=Target(kind="pod", namespace="default", pod=f"{name}-1", container="main")),
        timeout=120)
    assert drain.status == "succeeded", drain.error
    reqs: list[RestoreRequested] = []
    entered, crash = asyncio.Event(), asyncio.Event()
    real, real_run = PodRestoreStep._restore, PodRestoreStep.run

    async def dies_after_criu(self: PodRestoreStep, *args: Any, **kw: Any) -> int:
        await real(self, *args, **kw)  # the tree restored, CRIU done
        entered.set()
        await crash.wait()  # the agent's last moment: SIGKILL comes here
        raise RuntimeError("the agent was killed (test)")

    async def run(self: PodRestoreStep, req: RestoreRequested, progress: Any) -> Any:
        reqs.append(req)
        return await real_run(self, req, progress)

    monkeypatch.setattr(PodRestoreStep, "_restore", dies_after_criu)
    monkeypatch.setattr(PodRestoreStep, "run", run)
    shm.kube.put("pods", shm_pod(f"{name}-2", b, name))
    try:
        await asyncio.wait_for(entered.wait(), 90)
        [step] = [o for o in live(PodRestoreStep) if o.node == b]
        [req] = reqs
        yield HeldRestore(a, b, step, req)
    finally:
        crash.set()


async def test_a_recovered_final_dump_is_never_stored_without_its_dev_shm(
        shm: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent dies after CRIU finished a final dump and before /dev/shm
    was captured (the request is delivered again, and recover() finds
    dump.log complete in the work directory). Its recovery must store the
    workload's /dev/shm with it, not a generation without it; it then ends
    the workload held stopped, so nothing else has it."""
    a, b = list(shm.kubelets)
    shm.kube.put("pods", shm_pod("fin-1", a, "fin"))
    await shm.until_steps("fin-1", a, 10, timeout=60)
    real = rootfs.capture_shm
    entered, crash = agent_dies_in_capture_shm(monkeypatch)
    req = CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="fin", node=a,
        target=Target(kind="pod", namespace="default", pod="fin-1", container="main"))
    first = asyncio.create_task(shm.bus.request(req, timeout=120))
    try:
        await asyncio.wait_for(entered.wait(), 60)
        monkeypatch.setattr(rootfs, "capture_shm", real)  # the next agent's
        [step] = steps_of(a)
        # What the redelivered request's worker does on the next agent.
        done = await step.recover(req, {})
    finally:
        crash.set()
        await asyncio.gather(first, return_exceptions=True)
    gen = await shm.store.latest("default", "fin")
    if done is None:  # ran again instead: nothing stored without its /dev/shm
        assert gen is None or "devshm.tar" in {f["path"] for f in gen.manifest["files"]}
        return
    assert done.status == "succeeded", done.error
    assert gen is not None and gen.number == done.generation
    counter = shm_counter(await stored_file(shm, gen, "devshm.tar"))
    assert counter is not None, (
        "the recovered final checkpoint was stored without the workload's /dev/shm "
        "(and the workload was ended): its shared memory is lost")
    before = steps(shm.log("fin-1", a))
    shm.kube.put("pods", shm_pod("fin-2", b, "fin"))
    after = await shm.until_steps("fin-2", b, 5, timeout=60)
    assert after[0][0] == before[-1][0] + 1, "steps lost after a final checkpoint"
    assert not torn(shm.log("fin-2", b)), torn(shm.log("fin-2", b))[:1]


async def test_a_restored_event_names_the_pod_it_restored_by_uid(shm: Cluster) -> None:
    """A pod restored under the name of an earlier one (a Job's, a
    StatefulSet's pods keep names): its Restored Event must carry its uid,
    else it attaches to every pod of that name, and `kubectl describe pod`,
    which asks for the uid, shows it on none."""
    a, b = list(shm.kubelets)
    shm.kube.put("pods", shm_pod("same", a, "same"))
    await shm.until_steps("same", a, 5, timeout=60)
    done = await shm.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="same", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="same", container="main")),
        timeout=120)
    assert done.status == "succeeded", done.error
    first = shm.kube.get("pods", "same", "default")
    assert first is not None
    shm.kube.remove("pods", "same", "default")
    shm.kube.put("pods", shm_pod("same", b, "same"))
    await shm.until_steps("same", b, 5, timeout=60)
    second = shm.kube.get("pods", "same", "default")
    assert second is not None and second["metadata"]["uid"] != first["metadata"]["uid"]
    event = await shm.event("Restored", "same", timeout=60)
    assert event["involvedObject"].get("uid") == second["metadata"]["uid"], (
        f"the Restored Event names pod uid {event['involvedObject'].get('uid')}, the "
        f"restored pod is {second['metadata']['uid']}")


async def test_a_heartbeat_whose_agent_died_mid_capture_runs_on_and_is_stored_whole(
        shm: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat's tree is held stopped from its dump to the end of its
    captures; the agent dies in between. The redelivered request's recovery
    must not leave the workload stopped for good, and what it stores must be
    consistent (the captures done again from the tree still stopped). Its
    tree holds a zombie, which never stops: the recovery took such a tree,
    held, for a running one and ran the request again instead."""
    a, b = list(shm.kubelets)
    shm.kube.put("pods", shm_pod("hbr-1", a, "hbr", run="/bin/with-zombie"))
    await shm.until_steps("hbr-1", a, 10, timeout=60)
    [step] = steps_of(a)
    shim = step.shim_of(await step.pods.container(
        Target(kind="pod", namespace="default", pod="hbr-1", container="main")))
    deadline = asyncio.get_running_loop().time() + 30
    while "Z" not in (seen := await asyncio.to_thread(tree_states, shim)):
        assert asyncio.get_running_loop().time() < deadline, f"no zombie in its tree: {seen}"
        await asyncio.sleep(0.05)
    real = rootfs.capture_shm
    entered, crash = agent_dies_in_capture_shm(monkeypatch)
    req = CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="hbr", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="hbr-1", container="main"))
    first = asyncio.create_task(shm.bus.request(req, timeout=120))
    try:
        await asyncio.wait_for(entered.wait(), 60)
        monkeypatch.setattr(rootfs, "capture_shm", real)
        held_at = len(steps(shm.log("hbr-1", a)))
        await asyncio.sleep(1)
        assert len(steps(shm.log("hbr-1", a))) == held_at, "not held stopped while captured"
        done = await step.recover(req, {})
        await shm.until_steps("hbr-1", a, held_at + 10, timeout=30)  # it runs on
    finally:
        crash.set()
        await asyncio.gather(first, return_exceptions=True)
    assert done is not None and done.status == "succeeded", done
    gen = await shm.store.latest("default", "hbr")
    assert gen is not None and gen.number == done.generation
    assert shm_counter(await stored_file(shm, gen, "devshm.tar")) is not None
    shm.kube.put("pods", shm_pod("hbr-2", b, "hbr", run="/bin/with-zombie"))
    after = await shm.until_steps("hbr-2", b, 5, timeout=60)
    assert after[0][0] > 1, "it started over instead of being restored"
    assert not torn(shm.log("hbr-2", b)), torn(shm.log("hbr-2", b))[:1]


async def test_a_pod_restore_recovery_adopts_no_tree_whose_identity_does_not_match(
        shm: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent dies after CRIU restored a pod's tree; by the recovery the
    restored root's PID names a process that started at another tick (the
    tree ended and its PID was taken). Nothing is adopted: smr-init is not
    told to take that PID, the recovery answers nothing (the restore runs
    again), and no process is killed for it."""
    async with restore_held_after_criu(shm, monkeypatch, "ri") as held:
        step, req = held.step, held.req
        idfile = step.work(req.request_id) / IDENTITY
        ident = ProcessIdentity.read(idfile)
        assert ident is not None and ident.matches(), "no identity written as CRIU returned"
        ProcessIdentity(ident.pid, ident.start_ticks - 1, ident.boot_id).write(idfile)

        done = await step.recover(req, {})
        shim = step.shim_of(await step.pods.container(req.target))
        status = await asyncio.to_thread(shim.status)
    assert done is None, f"a tree of another identity was adopted: {done}"
    assert status[:1] == ["waiting"], f"smr-init was told to adopt it: {status}"
    assert ident.matches(), "the recovery killed a process it did not adopt"


async def test_a_pod_restore_whose_agent_died_after_criu_runs_on_and_leaves_no_work_dir(
        shm: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU pod: the agent dies after CRIU restored its tree (CRIU itself
    continues a tree without GPU state) and before smr-init was told. The
    redelivered request's recovery must answer succeeded with the tree
    adopted and running on from its memory, and remove the request's work
    directory (the downloaded writable layer), as run() does: kept, every
    recovered restore left its files on the node's disk for good."""
    async with restore_held_after_criu(shm, monkeypatch, "rr") as held:
        a, b, step, req = held.a, held.b, held.step, held.req
        assert (step.work(req.request_id) / "restored.pid").is_file()
        # What the redelivered request's worker does on the next agent.
        done = await step.recover(req, {})
        assert done is not None and done.status == "succeeded", done
        left = step.work(req.request_id).exists()
        after = await shm.until_steps("rr-2", b, 5, timeout=30)
        shim = step.shim_of(await step.pods.container(req.target))
        deadline = asyncio.get_running_loop().time() + 30
        while (status := await asyncio.to_thread(shim.status))[:1] != ["running"]:
            assert asyncio.get_running_loop().time() < deadline, f"not adopted: {status}"
            await asyncio.sleep(0.1)
    assert status[1] == str(done.pid), status  # smr-init adopted the restored tree
    before = steps(shm.log("rr-1", a))  # read now: the log file lags the pipe
    assert after[0][0] == before[-1][0] + 1, "steps lost after a final checkpoint"
    assert not torn(shm.log("rr-2", b)), torn(shm.log("rr-2", b))[:1]
    assert not left, f"the recovered restore left its work directory {step.work(req.request_id)}"


async def test_a_pod_restore_whose_agent_died_as_criu_returned_adopts_the_tree_it_restored(
        shm: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent dies the moment CRIU has restored a pod's tree, before it
    wrote who CRIU restored (or CRIU finished on its own after the agent
    died): only CRIU's pidfile is left. The recovery adopts the tree that
    pidfile names, as it started after the restore began CRIU, instead of
    answering nothing, which would restore the pod again beside it."""
    async with restore_held_after_criu(shm, monkeypatch, "rp") as held:
        step, req = held.step, held.req
        work = step.work(req.request_id)
        ident = ProcessIdentity.read(work / IDENTITY)
        assert ident is not None and ident.matches(), "no identity written as CRIU returned"
        (work / IDENTITY).unlink()  # the agent died before writing it

        done = await step.recover(req, {})
        shim = step.shim_of(await step.pods.container(req.target))
        # smr-init acts on the decision in its own time: its status says
        # "running" once it has adopted the tree (30 s bounds a hang).
        for _ in range(300):
            status = await asyncio.to_thread(shim.status)
            if status[:1] == ["running"]:
                break
            await asyncio.sleep(0.1)
    assert done is not None and done.status == "succeeded", \
        f"the tree CRIU restored (root pid {ident.pid}) was not adopted: the recovery " \
        f"answered {done}, and the restore would run again beside it (smr-init: {status})"
    assert status[:1] == ["running"], f"smr-init was not told to adopt it: {status}"
    assert ident.matches(), "the recovery killed the tree it restored"
