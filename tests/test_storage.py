"""Checkpoint storage: commit, visibility, conditional writes, integrity.

Parametrized over backends; the S3 backend (moto's server over HTTP) joins
this suite when it lands."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.storage import layout
from services.storage.backend import Backend, Conflict
from services.storage.local import LocalBackend
from services.storage.store import CheckpointCorrupt, CheckpointNotFound, CheckpointStore
from smr.messages import Target

NS = layout.LOCAL_NAMESPACE


@pytest.fixture(params=["local"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    yield LocalBackend(tmp_path / "store")


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


async def test_flipped_byte_is_detected_before_use(
    store: CheckpointStore, backend: LocalBackend, tmp_path: Path
) -> None:
    gen = await store.commit(NS, "ck", images(tmp_path), meta("r1"))
    stored = backend.root / layout.file_key(NS, "ck", gen.number, "images/pages-1.img")
    data = bytearray(stored.read_bytes())
    data[12345] ^= 0x40
    stored.write_bytes(bytes(data))
    dst = tmp_path / "out"
    with pytest.raises(CheckpointCorrupt) as e:
        await store.fetch(gen, dst)
    assert "pages-1.img" in str(e.value)
    assert not (dst / "images" / "pages-1.img").exists(), "an unverified file got its name"
