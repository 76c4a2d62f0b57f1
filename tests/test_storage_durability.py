"""Nothing lost, for real (the storage layer): a part that fails
fails the commit; links the dump makes are stored; files beyond 10,000
parts; hostile manifests; GC against live writers; an upload already
aborted; power loss on the local backend; conditional writes whose answer
was lost; a commit run twice for one request.

S3 is moto's server over real HTTP, with a fault-injecting proxy in front
where a test needs a fault."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from botocore.config import Config

from services.storage import layout, upload, writeback
from services.storage.backend import Backend, PendingUpload, StorageError
from services.storage.claims import MISSED_RENEWALS
from services.storage.codec import Codec
from services.storage.generation import CheckpointCorrupt, CheckpointNotFound, Generation
from services.storage.local import LocalBackend
from services.storage.s3 import S3Backend
from services.storage.store import CheckpointStore
from services.storage.streamed import StreamedImages
from smr.contract.errors import PermanentError, SmrError
from smr.contract.messages import Target
from smr.natsserver import free_port
from tests import moto_s3
from tests.chaos.proxy import _HOP, _XML, FaultProxy

NS = layout.LOCAL_NAMESPACE
SMALL_PART = 1024  # 8 MiB scaled down 8192 times: frames and S3's minimum part


def meta(rid: str) -> dict[str, Any]:
    return {"request_id": rid, "node": "n1", "reason": "api",
            "target": Target.job("j").to_dict(), "versions": {"criu": "4.2"}}


def moto_server(env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        moto_s3.command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **env})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def small_parts_s3() -> Iterator[str]:
    """moto's S3 server with its minimum part size lowered to SMALL_PART, so
    that a file of many parts is a few MiB (it still allows PartNumber
    1..10000 only, as S3 does)."""
    yield from moto_server({"S3_UPLOAD_PART_MIN_SIZE": str(SMALL_PART),
                            "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(64 << 20)})


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames and parts of SMALL_PART bytes: 8 MiB scaled down 8192 times."""
    monkeypatch.setattr(upload, "FRAME_SIZE", SMALL_PART)
    monkeypatch.setattr(upload, "PART_TARGET", SMALL_PART)


async def new_bucket(endpoint: str, via: str | None = None, **kw: Any) -> S3Backend:
    bucket = f"smr-{uuid.uuid4().hex[:12]}"
    b = S3Backend(bucket, prefix="ckpt", endpoint_url=via or endpoint, path_style=True, **kw)
    direct = S3Backend(bucket, endpoint_url=endpoint, path_style=True)
    async with direct._client() as c:
        await c.create_bucket(Bucket=bucket)
    await direct.close()
    return b


