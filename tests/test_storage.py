"""Checkpoint storage: commit, streaming, visibility, conditional writes,
integrity, encryption, retention, garbage collection.

One suite, run against both backends: a local directory, and S3 through
aioboto3 against moto's S3 server (a separate process, real HTTP)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from services.restorer import stream
from services.storage import download, layout, upload
from services.storage.backend import Backend, Conflict
from services.storage.claims import HEARTBEAT_S, MISSED_RENEWALS
from services.storage.codec import (
    FRAME_SIZE,
    Codec,
    WrongKey,
    WrongNamespace,
    key_id,
    load_keys,
    namespace_key,
)
from services.storage.generation import (
    CheckpointCorrupt,
    CheckpointNotFound,
    Generation,
    ScratchFull,
)
from services.storage.local import LocalBackend
from services.storage.s3 import S3Backend
from services.storage.scatter import SCRATCH_FILES
from services.storage.store import CheckpointStore
from services.storage.streamed import StreamedImages
from smr.aio import wait_event
from smr.contract.errors import ConfigError
from smr.contract.messages import Target
from smr.process.imagestream import FileRange

NS = layout.LOCAL_NAMESPACE


@pytest.fixture(params=["local", "s3"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "local":
        yield LocalBackend(tmp_path / "store")
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"smr-{uuid.uuid4().hex[:12]}"
    b = S3Backend(bucket, prefix="ckpt", endpoint_url=endpoint, path_style=True)
    async with b._client() as c:
        await c.create_bucket(Bucket=bucket)
    yield b
    await b.close()


KEY_A = os.urandom(32)
KEY_B = os.urandom(32)
CODECS = {"plain": Codec(level=0), "zstd": Codec(level=3), "zstd+aes": Codec(level=3, key=KEY_A)}


@pytest.fixture(params=list(CODECS))
def store(request: pytest.FixtureRequest, backend: Backend) -> CheckpointStore:
    return CheckpointStore(backend, CODECS[request.param])


def images(tmp_path: Path, name: str = "img", size: int = 3 << 20) -> Path:
    d = tmp_path / name
    (d / "images").mkdir(parents=True)
    (d / "images" / "pages-1.img").write_bytes(os.urandom(size))
    (d / "images" / "inventory.img").write_bytes(b"inventory")
    (d / "images" / "parent").symlink_to("../pre")
    return d


def meta(rid: str) -> dict[str, object]:
    return {"request_id": rid, "node": "n1", "reason": "api",
            "target": Target.job("j").to_dict(), "versions": {"criu": "4.1.1"}}


async def test_round_trip(store: CheckpointStore, tmp_path: Path) -> None:
    src = images(tmp_path)
    gen = await store.commit(NS, "ck", src, meta("r1"))
    assert gen.number == 1 and gen.size_bytes == (3 << 20) + len(b"inventory")
    latest = await store.latest(NS, "ck")
    assert latest and latest.number == 1
    dst = tmp_path / "out"
    await store.fetch(latest, dst)
    for rel in ("images/pages-1.img", "images/inventory.img"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()
    assert os.readlink(dst / "images" / "parent") == "../pre"


async def test_generations_count_up_and_latest_moves_forward(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = images(tmp_path, size=1024)
    gens = await asyncio.gather(*(store.commit(NS, "ck", src, meta(f"r{i}")) for i in range(4)))
    assert sorted(g.number for g in gens) == [1, 2, 3, 4]
    latest = await store.latest(NS, "ck")
    assert latest and latest.number == 4
    assert [g.number for g in await store.generations(NS, "ck")] == [1, 2, 3, 4]


async def test_conditional_write_race_has_one_winner(backend: Backend) -> None:
    key = layout.latest_key(NS, "race")
    etag = await backend.put_bytes(key, b'{"generation": 1}', if_none_match=True)
    with pytest.raises(Conflict):
        await backend.put_bytes(key, b'{"generation": 9}', if_none_match=True)
    results = await asyncio.gather(
        backend.put_bytes(key, b'{"generation": 2}', if_match=etag),
        backend.put_bytes(key, b'{"generation": 3}', if_match=etag),
        return_exceptions=True,
    )
    assert sum(isinstance(r, Conflict) for r in results) == 1
    assert sum(isinstance(r, str) for r in results) == 1


async def test_uncommitted_generation_is_invisible(
    store: CheckpointStore, backend: Backend, tmp_path: Path
) -> None:
    await store.commit(NS, "ck", images(tmp_path, size=1024), meta("r1"))
    # A writer that died after uploading files but before its manifest:
    await backend.put_bytes(layout.claim_key(NS, "ck", 2), b"{}", if_none_match=True)
    await backend.put_bytes(layout.file_key(NS, "ck", 2, "images/pages-1.img"), b"x" * 1024)
    assert [g.number for g in await store.generations(NS, "ck")] == [1]
    latest = await store.latest(NS, "ck")
    assert latest and latest.number == 1
    with pytest.raises(CheckpointNotFound):
        await store.get(NS, "ck", 2)
    # The next writer skips the abandoned number instead of mixing into it.
    gen = await store.commit(NS, "ck", images(tmp_path, "img2", size=1024), meta("r3"))
    assert gen.number == 3


async def test_large_file_round_trip_in_parts(store: CheckpointStore, tmp_path: Path) -> None:
    src = images(tmp_path, size=(2 * FRAME_SIZE) + 12345)  # three frames, parts on S3
    gen = await store.commit(NS, "big", src, meta("r1"))
    dst = tmp_path / "out"
    await store.fetch(gen, dst)
    want = (src / "images" / "pages-1.img").read_bytes()
    assert (dst / "images" / "pages-1.img").read_bytes() == want


def parts_of_many_frames(monkeypatch: pytest.MonkeyPatch, frames: int) -> int:
    """Uploads whose parts hold ``frames`` frames each, one part (and one
    frame encoded) at a time; the part size."""
    monkeypatch.setattr(upload, "PART_TARGET", frames * FRAME_SIZE)
    monkeypatch.setattr(upload, "PARTS_IN_FLIGHT", 1)
    monkeypatch.setattr(upload, "BUDGET_PARTS", 1)
    monkeypatch.setattr(upload, "ENCODING", 1)
    return frames * FRAME_SIZE


async def test_a_part_of_many_frames_goes_up_whole_on_both_backends(
        backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts filled frame by frame (three frames a part, the last part
    shorter) reach the backend whole and in order."""
    part = parts_of_many_frames(monkeypatch, 3)
    src = images(tmp_path, size=2 * part + FRAME_SIZE + 777)
    store = CheckpointStore(backend, Codec(level=0))
    gen = await store.commit(NS, "parts", src, meta("r1"))
    dst = tmp_path / "out"
    await store.fetch(gen, dst)
    assert (dst / "images" / "pages-1.img").read_bytes() == \
        (src / "images" / "pages-1.img").read_bytes()


