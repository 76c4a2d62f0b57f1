"""What the checkpointer and restorer share for local jobs (the embedded
mode): their collaborators, and which targets they accept."""

from __future__ import annotations

from pathlib import Path

from services.storage.store import CheckpointStore
from smr.contract.errors import PermanentError
from smr.contract.messages import Target
from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.jobs import JobLock, JobRegistry
from smr.process.criu import Criu


class LocalJobStep:
    # How long a restored process must run on before its restore answers
    # (one that dies at once is reported so, with how it ended).
    settle_s = 0.3
    # How long a restore waits for the dumped PIDs to be reaped.
    pid_wait_s = 30.0

    def __init__(self, *, criu: Criu, store: CheckpointStore, jobs: JobRegistry, lock: JobLock,
                 work_dir: Path, node: str, cuda: CudaCheckpoint | None = None,
                 commit_deadline: float = 1800.0) -> None:
        self.criu = criu
        self.store = store
        self.jobs = jobs
        self.lock = lock
        self.work_dir = work_dir
        self.node = node
        self.cuda = cuda  # None on a node without the NVIDIA driver
        # How long a finished dump is retried into storage (its job held
        # stopped) before the checkpoint fails and the job runs on.
        self.commit_deadline = commit_deadline

    @staticmethod
    def job_id(target: Target) -> str:
        if target.kind != "job" or not target.job_id:
            raise PermanentError(
                f"this node handles local jobs; {target} needs the node agent",
                code="target-unsupported", hint="run the node agent on Kubernetes nodes",
            )
        return target.job_id
