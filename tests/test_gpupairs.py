"""Which GPUs a restore puts GPU state onto (smr.gpu.gpupairs), and which GPUs a
pod container was given (services/containers/gpus): no GPU needed, the GPUs
are dicts as smr.gpu.gpuinfo.devices gives them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from services.containers import gpus
from services.restorer.pod import PodRestoreStep
from smr.contract.errors import ContractError, PermanentError
from smr.contract.messages import RestoreRequested, Target
from smr.gpu import gpuinfo, gpupairs
from smr.gpu.gpuinfo import GpuMismatch
from smrctl.args import gpu_list

MIB = 1 << 20
H200 = "NVIDIA H200"
U = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-00000000000{i}" for i in range(4)]


def gpu(i: int, model: str = H200, free: int = 1000 * MIB) -> dict[str, Any]:
    return {"index": i, "uuid": U[i], "model": model, "minor": i, "memory_total": 2 * free,
            "memory_free": free, "processes": {}}


def record(*devs: tuple[int, int], model: str = H200) -> dict[str, Any]:
    """A manifest's ``gpu``: (GPU index, MiB used) for each device."""
    held = [{"uuid": U[i], "model": model, "memory_total": 2000 * MIB, "used_bytes": m * MIB}
            for i, m in devs]
    return {"model": model, "count": len(held), "used_bytes": sum(h["used_bytes"] for h in held),
            "devices": held}


def test_the_same_gpus_pass_no_pairs() -> None:
    assert gpupairs.decide(record((0, 500)), [gpu(0)], "ck") is None
    # More GPUs than it used, its own among them: still none.
    assert gpupairs.decide(record((1, 500)), [gpu(0), gpu(1)], "ck") is None
    assert gpupairs.decide(record((0, 10), (1, 10)), [gpu(0), gpu(1)], "ck") is None


def test_a_manifest_without_gpu_uuids_passes_no_pairs() -> None:
    old = {"model": H200, "count": 1, "used_bytes": MIB}  # before smr recorded the devices
    assert gpupairs.decide(old, [gpu(1)], "ck") is None
    assert gpupairs.decide(None, [gpu(1)], "ck") is None


def test_another_gpu_gets_the_pairs_in_order() -> None:
    assert gpupairs.decide(record((0, 500)), [gpu(1)], "ck") == [(U[0], U[1])]
    assert gpupairs.decide(record((0, 10), (1, 10)), [gpu(2), gpu(3)], "ck") == [
        (U[0], U[2]), (U[1], U[3])]
    # One of its GPUs here, the other not: every checkpointed GPU is named.
    assert gpupairs.decide(record((0, 10), (1, 10)), [gpu(0), gpu(2)], "ck") == [
        (U[0], U[0]), (U[1], U[2])]


def test_its_own_gpu_without_room_is_passed_over_for_one_with_room() -> None:
    full = gpu(0, free=100 * MIB)
    assert gpupairs.decide(record((0, 500)), [full, gpu(1)], "ck") == [(U[0], U[1])]


@pytest.mark.parametrize(("targets", "why"), [
    ([], "it held 1 GPU(s) and 0 can take it here"),
    ([gpu(1, model="NVIDIA H100 80GB HBM3")], "none of its model"),
    ([gpu(1, free=100 * MIB)], "too little free memory"),
])
def test_a_mismatch_is_refused_naming_both_sides(targets: list[dict[str, Any]],
                                                 why: str) -> None:
    with pytest.raises(GpuMismatch) as e:
        gpupairs.decide(record((0, 500)), targets, "checkpoint ck generation 3")
    msg = e.value.message
    assert why in msg and "checkpoint ck generation 3" in msg and U[0] in msg, msg
    assert all(t["uuid"] in msg for t in targets), msg
    assert e.value.code == "gpu-mismatch"


def test_two_gpus_do_not_go_onto_one() -> None:
    with pytest.raises(GpuMismatch, match="held 2 GPU"):
        gpupairs.decide(record((0, 10), (1, 10)), [gpu(2)], "ck")


def test_smr_restore_gpus_names_this_nodes_gpus_in_its_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpuinfo, "devices", lambda: [gpu(0), gpu(1), gpu(2)])
    assert [d["uuid"] for d in gpupairs.node_targets(None)] == U[:3]
    assert [d["uuid"] for d in gpupairs.node_targets([U[2], U[0]])] == [U[2], U[0]]
    with pytest.raises(GpuMismatch, match="not a GPU of this node") as e:
        gpupairs.node_targets([U[3]])
    assert e.value.code == "invalid-gpu"
    with pytest.raises(GpuMismatch, match="twice"):
        gpupairs.node_targets([U[1], U[1]])


def test_the_gpus_option_takes_gpu_uuids_only() -> None:
    assert gpu_list(f"{U[1]},{U[0]}") == [U[1], U[0]]
    for bad in ("0", "GPU-1", f"{U[0]},{U[0]}", "", f"{U[0]},../x"):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_list(bad)


# -- a pod container's GPUs, from its runtime's spec ------------------------------------

NODE = [gpu(0), gpu(1), gpu(2)]


