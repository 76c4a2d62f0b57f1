"""A pod whose Python workers are started by 'spawn' and share semaphores
(a PyTorch DataLoader with spawn workers), through a heartbeat
and two drains, each resumed on the other node.

CRIU saves the creator's mapping of a semaphore (a deleted name of a file
still linked under the semaphore's name) only with --link-remap, through a
link it makes beside it in the container's /dev/shm. A pod's /dev/shm is
its own and travels with the checkpoint (devshm.tar), so the link travels
in it; the agent takes it out of the running container once captured, or
the next dump would meet it. Before, every such dump failed ('Can't create
link remap for /dev/shm/sem.XXXXXX').

REAL: containerd + runc + CRIU 4.2, smr-init, the webhook, the watcher, two
node agents, nats-server. FAKE: the API server and kubelets.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path
from typing import Any

from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import USR_IMAGE, Cluster
from tests.agent.test_injection import create, plain_pod
from tests.agent.test_programs_pods import migrate
from tests.test_spawn_semaphore import HOLDS_DELETED_NAME, PROGRAM

CKPT = "spawn-pod"
# The job of tests/test_spawn_semaphore.py (two semaphores ping-pong between
# the main process and its worker), saying how many of CRIU's links its
# /dev/shm holds.
# /dev/shm holds, and whether each semaphore file it maps is the one its name
# opens (a worker started now would share it).
POD_PROGRAM = PROGRAM.replace("import multiprocessing as mp, sys, time", """
import multiprocessing as mp, os, sys, time

def named():
    mapped = {int(ln.split()[4]) for ln in open("/proc/self/maps") if "/dev/shm/sem." in ln}
    names = {os.stat("/dev/shm/" + f).st_ino for f in os.listdir("/dev/shm")
             if f.startswith("sem.")}
    return int(bool(mapped) and mapped <= names)
""").replace(
    'print(f"step={n}", flush=True)',
    'links = sum(f.startswith("link_remap.") for f in os.listdir("/dev/shm"))\n'
    '        print(f"step={n} links={links} named={named()}", flush=True)')
STEP = re.compile(r"^step=(\d+) links=(\d+) named=(\d)$", re.M)


def spawn_pod(name: str, node: str, app: str) -> dict[str, Any]:
    p = plain_pod(name, node, image=USR_IMAGE, labels={"smr.dev/node-restore": "true"},
                  env={"SMR_CHECKPOINT": CKPT}, owner="spawn",
                  command=["/usr/bin/python3", "/app-spawn/spawner.py"])
    p["spec"]["restartPolicy"] = "Never"
    p["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "usr", "mountPath": "/usr", "readOnly": True},
        {"name": "app", "mountPath": "/app-spawn", "readOnly": True}]
    p["spec"]["volumes"] = [{"name": "usr", "hostPath": {"path": "/usr"}},
                            {"name": "app", "hostPath": {"path": app}}]
    return p


def steps(cluster: Cluster, name: str, node: str) -> list[tuple[int, int, int]]:
    return [(int(s), int(n), int(k)) for s, n, k in STEP.findall(cluster.log(name, node))]


async def more(cluster: Cluster, name: str, node: str, than: int,
               timeout: float = 60) -> list[tuple[int, int, int]]:
    deadline = time.monotonic() + timeout
    while not (got := steps(cluster, name, node)) or got[-1][0] <= than:
        assert time.monotonic() < deadline, cluster.log(name, node)[-2000:]
        await asyncio.sleep(0.1)
    return got


async def test_a_pod_with_spawn_workers_and_semaphores_through_a_heartbeat_and_two_drains(
        cluster: Cluster, tmp_path: Path) -> None:
    a, b = list(cluster.kubelets)
    (tmp_path / "spawner.py").write_text(POD_PROGRAM)
    app = str(tmp_path)
    await create(cluster, spawn_pod("spawn-a", a, app))
    await more(cluster, "spawn-a", a, 5)
    for _ in range(2):  # a second heartbeat would meet the first's links, were they left
        beat = await cluster.bus.request(CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id=CKPT, node=a, reason="heartbeat",
            leave_running=True, target=Target(kind="pod", namespace="default", pod="spawn-a",
                                              container="main")), timeout=90)
        assert beat.status == "succeeded", beat.error
        at = steps(cluster, "spawn-a", a)[-1][0]
        got = await more(cluster, "spawn-a", a, at + 3)
        assert got[-1][1:] == (0, 1), "CRIU's links left in the running container's /dev/shm"
    for src, dst, n_from, n_to in (("spawn-a", "spawn-b", a, b), ("spawn-b", "spawn-c", b, a)):
        await migrate(cluster, src, dst, n_from, n_to, app, spawn_pod, CKPT)
        before = steps(cluster, src, n_from)[-1][0]
        after = [s for s in await more(cluster, dst, n_to, before + 3)]
        # Where it stopped, its semaphores shared (it would be 'stuck' otherwise),
        # CRIU's links consumed by the restore.
        assert [s for s, _, _ in after[:4]] == list(range(before + 1, before + 5)), after[:4]
        assert after[-1][1:] == (0, 1), after[-3:]  # no link left; the names are its files


async def test_a_pod_holding_a_deleted_name_outside_dev_shm_is_refused_and_runs_on(
        cluster: Cluster, tmp_path: Path) -> None:
    """CRIU would leave its link in the container's /tmp: smr carries link
    remaps only in /dev/shm (one in a volume would not travel), so both the
    heartbeat and the drain are refused, and the pod runs on."""
    a, _ = list(cluster.kubelets)
    (tmp_path / "spawner.py").write_text(
        HOLDS_DELETED_NAME.replace("d = sys.argv[1]", 'd = "/tmp"').replace(
            'print(f"step={n}", flush=True)', 'print(f"step={n} links=0 named=0", flush=True)'))
    await create(cluster, spawn_pod("held-a", a, str(tmp_path)))
    await more(cluster, "held-a", a, 3)
    for leave_running in (True, False):
        done = await cluster.bus.request(CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id="held", node=a,
            reason="heartbeat" if leave_running else "drain", leave_running=leave_running,
            target=Target(kind="pod", namespace="default", pod="held-a", container="main")),
            timeout=90)
        assert done.status == "failed", done
        assert done.error["code"] == "link-remap-unsupported", done.error
        assert "/tmp/first" in done.error["message"], done.error
        await more(cluster, "held-a", a, steps(cluster, "held-a", a)[-1][0] + 3)  # runs on
