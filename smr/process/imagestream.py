"""Images handed to CRIU as they arrive: the streamer end of ``criu restore --stream``.

With ``--stream``, CRIU reads no image from its images directory. It
connects to ``<images dir>/streamer-serve.sock`` and asks for each image by
name, in the order it needs them (the small ones first, each process's
``pages-N.img`` last). For each request we answer whether the image exists;
if it does, CRIU sends the write end of a pipe (SCM_RIGHTS) and reads the
image from the other end while we write it. So a restore can run while its
page images are still being downloaded, and no copy of them is written to
disk.

The wire format is criu/img-streamer.c's: each message is a little-endian
u32 length and a protobuf, ``ImgStreamerRequestEntry {string filename = 1}``
from CRIU and ``ImgStreamerReplyEntry {bool exists = 1}`` back. Two
one-field messages are encoded here by hand rather than adding protobuf.

Sources must deliver only verified bytes and end short on a mismatch
(services/storage/download holds each file's last range back until its
sha256 matched): CRIU then fails on the short image and kills the tree it
was restoring, so a process never resumes on bytes that were not stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger("smr.process.criu")

SOCKET = "streamer-serve.sock"
# Larger pipes mean fewer wake-ups per image; above /proc/sys/fs/pipe-max-size
# (1 MiB by default) only root may go, which the restorer is.
PIPE_SIZES = (16 << 20, 1 << 20)
_F_SETPIPE_SZ = 1031

@dataclass(frozen=True)
class FileRange:
    """Bytes already in a file (a RAM-backed scratch file): spliced into
    CRIU's pipe by the kernel, never copied through this process."""

    fd: int
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length


Chunk = bytes | memoryview | FileRange
# An image's bytes, or None when the checkpoint has no such image.
Source = Callable[[str], AsyncIterator[Chunk] | None]


class StreamerError(Exception):
    """CRIU spoke something other than the image-streamer protocol."""


def encode_reply(exists: bool) -> bytes:
    body = b"\x08\x01" if exists else b"\x08\x00"  # field 1, varint
    return struct.pack("<I", len(body)) + body


