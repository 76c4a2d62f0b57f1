"""What NVML (pynvml) says about GPUs: which a job's processes hold and how
much memory, the model and driver recorded in a manifest, and whether a
node can take a checkpoint or a restore. Everything here is read-only.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Any

from smr.contract.errors import PermanentError

HEADROOM = 1.10  # the driver's copy of GPU memory plus what CRIU and the page cache need


class GpuMismatch(PermanentError):
    code = "gpu-mismatch"


class NoRoom(PermanentError):
    code = "node-lacks-room"


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no GPU: all mean "no GPU here"
        return None



def devices() -> list[dict[str, Any]]:
    nv = _nvml()
    if not nv:
        return []
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        # minor: N of /dev/nvidiaN, how a container's device nodes name the GPU.
        out.append({"index": i, "uuid": nv.nvmlDeviceGetUUID(h), "model": nv.nvmlDeviceGetName(h),
                    "minor": _minor(nv, h),
                    "memory_total": int(mem.total), "memory_free": int(mem.free),
                    "processes": {p.pid: int(p.usedGpuMemory or 0)
                                  for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}})
    return out


def _minor(nv: Any, handle: Any) -> int | None:
    """N of the GPU's /dev/nvidiaN; None where NVML does not say (it must not
    cost the rest of what devices() reports)."""
    try:
        return int(nv.nvmlDeviceGetMinorNumber(handle))
    except Exception:
        return None


def versions() -> dict[str, str]:
    nv = _nvml()
    if not nv:
        return {}
    cuda = nv.nvmlSystemGetCudaDriverVersion_v2()
    return {"nvidia_driver": str(nv.nvmlSystemGetDriverVersion()),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}"}


def job_gpus(pids: list[int]) -> dict[str, Any] | None:
    """The GPUs the processes hold, for the manifest; None if they hold none."""
    held = []
    for d in devices():
        used = sum(b for p, b in d["processes"].items() if p in pids)
        if any(p in pids for p in d["processes"]):
            held.append({"uuid": d["uuid"], "model": d["model"],
                         "memory_total": d["memory_total"], "used_bytes": used})
    if not held:
        return None
    return {"model": held[0]["model"], "count": len(held),
            "used_bytes": sum(h["used_bytes"] for h in held), "devices": held}


def gpus_by_pid(pids: list[int]) -> dict[int, list[str]]:
    """The GPUs (UUIDs) each of ``pids`` holds a context on, as NVML lists
    them; a process NVML does not list holds none it knows of."""
    out: dict[int, list[str]] = {}
    for d in devices():
        for p in d["processes"]:
            if p in pids:
                out.setdefault(p, []).append(d["uuid"])
    return out


def for_checkpoint(pids: list[int], work_dir: Path) -> dict[str, Any] | None:
    """The GPUs the CUDA processes ``pids`` hold (None without any), refused at
    once if this node lacks the room to checkpoint them."""
    if not pids:
        return None
    gpu = job_gpus(pids) or {"model": "unknown", "count": 0, "used_bytes": 0}
    check_room_for_checkpoint(gpu, work_dir, host=host_bytes(pids))
    # Each process's GPUs, as they were: what a failed restore is explained
    # by (smr.gpu.gpugate.restore_cause), not the driver's answer alone.
    if by_pid := gpus_by_pid(pids):
        gpu["processes"] = {str(p): u for p, u in sorted(by_pid.items())}
    return gpu


def host_bytes(pids: list[int]) -> int:
    """The resident host memory of ``pids`` (what CRIU writes besides the GPU's)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) << 10
        except (OSError, ValueError):
            continue
    return total


# What CRIU saves of mappings under /dev: /dev/zero (shared anonymous memory)
# and the regular files of the tmpfs and hugetlbfs mounted there. Any other
# mapping there is a device's, which CRIU refuses without a plugin of its own
# ("Can't handle non-regular mapping", criu/proc_parse.c): the GPU's, in a
# CUDA process, the driver's checkpoint releases first; the others (RDMA's
# /dev/infiniband/uverbs*, another accelerator's, VFIO's) would fail CRIU
# after the GPU lock.
_SAVED_UNDER_DEV = ("/dev/shm/", "/dev/hugepages/")
# The GPU's own device files by their exact names (a name that only begins
# so, /dev/nvidia-anything, is a tenant's other device).
_GPU_FILES = re.compile(r"/dev/nvidia(\d+|ctl|-uvm|-uvm-tools)")


def _saved_or_own(path: str, device: str) -> bool:
    if path == "/dev/zero" or path.startswith(_SAVED_UNDER_DEV):
        return True
    return bool(_GPU_FILES.fullmatch(path)) if device == "/dev/nvidia" \
        else path.startswith(device)


def check_mappings(tree: list[int], cuda_pids: list[int], device: str = "/dev/nvidia") -> None:
    """Refuse, before anything is frozen, a process of the tree that maps the
    GPU's device files without a CUDA context of its own: the driver's
    checkpoint releases the mappings of CUDA processes only, and CRIU cannot
    save a device mapping ('handle_device_vma plugin failed', H100, driver
    580). A child forked from a CUDA process after CUDA started is one (a
    PyTorch DataLoader worker under the default 'fork' start method). Any
    process mapping another device (_SAVED_UNDER_DEV) is refused too. The
    paths are the tenant's, only compared: a forged one refuses its own job."""
    for pid in tree:
        try:
            # Names are the tenant's bytes: any of them, decoded without failing.
            maps = Path(f"/proc/{pid}/maps").read_bytes().decode(errors="replace")
            comm = Path(f"/proc/{pid}/comm").read_bytes().decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
        paths = {" ".join(ln.split()[5:]).removesuffix(" (deleted)") for ln in maps.splitlines()}
        if pid in cuda_pids:
            _check_ipc(pid, comm, paths)
        elif held := sorted(p for p in paths if p.startswith(device)):
            raise PermanentError(
                f"process {pid} ({comm}) maps {', '.join(held)} without a CUDA context of its "
                "own (a child forked from a CUDA process); the driver's checkpoint does not "
                "release those mappings and CRIU cannot save them", code="gpu-forked-mapping",
                hint="start such children with the 'spawn' or 'forkserver' start method (PyTorch: "
                     "DataLoader(..., multiprocessing_context='spawn')), or before CUDA starts")
        if other := sorted(p for p in paths if p.startswith("/dev/")
                           and not _saved_or_own(p, device)):
            raise PermanentError(
                f"process {pid} ({comm}) maps {', '.join(other[:4])}: a device's memory, which "
                "CRIU cannot save (it saves mappings of regular files and /dev/zero), and which "
                "the GPU's checkpoint does not release; found after the GPU lock it would fail "
                "the checkpoint with the GPU's state at stake, so nothing was frozen, the job "
                "runs on", code="device-mapping",
                hint="run the job without that device: NCCL over RDMA (InfiniBand, RoCE, EFA) "
                     "maps /dev/infiniband/uverbs*, and runs over sockets with NCCL_NET=Socket "
                     "(docs/gpu.md)")


# The driver's file for a process's CUDA IPC, named after its creator's PID (in
# hex, as the PID namespace it runs in sees it); a process that mapped another
# process's GPU memory maps its creator's too (H100, driver 580:
# bench/cuda_ipc_probe.py).
_CUDA_IPC_SHM = re.compile(r"/dev/shm/cuda\.shm\.\d+\.([0-9a-f]+)\.\d+")


def ns_pid(pid: int) -> int | None:
    """``pid`` as its own PID namespace sees it (the last NSpid field)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return None


def _check_ipc(pid: int, comm: str, paths: set[str]) -> None:
    """Refuse a CUDA process that maps another process's GPU memory through
    CUDA IPC (CUDA tensors shared by torch.multiprocessing; NCCL's P2P
    transport between ranks): driver 580 locks and checkpoints it, then never
    restores it, and it stays CHECKPOINTED for good. The names are the
    tenant's: a forged one refuses only its own job."""
    own = ns_pid(pid)
    foreign = sorted(p for p in paths if (m := _CUDA_IPC_SHM.fullmatch(p))
                     and own is not None and int(m.group(1), 16) != own)
    if foreign:
        raise PermanentError(
            f"process {pid} ({comm}) maps GPU memory of another process through CUDA IPC "
            f"({', '.join(foreign)}, that process's): the NVIDIA driver checkpoints such a "
            "process but cannot restore it (driver 580), so it is not frozen",
            code="cuda-ipc-mapping",
            hint="share GPU tensors between processes through host memory, or for NCCL set "
                 "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0; docs/gpu.md")


def check_room_for_checkpoint(gpu: dict[str, Any], work_dir: Path, host: int = 0) -> None:
    """Refuse early: the driver copies GPU memory into the job's host memory,
    then CRIU writes it and the job's own memory (``host`` bytes) to
    ``work_dir``. A job holding most of the GPU (JAX preallocates 75 % of it)
    has an image that size."""
    copy = int(gpu["used_bytes"] * HEADROOM)
    image = int((gpu["used_bytes"] + host) * HEADROOM)
    sizes = f"{gpu['used_bytes'] >> 20} MiB of GPU memory and {host >> 20} MiB of host memory"
    work_dir.mkdir(parents=True, exist_ok=True)
    # A dump into a tmpfs takes RAM again for the whole image.
    tmpfs = on_tmpfs(work_dir)
    need = copy + (image if tmpfs else 0)
    avail = _mem_available()
    if avail is not None and avail < need:
        where = f" and {image >> 20} MiB for its images in {work_dir} (a tmpfs)" if tmpfs else ""
        raise NoRoom(f"checkpointing needs about {need >> 20} MiB of free host memory: "
                     f"{copy >> 20} MiB for the driver's copy of the job's "
                     f"{gpu['used_bytes'] >> 20} MiB of GPU memory{where}; "
                     f"{avail >> 20} MiB free",
                     hint="free host memory on this node, or give the agent a node with more "
                     "RAM" + ("; or point SMR_WORK_DIR at a disk" if tmpfs else "")
                     + "; a JAX job: XLA_PYTHON_CLIENT_PREALLOCATE=false (docs/gpu.md)")
    free = shutil.disk_usage(work_dir).free
    if free < image:
        raise NoRoom(f"{work_dir} has {free >> 20} MiB free; the job's image needs about "
                     f"{image >> 20} MiB ({sizes})",
                     hint="point SMR_WORK_DIR at a larger disk or tmpfs; a JAX job: "
                          "XLA_PYTHON_CLIENT_PREALLOCATE=false (docs/gpu.md)")


def on_tmpfs(path: Path) -> bool:
    """Is ``path`` on a RAM-backed filesystem (the deepest mount holding it)?"""
    target, best, kind = str(path.resolve()), "", ""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind in ("tmpfs", "ramfs")


def check_restorable(gpu: dict[str, Any] | None, what: str, *, has_api: bool) -> None:
    """Refuse, before any byte moves, GPU state this node cannot take back:
    no checkpoint API here (no driver, or SMR_GPU=off), another model, too
    little free memory. ``what`` names the checkpoint for the message."""
    if gpu and not has_api:
        raise GpuMismatch(
            f"{what} holds GPU state ({gpu.get('model')}) and this node cannot restore it "
            "(no NVIDIA driver with the checkpoint API, or SMR_GPU=off)",
            hint="restore on a GPU node with driver 560 or newer and SMR_GPU=auto")
    check_fits(gpu)


def check_fits(gpu: dict[str, Any] | None) -> None:
    """Refuse a restore onto a node whose GPUs differ or lack memory."""
    if not gpu:
        return
    here = devices()
    if not here:
        raise GpuMismatch(f"the checkpoint holds GPU state ({gpu['model']}) and this node "
                          "has no usable GPU", hint="restore on a node with that GPU model")
    for want in gpu.get("devices", [gpu]):
        fits = [d for d in here if d["model"] == want["model"]
                and d["memory_free"] >= want["used_bytes"]]
        if not fits:
            have = ", ".join(f"{d['model']} ({d['memory_free'] >> 20} MiB free)" for d in here)
            raise GpuMismatch(
                f"the checkpoint needs a {want['model']} with {want['used_bytes'] >> 20} MiB "
                f"free; this node has {have}",
                hint="restore on a node with that GPU model and enough free memory")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def thp_mode() -> str:
    """Transparent huge pages; `always` made the driver's checkpoint 1.8x
    faster on the H100 (docs/gpu.md)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"