def spec(devices: list[tuple[int, int]] = (), env: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {"process": {"env": ["PATH=/bin", *env]},
            "linux": {"devices": [{"path": f"/dev/x{mi}", "type": "c", "major": ma,
                                   "minor": mi} for ma, mi in devices]}}


def test_the_device_nodes_in_the_spec_are_the_containers_gpus() -> None:
    got = gpus.granted(spec([(195, 1), (195, 255), (195, 254), (511, 0)]), NODE)
    assert got is not None and [d["uuid"] for d in got] == [U[1]]
    # What the env says does not add a GPU where the spec has device nodes.
    got = gpus.granted(spec([(195, 2)], [f"NVIDIA_VISIBLE_DEVICES={U[0]}"]), NODE)
    assert got is not None and [d["uuid"] for d in got] == [U[2]]


def test_without_device_nodes_the_env_names_them() -> None:
    named = gpus.granted(spec(env=[f"NVIDIA_VISIBLE_DEVICES={U[2]},0"]), NODE)
    assert named is not None and [d["uuid"] for d in named] == [U[0], U[2]]  # node order
    assert gpus.granted(spec(env=["NVIDIA_VISIBLE_DEVICES=all"]), NODE) == NODE
    assert gpus.granted(spec(env=["NVIDIA_VISIBLE_DEVICES=void"]), NODE) == []
    assert gpus.granted(spec(), NODE) == []
    # The last one counts (a pod spec's own env comes after the device plugin's).
    last = gpus.granted(spec(env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=1"]),
                        NODE)
    assert last is not None and [d["uuid"] for d in last] == [U[1]]
    # The device plugin's volume-mounts strategy: a mount named for each GPU.
    mounted = spec(env=[f"NVIDIA_VISIBLE_DEVICES={gpus.VOLUME_MOUNTS}"])
    mounted["mounts"] = [{"destination": "/proc"},
                         {"destination": f"{gpus.VOLUME_MOUNTS}/{U[1]}", "source": "/dev/null"}]
    got = gpus.granted(mounted, NODE)
    assert got is not None and [d["uuid"] for d in got] == [U[1]]
    # What this cannot tell (a MIG device): unknown, not guessed.
    assert gpus.granted(spec(env=["NVIDIA_VISIBLE_DEVICES=MIG-abc"]), NODE) is None


def test_a_gpu_the_env_names_without_its_device_node_is_refused() -> None:
    """A tenant's pod spec may set NVIDIA_VISIBLE_DEVICES; a GPU it names
    that the container has no device node of is refused (this process's
    /dev, as a container's, has no /dev/nvidia1 here)."""
    if Path("/dev/nvidia1").exists():
        pytest.skip("this machine has a /dev/nvidia1")
    with pytest.raises(gpus.ContainerGpuError) as e:
        gpus.granted(spec(env=[f"NVIDIA_VISIBLE_DEVICES={U[1]}"]), NODE, os.getpid())
    assert e.value.code == "gpu-not-granted" and "/dev/nvidia1" in e.value.message


def test_a_bundle_is_found_only_through_a_root_runtime_outside_the_container() -> None:
    # This test's process: its parent is in its own PID namespace, so no bundle.
    assert gpus.runtime_spec(os.getpid(), "abc") is None
    assert gpus.runtime_spec(os.getpid(), "../etc") is None


# -- the request ------------------------------------------------------------------------

def local_restore(**kw: Any) -> RestoreRequested:
    return RestoreRequested(request_id="r1", checkpoint_id="ck", target=Target.job("ck"),
                            node="n1", **kw)


def test_a_restore_request_carries_gpu_uuids_only() -> None:
    req = local_restore(gpus=[U[1], U[0]])
    assert RestoreRequested.from_payload(req.to_payload()).gpus == [U[1], U[0]]
    assert "gpus" not in orjson.loads(local_restore().to_payload())  # absent: the node chooses
    for bad in (["0"], [U[0], U[0]], [], [f"{U[0]}/.."]):
        with pytest.raises(ContractError):
            local_restore(gpus=bad).to_payload()


async def test_a_pod_restore_naming_gpus_is_refused() -> None:
    """A tenant may publish restore requests for its own pods: the GPUs a
    pod's state goes onto are its container's, never the request's."""
    req = RestoreRequested(request_id="r1", checkpoint_id="ck", node="n1", gpus=[U[1]],
                           target=Target(kind="pod", namespace="t", pod="p", container="main"))
    with pytest.raises(PermanentError) as e:
        await PodRestoreStep.gpu_pairs(SimpleNamespace(cuda=None), req,  # type: ignore[arg-type]
                                       None, None, None)  # type: ignore[arg-type]
    assert e.value.code == "gpus-not-for-pods"


async def test_a_pod_restore_recovery_counts_the_restored_trees_gpu_memory_as_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A recovery decides the pairs again for the tree CRIU restored, whose
    GPU state the driver may already have put back: that memory is the
    tree's own (here this test's process holds 990 MiB of the 1000 MiB the
    checkpoint needs). Counted as taken, the recovery refuses with 'too little
    free memory' and the tree, running again, is ended and restored twice."""
    held = {**gpu(0, free=10 * MIB), "processes": {os.getpid(): 990 * MIB}}
    monkeypatch.setattr(gpuinfo, "devices", lambda: [held])
    monkeypatch.setattr(gpus, "container_gpus", lambda pid, cid, node: node)
    step = SimpleNamespace(cuda=object())
    req = RestoreRequested(request_id="r1", checkpoint_id="ck", node="n1",
                           target=Target(kind="pod", namespace="t", pod="p", container="main"))
    gen = SimpleNamespace(manifest={"checkpoint_id": "ck", "gpu": record((0, 1000))}, number=1)
    c, shim = SimpleNamespace(container_id="abc"), SimpleNamespace(pid=1)
    with pytest.raises(GpuMismatch, match="too little free memory"):  # run(): it is taken
        await PodRestoreStep.gpu_pairs(step, req, gen, c, shim)  # type: ignore[arg-type]
    assert await PodRestoreStep.gpu_pairs(step, req, gen, c, shim,  # type: ignore[arg-type]
                                          restored=os.getpid()) is None  # onto its own GPU
