"""GPU pod containers through the node agent, on a machine with an NVIDIA GPU
(the H100 device machine; skipped elsewhere).

REAL: containerd + runc + CRIU 4.2, the CUDA driver's checkpoint API, the
webhook and smr-runtime (the pods are opted in by their env var alone),
nats-server, the watcher and two agents. FAKE: the API server and kubelets
(tests/agent/cluster.py). Storage: a directory both simulated nodes share
(SMR_TEST_STORAGE=local; no S3 server runs there). The GPU reaches the
containers as the NVIDIA device plugin and runtime give it: its device nodes,
and the host's /usr (driver libraries, Python) and /opt (PyTorch) as hostPath
volumes.

The workload is a PyTorch training loop with fixed seeds and deterministic
algorithms (tests/agent/cluster.py TRAIN); the weights it ends with are
compared with those of the same loop run once without interruption.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

from services.containers import host
from services.storage.layout import template_id
from smr.contract.messages import CkptDone, CkptRequested, Target
from smr.gpu import cuda_checkpoint, gpuinfo
from tests.agent.cluster import GPU_IMAGE, TRAIN, Cluster
from tests.fake_apiserver import pod
from tests.fake_kubelet import node_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not cuda_checkpoint.available(), reason="no NVIDIA driver with the CUDA checkpoint API")]

STEPS, GIB, PAUSE = 400, 1.0, 0.05
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1", "HOME": "/tmp",
       "USER": "root"}
STEP = re.compile(r"^step (\d+) loss \S+ ballast_ok (\w+)$", re.M)
FINAL = re.compile(r"^final ([0-9a-f]{64})$", re.M)


def uninterrupted(tmp_path_factory: pytest.TempPathFactory, n: int = STEPS) -> str:
    """The weights' sha256 after ``n`` uninterrupted steps on this GPU."""
    script = tmp_path_factory.mktemp("ref") / "train.py"
    script.write_bytes(TRAIN)
    out = subprocess.run([sys.executable, str(script), str(n), str(GIB), "0"],
                         capture_output=True, text=True, env={**os.environ, **ENV}, timeout=300)
    m = FINAL.search(out.stdout)
    assert m, out.stdout[-2000:] + out.stderr[-2000:]
    return m.group(1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The weights' sha256 after STEPS uninterrupted steps on this GPU."""
    return uninterrupted(tmp_path_factory)


def train_pod(name: str, node: str, checkpoint: str, helpers: int = 0,
              gpus: int = 1, labels: dict[str, str] | None = None,
              ready: bool = False) -> dict[str, Any]:
    """``ready``: Ready (its readiness probe) once it has made 5 steps."""
    p = pod(name, node, env={"SMR_CHECKPOINT": checkpoint, **ENV}, owner=checkpoint,
            labels=labels)
    p.pop("status")
    c = p["spec"]["containers"][0]
    c["image"] = GPU_IMAGE
    # The interpreter PyTorch is installed for, as the image would name it.
    c["command"] = [sys.executable, "/app/train.py", str(STEPS), str(GIB), str(PAUSE),
                    str(helpers), str(gpus), *(["/tmp/ready"] if ready else [])]
    if ready:  # the image has no /bin: the host's /usr comes as a volume
        c["readinessProbe"] = {"exec": {"command": ["/usr/bin/test", "-f", "/tmp/ready"]},
                               "periodSeconds": 1}
    c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    c["volumeMounts"] = [{"name": "usr", "mountPath": "/usr", "readOnly": True},
                         {"name": "opt", "mountPath": "/opt", "readOnly": True}]
    p["spec"]["volumes"] = [{"name": "usr", "hostPath": {"path": "/usr"}},
                            {"name": "opt", "hostPath": {"path": "/opt"}}]
    p["spec"]["restartPolicy"] = "Never"
    return p


def steps(log: str) -> list[tuple[int, str]]:
    return [(int(a), b) for a, b in STEP.findall(log)]


async def start(cluster: Cluster, name: str, node: str, checkpoint: str,
                at_least: int = 3, timeout: float = 120, helpers: int = 0, gpus: int = 1,
                labels: dict[str, str] | None = None, ready: bool = False
                ) -> list[tuple[int, str]]:
    await cluster.core.create_namespaced_pod(
        "default", train_pod(name, node, checkpoint, helpers, gpus, labels, ready))
    stored = cluster.kube.get("pods", name, "default")
    assert stored is not None and stored["spec"]["runtimeClassName"] == "smr"
    stored["status"] = {"phase": "Pending"}
    cluster.kube.put("pods", stored)
    deadline = time.monotonic() + timeout
    while len(got := steps(cluster.log(name, node))) < at_least:
        assert time.monotonic() < deadline, cluster.log(name, node)[-3000:]
        await asyncio.sleep(0.2)
    return got


async def checkpoint(cluster: Cluster, name: str, node: str, ckpt: str, *, reason: str,
                     leave_running: bool) -> CkptDone:
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=node, reason=reason,  # type: ignore[arg-type]
        leave_running=leave_running,
        target=Target(kind="pod", namespace="default", pod=name, container="main")),
        timeout=300)
    assert isinstance(done, CkptDone) and done.status == "succeeded", done
    print(f"{reason} checkpoint of {name} on {node}: {done.durations}")
    return done


