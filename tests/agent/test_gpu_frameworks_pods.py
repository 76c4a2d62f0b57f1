"""GPU frameworks in pod containers through the node agent, on a
machine with an NVIDIA GPU and the framework installed (the H100 device
machine; skipped elsewhere; tests/agent/test_gpu_pod_order.py runs the same
order of steps in CI with a stand-in driver).

Each workload in a pod: one heartbeat, then three drains, each resumed on the
other node; its final hash must equal that of the same loop run once without
interruption on this GPU. The workloads: a jitted JAX training loop
(tests/workloads/jax_mlp.py); PyTorch loops (tests/workloads/torch_train.py)
under ``torch.compile`` (Inductor's Triton kernels), with
``mode="reduce-overhead"`` (CUDA graphs too) and without, and fed by a
DataLoader whose two workers are started by 'spawn' (pinned memory,
persistent workers).

A Hugging Face ``transformers`` generation server (tests/workloads/hf_generate.py:
a Llama-shaped causal LM of 1.4 GiB bf16 weights, loaded with
``from_pretrained`` from a hostPath volume, greedy ``generate`` with the KV
cache over HTTP), asked in the pod's network namespace: before a heartbeat,
between it and the first drain and after each of three drains, each resumed
on the other node; every answer must be token for token that of an
uninterrupted server on this GPU.

REAL: containerd + runc + CRIU 4.2, the CUDA driver's checkpoint API, the
webhook, smr-runtime, nats-server, the watcher and two agents. FAKE: the API
server and kubelets (tests/agent/cluster.py). The framework reaches the
container as the host's /usr and /opt (and its site directory if elsewhere),
as hostPath volumes, with the host's /etc/alternatives (the CUDA toolkit's
link: ALTERNATIVES).
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from smr.gpu import cuda_checkpoint
from smr.natsserver import free_port
from tests.agent.cluster import GPU_IMAGE, Cluster, netns_pid
from tests.agent.test_gpu_pods import checkpoint
from tests.fake_apiserver import pod
from tests.helpers.netns import in_netns
from tests.workloads import hf_generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not cuda_checkpoint.available(), reason="no NVIDIA driver with the CUDA checkpoint API")]

STEPS = 300
ARGS = ["--steps", str(STEPS), "--gib", "1"]
COMMON = {"PYTHONUNBUFFERED": "1", "HOME": "/tmp"}
TORCH = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@dataclass(frozen=True)
class Workload:
    module: str  # the framework
    script: str  # in the GPU image as /app/<script>.py (tests/agent/conftest.py)
    args: list[str]
    env: dict[str, str]


WORKLOADS = {
    "jax": Workload("jax", "jax_mlp", ARGS, {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"}),
    # Inductor's compile cache in /tmp (HOME), the container's writable layer,
    # which the checkpoint carries: the compiled kernels the process maps.
    # Triton builds its launchers with the host's gcc: PATH names /usr/bin
    # (the image's own PATH is its busybox /bin). One compile thread: with
    # Inductor's pool, the second drain's dump failed ('handle_device_vma
    # plugin failed': workers forked after the restore map /dev/nvidia*
    # without a CUDA context; docs/compatibility.md, the torch.compile rows).
    "torch-compile-ro": Workload("torch", "torch_train",
                                 [*ARGS, "--compile", "reduce-overhead"],
                                 {**TORCH, "TORCHINDUCTOR_COMPILE_THREADS": "1",
                                  "PATH": "/usr/local/bin:/usr/bin:/bin"}),
    # The default mode: Inductor's Triton kernels, no CUDA graphs; one compile
    # thread for the same reason (the local job's third checkpoint failed
    # with the pool: docs/compatibility.md).
    "torch-compile": Workload("torch", "torch_train", [*ARGS, "--compile", "default"],
                              {**TORCH, "TORCHINDUCTOR_COMPILE_THREADS": "1",
                               "PATH": "/usr/local/bin:/usr/bin:/bin"}),
    # num_workers=2, pin_memory=True, persistent_workers=True, 'spawn': the
    # workers' semaphores in the pod's /dev/shm go through CRIU's link remaps
    # (tests/agent/test_spawn_pods.py); forked workers are refused
    # (gpu-forked-mapping).
    "dataloader-spawn": Workload("torch", "torch_train", [*ARGS, "--loader", "--spawn"], TORCH),
}
# The generation server: its port in the pod's own network namespace; the
# model in a hostPath volume at MODEL (the reference server saved it there).
HF_PORT, MODEL = 8731, "/model"
HF = Workload("transformers", "hf_generate", ["--dir", MODEL, "--port", str(HF_PORT)],
              {**TORCH, "HF_HUB_OFFLINE": "1"})
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


def site(module: str) -> str | None:
    """The framework's site directory where it is not under /usr or /opt
    (the pod mounts it too)."""
    spec = importlib.util.find_spec(module)
    assert spec and spec.origin
    d = str(Path(spec.origin).parents[1])
    return None if d.startswith(("/usr/", "/opt/")) else d


@pytest.fixture(params=list(WORKLOADS))
def workload(request: pytest.FixtureRequest) -> tuple[str, Workload]:
    w = WORKLOADS[request.param]
    if importlib.util.find_spec(w.module) is None:
        pytest.skip(f"no {w.module} here")
    return request.param, w


@pytest.fixture
def reference(workload: tuple[str, Workload]) -> str:
    """The final hash after STEPS uninterrupted steps on this GPU."""
    w = workload[1]
    out = subprocess.run([sys.executable, "-m", f"tests.workloads.{w.script}", *w.args],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, **COMMON, **w.env})
    m = FINAL.search(out.stdout)
    assert m, out.stdout[-2000:] + out.stderr[-2000:]
    return m.group(1)


def libcuda_dir() -> str | None:
    """Where the host's libcuda.so.1 is. Triton asks `/sbin/ldconfig -p`,
    which in the pod reads the image's /etc/ld.so.cache (none): the pod
    names it in TRITON_LIBCUDA_PATH instead."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return None
    for line in out.splitlines():
        if line.strip().startswith("libcuda.so.1 ") and "x86-64" in line:
            return os.path.dirname(line.split()[-1])
    return None


