"""The local-directory backend: objects are files under a root directory.

Writes go to a temporary name and are renamed into place, so a reader never
sees half an object. Conditional writes hold an flock on the object's
directory, so two writers in different processes are serialised.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.storage.backend import Conflict, NotFound, StorageError

CHUNK = 1 << 20


class LocalBackend:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def url(self, key: str) -> str:
        return (self.root / key).as_uri()

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root.resolve() not in p.parents:
            raise StorageError(f"key {key!r} escapes the storage root")
        return p

    async def put_file(self, key: str, src: Path) -> tuple[int, str]:
        return await asyncio.to_thread(self._copy, src, self._path(key))

    async def get_file(self, key: str, dst: Path) -> tuple[int, str]:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"no object {key} in {self.root}")
        return await asyncio.to_thread(self._copy, src, dst)

    @staticmethod
    def _copy(src: Path, dst: Path) -> tuple[int, str]:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.part")
        h, size = hashlib.sha256(), 0
        with open(src, "rb") as i, open(tmp, "wb") as o:
            while chunk := i.read(CHUNK):
                h.update(chunk)
                o.write(chunk)
                size += len(chunk)
        os.replace(tmp, dst)
        return size, h.hexdigest()

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                        if_match: str | None = None) -> str:
        path = self._path(key)
        with self._locked(path.parent):
            exists = path.is_file()
            if if_none_match and exists:
                raise Conflict(f"{key} already exists")
            if if_match is not None:
                if not exists:
                    raise Conflict(f"{key} no longer exists")
                if _etag(path.read_bytes()) != if_match:
                    raise Conflict(f"{key} was changed by another writer")
            tmp = path.with_name(f".{path.name}.part")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return _etag(data)

    async def get_bytes(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"no object {key} in {self.root}") from None
        return data, _etag(data)

    async def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.exists():
            return []
        out = []
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.startswith(".") and (f.endswith(".part") or f == ".lock"):
                    continue
                out.append(str(Path(dirpath, f).relative_to(self.root)))
        return sorted(k for k in out if k.startswith(prefix))

    async def delete(self, keys: list[str]) -> None:
        dirs = set()
        for k in keys:
            path = self._path(k)
            path.unlink(missing_ok=True)
            dirs.update(p for p in path.parents if self.root.resolve() in p.parents)
        # Directories left holding nothing but a lock file go too, deepest first.
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            if d.is_dir() and {c.name for c in d.iterdir()} <= {".lock"}:
                (d / ".lock").unlink(missing_ok=True)
                d.rmdir()

    @contextmanager
    def _locked(self, directory: Path) -> Iterator[None]:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _etag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()
