"""A pod's checkpoint writes no more of its writable layer and /dev/shm into
the node's disk than its ephemeral-storage limit: over it, the checkpoint
fails with ``capture-too-large`` and the workload runs on. Real containerd,
runc, CRIU and S3 (moto); the harness is tests/agent/cluster.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from smr.contract.messages import CkptDone, CkptRequested, Target
from tests import oci_image
from tests.agent.cluster import CMD, COUNTER, Cluster, steps, workload

IMAGE = "smr.test/dense-layer:1"
# 4 MiB of data in its writable layer, then the counter.
DENSE = b"""#!/bin/sh
test -f /data/dense || head -c 4194304 /dev/urandom > /data/dense
exec /bin/counter
"""


@pytest.fixture(scope="module")
def dense_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dense")
    return oci_image.build(d / "dense.tar", IMAGE,
                           files={"/bin/counter": COUNTER, "/bin/dense": DENSE})


@pytest.fixture
async def dense(cluster: Cluster, dense_image: Path) -> Cluster:
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, dense_image)
    return cluster


async def test_a_final_checkpoint_over_the_pods_ephemeral_storage_limit_fails_and_it_runs_on(
        dense: Cluster) -> None:
    a, _ = list(dense.kubelets)
    p = workload("dense", a, image=IMAGE, env={"SMR_CHECKPOINT": "dense"})
    c = p["spec"]["containers"][0]
    c["command"] = [*CMD[:-1], "/bin/dense"]
    c["resources"] = {"limits": {"ephemeral-storage": "1Mi"}}
    dense.kube.put("pods", p)
    await dense.until_steps("dense", a, 5, timeout=60)
    done = await dense.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="dense", node=a, leave_running=False,
        target=Target(kind="pod", namespace="default", pod="dense", container="main")),
        timeout=120)
    assert isinstance(done, CkptDone)
    assert done.status == "failed", (
        "a checkpoint saved a 4 MiB layer of a container limited to 1 MiB of ephemeral storage")
    assert done.error["code"] == "capture-too-large", done.error
    assert "ephemeral-storage limit" in done.error["message"], done.error
    n = len(steps(dense.log("dense", a)))
    after = await dense.until_steps("dense", a, n + 5, timeout=30)
    assert [s for s, _, _ in after] == list(range(1, len(after) + 1)), (
        "the workload did not run on after its failed checkpoint")
    assert await dense.store.latest("default", "dense") is None, "something was stored"