async def test_a_part_is_held_once_in_memory_while_it_is_uploaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part is built by copying each frame into it as the frame comes and
    letting the frame go: what the upload holds at its peak is one part,
    the frame being added and the one being encoded, never the part's
    frames and their join besides (a 4 GiB part held twice is 8 GiB).
    Measured by Python's own allocation accounting (tracemalloc) over the
    upload of a file that is one part of eight frames."""
    part = parts_of_many_frames(monkeypatch, 16)
    src = tmp_path / "img"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(part // 2))  # eight frames, one part
    up = upload.Uploader(LocalBackend(tmp_path / "store"), Codec(level=0))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        [entry] = await up.upload_dir(src, lambda rel: f"k/{rel}")
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    size = entry["stored_size"]
    assert len(entry["frames"]) == 8
    # One part (its buffer grows by at most an eighth), plus the frame being
    # copied in and the raw frame being encoded: about 1.5 parts here.
    assert peak < size + 3 * FRAME_SIZE, \
        f"a part of {size} bytes held {peak / size:.2f}x its size in memory while uploaded"


class WatchedBackend(LocalBackend):
    """The real local backend, recording how many ranged GETs are in flight
    as each one starts."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.in_flight = 0
        self.seen: list[int] = []

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        self.in_flight += 1
        self.seen.append(self.in_flight)
        try:
            await asyncio.sleep(0.05)  # a round trip, so that GETs can overlap
            return await super().get_range(key, start, length)
        finally:
            self.in_flight -= 1


