"""Typed message classes, one per schema in ``schemas/``.

``to_payload`` validates and serialises (orjson); ``from_payload`` parses and
validates. Field names are the schema's; a ``None`` field is left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, Self

from smr.contract import schemas as contract

SCHEMA_VERSION = 1

# "template": a warm pod's leave-running checkpoint that new replicas start
# from (docs/warm-start.md). "suspended": the final checkpoint of a pod whose
# Job was suspended (a batch queue's preemption, services/suspension).
Reason = Literal["cordon", "drain", "node-deleted", "preemption", "heartbeat", "api",
                 "template", "suspended"]
# "superseded": a checkpoint stored, but after a later dump of it (latest stays there).
Status = Literal["succeeded", "failed", "superseded"]


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def epoch(ts: str) -> float:
    """Unix time of a timestamp as ``now`` writes it."""
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def derive_request_id(*parts: str) -> str:
    """A deterministic request_id: the same event always gives the same id,
    so a repeated event is dropped by JetStream's dedupe."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


LOCAL_NAMESPACE = "local"  # where a job of `smr up` (no pod) is stored and named


@dataclass(frozen=True, slots=True)
class Target:
    kind: Literal["job", "pod"]
    job_id: str | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    pod_uid: str | None = None  # the pod's uid when asked: a recreated one is refused

    @classmethod
    def job(cls, job_id: str) -> Target:
        return cls(kind="job", job_id=job_id)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Target:
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def namespace_name(self) -> str:
        """The namespace it acts in: its pod's, ``local`` for a job (storage
        paths and subjects end in it)."""
        return (self.namespace if self.kind == "pod" else None) or LOCAL_NAMESPACE

    def __str__(self) -> str:
        if self.kind == "job":
            return f"job {self.job_id}"
        return f"pod {self.namespace}/{self.pod} container {self.container}"


@dataclass(slots=True, kw_only=True)
class Message:
    SCHEMA: ClassVar[str]
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            out[f.name] = v.to_dict() if isinstance(v, Target) else v
        return out

    def to_payload(self) -> bytes:
        return contract.encode(self.SCHEMA, self.to_dict())

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in doc.items() if k in names}
        if isinstance(kw.get("target"), dict):
            kw["target"] = Target.from_dict(kw["target"])
        return cls(**kw)

    @classmethod
    def from_payload(cls, payload: bytes) -> Self:
        return cls.from_dict(contract.decode(cls.SCHEMA, payload))


@dataclass(slots=True, kw_only=True)
class NodeDraining(Message):
    SCHEMA: ClassVar[str] = "node.draining"
    request_id: str
    node: str
    reason: Reason
    observed_at: str = field(default_factory=now)
    detail: str | None = None


@dataclass(slots=True, kw_only=True)
class _Request(Message):
    request_id: str
    checkpoint_id: str
    target: Target
    node: str
    reason: Reason = "api"
    requested_at: str = field(default_factory=now)
    deadline: str | None = None  # refused after it (request-expired), not carried out


@dataclass(slots=True, kw_only=True)
class CkptRequested(_Request):
    SCHEMA: ClassVar[str] = "ckpt.requested"
    leave_running: bool = False
    pre_dump: bool = False
    tcp: Literal["keep", "close"] | None = None  # None: the workload's policy decides


@dataclass(slots=True, kw_only=True)
class RestoreRequested(_Request):
    SCHEMA: ClassVar[str] = "restore.requested"
    generation: int | None = None
    # A local job's GPUs to restore onto (UUIDs; smr restore --gpus). A pod's
    # are those its new container was given, never a request's.
    gpus: list[str] | None = None


@dataclass(slots=True, kw_only=True)
class _Result(_Request):
    status: Status
    generation: int | None = None
    location: str | None = None
    size_bytes: int | None = None
    durations: dict[str, float] = field(default_factory=dict)
    started_at: str | None = None
    finished_at: str = field(default_factory=now)
    error: dict[str, str] | None = None
    sockets: dict[str, Any] | None = None  # what the tree held; what happened to connections

    @classmethod
    def for_request(cls, req: _Request, **kw: Any) -> Self:
        return cls(
            request_id=req.request_id, checkpoint_id=req.checkpoint_id, target=req.target,
            node=req.node, reason=req.reason, requested_at=req.requested_at, **kw,
        )


@dataclass(slots=True, kw_only=True)
class CkptDone(_Result):
    SCHEMA: ClassVar[str] = "ckpt.done"
    # Why a requested pre-dump was not taken (the dump was a full one).
    pre_dump_skipped: str | None = None


@dataclass(slots=True, kw_only=True)
class RestoreDone(_Result):
    SCHEMA: ClassVar[str] = "restore.done"
    pid: int | None = None


@dataclass(slots=True, kw_only=True)
class DeadLetter(Message):
    SCHEMA: ClassVar[str] = "error"
    subject: str
    error: dict[str, str]
    payload: str
    service: str
    request_id: str | None = None
    deliveries: int | None = None
    received_at: str = field(default_factory=now)


@dataclass(slots=True, kw_only=True)
class StorageQuery(Message):
    SCHEMA: ClassVar[str] = "storage.query"
    checkpoint_id: str | None = None  # required except by storage.checkpoints
    namespace: str | None = None  # None: `local`, or every namespace for storage.checkpoints


@dataclass(slots=True, kw_only=True)
class StorageReply(Message):
    SCHEMA: ClassVar[str] = "storage.reply"
    generations: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_id: str | None = None
    namespace: str | None = None
    error: dict[str, str] | None = None
