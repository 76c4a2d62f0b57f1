"""A **stand-in** for the CUDA driver's checkpoint API, for the fault
campaign's nodes on machines without a GPU (CI).

The real driver keeps a process's checkpoint state (RUNNING, LOCKED,
CHECKPOINTED) with the process: a process CRIU restores comes back
CHECKPOINTED, and one whose checkpointer died midway stays suspended and
hangs at its next CUDA call. The stand-in keeps that state in a file per
workload (named by the ``SMR_STANDIN_GPU`` variable in the workload's own
environment, which CRIU restores with it), in a directory every node shares,
and moves it with the driver's own rules. Nothing touches a GPU.

``python -m tests.chaos.gpu_standin`` runs ``smr up`` with the stand-in in
place of the driver (and a stand-in device for the GPU checks).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from smr.gpu import cuda_checkpoint, frozen, gpuinfo
from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.gpu.driver import CudaError, CudaState

ENV = "SMR_STANDIN_GPU"  # in a workload's environment: it "holds a GPU"
DIR_ENV = "SMR_STANDIN_GPU_DIR"  # where the states live (shared by the nodes)
MODEL = "stand-in GPU"


def gpu_id(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
        # A local job's init (smr-init --local) inherits the workload's
        # environment but holds no GPU: the workload under it does.
        if Path(f"/proc/{pid}/comm").read_text().strip() == "smr-init":
            return None
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(ENV.encode() + b"="):
            return item.split(b"=", 1)[1].decode()
    return None


class StandInDriver:
    """The driver's calls smr makes, over a state file per workload.

    ``held``: the driver's restore also checks what the real one needs and
    cannot check itself: that no thread of the process but the one it
    restores through runs until its GPU state is back (a JAX thread that
    touched a GPU mapping in that gap died of SIGSEGV in libcuda on an
    H100). A restore that finds another thread running is refused; each
    restore's count of held threads goes to ``restores``."""

    def __init__(self, root: Path, *, held: bool = False) -> None:
        self.root = root
        self.held = held
        self.restores: list[tuple[int, int]] = []  # (pid, threads held) per restore
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, pid: int) -> Path | None:
        gid = gpu_id(pid)
        return self.root / gid if gid else None

    def state(self, pid: int) -> CudaState | None:
        path = self._path(pid)
        if path is None:
            return None
        try:
            return CudaState[path.read_text().strip()]
        except FileNotFoundError:
            return CudaState.RUNNING
        except KeyError:
            return CudaState.FAILED

    def _move(self, pid: int, frm: CudaState, to: CudaState, call: str) -> None:
        path = self._path(pid)
        st = self.state(pid)
        if path is None or st is not frm:
            raise CudaError(f"{call}({pid}) failed: state {st and st.name}, not {frm.name} "
                            "(stand-in driver)")
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(to.name)
        tmp.replace(path)

    def lock(self, pid: int, timeout_s: float) -> None:
        self._move(pid, CudaState.RUNNING, CudaState.LOCKED, "cuCheckpointProcessLock")

    def checkpoint(self, pid: int) -> None:
        self._move(pid, CudaState.LOCKED, CudaState.CHECKPOINTED,
                   "cuCheckpointProcessCheckpoint")

    def restore(self, pid: int) -> None:
        if self.held:
            others = [t for t in frozen.threads(pid) if t != pid]
            running = [t for t in others if frozen.state(t) not in ("t", "T", "")]
            if running:
                raise CudaError(f"cuCheckpointProcessRestore({pid}) failed: threads {running} "
                                "run before the process's GPU state is back; on a real GPU "
                                "one that touches a GPU mapping dies (stand-in driver)")
            self.restores.append((pid, len(others)))
        self._move(pid, CudaState.CHECKPOINTED, CudaState.LOCKED, "cuCheckpointProcessRestore")

    def unlock(self, pid: int) -> None:
        self._move(pid, CudaState.LOCKED, CudaState.RUNNING, "cuCheckpointProcessUnlock")

    def restore_tid(self, pid: int) -> int | None:
        """The thread the driver restores through: the stand-in names the
        main one; a process without a (stand-in) GPU has no CUDA context."""
        if self._path(pid) is None:
            raise CudaError(f"cuCheckpointProcessGetRestoreThreadId({pid}) failed: "
                            "no CUDA context (stand-in driver)")
        return pid


def state_of(root: Path, workload: str) -> str:
    """What the stand-in says of a workload (the campaign's oracle reads it)."""
    try:
        return (root / workload).read_text().strip()
    except FileNotFoundError:
        return CudaState.RUNNING.name


def install(root: Path, driver: StandInDriver | None = None) -> None:
    """Put the stand-in where smr looks for the driver and for GPU devices
    (``driver``: one instance for every node of this process, to look at)."""
    def for_settings(gpu: str, lock_timeout_s: float, hold_dir: Path | None = None,
                     allow: tuple[str, ...] = ()) -> CudaCheckpoint | None:
        return CudaCheckpoint(driver or StandInDriver(root),  # type: ignore[arg-type]
                              lock_timeout_s, hold_dir=hold_dir, allow=allow)

    def devices() -> list[dict[str, Any]]:
        return [{"index": 0, "model": MODEL, "memory_total": 1 << 40,
                 "memory_free": 1 << 40, "processes": {}}]

    def job_gpus(pids: list[int]) -> dict[str, Any] | None:
        return {"model": MODEL, "count": 1, "used_bytes": 0} if pids else None

    cuda_checkpoint.for_settings = for_settings  # type: ignore[assignment]
    gpuinfo.devices = devices  # type: ignore[assignment]
    gpuinfo.job_gpus = job_gpus  # type: ignore[assignment]


def main() -> int:
    install(Path(os.environ[DIR_ENV]))
    from smrctl.cli import main as smr

    return smr(["up"])


if __name__ == "__main__":
    sys.exit(main())
