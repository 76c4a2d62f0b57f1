"""A GPU training Job preempted by a batch queue three times, on a machine with
an NVIDIA GPU (the device machine; skipped elsewhere).

The Indexed Job (one completion) runs the PyTorch training loop of
tests/agent/test_gpu_pods.py (fixed seeds, deterministic algorithms, a GPU
ballast it checks). The test plays Kueue as tests/agent/test_suspension_pods.py
does: the Workload evicted and ``spec.suspend: true``, then admitted again on
the other node (the old one cordoned). Each suspension must take a final
checkpoint of the index with its GPU state; each admission must resume it at
its last step + 1 with its GPU memory intact; the weights it ends with must
equal those of the same loop run once without interruption on this GPU.

Printed, not asserted, for each turn: from ``suspend: true`` to the pod's
final checkpoint durable (its preStop hook released: smr-init's hook returns
once the agent has stored the final state), and from ``suspend: false`` to
the first step the resumed pod logs.

REAL: containerd + runc + CRIU 4.2, the CUDA driver's checkpoint API, the
webhook, smr-runtime, nats-server, the watcher and two agents. FAKE: the API
server, kubelets, Job controller and scheduler (tests/fake_controllers.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes_asyncio import client

from smr import cuda_checkpoint
from tests.agent import test_gpu_pods
from tests.agent.cluster import Cluster
from tests.agent.test_gpu_pods import assert_resumed, finish, steps, train_pod
from tests.agent.test_suspension_pods import gone, index_pods, workload
from tests.fake_controllers import FakeControllers, job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not cuda_checkpoint.available(), reason="no NVIDIA driver with the CUDA checkpoint API")]

reference = test_gpu_pods.reference
JOB = "train-gpu-job"
TURNS = 3


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


def hook_released(cluster: Cluster, node: str, name: str) -> tuple[float, str]:
    """When the pod's preStop hook ended, and what it said."""
    done = [(t, what) for t, pod, _, what in cluster.kubelets[node].actions
            if pod == name and what.startswith("prestop-done")]
    assert done, f"the preStop hook of {name} did not end"
    return done[0]


async def test_a_gpu_training_job_preempted_three_times_ends_with_the_same_weights(
        cluster: Cluster, controllers: FakeControllers, reference: str) -> None:
    a, b = list(cluster.kubelets)
    jobs = client.BatchV1Api(cluster.core.api_client)
    await cluster.core.patch_node(b, {"spec": {"unschedulable": True}})
    spec = train_pod("x", None, JOB)["spec"]  # type: ignore[arg-type]
    spec["terminationGracePeriodSeconds"] = 120
    cluster.kube.put("jobs", job(JOB, {"metadata": {"labels": {"app": JOB}}, "spec": spec},
                                 completionMode="Indexed", completions=1, parallelism=1))
    uid = cluster.kube.get("jobs", JOB, "default")["metadata"]["uid"]  # type: ignore[index]
    seen: set[str] = set()
    before: list[tuple[int, str]] = []
    timings = []
    unsuspended, was = 0.0, ""
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
        await gone(cluster, name)
        released, said = hook_released(cluster, node, name)
        assert "final checkpoint done" in said, f"turn {turn + 1}: the hook said {said}"
        before = steps(cluster.log(name, node))
        latest = await cluster.store.latest("default", f"{JOB}-0")
        assert latest is not None and latest.manifest["reason"] == "suspended", (
            f"turn {turn + 1}: no final checkpoint at the suspension: "
            f"{latest and latest.manifest}")
        assert latest.manifest["gpu"]["used_bytes"] > 0, latest.manifest["gpu"]
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
    assert await finish(cluster, name, node) == reference, (
        "the weights differ from an uninterrupted run's")
    assert len(cluster.events("preempted-by-queue")) == TURNS
