"""Which GPUs a checkpoint's GPU state goes back onto.

The checkpoint's manifest records the GPUs its processes held (``gpu.devices``:
uuid, model, used_bytes; smr.gpu.gpuinfo.job_gpus). A restore has target GPUs:
for a local job this node's (or those ``smr restore --gpus`` names), for a
pod container those the runtime gave the new container
(services/containers/gpus). Where every checkpointed GPU is among the
targets, with room, nothing is passed to the driver: it restores onto the
GPUs the process had, as it always did. Otherwise each checkpointed GPU is
paired, in order, with the next target GPU of its model with room for its
memory, and the driver's restore gets the pairs
(CUcheckpointRestoreArgs.gpuPairs, driver 580; smr.gpu.driver.Driver.
restore). What cannot be paired is refused here, before a byte is
downloaded or CRIU runs.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from smr.gpu import gpuinfo
from smr.gpu.gpuinfo import GpuMismatch

log = logging.getLogger("smr.gpu")

Pairs = list[tuple[str, str]]  # (checkpointed GPU's UUID, GPU to restore onto)
# A GPU's UUID as NVML and nvidia-smi -L give it (schemas/restore.requested.json).
GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                      r"[0-9a-fA-F]{12}")


def decide(record: dict[str, Any] | None, targets: list[dict[str, Any]],
           what: str) -> Pairs | None:
    """The pairs for the driver's restore; None where the checkpointed GPUs
    are all among ``targets`` with room (or the record names no GPU by
    UUID: a manifest from before smr recorded them). ``targets``: dicts as
    smr.gpu.gpuinfo.devices gives them (uuid, model, memory_free), in the order
    to pair them in. Raises GpuMismatch naming both sides."""
    saved = [d for d in (record or {}).get("devices") or [] if d.get("uuid")]
    if not saved:
        return None
    here = {t["uuid"]: t for t in targets}
    if all(d["uuid"] in here and _fits(d, here[d["uuid"]]) for d in saved):
        return None
    if len(targets) < len(saved):
        raise _mismatch(what, saved, targets,
                        f"it held {len(saved)} GPU(s) and {len(targets)} can take it here")
    pairs: Pairs = []
    left = list(targets)
    for d in saved:
        fit = next((t for t in left if _fits(d, t)), None)
        if fit is None:
            why = (f"no GPU left here for {_name(d)}: "
                   + ("none of its model" if not any(t["model"] == d["model"] for t in left)
                      else "too little free memory"))
            raise _mismatch(what, saved, targets, why)
        left.remove(fit)
        pairs.append((d["uuid"], fit["uuid"]))
    log.info("%s: GPU state restored onto other GPUs: %s", what,
             ", ".join(f"{old} -> {new}" for old, new in pairs))
    return pairs


def node_targets(chosen: list[str] | None = None) -> list[dict[str, Any]]:
    """A local job's target GPUs: this node's, in index order, or those
    ``chosen`` names (``smr restore --gpus``), in the order named; a GPU
    that is not this node's is refused."""
    here = gpuinfo.devices()
    if not chosen:
        return here
    by_uuid = {d["uuid"]: d for d in here}
    if len(set(chosen)) != len(chosen):
        raise GpuMismatch(f"--gpus names a GPU twice: {','.join(chosen)}", code="invalid-gpu",
                          hint="name each GPU once, by the UUID nvidia-smi -L prints")
    unknown = [u for u in chosen if u not in by_uuid]
    if unknown:
        raise GpuMismatch(
            f"--gpus names {', '.join(unknown)}, not a GPU of this node (it has "
            f"{', '.join(by_uuid) or 'none'})", code="invalid-gpu",
            hint="name GPUs of the node that restores, by the UUID nvidia-smi -L prints")
    return [by_uuid[u] for u in chosen]


def holding(targets: list[dict[str, Any]], pids: list[int]) -> list[dict[str, Any]]:
    """``targets`` with the GPU memory ``pids`` hold counted as free: a
    recovery's restored processes may hold theirs already (the driver's
    restore done before the worker died), and that is room for them."""
    mine = set(pids)
    return [{**t, "memory_free": t.get("memory_free", 0) + sum(
        used for pid, used in (t.get("processes") or {}).items() if pid in mine)}
        for t in targets]


def for_restore(record: dict[str, Any] | None, what: str, *, has_api: bool,
                targets: list[dict[str, Any]] | None) -> Pairs | None:
    """Everything a restore checks of the GPU before any byte moves: the node
    can restore GPU state at all, and which of ``targets`` it goes onto
    (``decide``). Where the targets are unknown (None), or the manifest names
    no GPU by UUID, the node-wide check of before (smr.gpu.gpuinfo.check_fits: a
    GPU of the model with room) and no pairs: the driver restores onto the
    checkpointed GPUs."""
    if not record:
        return None
    if targets is None or not has_api or not any(
            d.get("uuid") for d in record.get("devices") or []):
        gpuinfo.check_restorable(record, what, has_api=has_api)
        return None
    return decide(record, targets, what)


def _fits(saved: dict[str, Any], target: dict[str, Any]) -> bool:
    return bool(target["model"] == saved["model"]
                and target.get("memory_free", 0) >= saved.get("used_bytes", 0))


def _name(d: dict[str, Any]) -> str:
    if "memory_free" in d:
        return f"{d['uuid']} ({d['model']}, {d['memory_free'] >> 20} MiB free)"
    return f"{d['uuid']} ({d['model']}, {d.get('used_bytes', 0) >> 20} MiB used)"


def _mismatch(what: str, saved: list[dict[str, Any]], targets: list[dict[str, Any]],
              why: str) -> GpuMismatch:
    return GpuMismatch(
        f"{what} holds GPU state on {', '.join(_name(d) for d in saved)}; the GPUs it can be "
        f"restored onto here: {', '.join(_name(t) for t in targets) or 'none'}; {why}",
        hint="restore where GPUs of the same model with that much free memory are "
             "(a pod: ask for as many nvidia.com/gpu; a local job: smr restore --gpus)")