async def test_a_files_first_range_goes_alone_then_the_rest_in_parallel(
    tmp_path: Path,
) -> None:
    # A server that computes an object's ETag on its first read (rclone's
    # serve s3) computes it once per concurrent GET: the first goes alone.
    backend = WatchedBackend(tmp_path / "store")
    store = CheckpointStore(backend, Codec(level=0))
    src = images(tmp_path, size=6 * FRAME_SIZE)  # six ranges
    gen = await store.commit(NS, "ck", src, meta("r1"))
    backend.seen.clear()
    await store.fetch(gen, tmp_path / "out", only=lambda p: p.endswith("pages-1.img"))
    assert backend.seen[0] == 1 and backend.seen[1] == 1, backend.seen  # the second waited
    assert max(backend.seen) > 1, "the other ranges were not fetched in parallel"
    assert (tmp_path / "out" / "images" / "pages-1.img").read_bytes() == \
        (src / "images" / "pages-1.img").read_bytes()


async def test_a_slow_reader_holds_a_bounded_amount_of_a_file_in_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """A page image streams to CRIU through the agent: however far CRIU lags,
    the download holds at most AHEAD_BYTES of it decoded (and one range more),
    never a fixed count of ranges (eight ranges of well compressed memory
    were 256 MiB)."""
    monkeypatch.setattr(download, "RANGE_RAW", FRAME_SIZE)  # a range per frame
    monkeypatch.setattr(download, "AHEAD_BYTES", 2 * FRAME_SIZE)
    backend = WatchedBackend(tmp_path / "store")
    store = CheckpointStore(backend, Codec(level=1))
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    (src / "images" / "pages-1.img").write_bytes(bytes(12 * FRAME_SIZE))  # compresses well
    gen = await store.commit(NS, "ck", src, meta("r1"))
    f = next(f for f in gen.manifest["files"] if f["path"] == "images/pages-1.img")
    backend.seen.clear()
    got = 0
    async with contextlib.aclosing(store.read_file(gen.manifest, f)) as chunks:
        async for chunk in chunks:
            got += len(chunk)
            if got == FRAME_SIZE:
                await asyncio.sleep(0.5)  # CRIU lags: the download must not run on
                # The first range yielded; the second held back; at most
                # AHEAD_BYTES of raw bytes ahead of that.
                assert len(backend.seen) <= 2 + 2, \
                    f"{len(backend.seen)} ranges fetched while the reader had one"
    assert got == 12 * FRAME_SIZE


async def test_flipped_byte_is_detected_before_use(
    store: CheckpointStore, backend: Backend, tmp_path: Path
) -> None:
    gen = await store.commit(NS, "ck", images(tmp_path), meta("r1"))
    key = layout.file_key(NS, "ck", gen.number, "images/pages-1.img")
    data = bytearray((await backend.get_bytes(key))[0])
    data[12345] ^= 0x40
    await backend.put_bytes(key, bytes(data))
    dst = tmp_path / "out"
    with pytest.raises(CheckpointCorrupt) as e:
        await store.fetch(gen, dst)
    assert "pages-1.img" in str(e.value)
    assert not (dst / "images" / "pages-1.img").exists(), "an unverified file got its name"


async def test_delete_checkpoint_removes_every_generation(
    store: CheckpointStore, backend: Backend, tmp_path: Path
) -> None:
    for i in range(2):
        await store.commit(NS, "gone", images(tmp_path, f"i{i}", size=1024), meta(f"r{i}"))
    await store.commit(NS, "kept", images(tmp_path, "k", size=1024), meta("rk"))
    assert await store.delete_checkpoint(NS, "gone") > 0
    assert await store.latest(NS, "gone") is None
    assert await backend.list(layout.checkpoint_prefix(NS, "gone")) == []
    assert [g.number for g in await store.generations(NS, "kept")] == [1]
    if isinstance(backend, LocalBackend):
        assert not (backend.root / NS / "gone").exists()


