"""What the CUDA driver's checkpoint API does with two processes that share
GPU memory through CUDA IPC (issue #26), at the driver's level only (no
CRIU), on one GPU:

    python3 bench/cuda_ipc_probe.py [--out DIR]

NCCL's P2P transport between the ranks of one node maps each peer's buffers
through CUDA IPC: legacy handles (cudaIpcGetMemHandle) or, since NCCL 2.19,
the virtual memory API's exported handles (cuMemExportToShareableHandle,
POSIX file descriptors). PyTorch shares a CUDA tensor with another process
the same two ways: legacy handles by default, descriptors with
``expandable_segments``, each with an IPC event beside the memory; ``raw``
and ``rawcumem`` map the memory alone through the CUDA APIs, as NCCL does
(legacy handles; the virtual memory API's descriptors). So one GPU is enough to ask the driver the
question of the two-GPU NCCL job.

For each kind of handle and each choice of process to suspend (the
importer, the exporter, both, both with the
importer restored first), a fresh pair: the exporter fills a tensor and
hands it to the importer, which reads its sum every 50 ms. The probe prints
what each holds (descriptors, mappings of the GPU's files), suspends the
chosen ones as smr does (smr.gpu.cuda_checkpoint: locked, then checkpointed),
restores and unlocks them (a failed restore is tried once more after
the others run again), and checks that the importer still reads the
same sum. Every driver answer is printed as the driver gave it."""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import time
from pathlib import Path

N = 1 << 24  # 64 MiB of float32


def _importer(q: object, log: str) -> None:
    import torch
    t = q.get()  # type: ignore[attr-defined]
    first = float(t.sum())
    with open(log, "a") as f:
        for i in range(100000):
            s = float(t.sum())
            f.write(f"role=importer pid={os.getpid()} step={i} same={s == first}\n")
            f.flush()
            time.sleep(0.05)
    del torch


def worker(log: str) -> None:
    import torch
    import torch.multiprocessing as mp
    mp.set_start_method("spawn")
    t = torch.arange(N, device="cuda", dtype=torch.float32)
    q = mp.Queue()
    p = mp.Process(target=_importer, args=(q, log), daemon=True)
    p.start()
    q.put(t)
    with open(log, "a") as f:
        for i in range(100000):
            t.add_(0)  # the exporter uses its memory too
            torch.cuda.synchronize()
            f.write(f"role=exporter pid={os.getpid()} step={i}\n")
            f.flush()
            time.sleep(0.05)


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # cudaIpcMemHandle_t


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


U64, SZ = ctypes.c_uint64, ctypes.c_size_t
POSIX_FD, DEVICE, PINNED, READWRITE = 1, 1, 1, 3


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The runtime (torch has loaded it: found by its name) and the driver."""
    import torch
    torch.zeros(1, device="cuda")  # a current context
    rt, cu = ctypes.CDLL("libcudart.so.13"), ctypes.CDLL("libcuda.so.1")
    rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_void_p]
    rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
    cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(U64), SZ, SZ, U64, ctypes.c_ulonglong]
    cu.cuMemMap.argtypes = [U64, SZ, SZ, U64, ctypes.c_ulonglong]
    cu.cuMemSetAccess.argtypes = [U64, SZ, ctypes.POINTER(_AccessDesc), SZ]
    cu.cuMemsetD32_v2.argtypes = [U64, ctypes.c_uint, SZ]
    cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, U64, SZ]
    cu.cuMemCreate.argtypes = [ctypes.POINTER(U64), SZ, ctypes.POINTER(_AllocProp),
                               ctypes.c_ulonglong]
    cu.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, U64, ctypes.c_int,
                                                ctypes.c_ulonglong]
    cu.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(U64), ctypes.c_void_p,
                                                  ctypes.c_int]
    return rt, cu


def _map(cu: ctypes.CDLL, handle: int, size: int) -> int:
    ptr = U64()
    assert cu.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0) == 0
    assert cu.cuMemMap(ptr, size, 0, handle, 0) == 0
    desc = _AccessDesc(_Location(DEVICE, 0), READWRITE)
    assert cu.cuMemSetAccess(ptr, size, ctypes.byref(desc), 1) == 0
    return ptr.value


def raw_importer(log: str, kind: str, arg: str) -> None:
    """Another process's GPU memory mapped through the CUDA APIs alone, with
    no IPC event beside it, as NCCL's P2P transport maps a peer's buffer:
    a legacy handle (``raw``: its open answered cudaErrorInvalidValue on the
    H100, so not measured yet) or a virtual memory API descriptor taken from
    the exporter with pidfd_getfd (``rawcumem``, NCCL's default since 2.19)."""
    rt, cu = _libs()
    if kind == "raw":
        dptr = ctypes.c_void_p()
        rc = rt.cudaIpcOpenMemHandle(ctypes.byref(dptr), _Handle(bytes.fromhex(arg)), 1)
        ptr = dptr.value or 0
    else:
        pid, fd, size = (int(x) for x in arg.split(":"))
        libc = ctypes.CDLL(None, use_errno=True)
        pidfd = os.pidfd_open(pid)
        mine = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
        os.close(pidfd)
        handle = U64()
        rc = cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(mine),
                                               POSIX_FD)
        ptr = _map(cu, handle.value, size) if rc == 0 else 0
        os.close(mine)  # as NCCL does once imported
    buf = (ctypes.c_float * 1024)()
    first = None
    with open(log, "a") as f:
        f.write(f"role=opened rc={rc}\n")
        if rc != 0:
            return
        for i in range(100000):
            cu.cuMemcpyDtoH_v2(buf, ptr, ctypes.sizeof(buf))
            s = sum(buf)
            first = s if first is None else first
            f.write(f"role=importer pid={os.getpid()} step={i} same={s == first}\n")
            f.flush()
            time.sleep(0.05)


