"""Uploads: files cut into frames, encoded in worker threads, and sent as
parts with bounded memory — while CRIU is still writing them.

CRIU appends memory pages to ``pages-*.img`` as it dumps, and writes every
other image (small protobuf files) in one go. So while a dump runs, the
page images are followed as they grow and their complete frames go up at
once; when the dump is over, the tail of each and all other files follow.
Time-to-durable becomes max(dump, upload) instead of dump + upload.

Parts grow with their number (see ``part_size``): S3 takes at most 10,000
parts of an object, and a page image of several TiB must fit.

Memory bound: ``ENCODING`` raw frames per file being encoded, one part
being filled per file, plus, across all files, at most ``PARTS_IN_FLIGHT``
parts and ``BUDGET_PARTS`` x ``PART_TARGET`` bytes being sent (a part larger
than that goes alone).

Neighbours: ``codec`` encodes a frame; ``store`` turns the entries returned
here into a manifest; ``download`` reads them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.storage.backend import Backend
from services.storage.codec import FRAME_SIZE, Codec
from smr.contract.errors import PermanentError

STREAMED = "pages-*.img"  # append-only while CRIU dumps
PART_TARGET = 8 << 20  # S3 wants parts of at least 5 MiB, but the last
PARTS_IN_FLIGHT = max(8, os.cpu_count() or 1)
BUDGET_PARTS = 32  # bytes in flight: this many parts of PART_TARGET
MAX_PARTS = 10_000  # S3's limit: part numbers 1..10000
PARTS_PER_STEP = 1_000  # parts of one size before the size doubles
# Frames of one file encoded at once: every core, since one page image can
# hold a whole GPU's memory (measured on the H100 machine: with 4, upload fell
# behind CRIU's 1.7 GB/s).
ENCODING = max(4, os.cpu_count() or 1)
SMALL_FILES_AT_ONCE = 16
POLL_S = 0.02  # how often a growing file is looked at


def part_size(number: int) -> int:
    """The size part ``number`` (from 1) is filled to: ``PART_TARGET`` for
    the first 1,000 parts, doubling every 1,000 after, so a part is about
    1/1000 of what went before it. 10,000 parts hold 1023 x 1,000 x
    ``PART_TARGET`` (8 TiB); the last are 512 x ``PART_TARGET`` (4 GiB, S3
    takes 5 GiB)."""
    return PART_TARGET << min((number - 1) // PARTS_PER_STEP, 9)


class ByteBudget:
    """Bytes of parts being sent, across all files. First come, first
    served, so a large part is not starved by small ones; a part larger than
    the whole budget waits for it all and goes alone."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, n: int) -> int:
        """Wait for ``n`` bytes (at most the whole budget); returns what to release."""
        n = min(n, self.capacity)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
            return n
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted, then cancelled before it ran
            else:
                fut.cancel()
                self._wake()
            raise
        return n

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.capacity:
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)


def frame_aad(key: str, index: int) -> bytes:
    """Binds an encrypted frame to its object and position."""
    return f"{key}#{index}".encode()


