"""Downloads: parallel ranged GETs, decoded and hashed in worker threads,
delivered in order; nothing leaves here unverified.

Consecutive frames are grouped into ranges of about ``RANGE_TARGET`` stored
bytes (compressed frames can be tiny); up to ``RANGES_AHEAD`` ranges of a
file are fetched and decoded while the earliest is consumed, as long as they
decode to at most ``AHEAD_BYTES`` with the range held back (below). The
reader's memory is thereby bounded whatever the file's size: a page image
streamed to CRIU passes through the node agent, whose memory limit is far
below the workloads it restores. By count alone, eight ranges of well
compressed memory (32 MiB each, as ranges were then) held 256 MiB (measured:
the agent's anonymous memory grew by 130 MiB restoring 160 MiB, and a 320 MiB
limit killed it restoring 512). Ranges of such memory now decode to 16 MiB
at most, so that several GETs stay in flight within the bound.

The first range of a file goes alone, the others once it is in: a server
that computes an object's ETag on its first read (rclone's ``serve s3``,
and other servers over plain files) computed it once per concurrent GET,
eight times over (measured: 35 s of its CPU for a 2 GiB object, against
4 s); S3 itself loses one round trip per file.

The file's sha256 (over its frames' digests, see ``upload.file_digest``) is
known only once its last frame is decoded, so ``decoded`` holds the last
range back until the whole file matches its manifest. A consumer that
streams the bytes on (to CRIU, through a pipe) therefore never delivers a
complete file that is not the one stored: on a mismatch the stream ends
short, and the reader fails instead of running on altered bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from services.storage.codec import Codec, DecodeError
from services.storage.upload import file_digest, frame_aad

RANGE_TARGET = 8 << 20  # stored bytes per ranged GET
RANGE_RAW = 16 << 20  # and at most this many decoded: frames of a range decode in parallel
RANGES_AHEAD = 8
# Decoded bytes of a file in memory at once (held back and ahead), at least
# one range: seven incompressible ranges besides the one held, three of well
# compressed memory. With a sink that stores the frames elsewhere (a scratch
# file) a decoded range holds no memory: only the ranges still decoding count.
AHEAD_BYTES = 64 << 20

Frame = tuple[int, int, int, int]  # index, stored size, raw size, compressed
Chunk = bytes | memoryview


class Mismatch(DecodeError):
    """Every frame decoded, but the file is not the one the manifest names."""


class Diverged(DecodeError):
    """A read again (``skip``) found other bytes than those already handed on."""


def ranges(frames: list[list[int]]) -> list[tuple[int, int, list[Frame]]]:
    """(start, length, frames) covering the object, each about RANGE_TARGET."""
    out: list[tuple[int, int, list[Frame]]] = []
    start = length = decoded_len = 0
    group: list[Frame] = []
    for i, (stored, raw, z) in enumerate(frames):
        group.append((i, stored, raw, z))
        length += stored
        decoded_len += raw
        # A memory image can shrink a thousandfold: a range of 8 MiB stored
        # could be a whole file, decoded by one thread.
        if length >= RANGE_TARGET or decoded_len >= RANGE_RAW:
            out.append((start, length, group))
            start, length, decoded_len, group = start + length, 0, 0, []
    if group:
        out.append((start, length, group))
    return out


Sink = Callable[[int, Chunk], Any]


PLAIN = Codec(level=0)  # frames stored as they are: a node cache's decoded copy


def plain(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` as its decoded copy holds it (services/storage/cache): each
    frame as is, at its place in the file; the same frames' sha256."""
    return {**entry, "frames": [[raw, raw, 0] for _, raw, _ in entry["frames"]],
            "encryption": None}


class Ranges(Protocol):
    """Where an object's bytes come from: storage (a Backend) or a node's cache."""

    async def get_range(self, key: str, start: int, length: int) -> bytes: ...


async def decoded(backend: Ranges, codec: Codec, key: str, entry: dict[str, Any],
                  sink: Sink | None = None, *, handed: list[bytes] | None = None,
                  skip: Sequence[bytes] = ()) -> AsyncIterator[Any]:
    """The object's decoded bytes in order, a frame at a time. The last range
    comes only after the file's size and sha256 matched ``entry``; otherwise
    Mismatch (or DecodeError for a frame that does not decode) is raised.

    ``sink(index, frame)``: called in the worker thread that decoded frame
    ``index`` (frames of a range in parallel, out of order); what it returns
    is yielded in the frame's place, in order and held back alike.

    ``handed``: each frame's sha256 is appended as the frame is yielded.
    ``skip``: those of an earlier read that handed frames on before it
    failed; this read yields only the frames after them, and raises Diverged
    where a frame differs from the one handed on (it cannot be taken back)."""
    enc = entry.get("encryption")

    async def get(start: int, length: int, group: list[Frame]) -> list[tuple[Any, int, bytes]]:
        data = await backend.get_range(key, start, length)
        if len(data) != length:
            raise DecodeError(f"object {key} is shorter than its manifest says",
                              hint="restore another generation (--generation N)")
        # memoryview slices: a stored-as-is frame is handed on without a copy.
        view, frames, pos = memoryview(data), [], 0
        for i, stored, raw, z in group:
            frames.append(asyncio.to_thread(decode, view[pos:pos + stored], i, raw, z))
            pos += stored
        return await asyncio.gather(*frames)

    def decode(stored: memoryview, i: int, raw: int, z: int) -> tuple[Any, int, bytes]:
        frame = codec.decode(stored, raw, bool(z), frame_aad(key, i), enc)
        digest = hashlib.sha256(frame).digest()
        return (sink(i, frame) if sink else frame), len(frame), digest

    def raw(r: tuple[int, int, list[Frame]]) -> int:
        return sum(f[2] for f in r[2])

    size, digests = 0, []
    todo = deque(ranges(entry["frames"]))
    ahead: deque[tuple[asyncio.Task[list[tuple[Any, int, bytes]]], int]] = deque()
    held: list[tuple[Any, bytes]] = []
    held_raw = 0
    try:
        while todo or ahead:
            while todo and (not ahead or (
                    len(ahead) < (RANGES_AHEAD if digests else 1)
                    and (0 if sink else held_raw) + raw(todo[0])
                    + sum(n for t, n in ahead if not (sink and t.done())) <= AHEAD_BYTES)):
                r = todo.popleft()
                ahead.append((asyncio.create_task(get(*r)), raw(r)))
            task, held_next = ahead.popleft()
            decoded_range = await task
            for chunk, d in held:
                if handed is not None:
                    handed.append(d)
                yield chunk
            held, held_raw = [], held_next
            for piece, n, digest in decoded_range:
                i = len(digests)
                digests.append(digest)
                size += n
                if i >= len(skip):
                    held.append((piece, digest))
                elif digest != skip[i]:
                    raise Diverged(f"frame {i} of {key} differs from the one read before",
                                   hint="read the object again from its start")
        digest = file_digest(digests)
        if size != entry["size"]:
            raise Mismatch(f"it holds {size} bytes, the manifest says {entry['size']}",
                           hint="restore another generation (--generation N)")
        if digest != entry["sha256"]:
            raise Mismatch(f"sha256 {digest[:16]}… expected {entry['sha256'][:16]}…",
                           hint="restore another generation (--generation N); "
                                "this one is unusable")
        for chunk, d in held:
            if handed is not None:
                handed.append(d)
            yield chunk
    finally:
        for t, _ in ahead:
            t.cancel()
        await asyncio.gather(*(t for t, _ in ahead), return_exceptions=True)

