"""The contract every storage backend implements.

Backends move bytes and enforce conditional writes; policy (layout,
generations, verification, retention) lives in ``store``. Backend-specific
exceptions are translated to these at the backend's edge.

    StorageError
    ├── NotFound   no object at that key
    └── Conflict   a conditional write lost (the object exists / changed)
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from smr.errors import SmrError


class StorageError(SmrError):
    code = "storage-error"


class NotFound(StorageError):
    code = "not-found"


class Conflict(StorageError):
    code = "conflict"


class Backend(Protocol):
    def url(self, key: str) -> str: ...

    async def put_file(self, key: str, src: Path) -> tuple[int, str]:
        """Store a file; returns (size, sha256 hex) of what was stored."""
        ...

    async def get_file(self, key: str, dst: Path) -> tuple[int, str]:
        """Fetch into ``dst``; returns (size, sha256 hex) of what was read."""
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