async def finish(cluster: Cluster, name: str, node: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while not (m := FINAL.search(cluster.log(name, node))):
        assert time.monotonic() < deadline, cluster.log(name, node)[-3000:]
        await asyncio.sleep(0.5)
    return m.group(1)


def assert_resumed(before: list[tuple[int, str]], after: list[tuple[int, str]]) -> None:
    first = after[0][0]
    assert 1 < first <= before[-1][0] + 1, f"not resumed: {before[-2:]} then {after[:2]}"
    assert all(ok == "True" for _, ok in after), "GPU memory changed across the restore"


async def test_training_pod_migrates_three_times_and_ends_with_the_same_weights(
        cluster: Cluster, reference: str) -> None:
    nodes = list(cluster.kubelets)
    ckpt = "train-gpu"
    node, before = nodes[0], await start(cluster, "train-0", nodes[0], ckpt)
    for i in range(1, 4):
        name = f"train-{i - 1}"
        if i == 1:
            # kubectl cordon: the watcher takes a checkpoint that leaves it running.
            await cluster.core.patch_node(node, {"spec": {"unschedulable": True}})
            manifest = await cluster.latest(ckpt)
            assert manifest["reason"] == "cordon" and manifest["gpu"]["used_bytes"] > 0
            await cluster.core.patch_node(node, {"spec": {"unschedulable": False}})
        done = await checkpoint(cluster, name, node, ckpt, reason="drain", leave_running=False)
        assert done.durations["cuda_checkpoint"] > 0
        before = steps(cluster.log(name, node))
        cluster.kube.remove("pods", name, "default")
        node = nodes[i % 2]  # the replacement lands on the other node
        after = await start(cluster, f"train-{i}", node, ckpt, at_least=1)
        assert_resumed(before, after)
        assert after[0][0] == before[-1][0] + 1, "a final checkpoint loses no step"
    assert await finish(cluster, "train-3", node) == reference


async def test_job_pod_resumes_from_a_gpu_heartbeat_after_its_container_is_killed(
        cluster: Cluster, reference: str) -> None:
    a, b = list(cluster.kubelets)
    ckpt = "train-job"
    await start(cluster, "job-1", a, ckpt, at_least=20)
    beat = await checkpoint(cluster, "job-1", a, ckpt, reason="heartbeat", leave_running=True)
    d = beat.durations
    print(f"GPU heartbeat downtime {d['downtime']:.2f}s = lock {d['cuda_lock']:.3f}s + driver "
          f"checkpoint {d['cuda_checkpoint']:.2f}s + dump {d['dump']:.2f}s + driver restore "
          f"{d.get('cuda_restore', 0):.2f}s + unlock {d.get('cuda_unlock', 0):.3f}s")
    n = len(steps(cluster.log("job-1", a)))
    await asyncio.sleep(1.0)
    assert len(steps(cluster.log("job-1", a))) > n, "a heartbeat leaves the pod running"
    # The container dies (an OOM kill, a node failure); the Job's next pod resumes
    # from the heartbeat.
    p = cluster.kube.get("pods", "job-1", "default")
    assert p is not None
    shim = host.find_shim(p["status"]["containerStatuses"][0]["containerID"].split("://")[1])
    running = shim.workload() if shim else None
    assert running, "the training process is not running"
    os.kill(running[0], signal.SIGKILL)
    before = steps(cluster.log("job-1", a))
    cluster.kube.remove("pods", "job-1", "default")
    after = await start(cluster, "job-2", b, ckpt, at_least=1)
    assert_resumed(before, after)
    assert after[0][0] <= before[-1][0], "it went back to the heartbeat, not further"
    assert await finish(cluster, "job-2", b) == reference


async def test_a_container_with_two_cuda_processes_migrates(cluster: Cluster,
                                                            reference: str) -> None:
    """A training process and a helper process (spawned, as a DataLoader
    worker or a second model server would be), both holding GPU memory on the
    one GPU: both are locked and checkpointed, both come back."""
    a, b = list(cluster.kubelets)
    ckpt = "train-two"
    await start(cluster, "two-1", a, ckpt, at_least=5, helpers=1)
    done = await checkpoint(cluster, "two-1", a, ckpt, reason="drain", leave_running=False)
    manifest = (await cluster.store.latest("default", ckpt)).manifest  # type: ignore[union-attr]
    assert manifest["gpu"]["used_bytes"] >= GIB * 1.4 * 2**30, manifest["gpu"]
    before = steps(cluster.log("two-1", a))
    cluster.kube.remove("pods", "two-1", "default")
    after = await start(cluster, "two-2", b, ckpt, at_least=5, helpers=1)
    assert_resumed(before, after)  # ballast_ok: the main and the helper's memory intact
    assert done.durations["cuda_checkpoint"] > 0
    assert await finish(cluster, "two-2", b) == reference


@pytest.mark.skipif(len(gpuinfo.devices()) < 2, reason="needs two GPUs")
async def test_a_pod_on_two_gpus_migrates(cluster: Cluster, reference: str) -> None:
    """GPU memory on two devices of one process: both come back. The GPU
    gate refuses such a process (peer access cannot be told from outside):
    run it with SMR_GPU_ALLOW=peer-access in the agents' environment."""
    a, b = list(cluster.kubelets)
    ckpt = "train-two-gpus"
    await start(cluster, "wide-1", a, ckpt, at_least=5, gpus=2)
    await checkpoint(cluster, "wide-1", a, ckpt, reason="drain", leave_running=False)
    manifest = (await cluster.store.latest("default", ckpt)).manifest  # type: ignore[union-attr]
    assert manifest["gpu"]["count"] == 2, manifest["gpu"]
    before = steps(cluster.log("wide-1", a))
    cluster.kube.remove("pods", "wide-1", "default")
    after = await start(cluster, "wide-2", b, ckpt, at_least=5, gpus=2)
    assert_resumed(before, after)
    assert await finish(cluster, "wide-2", b) == reference


def gpu_of(cluster: Cluster, name: str) -> set[str]:
    """The UUIDs of the GPUs NVML shows the pod's workload process on."""
    p = cluster.kube.get("pods", name, "default")
    assert p is not None
    shim = host.find_shim(p["status"]["containerStatuses"][0]["containerID"].split("://")[1])
    running = shim.workload() if shim else None
    assert running, f"{name}: the training process is not running"
    return {d["uuid"] for d in gpuinfo.devices() if running[0] in d["processes"]}


@pytest.mark.skipif(len(gpuinfo.devices()) < 2, reason="needs two GPUs")
async def test_a_pod_migrates_onto_the_other_gpu(cluster: Cluster, reference: str) -> None:
    """Node a's (fake) device plugin has GPU 0, node b's GPU 1.
    The pod's process is checkpointed on GPU 0 by a drain; the new pod on
    node b is given GPU 1 only (its device node, NVIDIA_VISIBLE_DEVICES), and
    the agent restores the GPU state onto it (the driver's gpuPairs, 0→1).
    NVML shows the process on GPU 1 after, and it ends with the weights of an
    uninterrupted run."""
    a, b = list(cluster.kubelets)
    gpu0, gpu1 = node_gpus()[:2]
    cluster.kubelets[a].gpus, cluster.kubelets[b].gpus = [gpu0], [gpu1]
    ckpt = "train-other-gpu"
    await start(cluster, "other-1", a, ckpt, at_least=5)
    assert gpu_of(cluster, "other-1") == {gpu0.uuid}
    done = await checkpoint(cluster, "other-1", a, ckpt, reason="drain", leave_running=False)
    manifest = (await cluster.store.latest("default", ckpt)).manifest  # type: ignore[union-attr]
    assert [d["uuid"] for d in manifest["gpu"]["devices"]] == [gpu0.uuid], manifest["gpu"]
    before = steps(cluster.log("other-1", a))
    cluster.kube.remove("pods", "other-1", "default")
    t = time.monotonic()
    after = await start(cluster, "other-2", b, ckpt, at_least=5)
    print(f"onto the other GPU: drain checkpoint {done.durations}; new pod created to its "
          f"5th step after the restore {time.monotonic() - t:.2f}s (timings, not asserted)")
    assert_resumed(before, after)
    assert after[0][0] == before[-1][0] + 1, "a final checkpoint loses no step"
    deadline = time.monotonic() + 10
    while (where := gpu_of(cluster, "other-2")) != {gpu1.uuid}:  # NVML's list may lag
        assert time.monotonic() < deadline, f"the restored process is on {where}, not GPU 1"
        await asyncio.sleep(0.5)
    assert await finish(cluster, "other-2", b) == reference


@pytest.mark.skipif(len(gpuinfo.devices()) < 2, reason="needs two GPUs")
async def test_a_replica_starts_on_the_other_gpu_from_a_template(cluster: Cluster,
                                                                 reference: str) -> None:
    """Warm starts: the template is taken on node a's GPU 0 once
    the pod is Ready; a replica on node b, whose device plugin has GPU 1
    only, starts from it there (the driver's gpuPairs, 0→1). Both end with
    the weights of an uninterrupted run."""
    a, b = list(cluster.kubelets)
    gpu0, gpu1 = node_gpus()[:2]
    cluster.kubelets[a].gpus, cluster.kubelets[b].gpus = [gpu0], [gpu1]
    await start(cluster, "tpl", a, "tpl-own", at_least=5, ready=True,
                labels={"smr.dev/snapshot-when-ready": "train"})
    manifest = await cluster.latest(template_id("train", "main"), timeout=120)
    assert manifest["reason"] == "template", manifest["reason"]
    assert [d["uuid"] for d in manifest["gpu"]["devices"]] == [gpu0.uuid], manifest["gpu"]
    t = time.monotonic()
    got = await start(cluster, "replica", b, "replica-own", at_least=5,
                      labels={"smr.dev/start-from": "train", "smr.dev/node-restore": "true"})
    print(f"replica onto the other GPU: created to its 5th step after the restore "
          f"{time.monotonic() - t:.2f}s (a timing, not asserted)")
    assert got[0][0] > 1, f"the replica started over, not from the template: {got[:2]}"
    assert all(ok == "True" for _, ok in got), "GPU memory changed across the restore"
    deadline = time.monotonic() + 10
    while (where := gpu_of(cluster, "replica")) != {gpu1.uuid}:  # NVML's list may lag
        assert time.monotonic() < deadline, f"the replica is on {where}, not GPU 1"
        await asyncio.sleep(0.5)
    assert await finish(cluster, "replica", b) == reference
    assert await finish(cluster, "tpl", a) == reference
