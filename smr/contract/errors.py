"""Errors of smr.

    SmrError
    ├── ConfigError          a setting is missing or invalid (names the setting)
    ├── ContractError        a message does not match its schema
    └── StepError            a checkpoint/restore step failed
        ├── TemporaryError   worth retrying later (nak with delay)
        └── PermanentError   retrying cannot help (the request ends as failed)

Every error carries a stable ``code`` and a ``hint`` saying what to do; the
step errors become the ``error`` object of ckpt.done / restore.done.
"""

from __future__ import annotations

import errno

MAX_TEXT = 2000  # an error's message, hint or detail; they travel in results and dead letters


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut: an error
    that quotes a 1 MB field must not become a 1 MB message."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class SmrError(Exception):
    code = "smr-error"

    def __init__(
        self, message: str, *, code: str | None = None, hint: str = "", detail: str = ""
    ) -> None:
        message = clip(message)
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.hint = clip(hint)
        self.detail = clip(detail)

    def as_dict(self) -> dict[str, str]:
        out = {"code": self.code, "message": self.message}
        if self.hint:
            out["hint"] = self.hint
        if self.detail:
            out["detail"] = self.detail
        return out

    def __str__(self) -> str:
        s = self.message
        if self.detail:
            s += f"\n  {self.detail}"
        if self.hint:
            s += f"\n  hint: {self.hint}"
        return s


class ConfigError(SmrError):
    code = "config-invalid"


class ContractError(SmrError):
    code = "schema-invalid"


class StepError(SmrError):
    code = "step-failed"


class TemporaryError(StepError):
    code = "temporary"


class PermanentError(StepError):
    code = "permanent"


def disk_full(e: BaseException) -> PermanentError | None:
    """A step that ran out of disk (or quota) as the failure it is, naming
    where, rather than as a bug in smr. Not retried: a full disk rarely
    clears by itself, and the job keeps running meanwhile."""
    if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = e.filename or "the step's work or storage directory"
    return PermanentError(
        f"no space left on the disk of {where}", code="disk-full",
        hint="free space there, or point SMR_WORK_DIR and SMR_STORAGE_PATH (SMR_DATA_DIR "
        "holds both by default) at a larger disk: a checkpoint needs about its job's memory "
        "free in each; the job was left running")
