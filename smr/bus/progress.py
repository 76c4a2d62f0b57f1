"""What the worker runs and hears back: the ``Step`` protocol a checkpoint
or restore step implements, and the ``Progress`` it reports (written to
the step's KV state at each keepalive, each phase an event on its span)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from opentelemetry import trace

from smr.contract.messages import CkptDone, CkptRequested, RestoreDone, RestoreRequested

Req = TypeVar("Req", CkptRequested, RestoreRequested)
Res = TypeVar("Res", CkptDone, RestoreDone)


@dataclass
class Progress:
    """What a running step reports; written to its KV state at each keepalive."""

    phase: str = "starting"
    done_bytes: int = 0
    total_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    span: trace.Span | None = None  # the step's span: each phase is an event on it

    def update(self, phase: str | None = None, *, done_bytes: int | None = None,
               total_bytes: int | None = None, **extra: Any) -> None:
        if phase:
            if self.span is not None and phase != self.phase:
                self.span.add_event(f"phase {phase}")
            self.phase = phase
        if done_bytes is not None:
            self.done_bytes = done_bytes
        if total_bytes is not None:
            self.total_bytes = total_bytes
        self.extra.update(extra)


class Step(Protocol, Generic[Req, Res]):
    """A checkpoint or restore step, as the worker runs it."""

    kind: str  # "ckpt.requested" or "restore.requested"

    async def run(self, req: Req, progress: Progress) -> Res: ...

    async def recover(self, req: Req, state: dict[str, Any]) -> Res | None:
        """An earlier attempt died mid-step. Return its result if the world shows
        one (finished, or failed for good); None if running the step again is safe."""
        ...