def decode_request(body: bytes) -> str:
    """The filename of an ImgStreamerRequestEntry."""
    if not body or body[0] != 0x0A:  # field 1, length-delimited
        raise StreamerError(f"unexpected image request {body[:16]!r}")
    n = shift = 0
    pos = 1
    while True:
        if pos >= len(body):
            raise StreamerError("truncated image request")
        b = body[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    name = body[pos:pos + n]
    if len(name) != n:
        raise StreamerError("truncated image request")
    return name.decode()


class ImageStreamer:
    """Serves one ``criu restore --stream`` from ``source``.

    Use as ``async with ImageStreamer(images, source) as s:`` around the CRIU
    run, then ``await s.finish()`` once CRIU succeeded. ``s.cause()`` is the
    error of a source that failed (a corrupt or unreachable image): when CRIU
    fails, that, not CRIU's short read, is why.
    """

    def __init__(self, images: Path, source: Source,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.images = images
        self.source = source
        self.on_bytes = on_bytes
        self.served: list[str] = []
        self.bytes = 0
        self.done_at: float | None = None  # monotonic: the last image written
        self._errors: list[BaseException] = []
        self._writers: list[asyncio.Task[None]] = []
        # Its own threads: a write blocks until CRIU reads, and must never
        # hold a worker that the downloads' decoding needs.
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="smr-imagestream")
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._serving: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ImageStreamer:
        self.images.mkdir(parents=True, exist_ok=True)
        path = self.images / SOCKET
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound through the directory's descriptor: a socket path has at most
        # 107 bytes, and a pod volume's host path can be longer.
        dfd = os.open(self.images, os.O_PATH | os.O_DIRECTORY)
        try:
            self._listener.bind(f"/proc/self/fd/{dfd}/{SOCKET}")
        finally:
            os.close(dfd)
        self._listener.listen(1)
        self._listener.setblocking(False)
        self._serving = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._serving and not self._serving.done():
            self._serving.cancel()
        # Shut down (a thread blocked in recv returns), closed only once no
        # task uses them: a number closed under a thread about to recv could
        # be another file's by then.
        for sock in (self._conn, self._listener):
            if sock:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        tasks = [t for t in (self._serving, *self._writers) if t]
        if et is not None:
            for t in tasks:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in (self._conn, self._listener):
            if sock:
                sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        (self.images / SOCKET).unlink(missing_ok=True)

    def cause(self) -> BaseException | None:
        """The first error of a source (not a pipe CRIU closed on its way out)."""
        return next((e for e in self._errors if not isinstance(e, BrokenPipeError)), None)

    async def finish(self) -> None:
        """After CRIU succeeded: every requested image written; a source's error raised."""
        if self._serving:
            await asyncio.gather(self._serving, return_exceptions=True)
        await asyncio.gather(*self._writers, return_exceptions=True)
        # Not a pipe CRIU closed: it read what it needed, and succeeded.
        if (cause := self.cause()) is not None:
            raise cause

    async def _run(self, fn: Callable[..., object], *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _serve(self) -> None:
        assert self._listener
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self._listener)
        conn.setblocking(True)
        self._conn = conn
        try:
            while True:
                head = await self._run(_recv_exact, conn, 4)
                if not head:
                    return  # CRIU is done with its images
                (size,) = struct.unpack("<I", head)
                body = await self._run(_recv_exact, conn, size)
                if body is None:
                    raise StreamerError("CRIU hung up inside a request")
                name = decode_request(body)  # type: ignore[arg-type]
                chunks = self.source(name)
                await self._run(conn.sendall, encode_reply(chunks is not None))
                if chunks is None:
                    continue
                fd = await self._recv_pipe(conn, name)
                self.served.append(name)
                pipe = _Pipe(fd)
                writer = asyncio.create_task(self._write(name, pipe, chunks))
                # A writer cancelled before it ever ran closes nothing itself:
                # CRIU would wait on that pipe for ever.
                writer.add_done_callback(lambda _, p=pipe: p.close())  # type: ignore[misc]
                self._writers.append(writer)
        except (OSError, StreamerError) as e:
            self._errors.append(e)

    async def _recv_pipe(self, conn: socket.socket, name: str) -> int:
        """The write end of the pipe CRIU sends for image ``name``. One that
        arrives after this was cancelled is closed as it arrives."""
        receiving = self._pool.submit(socket.recv_fds, conn, 1, 1)
        try:
            _, fds, _, _ = await asyncio.wrap_future(receiving)
        except asyncio.CancelledError:
            receiving.add_done_callback(_close_received)
            raise
        if not fds:
            raise StreamerError(f"CRIU sent no pipe for {name}")
        for extra in fds[1:]:
            os.close(extra)
        return fds[0]

    async def _write(self, name: str, pipe: _Pipe, chunks: AsyncIterator[Chunk]) -> None:
        fd = pipe.fd
        for size in PIPE_SIZES:
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
                break
        writing: Future[None] | None = None
        hung_up = False
        try:
            async for chunk in chunks:
                if hung_up:
                    # CRIU closed the pipe, perhaps on bytes it took before
                    # the file's sha256 was known (the source holds back only
                    # the last range): the rest is read to be verified, so
                    # that a mismatch fails the restore (cause()).
                    continue
                writing = self._pool.submit(_write_all, fd, chunk)
                try:
                    await asyncio.wrap_future(writing)
                except BrokenPipeError as e:
                    log.debug("CRIU closed image %s early; reading the rest to verify it", name)
                    self._errors.append(e)
                    hung_up = True
                    continue
                self.bytes += len(chunk)
                if self.on_bytes:
                    self.on_bytes(self.bytes)
        except Exception as e:
            # Closing the pipe short makes CRIU fail on this image.
            log.debug("image %s not served in full: %s", name, e)
            self._errors.append(e)
        finally:
            if writing is not None and not writing.done():
                # Cancelled while a thread still writes to it: closed once
                # that thread is done, so the number is never reused under its feet.
                pipe.busy = writing
                writing.add_done_callback(lambda _: pipe.close())
            pipe.close()
            self.done_at = time.monotonic()
            aclose = getattr(chunks, "aclose", None)
            if aclose:
                with contextlib.suppress(Exception):
                    await aclose()


class _Pipe:
    """The write end of one image's pipe, closed exactly once: by its writer,
    by the writer's task ending (cancelled before it ran), or, while a thread
    still writes to it, when that thread is done."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.busy: Future[None] | None = None
        self._closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._closed or (self.busy is not None and not self.busy.done()):
                return
            self._closed = True
        os.close(self.fd)


def _close_received(received: Future[tuple[bytes, list[int], int, object]]) -> None:
    if not received.cancelled() and received.exception() is None:
        for fd in received.result()[1]:
            os.close(fd)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def _write_all(fd: int, data: Chunk) -> None:
    if isinstance(data, FileRange):
        offset, end = data.offset, data.offset + data.length
        while offset < end:
            n = os.splice(data.fd, fd, end - offset, offset_src=offset)
            if n == 0:
                raise OSError(f"scratch file ended at {offset} of {end}")
            offset += n
        return
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
