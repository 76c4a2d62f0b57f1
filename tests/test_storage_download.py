"""The bounded download (AHEAD_BYTES, EARLY_CHUNKS, the staged page
image): faults on ranged GETs that the cap holds back, and a restore
cancelled while ranges are queued, against moto's S3 server over HTTP through
a proxy that breaks the chosen ranges (tests/chaos/proxy.py).

What a user relies on: a transient fault below the retries costs nothing
(the image arrives whole and in order), and a restore given up midway leaves
no task, thread write or scratch file behind, so that the next one succeeds.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from services.storage import download, layout
from services.storage.codec import Codec
from services.storage.generation import CheckpointCorrupt, Generation
from services.storage.s3 import S3Backend
from services.storage.store import CheckpointStore
from services.storage.streamed import StreamedImages
from smr.process.imagestream import FileRange
from tests.chaos.proxy import _HOP, _XML, FaultProxy, _drop
from tests.test_storage import NS, meta
from tests.test_storage_durability import new_bucket, small_frames, small_parts_s3  # noqa: F401

KIB = 1024


class RangeFaults(FaultProxy):
    """Forwards to S3, except that a ranged GET starting at a planned offset
    gets its planned faults first, one per attempt: "500" (an InternalError
    answer), "cut" (half the body, then the connection dropped), "reset" (the
    connection dropped before any answer), "slow" (answered after a pause)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream, seed=0)
        self.plan: dict[int, list[str]] = {}
        self.hits: list[str] = []

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        rng = request.headers.get("Range", "")
        start = int(rng.split("=")[1].split("-")[0]) if rng.startswith("bytes=") else -1
        faults = self.plan.get(start)
        if request.method != "GET" or not faults:
            return await super()._answer(request)
        fault = faults.pop(0)
        self.hits.append(f"{fault} at {start}")
        if fault == "500":
            return web.Response(status=500, content_type="application/xml",
                                text=_XML.format(code="InternalError", message="injected"))
        if fault == "reset":
            _drop(request)
            return web.Response(status=500)
        if fault == "slow":
            await asyncio.sleep(0.5)
            return await super()._answer(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self.session.get(self.upstream + request.path_qs, headers=headers) as up:
            data = await up.read()
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
        out.content_length = len(data)
        await out.prepare(request)
        await out.write(data[: len(data) // 2])
        _drop(request)
        return out


@pytest.fixture
def small_ranges(small_frames: None, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Ranges of 4 frames and a cap of 2 ranges: most ranges wait behind it."""
    monkeypatch.setattr(download, "RANGE_TARGET", 4 * KIB)
    monkeypatch.setattr(download, "RANGE_RAW", 4 * KIB)
    monkeypatch.setattr(download, "AHEAD_BYTES", 8 * KIB)


@pytest.fixture
async def faulty(small_parts_s3: str, small_ranges: None  # noqa: F811
                 ) -> AsyncIterator[tuple[RangeFaults, CheckpointStore]]:
    proxy = await RangeFaults(small_parts_s3).start()
    backend: S3Backend = await new_bucket(small_parts_s3, via=proxy.url)
    store = CheckpointStore(backend, Codec(level=1))
    yield proxy, store
    await store.close()
    await proxy.stop()


async def committed(store: CheckpointStore, tmp_path: Path, size: int = 96 * KIB
                    ) -> tuple[Generation, bytes]:
    src = tmp_path / f"img-{uuid.uuid4().hex[:6]}"
    (src / "images").mkdir(parents=True)
    want = os.urandom(size)  # stored as is: each frame's bytes are checked by sha256 alone
    (src / "images" / "pages-1.img").write_bytes(want)
    (src / "images" / "inventory.img").write_bytes(b"inventory")
    return await store.commit(NS, f"dl-{uuid.uuid4().hex[:6]}", src, meta("r1")), want


def range_starts(gen: Generation) -> list[int]:
    f = next(f for f in gen.manifest["files"] if f["path"] == "images/pages-1.img")
    return [start for start, _, _ in download.ranges(f["frames"])]


async def read_all(chunks: AsyncIterator[Any] | None) -> bytes:
    assert chunks is not None
    got = bytearray()
    async for piece in chunks:
        got += (os.pread(piece.fd, piece.length, piece.offset)
                if isinstance(piece, FileRange) else piece)
    return bytes(got)


@pytest.mark.parametrize("staged", [False, True], ids=["through-memory", "staged"])
async def test_faults_on_held_back_ranges_cost_nothing(
        faulty: tuple[RangeFaults, CheckpointStore], tmp_path: Path, staged: bool) -> None:
    """A range GET cut midway, reset, or answered 500 (within botocore's
    retries), each on a range the cap held back: the page image reaches CRIU
    whole and in order, and so does a fetch to disk."""
    proxy, store = faulty
    gen, want = await committed(store, tmp_path)
    starts = range_starts(gen)
    assert len(starts) >= 12, "too few ranges for the cap to hold any back"

    def plan() -> None:
        proxy.plan = {starts[3]: ["cut"], starts[6]: ["reset", "500"],
                      starts[9]: ["500", "cut"], starts[-1]: ["cut"]}

    plan()
    scratch = tmp_path / "scratch" if staged else None
    if scratch:
        scratch.mkdir()
    source = StreamedImages(store, gen, scratch=scratch)
    try:
        assert await read_all(source("pages-1.img")) == want
    finally:
        await source.aclose()
    assert len(proxy.hits) == 6, proxy.hits
    plan()
    await store.fetch(gen, tmp_path / "fetched")
    assert (tmp_path / "fetched" / "images" / "pages-1.img").read_bytes() == want
    assert len(proxy.hits) == 12, proxy.hits


def proxy_side(t: asyncio.Task[Any]) -> bool:
    """The proxy's own connection handlers (its server), not the restore's."""
    return t.get_coro().__qualname__.startswith("RequestHandler.")  # type: ignore[union-attr]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("staged", [False, True], ids=["through-memory", "staged"])
async def test_a_restore_cancelled_with_ranges_queued_leaves_nothing_behind(
        faulty: tuple[RangeFaults, CheckpointStore], tmp_path: Path, staged: bool) -> None:
    """The restore is given up (its job deleted, its step cancelled) while
    ranges are in flight and more wait behind the cap: no task of it runs on,
    its scratch files are closed, and the next restore reads it whole."""
    proxy, store = faulty
    gen, want = await committed(store, tmp_path)
    starts = range_starts(gen)
    scratch = tmp_path / "scratch" if staged else None
    if scratch:
        scratch.mkdir()
    await asyncio.sleep(0.5)  # the connection pool's descriptors settle
    before = open_fds()
    proxy.plan = {s: ["slow"] for s in starts[2:6]}
    source = StreamedImages(store, gen, scratch=scratch)
    first = asyncio.Event()

    async def consume() -> None:
        chunks = source("pages-1.img")
        assert chunks is not None
        async for _ in chunks:
            first.set()

    reader = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 30)
    await asyncio.sleep(0.2)  # slow ranges in flight, later ones held back
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await source.aclose()
    await asyncio.sleep(1.0)  # the scratch files close off the event loop
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()
              and not t.done() and not proxy_side(t)]
    assert not others, f"tasks of the cancelled restore run on: {others}"
    leaked = open_fds() - before
    assert len(leaked) <= 2, f"descriptors left open: {sorted(leaked)} (scratch files?)"
    proxy.plan = {}
    again = StreamedImages(store, gen, scratch=scratch)
    try:
        assert await read_all(again("pages-1.img")) == want
    finally:
        await again.aclose()


@pytest.mark.parametrize("staged", [False, True], ids=["through-memory", "staged"])
async def test_a_held_back_range_altered_in_storage_never_completes_the_image(
        faulty: tuple[RangeFaults, CheckpointStore], tmp_path: Path, staged: bool) -> None:
    """One byte of a range the cap held back is altered in the bucket (the
    frames are stored as they are: only the file's sha256 catches it): CRIU
    is handed less than the whole image and the read fails as corrupt, so a
    restore never runs on altered memory."""
    _, store = faulty
    gen, want = await committed(store, tmp_path)
    starts = range_starts(gen)
    key = layout.file_key(NS, gen.manifest["checkpoint_id"], gen.number, "images/pages-1.img")
    data, _ = await store.backend.get_bytes(key)
    at = starts[5] + 100
    await store.backend.put_bytes(key, data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    scratch = tmp_path / "scratch" if staged else None
    if scratch:
        scratch.mkdir()
    source = StreamedImages(store, gen, scratch=scratch)
    chunks = source("pages-1.img")
    assert chunks is not None
    got = 0
    try:
        with pytest.raises(CheckpointCorrupt, match="sha256"):
            async for piece in chunks:
                got += piece.length if isinstance(piece, FileRange) else len(piece)
    finally:
        await source.aclose()
    assert got < len(want), "the whole altered image was handed on"
