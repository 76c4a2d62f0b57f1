"""Warm-start templates in storage (docs/warm-start.md): a node's template
cache (services/storage/cache) and retention, on both backends (a local
directory; moto's S3 server over HTTP)."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from services.agent.prepull import Prepull
from services.storage import layout
from services.storage.backend import Backend
from services.storage.cache import ObjectCache
from services.storage.codec import Codec
from services.storage.generation import CheckpointCorrupt, Generation
from services.storage.store import CheckpointStore
from smr.contract.errors import SmrError, TemporaryError
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


def cached_entry(root: Path, gen: Generation, path: str) -> tuple[str, dict[str, Any], Path]:
    key = layout.file_key(NS, TPL, gen.number, path)
    f = next(f for f in gen.manifest["files"] if f["path"] == path)
    return key, f, root / ObjectCache.name_of(key, f)


def alter(where: Path, at: int) -> None:
    """One bit flipped in place: the same size, other bytes."""
    data = bytearray(where.read_bytes())
    data[at] ^= 0x40
    where.write_bytes(bytes(data))


@pytest.mark.parametrize("key", [None, os.urandom(32)], ids=["clear", "encrypted"])
async def test_an_altered_cached_object_is_read_from_storage_again(
        backend: Backend, tmp_path: Path, key: bytes | None) -> None:  # noqa: F811
    writer = CheckpointStore(backend, Codec(level=1, key=key))
    gen = await writer.commit(NS, TPL, images(tmp_path), meta("r1"))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(backend, writer.codec).with_cache(cache)
    await node.fetch(gen, tmp_path / "one")
    good = (tmp_path / "one" / "images" / "pages-1.img").read_bytes()
    # Something on the node alters a cached file (same size): its sha256
    # catches it; the read falls back to storage's good bytes once, and the
    # cache holds them again.
    _, _, entry = cached_entry(tmp_path / "cache", gen, "images/pages-1.img")
    stored = entry.read_bytes()
    alter(entry, 1000)
    await node.fetch(gen, tmp_path / "two")
    assert (tmp_path / "two" / "images" / "pages-1.img").read_bytes() == good
    assert cache.stats["corrupt"] == 1
    assert entry.read_bytes() == stored, "the cache was not filled again with storage's bytes"
    hits = cache.stats["hits"]
    await node.fetch(gen, tmp_path / "three")
    assert cache.stats["hits"] > hits and cache.stats["corrupt"] == 1


async def test_a_template_altered_in_storage_and_in_the_cache_fails(
        backend: Backend, tmp_path: Path) -> None:  # noqa: F811
    writer = CheckpointStore(backend, Codec(level=1))
    gen = await writer.commit(NS, TPL, images(tmp_path), meta("r1"))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(backend, writer.codec).with_cache(cache)
    await node.fetch(gen, tmp_path / "one")
    key, _, entry = cached_entry(tmp_path / "cache", gen, "images/pages-1.img")
    data, _ = await backend.get_bytes(key)
    await backend.put_bytes(key, data[:-64] + bytes(64))
    alter(entry, 1000)
    with pytest.raises(CheckpointCorrupt) as e:
        await node.fetch(gen, tmp_path / "two")
    assert "pages-1.img" in e.value.message and "storage" in e.value.message
    assert not entry.exists(), "a copy known to be bad stayed in the cache"


async def test_an_altered_cached_object_already_streamed_in_part_is_retried(
        backend: Backend, tmp_path: Path) -> None:  # noqa: F811
    """A streamed read (to CRIU) has handed on the object's first ranges
    when a later one shows the cached copy altered: what it handed on cannot
    be taken back, so the restore fails for now (retried), never runs on
    those bytes; the retry reads the good copy the cache holds again."""
    writer = CheckpointStore(backend, Codec(level=0))  # stored as is: no frame check
    gen = await writer.commit(NS, TPL, images(tmp_path, size=24 << 20), meta("r1"))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(backend, writer.codec).with_cache(cache)
    m, path = gen.manifest, "images/pages-1.img"
    f = next(f for f in m["files"] if f["path"] == path)
    good = b"".join([bytes(c) async for c in node.read_file(m, f)])
    _, _, entry = cached_entry(tmp_path / "cache", gen, path)
    alter(entry, 100)  # in the first range
    got = bytearray()
    with pytest.raises(TemporaryError) as e:
        async for c in node.read_file(m, f):
            got += c
    assert path in e.value.message and "cache" in e.value.message
    assert len(got) < len(good), "the whole altered file was handed on"
    again = b"".join([bytes(c) async for c in node.read_file(m, f)])
    assert again == good


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


class Held:
    """The backend, holding every ranged GET until ``go`` is set: an entry
    being written stays half-written meanwhile."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()
        self.keys: set[str] = set()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        self.keys.add(key)
        self.waiting.set()
        await self.go.wait()
        return await self.inner.get_range(key, start, length)


