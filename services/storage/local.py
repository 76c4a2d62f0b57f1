"""The local-directory backend: objects are files under a root directory.

Writes go to a temporary name and are renamed into place, so a reader never
sees half an object. Conditional writes hold an flock on the object's
directory, so two writers in different processes are serialised.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.storage import writeback
from services.storage.backend import Conflict, NotFound, PendingUpload, StorageError
from smr.aio import in_thread
from smr.contract.errors import PermanentError

UPLOAD_MARK = ".upload-"


class LocalBackend:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def url(self, key: str) -> str:
        return (self.root / key).as_uri()

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root.resolve() not in p.parents:
            raise PermanentError(f"key {key!r} escapes the storage root", code="invalid-key",
                                 hint="checkpoint ids and namespaces are names, never paths")
        return p

    def start_upload(self, key: str) -> LocalUpload:
        return LocalUpload(self._path(key))

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return await asyncio.to_thread(os.pread, f.fileno(), length, start)
        except FileNotFoundError:
            raise NotFound(f"no object {key} in {self.root}") from None

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                        if_match: str | None = None) -> str:
        # Off the loop: the flock and the fsyncs wait on other writers and
        # the disk (files of different directories go up at once; one
        # directory's take turns under its lock).
        return await in_thread(self._put_bytes, key, data, if_none_match, if_match)

    def _put_bytes(self, key: str, data: bytes, if_none_match: bool,
                   if_match: str | None) -> str:
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
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, data)
                os.fsync(fd)  # the bytes on disk before the name: see durable()
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk keeps none of it
                raise
            finally:
                os.close(fd)
            durable(tmp, path)
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
        if base != self.root and not prefix.endswith("/") and not base.is_dir():
            base = base.parent  # a prefix within a name, as S3 takes it
        if not base.exists():
            return []
        out = []
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.startswith("."):
                    continue  # temporary names, uploads in progress, locks
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

    async def pending_uploads(self, prefix: str) -> list[PendingUpload]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        out = []
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.startswith(".") and UPLOAD_MARK in f:
                    p = Path(dirpath, f)
                    name, uid = f[1:].rsplit(UPLOAD_MARK, 1)
                    key = str(p.with_name(name).relative_to(self.root))
                    with contextlib.suppress(FileNotFoundError):
                        out.append(PendingUpload(key, uid, p.stat().st_mtime))
        return out

    async def abort_upload(self, upload: PendingUpload) -> None:
        LocalUpload(self._path(upload.key), upload.upload_id).path.unlink(missing_ok=True)

    async def close(self) -> None:
        pass

    @contextmanager
    def _locked(self, directory: Path) -> Iterator[None]:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class LocalUpload:
    """Parts are written at their offsets into a hidden file, renamed into
    place on completion: readers see the whole object or none of it."""

    def __init__(self, final: Path, upload_id: str | None = None) -> None:
        self.final = final
        self.path = final.with_name(f".{final.name}{UPLOAD_MARK}{upload_id or uuid.uuid4().hex}")
        self.written: set[int] = set()
        self.started = False

    async def put_part(self, number: int, offset: int, data: bytes | bytearray) -> None:
        await in_thread(self._write, offset, data)
        self.written.add(number)

    def _write(self, offset: int, data: bytes | bytearray) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Created by the first part only: one aborted meanwhile (a GC) is an
        # error, never a file made again with a hole where its parts were.
        fd = self._open(os.O_WRONLY | (0 if self.started else os.O_CREAT))
        self.started = True
        try:
            _write_all(fd, data, offset)
            # The disk writes the part now, while later parts come; the fsync
            # at complete() then waits for little more than the last ones.
            writeback.start(fd, offset, len(data))
        finally:
            os.close(fd)

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise StorageError(f"the upload of {self.final} was aborted while its parts went "
                               "up (a garbage collection took its writer for dead?)",
                               hint="the step is retried; if this repeats, raise SMR_GC_GRACE"
                               ) from None

    async def complete(self, parts: int) -> None:
        if self.written != set(range(1, parts + 1)):
            missing = sorted(set(range(1, parts + 1)) - self.written)
            raise StorageError(f"{self.final}: part(s) {missing[:10]} of {parts} were not "
                               "written; the upload is not completed", hint="the step is retried")
        await in_thread(self._finish)

    def _finish(self) -> None:
        if not self.started:
            self._write(0, b"")  # an empty object
        fd = self._open(os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        durable(self.path, self.final)

    async def abort(self) -> None:
        self.path.unlink(missing_ok=True)


def durable(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` (already fsynced) to ``final`` and fsync the directory:
    after a power loss the name holds the whole object or the old one, never
    an empty file that would break every later checkpoint of the id."""
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray, offset: int = 0) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _etag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()