def raw_worker(log: str, kind: str) -> None:
    rt, cu = _libs()
    if kind == "raw":
        import torch
        t = torch.arange(N, device="cuda", dtype=torch.float32)
        h = _Handle()
        rc = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(t.data_ptr()))
        arg = bytes(h).hex()
    else:
        prop = _AllocProp(type=PINNED, requestedHandleTypes=POSIX_FD,
                          location=_Location(DEVICE, 0))
        gran = SZ()
        cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0)
        size = -(-N * 4 // gran.value) * gran.value
        handle = U64()
        rc = cu.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0)
        ptr = _map(cu, handle.value, size)
        cu.cuMemsetD32_v2(ptr, 0x3F800000, size // 4)  # 1.0f everywhere
        fd = ctypes.c_int(-1)
        rc = rc or cu.cuMemExportToShareableHandle(ctypes.byref(fd), handle.value, POSIX_FD, 0)
        arg = f"{os.getpid()}:{fd.value}:{size}"
    with open(log, "a") as f:
        f.write(f"role=exported rc={rc}\n")
    subprocess.Popen([sys.executable, __file__, "--raw-importer", log, kind, arg])
    with open(log, "a") as f:
        for i in range(100000):
            f.write(f"role=exporter pid={os.getpid()} step={i}\n")
            f.flush()
            time.sleep(0.05)


def probe(kind: str, which: str, out: Path) -> None:
    from bench.nccl_probe import holdings, suspend_and_restore  # printed alike
    from smr.contract.errors import PermanentError
    from smr.gpu.cuda_checkpoint import driver
    from smr.gpu.gpuinfo import check_mappings

    tag = f"{kind}-{which}"
    log = out / f"ipc-{tag}.log"
    log.write_text("")
    env = dict(os.environ)
    if kind == "cumem":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    role = ["--raw-worker", str(log), kind] if kind.startswith("raw") else ["--worker", str(log)]
    job = subprocess.Popen([sys.executable, __file__, *role], env=env,
                           stdout=(out / f"ipc-{tag}-stdout.log").open("w"),
                           stderr=subprocess.STDOUT, start_new_session=True)

    def say(*what: object) -> None:
        print(f"[ipc {tag}]", *what, flush=True)

    def last(role: str) -> tuple[int, str, str]:
        m = re.findall(rf"role={role} pid=(\d+) step=(\d+)(?: same=(\S+))?", log.read_text())
        return (int(m[-1][0]), m[-1][1], m[-1][2]) if m else (0, "", "")

    t0 = time.monotonic()
    while (not last("importer")[0] or int(last("importer")[1] or 0) < 10) \
            and job.poll() is None and time.monotonic() - t0 < 120 \
            and not re.search(r"role=\w+ rc=[1-9]", log.read_text()):
        time.sleep(0.2)
    exp, imp = last("exporter")[0], last("importer")[0]
    if not exp or not imp:
        say("the pair did not start:", re.findall(r"role=\w+ rc=\S+", log.read_text()),
            (out / f"ipc-{tag}-stdout.log").read_text()[-2000:])
        os.killpg(job.pid, 9)
        return
    drv = driver()
    for name, pid in (("exporter", exp), ("importer", imp)):
        fds, maps = holdings(pid)
        say(f"{name} {pid} state {drv.state(pid)!r} descriptors {fds}")
        say(f"{name} {pid} mappings {maps}")
        try:  # what smr's check before the lock says of it
            check_mappings([pid], [pid])
            say(f"{name} {pid}: check_mappings lets it through")
        except PermanentError as e:
            say(f"{name} {pid}: check_mappings refuses it: {e.code}: {e.message}")
    # both-rev: the importer restored first, its exporter still checkpointed.
    pids = {"importer": [imp], "exporter": [exp], "both": [exp, imp],
            "both-rev": [imp, exp]}[which]
    suspend_and_restore(drv, pids, say, pause=1.0, again=True)
    at = int(last("importer")[1] or 0)
    time.sleep(2)
    _, step, same = last("importer")
    say(f"afterwards: importer steps {at} -> {step}, reads the same sum: {same}; "
        f"exporter at step {last('exporter')[1]}; pair alive: {job.poll() is None}")
    os.killpg(job.pid, 9)
    job.wait()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--raw-worker":
        raw_worker(sys.argv[2], sys.argv[3])
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "--raw-importer":
        raw_importer(sys.argv[2], sys.argv[3], sys.argv[4])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--kinds", default="legacy,cumem,rawcumem")
    ap.add_argument("--which", default="importer,exporter,both,both-rev")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for kind in a.kinds.split(","):
        for which in a.which.split(","):
            probe(kind, which, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