async def test_a_restarting_agent_leaves_the_entry_the_old_one_still_writes(
        backend: Backend, tmp_path: Path) -> None:  # noqa: F811
    """An agent starting while the one it replaces still writes an entry (a
    DaemonSet rollout overlaps them): its start-up cleanup removes only what
    no live writer holds."""
    writer = CheckpointStore(backend, Codec(level=1))
    gen = await writer.commit(NS, TPL, images(tmp_path), meta("r1"))
    held = Held(backend)
    old = ObjectCache(tmp_path / "cache", 64 << 20)
    old_node = CheckpointStore(held, writer.codec).with_cache(old)  # type: ignore[arg-type]
    fetch = asyncio.create_task(old_node.fetch(gen, tmp_path / "old"))
    await asyncio.wait_for(held.waiting.wait(), 30)
    # The entries whose bytes are being fetched (their writer holds them).
    by_key = {layout.file_key(NS, TPL, gen.number, f["path"]): f for f in gen.manifest["files"]}
    parts = [tmp_path / "cache" / f"{ObjectCache.name_of(k, by_key[k])}.part" for k in held.keys]
    assert parts and all(p.exists() for p in parts), "no entry being written"
    # A crashed agent's leftover, which no one holds: removed.
    (tmp_path / "cache" / f"{'0' * 64}.part").write_bytes(b"torn")
    new = ObjectCache(tmp_path / "cache", 64 << 20)
    assert all(p.exists() for p in parts), "the new agent removed an entry still being written"
    assert not (tmp_path / "cache" / f"{'0' * 64}.part").exists()
    held.go.set()
    await asyncio.wait_for(fetch, 60)
    assert (tmp_path / "old" / "images" / "inventory.img").read_bytes() == b"inventory"
    new_node = CheckpointStore(backend, writer.codec).with_cache(new)
    await new_node.fetch(gen, tmp_path / "new")
    assert new.stats["hits"] == len(gen.manifest["files"]) and not new.stats["downloads"]
    assert not list((tmp_path / "cache").glob("*.part"))


async def test_a_prepulled_template_is_read_from_the_node_decoded(
        backend: Backend, tmp_path: Path) -> None:  # noqa: F811
    """Pre-pulled (before any replica starts), a template's objects lie on
    the node decoded (no zstd or AES on a restore) and verified; the replica
    that starts later downloads nothing."""
    counting = Counting(backend)
    writer = CheckpointStore(backend, Codec(level=3, key=os.urandom(32)))
    src = images(tmp_path)
    (src / "images" / "pages-2.img").write_bytes(b"compressible " * 100_000)
    gen = await writer.commit(NS, TPL, src, meta("r1"))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(counting, writer.codec).with_cache(cache)  # type: ignore[arg-type]
    files = len(gen.manifest["files"])
    assert await node.prepull(gen) == files
    assert await node.prepull(gen) == 0, "a second pre-pull downloaded again"
    _, _, entry = cached_entry(tmp_path / "cache", gen, "images/pages-2.img")
    assert entry.read_bytes() == (src / "images" / "pages-2.img").read_bytes()
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    gets = sum(counting.gets.values())
    await node.fetch(gen, tmp_path / "r1")
    assert sum(counting.gets.values()) == gets, "the replica read storage"
    assert cache.stats["hits"] == files
    assert (tmp_path / "r1" / "images" / "pages-2.img").read_bytes() == \
        (src / "images" / "pages-2.img").read_bytes()