@pytest.fixture(params=["local", "s3"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "local":
        yield LocalBackend(tmp_path / "store")
        return
    b = await new_bucket(request.getfixturevalue("small_parts_s3"))
    yield b
    await b.close()


class Proxy(FaultProxy):
    """The chaos proxy, with one rule: ``hit(request)`` names what to do
    with a request — None (forward), "fail" (answer 500, never forward),
    or "lose" (forward, then answer 500 as if the answer was lost)."""

    def __init__(self, upstream: str, hit: Callable[[web.Request], str | None]) -> None:
        super().__init__(upstream, seed=0)
        self.hit = hit
        self.hits: list[str] = []

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        what = self.hit(request)
        if what is None:
            return await super()._answer(request)
        self.hits.append(f"{what} {request.method} {request.path_qs}")
        body = await request.read()
        if what == "lose":
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            async with self.session.request(request.method, self.upstream + request.path_qs,
                                            headers=headers, data=body) as up:
                await up.read()
        return web.Response(status=500, content_type="application/xml",
                            text=_XML.format(code="InternalError", message="injected"))


@pytest.fixture
async def proxied(small_parts_s3: str) -> AsyncIterator[Callable[..., Any]]:
    started: list[tuple[Proxy, S3Backend]] = []

    async def make(hit: Callable[[web.Request], str | None], upstream: str = small_parts_s3,
                   **kw: Any) -> S3Backend:
        proxy = await Proxy(upstream, hit).start()
        b = await new_bucket(upstream, via=proxy.url, **kw)
        started.append((proxy, b))
        return b

    yield make
    for proxy, b in started:
        await b.close()
        await proxy.stop()


def pages(tmp_path: Path, size: int, name: str = "img") -> Path:
    src = tmp_path / name
    (src / "images").mkdir(parents=True)
    (src / "images" / "pages-1.img").write_bytes(os.urandom(size))
    (src / "images" / "inventory.img").write_bytes(b"inventory")
    return src


async def restored(store: CheckpointStore, gen: Generation, src: Path, dst: Path) -> None:
    await store.fetch(gen, dst)
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if p.is_symlink():
            assert os.readlink(dst / rel) == os.readlink(p)
        elif p.is_file():
            assert (dst / rel).read_bytes() == p.read_bytes(), rel


# --- 1: a part that fails fails the commit ---------------------------------------------------

async def test_a_part_that_fails_after_retries_fails_the_commit(
        proxied: Callable[..., Any], small_frames: None, tmp_path: Path) -> None:
    failed: list[str] = []

    def part_two(r: web.Request) -> str | None:
        if r.method == "PUT" and r.query.get("partNumber") == "2":
            failed.append(r.path_qs)
            return "fail"
        return None

    b = await proxied(part_two)
    # Fewer of botocore's retries, so that the failure comes in a second; it
    # fails the same way after five.
    b.bulk_config = b.bulk_config.merge(Config(retries={"max_attempts": 2}))
    store = CheckpointStore(b, Codec(level=0))
    # Part 2 fails while the dump still writes, when nothing awaits it. The
    # old code lost it or not by the order of two callbacks (about half the
    # time): four commits, each must fail.
    for i in range(4):
        src = tmp_path / f"img{i}"
        (src / "images").mkdir(parents=True)
        writer = asyncio.create_task(slow_dump(src, 1.0)())
        with pytest.raises(StorageError) as e:
            await store.commit(NS, f"ck{i}", src, meta(f"r{i}"), writer=writer)
        assert "UploadPart" in e.value.message, e.value.message
        await writer  # (the dump is the caller's to stop)
        assert await store.latest(NS, f"ck{i}") is None
    assert failed
    assert [k for k in await b.list("") if k.endswith("manifest.json")] == []
    assert await b.pending_uploads("") == [], "the failed uploads were not aborted"


async def test_an_upload_completes_only_with_every_part(backend: Backend) -> None:
    up = backend.start_upload(layout.file_key(NS, "ck", 1, "images/pages-1.img"))
    await up.put_part(1, 0, b"a" * (5 << 20))
    await up.put_part(3, 10 << 20, b"c")
    with pytest.raises(StorageError, match="part"):
        await up.complete(3)
    await up.abort()


async def test_an_upload_aborted_under_its_writer_fails_its_next_part(backend: Backend) -> None:
    """A GC that took the writer for dead aborted its upload: the next part
    fails, and the object is never made again with a hole where parts were."""
    if isinstance(backend, S3Backend):
        # moto answers a part of an aborted upload 500 (S3: 404 NoSuchUpload),
        # which botocore retries: once is enough here.
        backend.bulk_config = backend.bulk_config.merge(Config(retries={"max_attempts": 2}))
    key = layout.file_key(NS, "ck", 1, "images/pages-1.img")
    up = backend.start_upload(key)
    await up.put_part(1, 0, b"a" * (5 << 20))
    [pending] = await backend.pending_uploads("")
    await backend.abort_upload(pending)
    with pytest.raises(StorageError):
        await up.put_part(2, 5 << 20, b"b")
        await up.complete(2)
    assert key not in await backend.list("")


async def test_a_part_cancelled_while_its_upload_begins_leaves_no_upload(
        small_parts_s3: str) -> None:
    """A dump that fails as its first part goes up cancels that part while S3
    is still creating the multipart upload: the upload S3 did begin must be
    aborted, not left behind (found as a leftover under load in CI)."""
    arrived = asyncio.Event()

    class SlowCreate(FaultProxy):
        async def _answer(self, request: web.Request) -> web.StreamResponse:
            if request.method == "POST" and "uploads" in request.query:
                arrived.set()
                await asyncio.sleep(1.0)  # S3 creates it; the client has gone by then
            return await super()._answer(request)

    proxy = await SlowCreate(small_parts_s3, seed=0).start()
    b = await new_bucket(small_parts_s3, via=proxy.url)
    try:
        up = b.start_upload(layout.file_key(NS, "ck", 1, "images/pages-1.img"))
        part = asyncio.create_task(up.put_part(1, 0, b"a" * (5 << 20)))
        await arrived.wait()
        part.cancel()
        await asyncio.gather(part, return_exceptions=True)
        await up.abort()
        await asyncio.sleep(1.5)  # the create the proxy held back has reached S3 by now
        assert await b.pending_uploads("") == [], "an upload S3 began was left behind"
    finally:
        await b.close()
        await proxy.stop()


# --- 3: the parent link of a pre-dump, made by the dump --------------------------------------

async def test_a_link_the_dump_makes_is_stored_and_restored(
        backend: Backend, tmp_path: Path) -> None:
    store = CheckpointStore(backend, Codec(level=0))
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)

    async def dump() -> None:  # CRIU with --prev-images-dir: it makes images/parent
        await asyncio.sleep(0.1)
        (src / "images" / "parent").symlink_to("../pre")
        (src / "images" / "pages-1.img").write_bytes(os.urandom(3 * SMALL_PART))
        (src / "images" / "inventory.img").write_bytes(b"inventory")

    gen = await store.commit(NS, "pre", src, meta("r1"), writer=asyncio.create_task(dump()))
    assert gen.manifest["symlinks"] == [{"path": "images/parent", "target": "../pre"}]
    await restored(store, gen, src, tmp_path / "out")


# --- 4: more than 10,000 parts' worth ----------------------------------------------------------

async def test_a_file_of_more_than_ten_thousand_parts_reaches_s3(
        small_parts_s3: str, small_frames: None, tmp_path: Path) -> None:
    """100 GiB in frames and parts of 8 MiB (12,800 parts), scaled down
    8192 times: 12.5 MiB in parts of 1 KiB. S3 (and moto) take part
    numbers 1..10000 only."""
    b = await new_bucket(small_parts_s3)
    try:
        store = CheckpointStore(b, Codec(level=0))
        src = pages(tmp_path, 12_800 * SMALL_PART)
        gen = await store.commit(NS, "huge", src, meta("r1"))
        assert gen.size_bytes > 10_000 * SMALL_PART
        await restored(store, gen, src, tmp_path / "out")
    finally:
        await b.close()


def test_ten_thousand_parts_hold_five_tib_in_parts_s3_takes() -> None:
    sizes = [upload.part_size(n) for n in range(1, upload.MAX_PARTS + 1)]
    assert sum(sizes) >= 5 << 40
    assert max(sizes) + (upload.FRAME_SIZE + 64) <= 5 << 30  # a part ends past its size by a frame
    assert sizes[0] == upload.PART_TARGET and sizes == sorted(sizes)


async def test_parts_in_flight_are_bounded_in_bytes() -> None:
    budget = upload.ByteBudget(100)
    assert await budget.acquire(60) == 60
    big = asyncio.create_task(budget.acquire(500))  # larger than the budget: alone
    await asyncio.sleep(0)
    small = asyncio.create_task(budget.acquire(10))  # after it, though it would fit
    await asyncio.sleep(0)
    assert not big.done() and not small.done()
    budget.release(60)
    assert await big == 100 and budget.used == 100
    await asyncio.sleep(0)
    assert not small.done()
    budget.release(100)
    assert await small == 10 and budget.used == 10


# --- 8: hostile manifests -----------------------------------------------------------------------

def escape_path(m: dict[str, Any]) -> None:
    m["files"][0]["path"] = "../../x"


def absolute_path(m: dict[str, Any]) -> None:
    m["files"][0]["path"] = "/tmp/smr-test-escape"


def escaping_link_path(m: dict[str, Any]) -> None:
    m["symlinks"] = [{"path": "../../evil", "target": "pre"}]


def absolute_link_target(m: dict[str, Any]) -> None:
    m["symlinks"] = [{"path": "images/parent", "target": "/etc"}]


def escaping_link_target(m: dict[str, Any]) -> None:
    m["symlinks"] = [{"path": "images/parent", "target": "../../../etc"}]


def link_through_a_link(m: dict[str, Any]) -> None:
    # images/up points at the restore directory itself; a link made under
    # it would land one level higher than it reads.
    m["symlinks"] = [{"path": "images/up", "target": ".."},
                     {"path": "images/up/parent", "target": "../x"}]


def plaintext_file(m: dict[str, Any]) -> None:
    del m["files"][0]["encryption"]
    m["files"][0]["frames"] = []


@pytest.mark.parametrize("tamper", [escape_path, absolute_path, escaping_link_path,
                                    absolute_link_target, escaping_link_target,
                                    link_through_a_link, plaintext_file])
async def test_a_hostile_manifest_is_refused_before_anything_is_written(
        tamper: Callable[[dict[str, Any]], None], tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "store")
    store = CheckpointStore(backend, Codec(level=0, key=os.urandom(32)))
    gen = await store.commit(NS, "ck", pages(tmp_path, 3 * SMALL_PART), meta("r1"))
    m = orjson.loads(orjson.dumps(gen.manifest))
    tamper(m)
    await backend.put_bytes(layout.manifest_key(NS, "ck", 1), orjson.dumps(m))
    if tamper is not plaintext_file:  # its metadata reads; its files do not
        with pytest.raises(SmrError) as e:
            await store.get(NS, "ck", 1)
        assert isinstance(e.value, CheckpointCorrupt), e.value
    # A Generation built from the manifest as it is (as a restore holds it):
    # refused by fetch and by the streamed restore alike.
    work = tmp_path / "a" / "b" / "c"
    with pytest.raises(SmrError) as e:
        await store.fetch(Generation(m, ""), work / "out")
    assert isinstance(e.value, PermanentError) and e.value.code in (
        "checkpoint-corrupt", "checkpoint-not-encrypted"), e.value
    with pytest.raises(PermanentError):
        StreamedImages(store, Generation(m, ""))
    assert not work.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img", "store"]
    assert not Path("/tmp/smr-test-escape").exists()


# --- 9: GC against a live writer ----------------------------------------------------------------

def slow_dump(src: Path, seconds: float) -> Callable[[], Any]:
    async def dump() -> None:
        with open(src / "images" / "pages-1.img", "ab") as f:
            for _ in range(int(seconds / 0.1)):
                f.write(os.urandom(SMALL_PART))
                f.flush()
                await asyncio.sleep(0.1)
        (src / "images" / "inventory.img").write_bytes(b"inventory")
    return dump


async def test_gc_leaves_a_live_commit_that_outlasts_the_grace_alone(
        backend: Backend, small_frames: None, tmp_path: Path) -> None:
    store = CheckpointStore(backend, Codec(level=0))
    store.heartbeat_s = 0.25  # grace / 4, below
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    commit = asyncio.create_task(store.commit(
        NS, "live", src, meta("r1"), writer=asyncio.create_task(slow_dump(src, 4.0)())))
    started = time.monotonic()
    reports = []
    while not commit.done():
        reports.append(await store.gc(grace_s=1.0))
        await asyncio.sleep(0.2)
    gen = await commit
    assert all(r.uploads_aborted == 0 and r.generations_removed == [] for r in reports), reports
    # Not vacuous: GC ran during the commit, and after the grace.
    assert len(reports) > 5 and time.monotonic() - started > 2.0
    await restored(store, gen, src, tmp_path / "out")


async def test_gc_with_a_grace_shorter_than_the_writers_renewals_leaves_it_alone(
        backend: Backend, small_frames: None, tmp_path: Path) -> None:
    """The writer's node renews its claim every second (its grace: 4 s);
    the storage Deployment collects with a grace of half a second. The
    claim says how often its writer renews it, and GC waits for the longer
    of the two: the live commit is never aborted. Once the writer is
    silent for longer than that, its leftovers are collected."""
    store = CheckpointStore(backend, Codec(level=0))
    store.heartbeat_s = 1.0
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    commit = asyncio.create_task(store.commit(
        NS, "short", src, meta("r1"), writer=asyncio.create_task(slow_dump(src, 3.0)())))
    reports = []
    while not commit.done():
        reports.append(await store.gc(grace_s=0.5))
        await asyncio.sleep(0.2)
    try:
        gen = await commit
    except SmrError as e:
        raise AssertionError(f"GC with a shorter grace aborted a live writer: {e}") from e
    assert all(r.uploads_aborted == 0 and r.generations_removed == [] for r in reports), reports
    assert len(reports) > 5  # not vacuous: GC ran throughout the commit
    await restored(store, gen, src, tmp_path / "out")
    # A writer that died after its claim: kept while it may still renew, then collected.
    await store._claim(NS, "dead", "r2", [])
    assert (await store.gc(grace_s=0.5, at=time.time() + 2.0)).generations_removed == []
    report = await store.gc(grace_s=0.5, at=time.time() + MISSED_RENEWALS * 1.0 + 1)
    assert report.generations_removed == [f"{NS}/dead/1"]


async def test_a_commit_whose_claim_was_reaped_does_not_commit(
        backend: Backend, small_frames: None, tmp_path: Path) -> None:
    store = CheckpointStore(backend, Codec(level=0))
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    commit = asyncio.create_task(store.commit(
        NS, "reaped", src, meta("r1"), writer=asyncio.create_task(slow_dump(src, 1.0)())))
    claim = layout.claim_key(NS, "reaped", 1)
    for _ in range(100):
        if claim in await backend.list(""):
            break
        await asyncio.sleep(0.05)
    await backend.delete([claim])  # what a GC that took the writer for dead does first
    with pytest.raises(SmrError):
        await commit
    assert await store.latest(NS, "reaped") is None
    assert layout.manifest_key(NS, "reaped", 1) not in await backend.list("")


# --- 11: an upload already aborted --------------------------------------------------------------

class StaleListing(S3Backend):
    """Lists pending uploads as they were before another GC aborted the first."""

    stale: list[PendingUpload]

    async def pending_uploads(self, prefix: str) -> list[PendingUpload]:
        return self.stale


async def test_gc_goes_on_past_an_upload_already_aborted(s3_endpoint: str) -> None:
    b = await new_bucket(s3_endpoint)
    s = StaleListing(b.bucket, prefix="ckpt", endpoint_url=s3_endpoint, path_style=True)
    await b.close()
    try:
        ups = []
        for name in ("a", "b"):
            up = s.start_upload(layout.file_key(NS, name, 1, "images/pages-1.img"))
            await up.put_part(1, 0, b"x")
            ups.append(up)
        s.stale = await S3Backend.pending_uploads(s, "")
        assert len(s.stale) == 2
        first = next(u for u in s.stale if "/a/" in u.key)
        await s.abort_upload(first)
        await s.abort_upload(first)  # gone already: nothing to do, no error
        report = await CheckpointStore(s).gc(grace_s=0, at=time.time() + 60)
        assert report.uploads_aborted == 2
        assert await S3Backend.pending_uploads(s, "") == []
    finally:
        await s.close()


# --- 15: power loss on the local backend --------------------------------------------------------

async def test_local_writes_reach_the_disk_before_their_name(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(a: Any, b: Any) -> None:
        events.append("replace")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    backend = LocalBackend(tmp_path / "store")
    await backend.put_bytes("ns/ck/latest", b'{"generation": 1}')
    assert events == ["fsync-file", "replace", "fsync-dir"], events
    events.clear()
    up = backend.start_upload("ns/ck/00000001/files/images/pages-1.img")
    await up.put_part(1, 0, b"x" * 100)
    await up.complete(1)
    assert events[-3:] == ["fsync-file", "replace", "fsync-dir"], events


async def test_a_cancelled_local_write_never_lands_after_its_caller_gave_up(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A step cancelled while its object's bytes go to the disk (in a worker
    thread) must not see that object renamed into place later: its retry may
    have written the same name again by then, and the stale rename would put
    the old bytes over a committed generation."""
    real_fsync, real_replace = os.fsync, os.replace
    release = threading.Event()
    renamed: list[float] = []

    def slow_fsync(fd: int) -> None:
        release.wait(5)  # the disk, slow
        real_fsync(fd)

    def replace(a: Any, b: Any) -> None:
        real_replace(a, b)
        renamed.append(time.monotonic())

    monkeypatch.setattr(os, "fsync", slow_fsync)
    monkeypatch.setattr(os, "replace", replace)
    backend = LocalBackend(tmp_path / "store")
    for write in (lambda: backend.put_bytes("ns/ck/00000001/files/images/core-1.img", b"old"),
                  lambda: _upload_one(backend, "ns/ck/00000001/files/images/pages-1.img")):
        renamed.clear()
        release.clear()
        task = asyncio.create_task(write())
        await asyncio.sleep(0.2)
        task.cancel()
        threading.Timer(0.3, release.set).start()
        with pytest.raises(asyncio.CancelledError):
            await task
        gave_up = time.monotonic()
        await asyncio.sleep(0.6)  # any thread still running has finished by now
        assert all(t <= gave_up for t in renamed), \
            "a write renamed its object into place after its caller had given up"


async def _upload_one(backend: LocalBackend, key: str) -> None:
    up = backend.start_upload(key)
    await up.put_part(1, 0, b"x" * 100)
    await up.complete(1)


async def test_a_local_write_that_fails_leaves_no_partial_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_fsync = os.fsync

    def full(fd: int) -> None:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    backend = LocalBackend(tmp_path / "store")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        await backend.put_bytes("ns/ck/00000001/files/images/core-1.img", b"x" * 4096)
    left = [p.name for p in (tmp_path / "store").rglob("*") if p.is_file()
            and not p.name.endswith(".lock")]
    assert not left, f"a failed write left {left}"


async def test_local_parts_go_to_the_disk_as_they_land_not_all_at_the_fsync(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each part's range is queued for writeback when it is written, so the
    fsync at complete() finds little left; the fsync still comes before the
    name (the test above)."""
    started: list[tuple[int, int]] = []
    real = writeback.start

    def start(fd: int, offset: int, length: int) -> bool:
        started.append((offset, length))
        ok = real(fd, offset, length)
        assert ok, "sync_file_range refused a regular file's range on this machine's disk"
        return ok

    monkeypatch.setattr(writeback, "start", start)
    up = LocalBackend(tmp_path / "store").start_upload("ns/ck/00000001/files/pages-1.img")
    await up.put_part(2, 1 << 20, b"b" * (1 << 20))
    assert started == [(1 << 20, 1 << 20)], "a part waited in memory for the final fsync"
    await up.put_part(1, 0, b"a" * (1 << 20))
    assert started == [(1 << 20, 1 << 20), (0, 1 << 20)]
    await up.complete(2)
    assert (tmp_path / "store/ns/ck/00000001/files/pages-1.img").read_bytes() == (
        b"a" * (1 << 20) + b"b" * (1 << 20))


async def test_pointers_and_manifests_torn_by_a_crash_are_not_fatal(
        backend: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(backend, Codec(level=0))
    src = pages(tmp_path, 2 * SMALL_PART)
    for i in (1, 2, 3):
        await store.commit(NS, "torn", src, meta(f"r{i}"))
    # Power lost after renames not yet on disk: an empty manifest (3), an empty latest.
    await backend.put_bytes(layout.manifest_key(NS, "torn", 3), b"")
    await backend.put_bytes(layout.latest_key(NS, "torn"), b"")
    latest = await store.latest(NS, "torn")
    assert latest and latest.number == 2
    assert [g.number for g in await store.generations(NS, "torn")] == [1, 2]
    with pytest.raises(CheckpointNotFound):
        await store.get(NS, "torn", 3)
    assert "torn" in caplog.text or "not valid" in caplog.text
    await backend.put_bytes(layout.latest_key(NS, "torn"), b"{garbage")
    gen = await store.commit(NS, "torn", src, meta("r4"))
    assert gen.number == 4
    latest = await store.latest(NS, "torn")
    assert latest and latest.number == 4
    await restored(store, latest, src, tmp_path / "out")


# --- conditional writes whose answer was lost ---------------------------------------------------

@pytest.mark.parametrize("what", ["claim", "manifest.json", "latest"])
async def test_a_conditional_put_whose_answer_was_lost_is_ours(
        proxied: Callable[..., Any], what: str, tmp_path: Path) -> None:
    lost: list[str] = []

    def lose_first(r: web.Request) -> str | None:
        if r.method == "PUT" and r.path.endswith("/" + what) and not lost:
            lost.append(r.path)
            return "lose"
        return None

    b = await proxied(lose_first)
    store = CheckpointStore(b, Codec(level=0))
    src = pages(tmp_path, 2 * SMALL_PART)
    gen = await store.commit(NS, "lost", src, meta("r1"))
    assert lost, "the proxy lost no answer"
    assert gen.number == 1
    latest = await store.latest(NS, "lost")
    assert latest and latest.number == 1 and latest.manifest["request_id"] == "r1"
    assert [k for k in await b.list("") if "/00000002/" in k] == []
    await restored(store, latest, src, tmp_path / "out")


# --- a commit run again for the same request ----------------------------------------------------

async def test_a_commit_run_again_for_its_request_returns_its_generation(
        backend: Backend, tmp_path: Path) -> None:
    store = CheckpointStore(backend, Codec(level=0))
    src = pages(tmp_path, 2 * SMALL_PART)
    first = await store.commit(NS, "again", src, meta("r1"))
    await store.commit(NS, "again", src, meta("r2"))
    again = await store.commit(NS, "again", src, meta("r1"))
    assert again.number == first.number == 1
    assert again.manifest == first.manifest
    assert [g.number for g in await store.generations(NS, "again")] == [1, 2]
    # A writer of r3 that died after its claim: its retry takes that number.
    await backend.put_bytes(layout.claim_key(NS, "again", 3),
                            orjson.dumps({"request_id": "r3", "claimed_at": time.time()}),
                            if_none_match=True)
    third = await store.commit(NS, "again", src, meta("r3"))
    assert third.number == 3
    assert [g.number for g in await store.generations(NS, "again")] == [1, 2, 3]
    latest = await store.latest(NS, "again")
    assert latest and latest.number == 3
    await restored(store, third, src, tmp_path / "out")
