"""A GPU training Job preempted by a batch queue three times, on a machine with
an NVIDIA GPU (the device machine; skipped elsewhere).

The Indexed Job (one completion) runs the PyTorch training loop of
tests/agent/test_gpu_pods.py (fixed seeds, deterministic algorithms, a GPU
ballast it checks), STEPS long. The test plays Kueue as tests/agent/test_suspension_pods.py
does: the Workload evicted and ``spec.suspend: true``, then admitted again on
the other node (the old one cordoned). Each suspension must take a final
checkpoint of the index with its GPU state; each admission must resume it at
its last step + 1 with its GPU memory intact; the weights it ends with must
equal those of the same loop run once without interruption on this GPU.

Printed, not asserted, for each turn: from ``suspend: true`` to the pod's
final checkpoint durable (the store's latest of the index, looked for every
50 ms), and from ``suspend: false`` to the first step the resumed pod logs;
at the end, the final weights' sha256 beside the uninterrupted run's.

REAL: containerd + runc + CRIU 4.2, the CUDA driver's checkpoint API, the
webhook, smr-runtime, nats-server, the watcher and two agents. FAKE: the API
server, kubelets, Job controller and scheduler (tests/fake_controllers.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kubernetes_asyncio import client

from smr.gpu import cuda_checkpoint
from tests.agent.cluster import Cluster
from tests.agent.test_gpu_pods import assert_resumed, finish, steps, train_pod, uninterrupted
from tests.agent.test_suspension_pods import gone, index_pods, workload
from tests.fake_controllers import FakeControllers, job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not cuda_checkpoint.available(), reason="no NVIDIA driver with the CUDA checkpoint API")]

JOB = "train-gpu-job"
TURNS = 3
# Enough steps that the loop cannot end before its third suspension, however
# long each suspension and admission takes (each turn waits for 20 steps).
STEPS = 1500


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return uninterrupted(tmp_path_factory, STEPS)


def job_spec() -> dict[str, Any]:
    """The pod template of the training Job: test_gpu_pods.py's pod, STEPS long."""
    spec: dict[str, Any] = train_pod("x", None, JOB)["spec"]  # type: ignore[arg-type]
    argv = spec["containers"][0]["command"]
    argv[2] = str(STEPS)  # [python, /app/train.py, steps, GiB, pause, ...]
    spec["terminationGracePeriodSeconds"] = 120
    return spec


async def first_step(cluster: Cluster, name: str, node: str, at_least: int = 1,
                     timeout: float = 180) -> tuple[list[tuple[int, str]], float]:
    """The pod's steps once it has logged ``at_least``, and when it logged its first."""
    deadline = time.monotonic() + timeout
    first = None
    while len(got := steps(cluster.log(name, node))) < at_least:
        if got and first is None:
            first = time.monotonic()
        assert time.monotonic() < deadline, cluster.log(name, node)[-3000:]
        await asyncio.sleep(0.05)
    return got, first if first is not None else time.monotonic()


async def durable(cluster: Cluster, ckpt: str, after: int, name: str, node: str,
                  timeout: float = 180) -> tuple[float, Any]:
    """When a final checkpoint of ``ckpt`` newer than generation ``after``
    became its latest (looked for every 50 ms), and that generation."""
    deadline = time.monotonic() + timeout
    while True:
        gen = await cluster.store.latest("default", ckpt)
        if gen is not None and gen.number > after and gen.manifest["reason"] == "suspended":
            return time.monotonic(), gen
        if time.monotonic() > deadline:
            events = [(e["reason"], e["message"]) for e in cluster.kube.list("events", "default")
                      if e["involvedObject"]["name"] == name]
            acts = [x[3] for x in cluster.kubelets[node].actions if x[1] == name]
            raise AssertionError(
                f"no final checkpoint of {ckpt} after the suspension (latest: "
                f"{gen and gen.manifest.get('reason')}); Events on {name}: {events}; its "
                f"kubelet did {acts}; its log ends {cluster.log(name, node)[-600:]!r}")
        await asyncio.sleep(0.05)