class Uploader:
    def __init__(self, backend: Backend, codec: Codec, *,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.backend = backend
        self.codec = codec
        self.parts = asyncio.Semaphore(PARTS_IN_FLIGHT)
        self.budget = ByteBudget(BUDGET_PARTS * PART_TARGET)
        self.small = asyncio.Semaphore(SMALL_FILES_AT_ONCE)
        self.on_bytes = on_bytes
        self.done_bytes = 0

    def _progress(self, n: int) -> None:
        self.done_bytes += n
        if self.on_bytes:
            self.on_bytes(self.done_bytes)

    async def upload_dir(self, src: Path, key_of: Callable[[str], str],
                         writer: asyncio.Future[Any] | None = None) -> list[dict[str, Any]]:
        """Upload every regular file under ``src``; returns their manifest
        entries, sorted by path. ``writer``: the task still writing into
        ``src`` (a CRIU dump); its page images are streamed while it runs. If
        it fails, every upload is aborted and its error raised."""
        tasks: dict[str, asyncio.Task[dict[str, Any]]] = {}
        finished = asyncio.Event()
        try:
            while writer is not None:
                done = writer.done()  # before the scan: a file seen after it is whole
                for p in sorted(src.rglob(STREAMED)):
                    rel = p.relative_to(src).as_posix()
                    if rel not in tasks and p.is_file() and not p.is_symlink():
                        tasks[rel] = asyncio.create_task(
                            self._frames(p, key_of(rel), rel, finished))
                if done:
                    writer.result()  # the dump's error, if it failed
                    break
                await asyncio.wait([writer, *tasks.values()], timeout=POLL_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                for t in tasks.values():
                    if t.done():
                        t.result()  # an upload failed: stop now, not after the dump
            finished.set()
            for p in sorted(src.rglob("*")):
                rel = p.relative_to(src).as_posix()
                if rel in tasks or p.is_symlink() or not p.is_file():
                    continue
                if p.stat().st_size <= FRAME_SIZE:
                    tasks[rel] = asyncio.create_task(self._small(p, key_of(rel), rel))
                else:
                    tasks[rel] = asyncio.create_task(self._frames(p, key_of(rel), rel, None))
            entries = await asyncio.gather(*tasks.values())
        except BaseException:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            raise
        return sorted(entries, key=lambda e: e["path"])

    def _entry(self, rel: str, size: int, digest: str, frames: list[list[int]]) -> dict[str, Any]:
        e: dict[str, Any] = {
            "path": rel, "size": size, "sha256": digest,
            "stored_size": sum(f[0] for f in frames),
            "compression": "zstd" if any(f[2] for f in frames) else "none",
            "frames": frames,
        }
        if enc := self.codec.encryption():
            e["encryption"] = enc
        return e

    async def _small(self, path: Path, key: str, rel: str) -> dict[str, Any]:
        """A file of at most one frame: one PUT, no multipart round trips."""
        async with self.small:
            raw = await asyncio.to_thread(path.read_bytes)
            frames, digests = [], []
            data = b""
            if raw:
                data, z, n, digest = await self._encode(raw, frame_aad(key, 0))
                frames, digests = [[len(data), n, int(z)]], [digest]
            await self.backend.put_bytes(key, data)
        self._progress(len(raw))
        return self._entry(rel, len(raw), file_digest(digests), frames)

    async def _frames(self, path: Path, key: str, rel: str,
                      finished: asyncio.Event | None) -> dict[str, Any]:
        """Frame by frame, in order, following the file while ``finished`` is unset."""
        upload = self.backend.start_upload(key)
        frames: list[list[int]] = []
        encoding: deque[asyncio.Task[tuple[bytes, bool, int, bytes]]] = deque()
        digests: list[bytes] = []
        sends: set[asyncio.Task[None]] = set()
        # The part being filled: its first frame as it is (a part of one
        # frame goes without a copy), then every frame copied in as it comes
        # and let go, so a part is held once, never as its frames and their
        # join besides (parts reach 4 GiB: ``part_size``).
        part: bytes | bytearray = b""
        part_len = part_raw = part_no = offset = raw_off = 0

        async def send(number: int, at: int, data: bytes | bytearray, raw: int,
                       held: int) -> None:
            try:
                await upload.put_part(number, at, data)
            finally:
                self.parts.release()
                self.budget.release(held)
            self._progress(raw)

        def check_sends() -> None:
            # A send leaves ``sends`` only here, once its result is read: a
            # failed part fails the file, never a shorter object.
            for t in [t for t in sends if t.done()]:
                sends.discard(t)
                t.result()

        async def flush() -> None:
            nonlocal part, part_len, part_raw, part_no, offset
            if part_no == MAX_PARTS:
                raise PermanentError(
                    f"{rel} is larger than {MAX_PARTS} parts hold ({offset} bytes stored)",
                    code="file-too-large", hint="S3 stores objects of at most 5 TiB")
            data = part  # the send owns it: ``part`` starts anew below
            await self.parts.acquire()  # back-pressure: wait for a free slot
            try:
                held = await self.budget.acquire(len(data))  # and for the bytes
            except BaseException:
                self.parts.release()
                raise
            part_no += 1
            sends.add(asyncio.create_task(send(part_no, offset, data, part_raw, held)))
            offset += part_len
            del data
            part, part_len, part_raw = b"", 0, 0
            check_sends()

        async def collect() -> None:
            nonlocal part, part_len, part_raw
            data, z, n, digest = await encoding.popleft()
            frames.append([len(data), n, int(z)])
            digests.append(digest)
            if not part_len:
                part = data
            else:
                if not isinstance(part, bytearray):
                    part = bytearray(part)
                part += data
            part_len += len(data)
            part_raw += n
            del data  # copied into ``part``: not held twice while it waits to go
            if part_len >= part_size(part_no + 1):
                await flush()

        fd = os.open(path, os.O_RDONLY)
        try:
            while True:
                final = finished is None or finished.is_set()  # before the size
                avail = os.fstat(fd).st_size - raw_off
                if avail >= FRAME_SIZE or (final and avail > 0):
                    n = min(FRAME_SIZE, avail)
                    raw = await asyncio.to_thread(_read, fd, raw_off, n)
                    aad = frame_aad(key, len(frames) + len(encoding))
                    encoding.append(asyncio.create_task(self._encode(raw, aad)))
                    raw_off += n
                elif final:
                    break
                else:
                    await asyncio.sleep(POLL_S)  # CRIU has not written a whole frame yet
                # Encoded frames leave at once; a full window waits for the oldest.
                while encoding and (len(encoding) >= ENCODING or encoding[0].done()):
                    await collect()
                check_sends()
            while encoding:
                await collect()
            if part_len:
                await flush()
            await asyncio.gather(*sends)
            check_sends()
            await upload.complete(part_no)
        except BaseException:
            for t in [*encoding, *sends]:
                t.cancel()
            await asyncio.gather(*encoding, *sends, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.shield(upload.abort())
            raise
        finally:
            os.close(fd)
        return self._entry(rel, raw_off, file_digest(digests), frames)

    async def _encode(self, raw: bytes, aad: bytes) -> tuple[bytes, bool, int, bytes]:
        def work() -> tuple[bytes, bool, int, bytes]:
            data, z = self.codec.encode(raw, aad)
            return data, z, len(raw), hashlib.sha256(raw).digest()

        return await asyncio.to_thread(work)


def file_digest(frame_digests: list[bytes]) -> str:
    """A file's sha256 as the manifest records it: over its frames' sha256
    digests, in order. Frames hash on every core; one sha256 over a 16 GiB
    page image ran at about 0.5 GB/s and held back the whole upload."""
    return hashlib.sha256(b"".join(frame_digests)).hexdigest()


def _read(fd: int, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise OSError(f"short read at {offset}: {len(data)} of {n} bytes")
    return data

