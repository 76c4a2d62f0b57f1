"""Checkpoint storage: commit, visibility, conditional writes, integrity.

One suite, run against both backends: a local directory, and S3 through
aioboto3 against moto's S3 server (a separate process, real HTTP)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.storage import layout
from services.storage.backend import Backend, Conflict
from services.storage.local import LocalBackend
from services.storage.s3 import PART_SIZE, S3Backend
from services.storage.store import CheckpointCorrupt, CheckpointNotFound, CheckpointStore
from smr.messages import Target
from smr.natsserver import free_port

NS = layout.LOCAL_NAMESPACE


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


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


@pytest.fixture
def store(backend: Backend) -> CheckpointStore:
    return CheckpointStore(backend)


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
    await backend.put_file(layout.file_key(NS, "ck", 2, "images/pages-1.img"),
                           tmp_path / "img" / "images" / "pages-1.img")
    assert [g.number for g in await store.generations(NS, "ck")] == [1]
    latest = await store.latest(NS, "ck")
    assert latest and latest.number == 1
    with pytest.raises(CheckpointNotFound):
        await store.get(NS, "ck", 2)
    # The next writer skips the abandoned number instead of mixing into it.
    gen = await store.commit(NS, "ck", images(tmp_path, "img2", size=1024), meta("r3"))
    assert gen.number == 3


async def test_large_file_round_trip_in_parts(store: CheckpointStore, tmp_path: Path) -> None:
    src = images(tmp_path, size=(2 * PART_SIZE) + 12345)  # three multipart parts on S3
    gen = await store.commit(NS, "big", src, meta("r1"))
    dst = tmp_path / "out"
    await store.fetch(gen, dst)
    want = (src / "images" / "pages-1.img").read_bytes()
    assert (dst / "images" / "pages-1.img").read_bytes() == want


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