def compressible(size: int) -> bytes:
    """Memory-like bytes: numbers and words, far from random."""
    line = b"step=000123 loss=0.0421 weights=[0.5, 0.25, 0.125] ok\n"
    return (line * (size // len(line) + 1))[:size]


async def test_compressible_images_are_stored_smaller(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    (src / "images" / "pages-1.img").write_bytes(compressible(3 * FRAME_SIZE))
    (src / "images" / "pages-2.img").write_bytes(os.urandom(FRAME_SIZE + 1))
    store = CheckpointStore(backend, Codec(level=3))
    gen = await store.commit(NS, "z", src, meta("r1"))
    files = {f["path"]: f for f in gen.manifest["files"]}
    assert files["images/pages-1.img"]["compression"] == "zstd"
    assert files["images/pages-1.img"]["stored_size"] < files["images/pages-1.img"]["size"] / 20
    # zstd cannot shrink random memory: it is stored as it is, not larger.
    assert files["images/pages-2.img"]["stored_size"] == FRAME_SIZE + 1
    dst = tmp_path / "out"
    await store.fetch(gen, dst)
    for rel in files:
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()


async def test_upload_streams_while_the_writer_is_still_writing(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """Pages go up while the dump runs; the tail and the other files after it."""
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    pages = src / "images" / "pages-1.img"
    chunks = [os.urandom(FRAME_SIZE) for _ in range(3)] + [os.urandom(4321)]
    uploaded_while_writing: list[int] = []
    done_bytes = [0]

    async def dump() -> None:  # stands for CRIU appending to its page image
        with open(pages, "ab") as f:
            for c in chunks[:-1]:
                f.write(c)
                f.flush()
            # The tail only once a frame went up: an upload that waited for
            # the dump's end would never get there (the deadline only bounds
            # that hang, whatever the machine's load).
            await wait_event(a_frame_up, 60)
            uploaded_while_writing.append(done_bytes[0])
            f.write(chunks[-1])
        (src / "images" / "core-1.img").write_bytes(b"core")

    a_frame_up = asyncio.Event()

    def on_bytes(n: int) -> None:
        done_bytes[0] = n
        if n >= FRAME_SIZE:
            a_frame_up.set()

    writer = asyncio.create_task(dump())
    gen = await store.commit(NS, "s", src, meta("r1"), writer=writer, on_bytes=on_bytes)
    assert uploaded_while_writing[0] >= FRAME_SIZE, "nothing went up before the dump ended"
    dst = tmp_path / "out"
    await store.fetch(gen, dst)
    assert (dst / "images" / "pages-1.img").read_bytes() == b"".join(chunks)
    assert (dst / "images" / "core-1.img").read_bytes() == b"core"


async def test_failed_dump_aborts_the_upload_and_leaves_nothing_visible(
    store: CheckpointStore, backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)

    async def failing_dump() -> None:
        (src / "images" / "pages-1.img").write_bytes(os.urandom(2 * FRAME_SIZE))
        await asyncio.sleep(0.5)
        raise RuntimeError("criu: dump failed")

    with pytest.raises(RuntimeError, match="dump failed"):
        await store.commit(NS, "f", src, meta("r1"), writer=asyncio.create_task(failing_dump()))
    assert await store.latest(NS, "f") is None
    assert await backend.pending_uploads("") == [], "the multipart upload was not aborted"
    await store.gc(grace_s=0, at=time.time() + MISSED_RENEWALS * store.heartbeat_s + 1)
    assert await backend.list("") == []


async def test_crash_mid_upload_is_invisible_and_gc_removes_its_parts(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    (src / "images" / "pages-1.img").write_bytes(os.urandom(3 * FRAME_SIZE))
    if isinstance(backend, LocalBackend):
        args = ["local", str(backend.root), str(src)]
    else:
        assert isinstance(backend, S3Backend)
        args = ["s3", str(backend.endpoint_url), backend.bucket, str(src)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.helpers.crash_upload", *args,
        stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).parent.parent)
    assert proc.stdout
    assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"uploading\n"
    proc.send_signal(signal.SIGKILL)
    await proc.wait()

    store = CheckpointStore(backend)
    assert await store.latest(NS, "ck") is None
    assert await store.generations(NS, "ck") == []
    assert await backend.pending_uploads(""), "the dead writer left no upload to collect"
    report = await store.gc(grace_s=3600)  # a writer may still be at work: keep
    assert report.uploads_aborted == 0 and report.generations_removed == []
    # Dead: silent for longer than the renewals its claim says it makes.
    report = await store.gc(grace_s=0, at=time.time() + MISSED_RENEWALS * HEARTBEAT_S + 1)
    assert report.uploads_aborted >= 1 and report.generations_removed == ["local/ck/1"]
    assert await backend.pending_uploads("") == []
    assert await backend.list("") == []


async def test_wrong_or_missing_key_is_refused_before_any_byte(
    backend: Backend, tmp_path: Path
) -> None:
    gen = await CheckpointStore(backend, Codec(key=KEY_A)).commit(
        NS, "enc", images(tmp_path), meta("r1"))
    for codec in (Codec(key=KEY_B), Codec()):
        dst = tmp_path / "out"
        with pytest.raises(WrongKey) as e:
            await CheckpointStore(backend, codec).fetch(gen, dst)
        assert gen.manifest["files"][0]["encryption"]["key_id"] in str(e.value)
        assert not (dst / "images").exists()
    raw = (await backend.get_bytes(layout.file_key(NS, "enc", 1, "images/pages-1.img")))[0]
    assert (tmp_path / "img" / "images" / "pages-1.img").read_bytes()[:4096] not in raw
    assert base64.b64encode(KEY_A).decode() not in str(gen.manifest)


async def restored(store: CheckpointStore, gen: Generation, src: Path, dst: Path) -> None:
    await store.fetch(gen, dst)
    for p in src.rglob("*"):
        if p.is_file():
            assert (dst / p.relative_to(src)).read_bytes() == p.read_bytes(), p


async def copy_checkpoint(backend: Backend, src_ns: str, dst_ns: str, ckpt: str,
                          edit: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Every object of ``ckpt`` copied into ``dst_ns`` (someone who can write
    there), its manifests passed through ``edit``."""
    prefix = layout.checkpoint_prefix(src_ns, ckpt)
    for key in await backend.list(prefix):
        data = (await backend.get_bytes(key))[0]
        if key.endswith("manifest.json") and edit:
            m = orjson.loads(data)
            edit(m)
            data = orjson.dumps(m)
        await backend.put_bytes(layout.checkpoint_prefix(dst_ns, ckpt) + key[len(prefix):], data)


async def test_each_namespace_has_its_own_key(backend: Backend, tmp_path: Path) -> None:
    """One master key, a data key per namespace: a checkpoint moved into
    another namespace is refused as what it is, before a byte is written."""
    store = CheckpointStore(backend, Codec(level=0, key=KEY_A))
    src = images(tmp_path)
    a = await store.commit("team-a", "db", src, meta("r1"))
    b = await store.commit("team-b", "db", src, meta("r2"))
    enc_a, enc_b = (g.manifest["files"][0]["encryption"] for g in (a, b))
    assert enc_a["master_key_id"] == enc_b["master_key_id"] == key_id(KEY_A)
    assert enc_a["namespace"] == "team-a" and enc_a["key_id"] != enc_b["key_id"]
    assert enc_a["key_id"] == key_id(namespace_key(KEY_A, "team-a"))
    # Each reads back in its own namespace.
    await restored(store, a, src, tmp_path / "a")

    # Copied as it is into team-c: its manifest names team-a.
    await copy_checkpoint(backend, "team-a", "team-c", "db")
    with pytest.raises(CheckpointCorrupt, match="names another checkpoint"):
        await store.get("team-c", "db", 1)

    # Copied over team-b's own generation with the manifest made to say team-b.
    def claim_team_b(m: dict[str, Any]) -> None:
        m["namespace"] = "team-b"

    await copy_checkpoint(backend, "team-a", "team-b", "db", claim_team_b)
    gen = await store.get("team-b", "db", 1)
    dst = tmp_path / "stolen"
    with pytest.raises(WrongNamespace, match=r"encrypted for another namespace .'team-a'."):
        await store.fetch(gen, dst)
    assert not (dst / "images").exists()


async def test_a_tampered_key_id_is_caught_before_any_byte(
        backend: Backend, tmp_path: Path) -> None:
    store = CheckpointStore(backend, Codec(level=0, key=KEY_A))
    await store.commit("team-a", "db", images(tmp_path), meta("r1"))
    mkey = layout.manifest_key("team-a", "db", 1)
    good = (await backend.get_bytes(mkey))[0]
    for field, value in (("key_id", key_id(namespace_key(KEY_A, "team-b"))),
                         ("master_key_id", key_id(KEY_B))):
        m = orjson.loads(good)
        for f in m["files"]:
            f["encryption"][field] = value
        await backend.put_bytes(mkey, orjson.dumps(m))
        dst = tmp_path / f"out-{field}"
        with pytest.raises(WrongKey, match=value):
            await store.fetch(await store.get("team-a", "db", 1), dst)
        assert not (dst / "images").exists()


async def test_a_rotated_key_still_reads_what_it_wrote(backend: Backend, tmp_path: Path) -> None:
    """The key file's first key writes; the others only read, until their
    generations expire."""
    src = images(tmp_path)
    old = await CheckpointStore(backend, Codec(level=0, key=KEY_A)).commit(
        "team-a", "db", src, meta("r1"))
    rotated = CheckpointStore(backend, Codec(level=0, key=KEY_B, old_keys=(KEY_A,)))
    new = await rotated.commit("team-a", "db", src, meta("r2"))
    assert new.manifest["files"][0]["encryption"]["master_key_id"] == key_id(KEY_B)
    await restored(rotated, old, src, tmp_path / "old")
    await restored(rotated, new, src, tmp_path / "new")
    with pytest.raises(WrongKey, match=f"under master key {key_id(KEY_A)}"):
        await CheckpointStore(backend, Codec(level=0, key=KEY_B)).fetch(old, tmp_path / "x")


class BeforeNamespaceKeys(Codec):
    """How smr wrote before namespaces had keys: the master key itself."""

    def for_namespace(self, namespace: str) -> Codec:
        return self


async def test_checkpoints_written_with_the_master_key_itself_still_read(
        backend: Backend, tmp_path: Path) -> None:
    src = images(tmp_path)
    old = await CheckpointStore(backend, BeforeNamespaceKeys(level=0, key=KEY_A)).commit(
        "team-a", "db", src, meta("r1"))
    assert old.manifest["files"][0]["encryption"] == {"algorithm": "AES-256-GCM",
                                                      "key_id": key_id(KEY_A)}
    await restored(CheckpointStore(backend, Codec(level=0, key=KEY_A)), old, src, tmp_path / "o")


def test_the_key_file_holds_the_writing_key_first(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"{base64.b64encode(KEY_B).decode()}\n{base64.b64encode(KEY_A).decode()}\n")
    assert load_keys("", str(f)) == (KEY_B, KEY_A)
    f.write_text("bm90IGEga2V5\n")
    with pytest.raises(ConfigError, match="key 1 is not"):
        load_keys("", str(f))


async def test_retention_keeps_the_newest_n_and_drops_old_ones(
    backend: Backend, tmp_path: Path
) -> None:
    store = CheckpointStore(backend)
    src = images(tmp_path, size=1024)
    for i in range(5):
        await store.commit(NS, "r", src, meta(f"r{i}"))
    assert await store.prune(NS, "r", keep=2) == [1, 2, 3]
    assert [g.number for g in await store.generations(NS, "r")] == [4, 5]
    assert await backend.list(layout.generation_prefix(NS, "r", 1)) == []
    assert await store.prune(NS, "r", keep=2) == []
    # By age: everything but what `latest` names, however old.
    assert await store.prune(NS, "r", max_age_s=60, at=time.time() + 3600) == [4]
    latest = await store.latest(NS, "r")
    assert latest and latest.number == 5
    dst = tmp_path / "out"
    await store.fetch(latest, dst)
    assert (dst / "images" / "inventory.img").read_bytes() == b"inventory"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a scratch that fills."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "scratch"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True)
    yield path
    subprocess.run(["umount", str(path)], check=True)


async def test_a_streamed_page_image_that_overfills_its_scratch_is_retried_not_crashed(
        tmp_path: Path, small_tmpfs: Path) -> None:
    """The largest page image of a streamed restore is staged in a scratch
    file; a full scratch is a temporary failure (retried), named as such."""
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    (src / "images" / "pages-1.img").write_bytes(os.urandom(3 << 20))
    store = CheckpointStore(LocalBackend(tmp_path / "store"), Codec(level=0))
    gen = await store.commit(NS, "full", src, meta("r1"))
    source = StreamedImages(store, gen, scratch=small_tmpfs)
    chunks = source("pages-1.img")
    assert chunks is not None
    with pytest.raises(ScratchFull) as e:
        async for _ in chunks:
            pass
    assert "pages-1.img" in e.value.message and str(small_tmpfs) in e.value.message
    await source.aclose()


async def test_a_staged_page_image_reaches_criu_whole_and_in_order(tmp_path: Path) -> None:
    """Staged in 16 scratch files by the decoding threads, out of order: what
    CRIU is handed, read back in order, is the image byte for byte."""
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    want = os.urandom(FRAME_SIZE * (SCRATCH_FILES + 3) + 4321)  # every file, some twice
    (src / "images" / "pages-1.img").write_bytes(want)
    store = CheckpointStore(LocalBackend(tmp_path / "store"), Codec(level=3))
    gen = await store.commit(NS, "staged", src, meta("r1"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    source = StreamedImages(store, gen, scratch=scratch)
    chunks = source("pages-1.img")
    assert chunks is not None
    got, fds = bytearray(), set()
    async for piece in chunks:
        assert isinstance(piece, FileRange), "not staged"
        got += os.pread(piece.fd, piece.length, piece.offset)
        fds.add(piece.fd)
    assert bytes(got) == want
    assert len(fds) == SCRATCH_FILES
    await source.aclose()


def test_a_small_node_streams_without_staging(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:

    gen = Generation({"files": [{"path": "images/pages-1.img", "size": 1 << 20}]}, "")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert stream.scratch_for(gen, tmp_path) is None
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert stream.scratch_for(gen, tmp_path) is not None


def test_memory_headroom_is_the_tightest_limit_above(tmp_path: Path) -> None:
    # cgroup v1: the agent's cgroup has no limit; the pod's above it has.
    v1 = tmp_path / "v1"
    pod = v1 / "memory" / "kubepods" / "pod1"
    (pod / "agent").mkdir(parents=True)
    for d, limit, usage in ((v1 / "memory", 9223372036854771712, 5 << 30),
                            (pod, 2 << 30, 1 << 30), (pod / "agent", 9223372036854771712, 1 << 30)):
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (tmp_path / "cg1").write_text("5:cpu:/\n4:memory:/kubepods/pod1/agent\n0::/\n")
    assert stream.memory_headroom(tmp_path / "cg1", v1) == 1 << 30
    # cgroup v2: "max" is no limit.
    v2 = tmp_path / "v2"
    (v2 / "agent").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "agent" / "memory.max").write_text(f"{512 << 20}\n")
    (v2 / "agent" / "memory.current").write_text(f"{100 << 20}\n")
    (tmp_path / "cg2").write_text("0::/agent\n")
    assert stream.memory_headroom(tmp_path / "cg2", v2) == 412 << 20
    (v2 / "agent" / "memory.max").write_text("max\n")
    assert stream.memory_headroom(tmp_path / "cg2", v2) == float("inf")


def test_a_page_image_larger_than_the_agents_memory_limit_is_staged_on_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A tmpfs page is charged to the agent that wrote it: staged in RAM, an
    # image larger than the agent's limit would get the agent OOM-killed.
    gen = Generation({"files": [{"path": "images/pages-1.img", "size": 1 << 30}]}, "")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(stream, "memory_headroom", lambda: float(512 << 20))
    assert stream.scratch_for(gen, tmp_path / "disk") == tmp_path / "disk"
    monkeypatch.setattr(stream, "memory_headroom", lambda: float("inf"))
    assert stream.scratch_for(gen, tmp_path / "disk") == stream.SHM


async def test_a_store_nothing_was_written_to_lists_nothing(backend: Backend,
                                                           tmp_path: Path) -> None:
    """The storage service's GC and metrics list the whole store from their
    first pass, often before any checkpoint made its directory. The local
    backend then took the empty prefix as a name within its parent and walked
    the files beside the store: both loops died on it, silently, for good."""
    (tmp_path / "beside.conf").write_bytes(b"not the store's")
    assert await backend.list("") == []
    assert await backend.list(NS[:2]) == []
    assert await backend.pending_uploads("") == []


def stamped(rid: str, seq: int | None, epoch: str = "e1",
            started_at: str = "2026-11-28T01:00:00.000Z") -> dict[str, object]:
    m = meta(rid)
    if seq is not None:
        m["dump"] = {"seq": seq, "lock_epoch": epoch, "started_at": started_at,
                     "boot_id": "b"}
    return m


async def test_latest_follows_the_dump_order_not_the_commit_order(
    backend: Backend, tmp_path: Path
) -> None:
    """A dump committed after a later one (its recovery came late) never
    becomes latest, and retention ranks it below the later one; dumps of
    older smr (no stamp) or of another lock bucket compare by number."""
    store = CheckpointStore(backend)
    src = images(tmp_path, size=1024)
    later = await store.commit(NS, "o", src, stamped("later", 9))
    earlier = await store.commit(NS, "o", src, stamped("earlier", 4))
    assert (later.number, earlier.number) == (1, 2)
    latest = await store.latest(NS, "o")
    assert latest and latest.number == 1, f"latest moved back to the dump of seq 4 ({latest})"
    assert await store.ensure_latest(NS, "o", earlier) is False
    assert await store.ensure_latest(NS, "o", later) is True
    # Keeping one generation keeps the later dump, whatever its number.
    assert await store.prune(NS, "o", keep=1) == [2]
    # An unstamped generation, and one of a lock bucket made again: by number.
    old = await store.commit(NS, "o", src, stamped("unstamped", None))
    assert (await store.latest(NS, "o")).number == old.number > 1  # type: ignore[union-attr]
    fresh = await store.commit(NS, "o", src, stamped("new-bucket", 1, epoch="e2"))
    assert (await store.latest(NS, "o")).number == fresh.number > old.number  # type: ignore[union-attr]


async def test_a_dump_of_an_old_lock_bucket_recovered_late_never_becomes_latest(
    backend: Backend, tmp_path: Path
) -> None:
    """The lock bucket made again (NATS lost it) starts its sequence over: a
    dump taken before that, recovered and committed after a later dump of the
    new bucket, is older by when it started, and latest stays."""
    store = CheckpointStore(backend)
    src = images(tmp_path, size=1024)
    later = await store.commit(NS, "b", src, stamped(
        "new-bucket", 1, epoch="e2", started_at="2026-11-28T01:05:00.000Z"))
    old = await store.commit(NS, "b", src, stamped(
        "old-bucket", 40, epoch="e1", started_at="2026-11-28T01:00:00.000Z"))
    assert old.number > later.number
    latest = await store.latest(NS, "b")
    assert latest and latest.number == later.number, (
        f"latest moved to generation {latest and latest.number}, dumped at 01:00 before "
        f"generation {later.number} (01:05) of a lock bucket made again")
    assert await store.prune(NS, "b", keep=1) == [old.number]


async def test_a_later_bucket_dump_is_latest_whatever_the_nodes_clocks_say(
    backend: Backend, tmp_path: Path
) -> None:
    """The last dump of a lock bucket, taken on a node whose clock
    runs 5 s fast, and the first dump of the bucket made again 4 s later on a
    node with a right clock, committed in that order (no recovery at all):
    the later one is latest. Node clocks must not order buckets: the bucket's
    epoch (its stream's creation time, NATS's one clock) does, since every dump
    of the new bucket started after it was made, and every dump of the old one
    took its sequence before it was lost."""
    store = CheckpointStore(backend)
    src = images(tmp_path, size=1024)
    e1, e2 = "2026-11-28T00:00:00.123456+00:00", "2026-11-28T01:00:08.500000+00:00"
    first = await store.commit(NS, "k", src, stamped(
        "fast-node", 7, epoch=e1, started_at="2026-11-28T01:00:10.000Z"))
    second = await store.commit(NS, "k", src, stamped(
        "right-node", 1, epoch=e2, started_at="2026-11-28T01:00:09.000Z"))
    latest = await store.latest(NS, "k")
    assert latest and latest.number == second.number, (
        f"latest stayed at {latest and latest.number}: the new bucket's first dump "
        f"(generation {second.number}) lost to a fast clock")
    assert await store.prune(NS, "k", keep=1) == [first.number]


def test_s3_backends_share_service_models_not_credentials() -> None:
    """Each S3 backend resolves and refreshes its own credentials (a
    refreshing one locks on the event loop that first uses it), while the
    service models botocore reads once are shared by the process."""
    from services.storage.s3 import S3Backend

    a, b = S3Backend("one"), S3Backend("two")
    core_a, core_b = a.session._session, b.session._session
    assert core_a is not core_b
    assert core_a.get_component("data_loader") is core_b.get_component("data_loader")
