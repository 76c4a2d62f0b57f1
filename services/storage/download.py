"""Downloads: parallel ranged GETs, decoded and hashed in worker threads,
written in order; a file's sha256 is checked before it gets its name.

Consecutive frames are grouped into ranges of about ``RANGE_TARGET`` stored
bytes (compressed frames can be tiny); up to ``RANGES_AHEAD`` ranges of a
file are fetched and decoded while the earliest is written.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.storage.backend import Backend
from services.storage.codec import Codec, DecodeError
from services.storage.upload import file_digest, frame_aad

RANGE_TARGET = 8 << 20
RANGES_AHEAD = 8

Frame = tuple[int, int, int, int]  # index, stored size, raw size, compressed


def ranges(frames: list[list[int]]) -> list[tuple[int, int, list[Frame]]]:
    """(start, length, frames) covering the object, each about RANGE_TARGET."""
    out: list[tuple[int, int, list[Frame]]] = []
    start = length = 0
    group: list[Frame] = []
    for i, (stored, raw, z) in enumerate(frames):
        group.append((i, stored, raw, z))
        length += stored
        if length >= RANGE_TARGET:
            out.append((start, length, group))
            start, length, group = start + length, 0, []
    if group:
        out.append((start, length, group))
    return out


async def fetch_file(backend: Backend, codec: Codec, key: str, entry: dict[str, Any],
                     dst: Path, on_bytes: Callable[[int], None] | None = None
                     ) -> tuple[int, str]:
    """Write the object's decoded bytes to ``dst``; returns (size, sha256)."""
    enc = entry.get("encryption")

    async def get(start: int, length: int, group: list[Frame]) -> tuple[bytes, list[bytes]]:
        data = await backend.get_range(key, start, length)
        if len(data) != length:
            raise DecodeError(f"object {key} is shorter than its manifest says",
                              hint="restore another generation (--generation N)")
        return await asyncio.to_thread(decode, data, group)

    def decode(data: bytes, group: list[Frame]) -> tuple[bytes, list[bytes]]:
        out, digests, pos = [], [], 0
        for i, stored, raw, z in group:
            frame = codec.decode(data[pos:pos + stored], raw, bool(z), frame_aad(key, i), enc)
            out.append(frame)
            digests.append(hashlib.sha256(frame).digest())
            pos += stored
        return b"".join(out), digests

    size, digests = 0, []
    todo = deque(ranges(entry["frames"]))
    ahead: deque[asyncio.Task[tuple[bytes, list[bytes]]]] = deque()
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(dst, "wb") as out:
            while todo or ahead:
                while todo and len(ahead) < RANGES_AHEAD:
                    ahead.append(asyncio.create_task(get(*todo.popleft())))
                data, ds = await ahead.popleft()
                digests.extend(ds)
                await asyncio.to_thread(out.write, data)
                size += len(data)
                if on_bytes:
                    on_bytes(len(data))
    except BaseException:
        for t in ahead:
            t.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)
        raise
    return size, file_digest(digests)
