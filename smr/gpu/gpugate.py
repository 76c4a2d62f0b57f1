"""The gate a job passes before its GPU is locked, and again after.

The driver's lock and checkpoint are a one-way door for a process it cannot
restore: they succeed, the restore fails, and a failed restore fails for
good (driver 580). So what the driver or CRIU is known not to bring back is
refused here, before the lock, with smr's own code naming the process; the
job runs on. What can appear between this check and CRIU's (a forked worker
mapping the GPU's device files, a new io_uring) is checked again with the
tree stopped, after the lock (``after_lock``).

Everything read here is the tenant's (/proc/PID/fd, maps, its memory): it is
only compared, never followed or trusted; a forged entry refuses its own job.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Collection, Mapping
from pathlib import Path

from smr.contract.errors import PermanentError
from smr.gpu.gpuinfo import check_mappings
from smr.process import liveenv, procfs

# How Linux names an io_uring instance's descriptor and its ring mappings.
IO_URING = "anon_inode:[io_uring]"
# Refusals a node's settings may lift (SMR_GPU_ALLOW), each where the
# operator knows better than driver 580's measured behaviour.
LIFTABLE = ("peer-access", "nccl-p2p")


# What a GPU job smr starts gets unless its environment says otherwise
# (`smr exec --gpu`, smr.jobs.gpu_env; a GPU container, the webhook):
# Inductor's compile pool forks workers that map the GPU's device files
# without a CUDA context, which CRIU cannot save, and after the check before
# the lock. With one compile thread there is no pool.
GPU_JOB_DEFAULTS = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


class GateRefused(PermanentError):
    code = "gpu-gate"


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


def io_uring_held(pid: int) -> str | None:
    """How ``pid`` holds an io_uring (a descriptor or a mapping), or None."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == IO_URING:
                return f"descriptor {fd}"
        except OSError:
            continue
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    return "a mapping of one" if IO_URING in maps else None


def check_io_uring(tree: list[int]) -> None:
    """Refuse a tree that holds an io_uring: CRIU cannot save one (it fails
    on the ring's mapping, 'Unknown shit 600 (anon_inode:[io_uring])'), and
    found after the GPU lock, the job's GPU state is at stake. libuv 1.50
    and later makes one in every event loop (torchrun's rendezvous store)."""
    for pid in tree:
        if how := io_uring_held(pid):
            raise GateRefused(
                f"process {pid} ({comm(pid)}) holds an io_uring ({how}), which CRIU cannot "
                "save; nothing was frozen", code="io-uring",
                hint="start it with `smr exec`, or in a pod smr injects: their seccomp filter "
                     "makes io_uring_setup fail, and libuv uses epoll instead; a job started "
                     "with SMR_IO_URING=allow keeps io_uring and cannot be checkpointed "
                     "(docs/compatibility.md)")


_LIBC = ctypes.CDLL(None)
_LIBC.strtol.restype = ctypes.c_long
_LIBC.strtol.argtypes = (ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int)


def _p2p_disabled(value: str | None) -> bool:
    """Whether NCCL reads ``value`` of NCCL_P2P_DISABLE as disabling P2P: it
    takes ``(int) strtol(value, NULL, 0) == 1`` (src/graph/paths.cc,
    ncclGetLevel), so "1", "01", "0x1" and " 1x" disable it, "true" does not.
    Asked of the C library's own strtol, and cut to an int as C cuts it."""
    if value is None:
        return False
    return ctypes.c_int(_LIBC.strtol(value.encode(), None, 0)).value == 1


def _shm_disabled(value: str | None) -> bool:
    """Whether NCCL reads ``value`` of NCCL_SHM_DISABLE as disabling SHM: an
    NCCL_PARAM, ``strtoll(value, NULL, 0)`` kept whole, the default (on)
    where it overflows, and SHM off only where it is 1 (src/transport/shm.cc)."""
    if value is None or not value:
        return False
    return _LIBC.strtol(value.encode(), None, 0) == 1  # long is int64_t here


def _nvls_off(value: str | None) -> bool:
    """Whether NCCL reads ``value`` of NCCL_NVLS_ENABLE as turning NVLink
    SHARP off: an NCCL_PARAM whose default, 2, turns it on where the GPUs
    can multicast (an NVSwitch), and off only where strtoll reads 0."""
    if value is None or not value:
        return False
    return _LIBC.strtol(value.encode(), None, 0) == 0


# NCCL's transports between ranks of one host that map another rank's
# memory through the driver, each with the variable that turns it off and
# how NCCL reads it: P2P (the peer's GPU memory), SHM (host memory), NVLS
# (multicast objects bound to every rank's GPU memory). Driver 580 restored
# neither P2P nor SHM ranks (bench/nccl_probe.py on two H200s: P2P 801 then
# 304; SHM 801 and 999); the same job over sockets alone, with NVLS off as
# that machine keeps it, it did. NVLS is not tried there (it can put a shared
# host's GPUs out of service), so it is not known to come back.
SHARING = (("NCCL_P2P_DISABLE", _p2p_disabled, "1"), ("NCCL_SHM_DISABLE", _shm_disabled, "1"),
           ("NCCL_NVLS_ENABLE", _nvls_off, "0"))
OFF = " ".join(f"{name}={value}" for name, _, value in SHARING)