async def test_the_agent_prepulls_the_templates_it_is_told_to(
        backend: Backend, tmp_path: Path) -> None:  # noqa: F811
    """SMR_TEMPLATE_PREPULL: a named template is read into the node's cache
    when storage holds it, once, and again when it is taken anew; other
    templates are not."""
    writer = CheckpointStore(backend, Codec(level=1))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(backend, writer.codec).with_cache(cache)
    pull = Prepull(node, ("default/llm",))
    assert await pull.once() == 0  # nothing stored yet
    first = await writer.commit(NS, TPL, images(tmp_path, "a"), meta("r1"))
    await writer.commit(NS, layout.template_id("other", "main"), images(tmp_path, "b"),
                        meta("r2"))
    files = len(first.manifest["files"])
    assert await pull.once() == files
    assert await pull.once() == 0, "pulled again though nothing changed"
    await writer.commit(NS, TPL, images(tmp_path, "c"), meta("r3"))  # taken anew
    assert await pull.once() == files
    assert len(list((tmp_path / "cache").iterdir())) == 2 * files
    with pytest.raises(SmrError):
        Prepull(node, ("llm",))


async def test_a_cached_template_is_linked_for_criu_only_whole_and_verified(
        backend: Backend, tmp_path: Path) -> None:  # noqa: F811
    """A template the node holds is handed to CRIU as local files (linked
    from the cache); one not wholly cached is not; an altered image is
    caught, before CRIU for the small ones, by the task the restore awaits
    before the tree runs for the page images."""
    writer = CheckpointStore(backend, Codec(level=1, key=os.urandom(32)))
    src = images(tmp_path)
    gen = await writer.commit(NS, TPL, src, meta("r1"))
    cache = ObjectCache(tmp_path / "cache", 64 << 20)
    node = CheckpointStore(backend, writer.codec).with_cache(cache)
    assert await node.link_cached(gen, tmp_path / "none") is None, "linked what is not cached"
    await node.prepull(gen)
    pages_ok = await node.link_cached(gen, tmp_path / "one")
    assert pages_ok is not None
    await pages_ok
    assert (tmp_path / "one" / "pages-1.img").read_bytes() == \
        (src / "images" / "pages-1.img").read_bytes()
    _, _, entry = cached_entry(tmp_path / "cache", gen, "images/pages-1.img")
    alter(entry, 1000)
    pages_ok = await node.link_cached(gen, tmp_path / "two")
    assert pages_ok is not None
    with pytest.raises(TemporaryError) as e:
        await pages_ok
    assert "pages-1.img" in e.value.message and not entry.exists()
    assert await node.prepull(gen) == 1  # the page image again
    _, _, small = cached_entry(tmp_path / "cache", gen, "images/inventory.img")
    alter(small, 1)
    assert await node.link_cached(gen, tmp_path / "three") is None, "linked an altered copy"
    assert not (tmp_path / "three").exists() and not small.exists()
    assert cache.stats["corrupt"] == 2


async def test_a_failing_prepull_never_ends_the_agent(tmp_path: Path) -> None:
    """Storage away or a full disk: the pre-pull logs and tries again later;
    an exception out of its loop would end the agent (a worker ending)."""

    class Away:
        async def list(self, prefix: str) -> list[str]:
            raise OSError(28, "No space left on device")

    cache = ObjectCache(tmp_path / "cache", 1 << 20)
    node = CheckpointStore(Away(), Codec()).with_cache(cache)  # type: ignore[arg-type]
    assert await Prepull(node, ("default/llm",)).once() == 0