def gpu_pod(w: Workload, name: str, node: str, ckpt: str,
            volumes: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """volumes: more read-only hostPath volumes, name: (host path, mount path)."""
    extra = site(w.module)
    env = {"SMR_CHECKPOINT": ckpt, **COMMON, **w.env,
           **({"PYTHONPATH": extra} if extra else {})}
    if w.module == "torch" and (libcuda := libcuda_dir()):
        env["TRITON_LIBCUDA_PATH"] = libcuda
    p = pod(name, node, env=env, owner=ckpt)
    p.pop("status")
    c = p["spec"]["containers"][0]
    c["image"] = GPU_IMAGE
    c["command"] = [sys.executable, f"/app/{w.script}.py", *w.args]
    c["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    mounts = {"usr": ("/usr", "/usr"), "opt": ("/opt", "/opt"),
              **({"site": (extra, extra)} if extra else {})}
    if Path(ALTERNATIVES).is_dir():
        mounts["alternatives"] = (ALTERNATIVES, ALTERNATIVES)
    mounts.update(volumes or {})
    c["volumeMounts"] = [{"name": k, "mountPath": at, "readOnly": True}
                         for k, (_, at) in mounts.items()]
    p["spec"]["volumes"] = [{"name": k, "hostPath": {"path": d}} for k, (d, _) in mounts.items()]
    p["spec"]["restartPolicy"] = "Never"
    return p


def steps(cluster: Cluster, name: str, node: str) -> list[int]:
    return [int(s) for s in STEP.findall(cluster.log(name, node))]


async def create(cluster: Cluster, w: Workload, name: str, node: str, ckpt: str,
                 volumes: dict[str, tuple[str, str]] | None = None) -> None:
    await cluster.core.create_namespaced_pod("default", gpu_pod(w, name, node, ckpt, volumes))
    stored = cluster.kube.get("pods", name, "default")
    assert stored is not None and stored["spec"]["runtimeClassName"] == "smr"
    stored["status"] = {"phase": "Pending"}
    cluster.kube.put("pods", stored)


async def start(cluster: Cluster, w: Workload, name: str, node: str, ckpt: str,
                at_least: int, timeout: float = 180) -> list[int]:
    await create(cluster, w, name, node, ckpt)
    return await until(cluster, name, node, at_least, timeout)


async def until(cluster: Cluster, name: str, node: str, n: int, timeout: float = 120
                ) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(got := steps(cluster, name, node)) < n:
        assert time.monotonic() < deadline, cluster.log(name, node)[-3000:]
        await asyncio.sleep(0.2)
    return got


async def test_pod_heartbeat_and_three_drains_end_with_the_same_hash(
        cluster: Cluster, workload: tuple[str, Workload], reference: str) -> None:
    tag, w = workload
    nodes = list(cluster.kubelets)
    ckpt = f"{tag}-pod"
    node = nodes[0]
    await start(cluster, w, f"{tag}-0", node, ckpt, at_least=20)
    t = time.monotonic()
    beat = await checkpoint(cluster, f"{tag}-0", node, ckpt, reason="heartbeat",
                            leave_running=True)
    n = len(steps(cluster, f"{tag}-0", node))
    await until(cluster, f"{tag}-0", node, n + 5)  # a heartbeat leaves it running
    print(f"[{tag}-pod] heartbeat: size {beat.size_bytes / 2**30:.2f} GiB downtime "
          f"{beat.durations['downtime']:.2f}s (request {time.monotonic() - t:.1f}s) "
          f"{beat.durations}", flush=True)
    for i in range(1, 4):
        name = f"{tag}-{i - 1}"
        await until(cluster, name, node, len(steps(cluster, name, node)) + 10)
        t = time.monotonic()
        done = await checkpoint(cluster, name, node, ckpt, reason="drain", leave_running=False)
        before = steps(cluster, name, node)
        cluster.kube.remove("pods", name, "default")
        node = nodes[i % 2]  # the replacement lands on the other node
        after = await start(cluster, w, f"{tag}-{i}", node, ckpt, at_least=1)
        took = time.monotonic() - t
        assert after[0] == before[-1] + 1, f"not resumed where it stopped: {before[-2:]} " \
                                           f"then {after[:2]}"
        print(f"[{tag}-pod] drain {i}: size {done.size_bytes / 2**30:.2f} GiB, checkpoint "
              f"{done.durations}, drain to first step on the other node {took:.1f}s",
              flush=True)
    deadline = time.monotonic() + 300
    while not (m := FINAL.search(cluster.log(f"{tag}-3", node))):
        assert time.monotonic() < deadline, cluster.log(f"{tag}-3", node)[-3000:]
        await asyncio.sleep(0.5)
    print(f"[{tag}-pod] final {m.group(1)} uninterrupted {reference}", flush=True)
    assert m.group(1) == reference


@pytest.fixture
def hf_reference(tmp_path: Path) -> tuple[Path, list[list[int]]]:
    """The model, saved once (save_pretrained) by a server run uninterrupted
    on this GPU, and that server's answers to hf_generate.PROMPTS. The pods
    load the same files (from_pretrained, a read-only hostPath volume)."""
    if importlib.util.find_spec(HF.module) is None:
        pytest.skip(f"no {HF.module} here")
    model, log, port = tmp_path / "hf-model", tmp_path / "hf-reference.log", free_port()
    with open(log, "wb") as f:
        server = subprocess.Popen(
            [sys.executable, "-m", f"tests.workloads.{HF.script}", "--dir", str(model),
             "--port", str(port)], stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, **COMMON, **HF.env})
    try:
        deadline = time.monotonic() + 300
        while "ready port=" not in log.read_text(errors="replace"):
            assert server.poll() is None and time.monotonic() < deadline, \
                log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        return model, [hf_generate.ask(port, ids) for ids in hf_generate.PROMPTS]
    finally:
        server.kill()
        server.wait()


