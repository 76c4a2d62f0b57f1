"""The contract every storage backend implements.

Backends move bytes and enforce conditional writes; policy (layout,
generations, verification, retention) lives in ``store``. Backend-specific
exceptions are translated to these at the backend's edge.

    StorageError   the store cannot be reached or answers with an error: a
    │              TemporaryError, so the step that met it is retried
    ├── NotFound   no object at that key
    └── Conflict   a conditional write lost (the object exists / changed)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from smr.contract.errors import TemporaryError


class StorageError(TemporaryError):
    code = "storage-error"


class NotFound(StorageError):
    code = "not-found"


class Conflict(StorageError):
    code = "conflict"


@dataclass(frozen=True)
class PendingUpload:
    """An upload begun and neither completed nor aborted (a writer died)."""

    key: str
    upload_id: str
    started: float  # epoch seconds


class Upload(Protocol):
    """One object written in parts. Parts may be sent concurrently; each
    knows its byte offset in the object, so parts can land out of order."""

    async def put_part(self, number: int, offset: int, data: bytes | bytearray) -> None: ...

    async def complete(self, parts: int) -> None:
        """Make the object visible as the concatenation of parts 1..``parts``;
        StorageError, and nothing visible, unless each of them went up."""
        ...

    async def abort(self) -> None: ...


class Backend(Protocol):
    def url(self, key: str) -> str: ...

    def start_upload(self, key: str) -> Upload: ...

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start``; NotFound if absent."""
        ...

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                        if_match: str | None = None) -> str:
        """Write a small object; returns its etag. ``if_none_match``: only if it
        does not exist; ``if_match``: only if its etag is still that. Conflict otherwise."""
        ...

    async def get_bytes(self, key: str) -> tuple[bytes, str]:
        """(content, etag); NotFound if absent."""
        ...

    async def list(self, prefix: str) -> list[str]:
        ...

    async def delete(self, keys: list[str]) -> None:
        ...

    async def pending_uploads(self, prefix: str) -> list[PendingUpload]:
        ...

    async def abort_upload(self, upload: PendingUpload) -> None:
        ...

    async def close(self) -> None:
        ...
