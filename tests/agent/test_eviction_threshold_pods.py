"""A pod's checkpoint never takes the node's disk below the kubelet's hard
eviction threshold (there the node gets DiskPressure and the kubelet evicts
pods with no grace): a dump that would fit the free space but cross the
threshold fails with ``eviction-threshold``, and the workload runs on. The
agent's work directory is a small file system of its own; real containerd,
runc, CRIU and S3 (moto); the harness is tests/agent/cluster.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from smr.contract.messages import CkptDone, CkptRequested, Target
from tests import oci_image
from tests.agent.cluster import CMD, COUNTER, Cluster, steps, workload

IMAGE = "smr.test/layer-32m:1"
MIB = 1 << 20
# 32 MiB of data in its writable layer, then the counter: its dump's estimate
# is that plus the counter's few hundred KiB of memory.
LAYER = b"""#!/bin/sh
test -f /data/layer || head -c 33554432 /dev/urandom > /data/layer
exec /bin/counter
"""
# The work directory's file system: the dump fits it (32 MiB and a little
# memory in 36 MiB free), but would leave under 15 % of it (5.4 MiB) free,
# the kubelet's default imagefs.available threshold.
SIZE_MIB = 36


@pytest.fixture(scope="module")
def layer_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("layer")
    return oci_image.build(d / "layer.tar", IMAGE,
                           files={"/bin/counter": COUNTER, "/bin/layer": LAYER})


@contextlib.contextmanager
def work_dir_of(cluster: Cluster, size_mib: int) -> Iterator[Path]:
    """Node a's agent's pod work directory on a file system of ``size_mib``."""
    a = next(iter(cluster.kubelets))
    work = cluster.agents[a].s.work_path / "pods"
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "smr-test-small", work],
                   check=True)
    try:
        yield work
    finally:
        subprocess.run(["umount", "-l", work], check=False)


@pytest.fixture
def small_work_dir(cluster: Cluster) -> Iterator[Path]:
    with work_dir_of(cluster, SIZE_MIB) as work:
        yield work


async def checkpoint_layer(cluster: Cluster, layer_image: Path, work: Path) -> CkptDone:
    """Start the layer pod on node a and checkpoint it, leaving it running."""
    a, _ = list(cluster.kubelets)
    await cluster.kubelets[a].ctd.import_image(a, layer_image)
    p = workload("layer", a, image=IMAGE, env={"SMR_CHECKPOINT": "layer"})
    p["spec"]["containers"][0]["command"] = [*CMD[:-1], "/bin/layer"]
    cluster.kube.put("pods", p)
    await cluster.until_steps("layer", a, 3, timeout=60)
    st = os.statvfs(work)
    assert st.f_bavail * st.f_frsize > 33 * MIB, "the dump would not fit: the test proves nothing"
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="layer", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="layer", container="main")),
        timeout=120)
    assert isinstance(done, CkptDone)
    return done


@pytest.mark.kubelet_default_eviction
async def test_a_dump_that_would_cross_the_kubelets_eviction_threshold_fails_and_it_runs_on(
        cluster: Cluster, layer_image: Path, small_work_dir: Path) -> None:
    a, _ = list(cluster.kubelets)
    done = await checkpoint_layer(cluster, layer_image, small_work_dir)
    assert done.status == "failed", (
        f"a checkpoint wrote a 32 MiB layer into {SIZE_MIB} MiB, which left its file system "
        "below the kubelet's default 15 % eviction threshold")
    assert done.error["code"] == "eviction-threshold", done.error
    assert "the kubelet evicts pods" in done.error["message"], done.error
    assert os.listdir(small_work_dir) == [], "the refused dump left files behind"
    n = len(steps(cluster.log("layer", a)))
    after = await cluster.until_steps("layer", a, n + 3, timeout=30)
    assert [s for s, _, _ in after] == list(range(1, len(after) + 1)), (
        "the workload did not run on after its refused checkpoint")
    assert await cluster.store.latest("default", "layer") is None, "something was stored"


async def test_the_harness_checkpoints_pods_on_a_disk_below_the_kubelets_default_threshold(
        cluster: Cluster, layer_image: Path) -> None:
    """The harness's agents hold their own small disk floor, not the kubelet's
    default 15 % free: on a test machine whose disk is fuller than that, pod
    checkpoints still go ahead (tests/agent/conftest.py)."""
    # 128 MiB with 80 MiB taken: the 33 MiB dump leaves about 15 MiB (12 %),
    # under the default 15 % and above the harness's floor.
    with work_dir_of(cluster, 128) as work:
        (work / "ballast").write_bytes(b"\1" * (80 * MIB))
        done = await checkpoint_layer(cluster, layer_image, work)
        assert done.status == "succeeded", (
            f"a pod checkpoint on a disk under the kubelet's default threshold failed: "
            f"{done.error}; the harness sets SMR_KUBELET_EVICTION_HARD for its agents")
