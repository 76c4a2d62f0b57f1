"""The CUDA driver's process checkpoint API through ctypes (libcuda's
cuCheckpointProcess* calls, driver 550+): one call per method, its error
named, nothing decided here (cuda_checkpoint.py drives a job's processes)."""

from __future__ import annotations

import ctypes
import enum

from smr.contract.errors import PermanentError, TemporaryError

CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_TIMEOUT = 909
# What cuCheckpointProcessLock returns when its timeout passes. Driver 580 on
# the H100 answers NOT_READY (measured with a kernel spinning past the
# timeout), not the TIMEOUT its documentation suggests: both mean "try later".
LOCK_TIMED_OUT = (CUDA_ERROR_NOT_READY, CUDA_ERROR_TIMEOUT)
LOCK_TIMEOUT_HINT = ("the job keeps running; try again, or raise SMR_CUDA_LOCK_TIMEOUT if "
                     "its kernels run long")
# What cuCheckpointProcessRestore answers (driver 580, H100) for a process that
# mapped another process's GPU memory through CUDA IPC, as NCCL's P2P transport
# and PyTorch's CUDA tensors shared between processes do: NOT_SUPPORTED for
# the virtual memory API's exported handles, INVALID_VALUE for legacy ones,
# OPERATING_SYSTEM when tried again. The lock and the checkpoint accept such a
# process; it stays CHECKPOINTED for good (bench/cuda_ipc_probe.py,
# docs/compatibility.md), and nothing outside it tells it apart beforehand.
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OPERATING_SYSTEM = 1, 304
CUDA_ERROR_NOT_SUPPORTED = 801
RESTORE_REFUSED_IPC = (CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_INVALID_VALUE,
                       CUDA_ERROR_OPERATING_SYSTEM)


class CudaState(enum.IntEnum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


# Said with a failure the driver returns without more words of its own.
DRIVER_HINT = ("the NVIDIA driver refused it: the kernel log (`dmesg`, NVRM lines) says why; "
               "docs/gpu.md, \"Failure behaviour\", says what smr does with the job then "
               "and lists the known causes")


class CudaError(PermanentError):
    code = "cuda-checkpoint-failed"


class CudaLockTimeout(TemporaryError):
    code = "cuda-lock-timeout"


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    """CUcheckpointRestoreArgs: 64 bytes, the pairs first, the rest zero."""
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_ubyte * 52)]


def gpu_uuid_bytes(uuid: str) -> bytes:
    """NVML's ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` as the driver's 16 bytes."""
    raw = bytes.fromhex(uuid.removeprefix("GPU-").replace("-", ""))
    if len(raw) != 16:
        raise CudaError(f"{uuid!r} is not a GPU UUID", code="invalid-gpu",
                        hint="name GPUs by the UUID nvidia-smi -L prints")
    return raw


class Driver:
    """Thin synchronous wrapper; every method raises CudaError naming the call."""

    def __init__(self, lib: str = "libcuda.so.1") -> None:
        try:
            self.cu = ctypes.CDLL(lib)
        except OSError as e:
            raise CudaError(f"cannot load {lib}: {e}", code="no-cuda-driver",
                            hint="run on a node with the NVIDIA driver (560 or newer)") from None
        if not hasattr(self.cu, "cuCheckpointProcessLock"):
            raise CudaError("this NVIDIA driver has no process checkpoint API",
                            code="no-cuda-checkpoint", hint="upgrade the driver to 560 or newer")
        self._call("cuInit", 0)

    def _name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self.cu.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return str(rc)

    def _call(self, fn: str, *args: object) -> None:
        rc = getattr(self.cu, fn)(*args)
        if rc != 0:
            raise CudaError(f"{fn} failed: {self._name(rc)} ({rc})", detail=str(rc),
                            hint=DRIVER_HINT)

    def state(self, pid: int) -> CudaState | None:
        """The process's checkpoint state; None if it holds no CUDA context."""
        st = ctypes.c_int(-1)
        rc = self.cu.cuCheckpointProcessGetState(pid, ctypes.byref(st))
        if rc != 0:
            return None  # not a CUDA process (or gone)
        return CudaState(st.value)

    def lock(self, pid: int, timeout_s: float) -> None:
        args = _LockArgs(timeoutMs=max(1, int(timeout_s * 1000)))
        rc = self.cu.cuCheckpointProcessLock(pid, ctypes.byref(args))
        if rc in LOCK_TIMED_OUT:
            raise CudaLockTimeout(
                f"process {pid} did not reach a point where its GPU work could be locked "
                f"within {timeout_s:g}s ({self._name(rc)})",
                hint=LOCK_TIMEOUT_HINT)
        if rc != 0:
            raise CudaError(f"cuCheckpointProcessLock({pid}) failed: {self._name(rc)} ({rc})",
                            hint=DRIVER_HINT)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        """``gpu_pairs``: (checkpointed GPU's UUID, GPU to restore onto), one
        for every GPU the process had; the driver documents that both must be
        the same chip, with room for the memory (driver 580 and newer)."""
        if not gpu_pairs:
            rc = self.cu.cuCheckpointProcessRestore(pid, None)
        else:
            pairs = (_GpuPair * len(gpu_pairs))()
            for pair, (old, new) in zip(pairs, gpu_pairs, strict=True):
                pair.oldUuid[:] = list(gpu_uuid_bytes(old))
                pair.newUuid[:] = list(gpu_uuid_bytes(new))
            args = _RestoreArgs(gpuPairs=pairs, gpuPairsCount=len(gpu_pairs))
            rc = self.cu.cuCheckpointProcessRestore(pid, ctypes.byref(args))
        if rc == 0:
            return
        said = f"cuCheckpointProcessRestore({pid}) failed: {self._name(rc)} ({rc})"
        if gpu_pairs and rc == CUDA_ERROR_INVALID_VALUE:
            raise CudaError(f"{said}: the GPU pairs must name every GPU the process had, "
                            f"each onto a GPU of the same model ({len(gpu_pairs)} given)",
                            detail=str(rc))
        # The answer alone does not say why: driver 580 gives the same codes
        # for a process with peer access between two GPUs (XLA turns it on),
        # one that imported another's memory (NCCL's P2P transport), and
        # others. What is known of the process is in the caller's message.
        raise CudaError(said, detail=str(rc))

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, None)

    def restore_tid(self, pid: int) -> int | None:
        """The thread of ``pid`` through which the driver restores it (None
        where this driver does not say: before 570)."""
        fn = getattr(self.cu, "cuCheckpointProcessGetRestoreThreadId", None)
        if fn is None:
            return None
        tid = ctypes.c_int(0)
        rc = fn(pid, ctypes.byref(tid))
        if rc != 0:
            raise CudaError(f"cuCheckpointProcessGetRestoreThreadId({pid}) failed: "
                            f"{self._name(rc)} ({rc})", hint=DRIVER_HINT)
        return tid.value
