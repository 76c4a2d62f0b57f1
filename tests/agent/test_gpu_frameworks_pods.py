"""GPU frameworks in pod containers through the node agent (issue #26), on a
machine with an NVIDIA GPU and the framework installed (the H100 device
machine; skipped elsewhere; tests/agent/test_gpu_pod_order.py runs the same
order of steps in CI with a stand-in driver).

A jitted JAX training loop (smr/workloads/jax_mlp.py) in a pod: one heartbeat,
then three drains, each resumed on the other node; its final hash must equal
that of the same loop run once without interruption on this GPU.

REAL: containerd + runc + CRIU 4.2, the CUDA driver's checkpoint API, the
webhook, smr-runtime, nats-server, the watcher and two agents. FAKE: the API
server and kubelets (tests/agent/cluster.py). The framework reaches the
container as the host's /usr and /opt (and its site directory if elsewhere),
as hostPath volumes, with the host's /etc/alternatives (the CUDA toolkit's
link: ALTERNATIVES).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from smr import cuda_checkpoint
from tests.agent.cluster import GPU_IMAGE, Cluster
from tests.agent.test_gpu_pods import checkpoint
from tests.fake_apiserver import pod

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not cuda_checkpoint.available(), reason="no NVIDIA driver with the CUDA checkpoint API"),
    pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="no jax here")]

STEPS = 300
ARGS = ["--steps", str(STEPS), "--gib", "1"]
ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1", "HOME": "/tmp",
       "XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"}
# XLA compiles with the CUDA toolkit's ptxas and nvlink, found on the H100
# machine as /usr/local/cuda/bin/*: /usr/local/cuda is a link through
# Debian's alternatives (/etc/alternatives/cuda -> /usr/local/cuda-13.0),
# which a pod given only the host's /usr and /opt cannot follow ('Couldn't
# find a suitable version of ptxas'; copies under /cuda named by
# --xla_gpu_cuda_data_dir were not looked at either). jax's own CUDA path is
# None there (its venv has no nvidia/cu13/bin, no CUDA_ROOT is set). So the
# pod gets the host's alternatives too, as an image built FROM a CUDA base
# has its own.
ALTERNATIVES = "/etc/alternatives"
STEP = re.compile(r"^step=(\d+) ", re.M)
FINAL = re.compile(r"^final=([0-9a-f]{64}) ballast_ok=True", re.M)


def site() -> str | None:
    """jax's site directory where it is not under /usr or /opt (the pod
    mounts it too)."""
    spec = importlib.util.find_spec("jax")
    assert spec and spec.origin
    d = str(Path(spec.origin).parents[1])
    return None if d.startswith(("/usr/", "/opt/")) else d


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final hash after STEPS uninterrupted steps on this GPU."""
    out = subprocess.run([sys.executable, "-m", "smr.workloads.jax_mlp", *ARGS],
                         capture_output=True, text=True, env={**os.environ, **ENV}, timeout=300)
    m = FINAL.search(out.stdout)
    assert m, out.stdout[-2000:] + out.stderr[-2000:]
    return m.group(1)


def jax_pod(name: str, node: str, ckpt: str) -> dict[str, Any]:
    extra = site()
    env = {"SMR_CHECKPOINT": ckpt, **ENV, **({"PYTHONPATH": extra} if extra else {})}
    p = pod(name, node, env=env, owner=ckpt)
    p.pop("status")
    c = p["spec"]["containers"][0]
    c["image"] = GPU_IMAGE
    c["command"] = [sys.executable, "/app/jax_mlp.py", *ARGS]
    c["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    mounts = {"usr": "/usr", "opt": "/opt", **({"site": extra} if extra else {})}
    if Path(ALTERNATIVES).is_dir():
        mounts["alternatives"] = ALTERNATIVES
    c["volumeMounts"] = [{"name": k, "mountPath": v, "readOnly": True} for k, v in mounts.items()]
    p["spec"]["volumes"] = [{"name": k, "hostPath": {"path": v}} for k, v in mounts.items()]
    p["spec"]["restartPolicy"] = "Never"
    return p


def steps(cluster: Cluster, name: str, node: str) -> list[int]:
    return [int(s) for s in STEP.findall(cluster.log(name, node))]


async def start(cluster: Cluster, name: str, node: str, ckpt: str, at_least: int,
                timeout: float = 180) -> list[int]:
    await cluster.core.create_namespaced_pod("default", jax_pod(name, node, ckpt))
    stored = cluster.kube.get("pods", name, "default")
    assert stored is not None and stored["spec"]["runtimeClassName"] == "smr"
    stored["status"] = {"phase": "Pending"}
    cluster.kube.put("pods", stored)
    return await until(cluster, name, node, at_least, timeout)


async def until(cluster: Cluster, name: str, node: str, n: int, timeout: float = 120
                ) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(got := steps(cluster, name, node)) < n:
        assert time.monotonic() < deadline, cluster.log(name, node)[-3000:]
        await asyncio.sleep(0.2)
    return got


async def test_jax_pod_heartbeat_and_three_drains_end_with_the_same_hash(
        cluster: Cluster, reference: str) -> None:
    nodes = list(cluster.kubelets)
    ckpt = "jax-pod"
    node = nodes[0]
    await start(cluster, "jax-0", node, ckpt, at_least=20)
    t = time.monotonic()
    beat = await checkpoint(cluster, "jax-0", node, ckpt, reason="heartbeat",
                            leave_running=True)
    n = len(steps(cluster, "jax-0", node))
    await until(cluster, "jax-0", node, n + 5)  # a heartbeat leaves it running
    print(f"[jax-pod] heartbeat: size {beat.size_bytes / 2**30:.2f} GiB downtime "
          f"{beat.durations['downtime']:.2f}s (request {time.monotonic() - t:.1f}s) "
          f"{beat.durations}", flush=True)
    for i in range(1, 4):
        name = f"jax-{i - 1}"
        await until(cluster, name, node, len(steps(cluster, name, node)) + 10)
        t = time.monotonic()
        done = await checkpoint(cluster, name, node, ckpt, reason="drain", leave_running=False)
        before = steps(cluster, name, node)
        cluster.kube.remove("pods", name, "default")
        node = nodes[i % 2]  # the replacement lands on the other node
        after = await start(cluster, f"jax-{i}", node, ckpt, at_least=1)
        took = time.monotonic() - t
        assert after[0] == before[-1] + 1, f"not resumed where it stopped: {before[-2:]} " \
                                           f"then {after[:2]}"
        print(f"[jax-pod] drain {i}: size {done.size_bytes / 2**30:.2f} GiB, checkpoint "
              f"{done.durations}, drain to first step on the other node {took:.1f}s",
              flush=True)
    deadline = time.monotonic() + 300
    while not (m := FINAL.search(cluster.log("jax-3", node))):
        assert time.monotonic() < deadline, cluster.log("jax-3", node)[-3000:]
        await asyncio.sleep(0.5)
    print(f"[jax-pod] final {m.group(1)} uninterrupted {reference}", flush=True)
    assert m.group(1) == reference
