"""A node's cache of warm-start template objects (docs/warm-start.md).

Several replicas of one template starting on a node read the same objects:
the first read of an object downloads it once into the node agent's own
directory (never a tenant's: a workload must not choose the bytes a later
restore reads), and later reads come from there.

The cache holds each object *decoded* (decompressed, decrypted) and
verified: the store fills an entry by reading the object from storage as
any read does (``download.decoded``: AES-GCM, zstd, the file's sha256), so a
restore from the cache pays neither zstd nor AES again, only the sha256 of
what it reads (checked like any read: an entry altered or torn on the node's
disk is caught there, removed, and read from storage again). Plaintext of a
tenant's memory therefore lies on the node: the directory is 0700, the
agent's own (docs/security.md).

An entry is named by what it must contain (the object's key, its frames, its
sha256 and its encryption as the manifest says), so a template taken again
under the same generation number never reads a stale copy.

Bounded: at most ``max_bytes`` together; the least recently used entries go
first, an object larger than the bound is read from storage as before.
Cleaned: entries not read for ``max_idle_s`` go at each insertion, and what a
crashed agent left half-written goes when the cache opens.

An entry is written as ``<name>.part`` under an exclusive flock, then renamed:
the lock says a live writer holds it (the kernel drops it when the writer
dies). An agent starting while the one it replaces still writes (a DaemonSet
rollout overlaps them) removes only the ``.part`` files no one holds, and
waits for an entry the other is writing rather than write it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("smr.storage.cache")

PART = ".part"
FORM = "decoded-v1"  # what an entry holds; part of its name

Fill = Callable[[int], Awaitable[None]]  # writes the decoded object into a file descriptor


class CachedObject:
    """One cached object, held open: reads stay valid while a concurrent
    insertion evicts it (the name goes, the open file stays)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return await asyncio.to_thread(os.pread, self.fd, length, start)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ObjectCache:
    def __init__(self, root: Path, max_bytes: int, *, max_idle_s: float = 86400.0) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_idle_s = max_idle_s
        self.stats: Counter[str] = Counter()  # downloads, hits, evicted, corrupt, too_large, linked
        self._locks: dict[str, asyncio.Lock] = {}
        root.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)
        for part in root.glob(f"*{PART}"):  # a crashed agent's half-written entries
            _remove_unheld(part)

    @staticmethod
    def name_of(key: str, entry: dict[str, Any]) -> str:
        what = [FORM, key, entry.get("sha256"), entry.get("size"), entry.get("frames"),
                entry.get("encryption")]
        return hashlib.sha256(orjson.dumps(what)).hexdigest()

    def path_of(self, key: str, entry: dict[str, Any]) -> Path:
        return self.root / self.name_of(key, entry)

    def has(self, key: str, entry: dict[str, Any]) -> bool:
        with contextlib.suppress(FileNotFoundError):
            return (self.root / self.name_of(key, entry)).lstat().st_size == int(entry["size"])
        return False

    async def open(self, key: str, entry: dict[str, Any], fill: Fill) -> CachedObject | None:
        """The decoded object, from the cache (``fill`` writes it there first
        if missing), or None where it is larger than the cache."""
        stored = int(entry["size"])
        if stored > self.max_bytes:
            self.stats["too_large"] += 1
            return None
        name = self.name_of(key, entry)
        path = self.root / name
        # One download per object, whatever the number of replicas reading it.
        async with self._locks.setdefault(name, asyncio.Lock()):
            try:
                st = path.lstat()
            except FileNotFoundError:
                st = None
            if st is not None and st.st_size == stored:
                self.stats["hits"] += 1
                os.utime(path)
            elif await self._fill(fill, stored, path):
                self.stats["downloads"] += 1
            else:
                self.stats["hits"] += 1  # another agent on this node wrote it meanwhile
            return CachedObject(path)

    def forget(self, key: str, entry: dict[str, Any]) -> None:
        """Drop an entry whose bytes did not verify: the next read fetches it again."""
        self.stats["corrupt"] += 1
        (self.root / self.name_of(key, entry)).unlink(missing_ok=True)

    async def _fill(self, fill: Fill, size: int, path: Path) -> bool:
        """Write the entry; False where another agent wrote it meanwhile."""
        part = path.with_name(path.name + PART)
        fd = await asyncio.to_thread(_locked, part)  # waits for another writer of it
        try:
            with contextlib.suppress(FileNotFoundError):
                if path.lstat().st_size == size:
                    part.unlink(missing_ok=True)
                    return False
            await asyncio.to_thread(self._make_room, size)
            os.ftruncate(fd, 0)
            try:
                # Not fsynced: every read checks the sha256, so an entry torn
                # by a crash is caught and read again, and the replica that
                # waits for the fill reads it back from the page cache
                # instead of waiting for GiBs to reach the disk.
                await fill(fd)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
            part.rename(path)  # still locked: no one takes it for a crashed writer's
            return True
        finally:
            os.close(fd)

    def _make_room(self, size: int) -> None:
        """Evict entries idle too long, then the least recently used, until
        ``size`` more bytes fit."""
        now = time.time()
        entries = []
        for p in self.root.iterdir():
            if p.name.endswith(PART):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = p.lstat()
                if now - st.st_mtime > self.max_idle_s:
                    p.unlink(missing_ok=True)
                    self.stats["evicted"] += 1
                else:
                    entries.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in entries)
        for _, s, p in sorted(entries):
            if total + size <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            self.stats["evicted"] += 1
            total -= s
        if total + size > self.max_bytes:
            log.info("template cache: %d bytes in flight leave no room below %d", total,
                     self.max_bytes)


def _locked(part: Path) -> int:
    """``part`` opened (created if missing) and exclusively flocked: blocks
    while another writer holds it. The file locked is the one at ``part``
    then (a writer that finished renamed it away, one that failed removed it)."""
    while True:
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == part.lstat().st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _remove_unheld(part: Path) -> None:
    """Remove a half-written entry unless a live writer holds its lock."""
    try:
        fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # gone, or not a file of ours (a link): left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno != errno.EWOULDBLOCK:
            log.warning("template cache: cannot lock %s: %s", part, e)
        os.close(fd)
        return
    try:
        if os.fstat(fd).st_ino == part.lstat().st_ino:
            part.unlink()
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