def pod_socket(pid: int) -> socket.socket:
    """A connection to the server in the network namespace of ``pid``."""
    return in_netns(pid, lambda: socket.create_connection(("127.0.0.1", HF_PORT), timeout=10))


async def answer(cluster: Cluster, name: str, node: str, ids: list[int],
                 timeout: float = 120) -> list[int]:
    """The answer of the server in pod ``name``, asked in the pod's network
    namespace (as a Service would reach it) until it listens. In a thread:
    the agents run on this loop, and a connection that reaches the restored
    socket while CRIU still restores waits (tests/agent/test_pod_sockets.py)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connect = functools.partial(pod_socket, netns_pid(cluster, name))
            return await asyncio.to_thread(hf_generate.ask, HF_PORT, ids, connect=connect)
        except (OSError, KeyError, IndexError, AssertionError, http.client.HTTPException) as e:
            assert time.monotonic() < deadline, \
                f"the server in {name} never answered ({e!r}): {cluster.log(name, node)[-3000:]}"
        await asyncio.sleep(0.2)


async def test_hf_generation_pod_answers_alike_through_a_heartbeat_and_three_drains(
        hf_reference: tuple[Path, list[list[int]]], cluster: Cluster) -> None:
    model, want = hf_reference
    nodes = list(cluster.kubelets)
    ckpt, volumes = "hf-pod", {"model": (str(model), MODEL)}
    node = nodes[0]

    async def ask(name: str, which: range) -> tuple[float, dict[int, list[int]]]:
        """The answers to PROMPTS[which], and when the first came."""
        got = {which.start: await answer(cluster, name, node, hf_generate.PROMPTS[which.start])}
        first = time.monotonic()
        for i in which[1:]:
            got[i] = await answer(cluster, name, node, hf_generate.PROMPTS[i])
        return first, got

    def check(phase: str, got: dict[int, list[int]]) -> None:
        equal = {i: tokens == want[i] for i, tokens in got.items()}
        print(f"[hf-pod] {phase}: equal {list(equal.values())}", flush=True)
        assert all(equal.values()), \
            f"{phase}: {got} where the uninterrupted server said {[want[i] for i in got]}"

    await create(cluster, HF, "hf-0", node, ckpt, volumes)
    deadline = time.monotonic() + 300
    while "ready port=" not in cluster.log("hf-0", node):
        assert time.monotonic() < deadline, cluster.log("hf-0", node)[-3000:]
        await asyncio.sleep(0.5)
    check("before the heartbeat", (await ask("hf-0", range(0, 3)))[1])
    t = time.monotonic()
    beat = await checkpoint(cluster, "hf-0", node, ckpt, reason="heartbeat", leave_running=True)
    print(f"[hf-pod] heartbeat: size {beat.size_bytes / 2**30:.2f} GiB downtime "
          f"{beat.durations['downtime']:.2f}s (request {time.monotonic() - t:.1f}s) "
          f"{beat.durations}", flush=True)
    check("between the heartbeat and the first drain", (await ask("hf-0", range(3, 6)))[1])
    for i in range(1, 4):
        name = f"hf-{i - 1}"
        t = time.monotonic()
        done = await checkpoint(cluster, name, node, ckpt, reason="drain", leave_running=False)
        cluster.kube.remove("pods", name, "default")
        node = nodes[i % 2]  # the replacement lands on the other node
        await create(cluster, HF, f"hf-{i}", node, ckpt, volumes)
        first, got = await ask(f"hf-{i}", range(6, 9))
        print(f"[hf-pod] drain {i}: size {done.size_bytes / 2**30:.2f} GiB, checkpoint "
              f"{done.durations}, drain to the first answer on the other node "
              f"{first - t:.1f}s", flush=True)
        # Restored, not started anew (which would answer alike too).
        assert "ready port=" not in cluster.log(f"hf-{i}", node), \
            f"the server in hf-{i} started anew: {cluster.log(f'hf-{i}', node)[-2000:]}"
        check(f"after drain {i}", got)
