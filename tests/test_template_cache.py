"""Warm-start templates in storage (docs/warm-start.md): a node's template
cache (services/storage/cache) and retention, on both backends (a local
directory; moto's S3 server over HTTP)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from services.storage import layout
from services.storage.backend import Backend
from services.storage.cache import ObjectCache
from services.storage.codec import Codec
from services.storage.store import CheckpointCorrupt, CheckpointStore
from tests.test_storage import backend, images, meta  # noqa: F401  (backend: a fixture)

NS = "default"
TPL = layout.template_id("llm", "main")


class Counting:
    """The backend, counting the ranged GETs of each key (what S3 bills)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.gets: Counter[str] = Counter()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        self.gets[key] += 1
        return await self.inner.get_range(key, start, length)


async def test_a_node_downloads_a_template_object_once(backend: Backend,  # noqa: F811
                                                       tmp_path: Path) -> None:
    counting = Counting(backend)
    writer = CheckpointStore(backend, Codec(level=1, key=os.urandom(32)))
    gen = await writer.commit(NS, TPL, images(tmp_path), meta("r1"))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(counting, writer.codec).with_cache(cache)  # type: ignore[arg-type]
    for i in range(3):  # three replicas on one node
        await node.fetch(gen, tmp_path / f"r{i}")
        assert (tmp_path / f"r{i}" / "images" / "inventory.img").read_bytes() == b"inventory"
    files = len(gen.manifest["files"])
    assert cache.stats["downloads"] == files and cache.stats["hits"] == 2 * files
    key = layout.file_key(NS, TPL, gen.number, "images/pages-1.img")
    assert counting.gets[key] == 1, "an object was fetched from storage more than once"
    assert oct(os.stat(tmp_path / "cache").st_mode & 0o777) == "0o700"
    # A checkpoint that is not a template is not cached.
    other = await writer.commit(NS, "r1.main", images(tmp_path, "plain"), meta("r2"))
    await node.fetch(other, tmp_path / "plain-out")
    assert cache.stats["downloads"] == files


async def test_a_cached_object_is_verified_like_any_read(backend: Backend,  # noqa: F811
                                                         tmp_path: Path) -> None:
    writer = CheckpointStore(backend, Codec(level=1))
    gen = await writer.commit(NS, TPL, images(tmp_path), meta("r1"))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(backend, writer.codec).with_cache(cache)
    await node.fetch(gen, tmp_path / "one")
    # Someone on the node alters a cached file: the read fails, names it, and
    # the entry goes; the next read fetches it from storage again.
    key = layout.file_key(NS, TPL, gen.number, "images/pages-1.img")
    f = next(f for f in gen.manifest["files"] if f["path"] == "images/pages-1.img")
    entry = tmp_path / "cache" / ObjectCache.name_of(key, f)
    data = bytearray(entry.read_bytes())
    data[1000] ^= 0x40
    entry.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt) as e:
        await node.fetch(gen, tmp_path / "two")
    assert "pages-1.img" in e.value.message and "cache" in e.value.message
    assert not entry.exists()
    await node.fetch(gen, tmp_path / "three")
    assert (tmp_path / "three" / "images" / "pages-1.img").read_bytes() == \
        (tmp_path / "one" / "images" / "pages-1.img").read_bytes()


async def test_the_cache_stays_within_its_bound(backend: Backend,  # noqa: F811
                                                tmp_path: Path) -> None:
    writer = CheckpointStore(backend, Codec(level=0))
    gens = [await writer.commit(NS, layout.template_id(f"t{i}", "main"),
                                images(tmp_path, f"i{i}", size=1 << 20), meta(f"r{i}"))
            for i in range(3)]
    cache = ObjectCache(tmp_path / "cache", (2 << 20) + 4096)  # two templates' pages
    node = CheckpointStore(backend, writer.codec).with_cache(cache)
    for i, g in enumerate(gens):
        await node.fetch(g, tmp_path / f"o{i}")
        held = sum(p.stat().st_size for p in (tmp_path / "cache").iterdir())
        assert held <= cache.max_bytes
    assert cache.stats["evicted"] >= 1
    # Larger than the whole cache: read from storage, not cached.
    big = await writer.commit(NS, layout.template_id("big", "main"),
                              images(tmp_path, "big", size=3 << 20), meta("rb"))
    await node.fetch(big, tmp_path / "big-out")
    assert cache.stats["too_large"] == 1


async def test_retention_never_removes_a_template(backend: Backend,  # noqa: F811
                                                  tmp_path: Path) -> None:
    store = CheckpointStore(backend)
    src = images(tmp_path, size=1024)
    for i in range(3):
        await store.commit(NS, TPL, src, meta(f"t{i}"))
        await store.commit(NS, "r1.main", src, meta(f"r{i}"))
    assert await store.prune(NS, TPL, keep=1, max_age_s=1e-6) == []
    assert [g.number for g in await store.generations(NS, TPL)] == [1, 2, 3]
    assert await store.prune(NS, "r1.main", keep=1) == [1, 2]  # a replica's own: as before
    await store.gc(grace_s=0)
    assert [g.number for g in await store.generations(NS, TPL)] == [1, 2, 3]