def hook_said(cluster: Cluster, node: str, name: str) -> str:
    done = [what for _, pod, _, what in cluster.kubelets[node].actions
            if pod == name and what.startswith("prestop-done")]
    return done[0] if done else "no preStop hook ended"


async def test_a_gpu_training_job_preempted_three_times_ends_with_the_same_weights(
        cluster: Cluster, controllers: FakeControllers, reference: str) -> None:
    a, b = list(cluster.kubelets)
    jobs = client.BatchV1Api(cluster.core.api_client)
    await cluster.core.patch_node(b, {"spec": {"unschedulable": True}})
    cluster.kube.put("jobs", job(JOB, {"metadata": {"labels": {"app": JOB}}, "spec": job_spec()},
                                 completionMode="Indexed", completions=1, parallelism=1))
    uid = cluster.kube.get("jobs", JOB, "default")["metadata"]["uid"]  # type: ignore[index]
    seen: set[str] = set()
    before: list[tuple[int, str]] = []
    timings = []
    unsuspended, was, generation = 0.0, "", 0
    for turn in range(TURNS + 1):
        (name, node), = (await index_pods(cluster, controllers, seen, timeout=120,
                                          n=1)).values()
        after, first_at = await first_step(cluster, name, node, at_least=20)
        if turn:
            assert node != was, f"admission {turn}: the pod came back on the cordoned {was}"
            assert_resumed(before, after)
            assert after[0][0] == before[-1][0] + 1, (
                f"admission {turn}: steps lost or done twice (stopped at {before[-1][0]}, "
                f"went on at {after[0][0]})")
            timings[-1]["unsuspend_to_first_step_s"] = first_at - unsuspended
            print(f"turn {turn}: suspend: true to the final checkpoint durable "
                  f"{timings[-1]['suspend_to_durable_s']:.2f}s; suspend: false to the first "
                  f"step after the restore {timings[-1]['unsuspend_to_first_step_s']:.2f}s "
                  f"(step {after[0][0]} on {node}; checkpoint {timings[-1]['size_gib']:.2f} "
                  f"GiB, GPU {timings[-1]['gpu_gib']:.2f} GiB)")
        if turn == TURNS:
            break
        # Kueue preempts: the Workload evicted, the Job suspended.
        cluster.kube.put("workloads", workload(uid, evicted=True))
        suspended = time.monotonic()
        await jobs.patch_namespaced_job(JOB, "default", {"spec": {"suspend": True}})
        released, latest = await durable(cluster, f"{JOB}-0", generation, name, node)
        generation = latest.number
        await gone(cluster, name)
        print(f"turn {turn + 1}: the preStop hook of {name}: {hook_said(cluster, node, name)}")
        before = steps(cluster.log(name, node))
        assert latest.manifest["gpu"]["used_bytes"] > 0, latest.manifest["gpu"]
        assert (await cluster.store.latest("default", f"{JOB}-0")).number == generation, (  # type: ignore[union-attr]
            "a checkpoint after the final one")
        timings.append({"suspend_to_durable_s": released - suspended,
                        "size_gib": latest.size_bytes / 2**30,
                        "gpu_gib": latest.manifest["gpu"]["used_bytes"] / 2**30})
        # Admitted again, on the other node.
        was = node
        other = b if was == a else a
        await cluster.core.patch_node(other, {"spec": {"unschedulable": False}})
        await cluster.core.patch_node(was, {"spec": {"unschedulable": True}})
        cluster.kube.put("workloads", workload(uid, evicted=False))
        unsuspended = time.monotonic()
        await jobs.patch_namespaced_job(JOB, "default", {"spec": {"suspend": False}})
    final = await finish(cluster, name, node)
    print(f"final weights sha256 {final} after {TURNS} suspensions; uninterrupted run "
          f"{reference}: {'equal' if final == reference else 'DIFFERENT'}")
    assert final == reference, "the weights differ from an uninterrupted run's"
    assert len(cluster.events("preempted-by-queue")) == TURNS