def _maps_nccl(pid: int) -> bool:
    try:
        return "/libnccl" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _sharing(pid: int) -> str | None:
    """Why rank ``pid``'s NCCL may map its peers' memory, or None where every
    variable of SHARING turns that off both in the environment the rank
    started with (/proc/PID/environ) and in the one its C library holds now,
    which NCCL's getenv() reads when it starts: a job script may change
    os.environ before that, and which of the two NCCL saw cannot be told
    from outside."""
    for name, off, _ in SHARING:
        if not off(started := procfs.env_value(pid, name)):
            return _named(name, started, "when it started")
    try:
        now = liveenv.getenv(pid, *(name for name, _, _ in SHARING))
    except liveenv.EnvironUnreadable as e:
        return f"its environment as it is now cannot be read: {e}"
    for name, off, _ in SHARING:
        if not off(now[name]):
            return _named(name, now[name], "now")
    return None


def _named(name: str, value: str | None, when: str) -> str:
    if value is None:
        return f"{name} unset {when}"
    return f"{name}={value[:40]!r} {when}"


def _maps_xla(pid: int) -> bool:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return "xla_extension" in maps or "/jaxlib" in maps


def check_peers(gpus: Mapping[int, Collection[str]], allow: Collection[str] = (),
                released: Collection[int] = ()) -> None:
    """Refuse what driver 580 checkpoints and never restores, told from the
    GPUs each CUDA process holds (``gpus``: pid → GPU UUIDs, NVML's):

    - a process holding contexts on two GPUs or more: with peer access
      between them (XLA turns it on between every pair of visible GPUs, and
      nothing switches it off) its restore fails (CUDA_ERROR_INVALID_VALUE),
      and from outside, peer access cannot be told apart (``peer-access``);
    - NCCL ranks of one tree on different GPUs with a transport on that maps
      a peer's memory (SHARING: P2P, SHM, NVLS): driver 580 answers such a
      rank's restore 801, then 304 for good (``nccl-p2p``). Every variable
      must turn them off as the rank started and as it holds its environment
      now (smr.process.liveenv).

    ``allow``: refusals the node's settings lift (SMR_GPU_ALLOW); ``released``:
    ranks that dropped their NCCL communicators on smr's request (the
    cooperative path, smr.gpu.coopgate): they map no peer's memory."""
    if "peer-access" not in allow:
        for pid, held in sorted(gpus.items()):
            if len(held) >= 2:
                xla = " (XLA enables peer access between all visible GPUs)" \
                    if _maps_xla(pid) else ""
                raise GateRefused(
                    f"process {pid} ({comm(pid)}) holds CUDA contexts on {len(held)} GPUs "
                    f"({', '.join(sorted(held))}){xla}: driver 580 does not restore a process "
                    "with peer access between its GPUs, and that cannot be told from outside; "
                    "nothing was frozen, the job runs on", code="gpu-peer-access",
                    hint="give each process one GPU (smr exec --gpus 1, or "
                         "CUDA_VISIBLE_DEVICES); where the job uses no peer access, or the "
                         "driver restores it, set SMR_GPU_ALLOW=peer-access on the node "
                         "(docs/gpu.md)")
    if "nccl-p2p" not in allow:
        on = {p: why for p in gpus if p not in released and _maps_nccl(p)
              and (why := _sharing(p)) is not None}
        used = {u for p in on for u in gpus[p]}
        if len(on) >= 2 and len(used) >= 2:
            named = ", ".join(f"{p} ({comm(p)}: {why})" for p, why in sorted(on.items()))
            raise GateRefused(
                f"NCCL ranks {named} run on {len(used)} GPUs with a transport of NCCL's on that "
                f"maps a peer's memory (P2P, shared memory or NVLS; only {OFF}, NCCL over "
                "sockets, is known to come back): driver 580 checkpoints such ranks and never "
                "restores them; nothing was frozen, the job runs on", code="nccl-p2p",
                hint=f"start the job with {OFF} (slower), and leave them set, or add the "
                     "cooperative path's one line (docs/gpu.md); where the driver restores "
                     "it, set SMR_GPU_ALLOW=nccl-p2p on the node")


def before_lock(tree: list[int], cuda_pids: list[int], gpus: Mapping[int, Collection[str]],
                allow: Collection[str] = (), released: Collection[int] = ()) -> None:
    """Everything known to make the driver's or CRIU's part fail, checked on
    the running tree before anything is locked."""
    check_io_uring(tree)
    check_mappings(tree, cuda_pids)
    check_peers(gpus, allow, released)


def after_lock(tree: list[int], cuda_pids: list[int]) -> None:
    """The checks whose subject can appear after ``before_lock`` ran (a
    worker of a compile pool mapping the GPU's devices; a new io_uring),
    again on the tree smr holds stopped, just before CRIU sees it."""
    check_io_uring(tree)
    check_mappings(tree, cuda_pids)


def restore_cause(gpu: Mapping[str, object] | None) -> str:
    """What the checkpoint's recorded facts (its manifest's ``gpu``) say of
    why the driver may refuse its restore; empty where they say nothing."""
    held = (gpu or {}).get("processes") or {}
    if not isinstance(held, Mapping):
        return ""
    several = sorted(str(p) for p, u in held.items() if isinstance(u, list) and len(u) >= 2)
    if several:
        return (f"process {', '.join(several)} held CUDA contexts on two GPUs or more when "
                "checkpointed: driver 580 does not restore a process with peer access between "
                "its GPUs (XLA turns it on between all visible GPUs); checkpoint such a job "
                "with one GPU per process (docs/gpu.md)")
    return ""
