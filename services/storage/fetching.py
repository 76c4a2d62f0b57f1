"""Reading a generation's files: onto disk, into a sink, through a node's
template cache, or ahead of a restore (prepull), each verified as read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from services.storage import layout
from services.storage.backend import NotFound
from services.storage.cache import CachedObject
from services.storage.codec import Codec, DecodeError
from services.storage.download import PLAIN, Diverged, Sink, decoded, plain
from services.storage.generation import (
    SPACE_HINT,
    CheckpointCorrupt,
    Generation,
    ScratchFull,
    Unencrypted,
    check_paths,
    out_of_space,
)
from services.storage.scatter import Scatter
from smr import tracing
from smr.contract.errors import TemporaryError

log = logging.getLogger("smr.storage")


FILES_AT_ONCE = 4  # fetched concurrently; each has its own ranged GETs ahead


class Fetching:
    """The file reads of CheckpointStore (store.py)."""

    async def fetch(self, gen: Generation, dst: Path, *,
                    on_bytes: Callable[[int], None] | None = None,
                    only: Callable[[str], bool] | None = None) -> None:
        """Download a generation into ``dst``, every file checked against its
        sha256 before it gets its final name: CRIU never reads an unverified byte.
        ``only``: the files (by path) to fetch; all by default."""
        with tracing.tracer.start_as_current_span(
                "download", attributes={"smr.checkpoint_id": gen.manifest["checkpoint_id"],
                                        "smr.generation": gen.number,
                                        "smr.size_bytes": gen.size_bytes}):
            await self._fetch(gen, dst, on_bytes, only)

    async def _fetch(self, gen: Generation, dst: Path,
                     on_bytes: Callable[[int], None] | None,
                     only: Callable[[str], bool] | None = None) -> None:
        m = gen.manifest
        check_paths(m)  # before anything is written
        self.check_keys(m)  # before any byte is fetched
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        done = 0
        slots = asyncio.Semaphore(FILES_AT_ONCE)

        def count(n: int) -> None:
            nonlocal done
            done += n
            if on_bytes:
                on_bytes(done)

        async def one(f: dict[str, Any]) -> None:
            async with slots:
                await self._fetch_file(m, f, dst, count)

        tasks = [asyncio.create_task(one(f)) for f in m["files"] if not only or only(f["path"])]
        try:
            await asyncio.gather(*tasks)
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if out_of_space(e):
                raise ScratchFull(f"no space left in {dst.parent} for the {gen.size_bytes} "
                                  f"bytes of generation {gen.number}", hint=SPACE_HINT) from None
            raise
        for link in m.get("symlinks", []):
            (dst / link["path"]).symlink_to(link["target"])

    async def _fetch_file(self, m: dict[str, Any], f: dict[str, Any], dst: Path,
                          count: Callable[[int], None]) -> None:
        final = dst / f["path"]
        part = final.with_name(final.name + ".unverified")
        part.parent.mkdir(parents=True, exist_ok=True)
        # Each frame is written where it belongs by the thread that decoded it.
        out = Scatter([os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)],
                      f["frames"])
        try:
            try:
                async with contextlib.aclosing(self.read_file(m, f, out)) as pieces:
                    async for piece in pieces:
                        count(piece.length)
            finally:
                await asyncio.to_thread(out.close)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        part.rename(final)

    def check_keys(self, m: dict[str, Any]) -> None:
        """Can this node read manifest ``m``'s files as their manifest says?
        A node holding a key takes nothing in clear: a manifest that says
        otherwise was altered, or written where no key was set."""
        codec = self.codec.for_namespace(m["namespace"])
        for f in m["files"]:
            if f.get("encryption"):
                codec.check_key(f["encryption"])
            elif self.codec.key:
                raise Unencrypted(
                    f"{f['path']} of {m.get('checkpoint_id')} generation {m.get('generation')} "
                    "is stored in clear, and this node holds an encryption key",
                    hint="a node with a key restores only encrypted checkpoints: the manifest "
                         "was altered, or written by a node without SMR_ENCRYPTION_KEY")

    async def read_file(self, m: dict[str, Any], f: dict[str, Any],
                        sink: Sink | None = None) -> AsyncIterator[Any]:
        """The decoded bytes of file ``f`` of manifest ``m``, in order; the
        last chunk only once the whole file matched its sha256 (see download,
        also for ``sink``)."""
        self.check_keys({**m, "files": [f]})
        key = layout.file_key(m["namespace"], m["checkpoint_id"], m["generation"], f["path"])
        where = f"{f['path']} of {m['checkpoint_id']} generation {m['generation']}"
        codec = self.codec.for_namespace(m["namespace"])
        try:
            if self.cache is None or not layout.is_template(m["checkpoint_id"]):
                async with contextlib.aclosing(decoded(self.backend, codec, key, f,
                                                       sink)) as chunks:
                    async for data in chunks:
                        yield data
                return
            async with contextlib.aclosing(self._read_cached(key, f, codec, sink,
                                                             where)) as chunks:
                async for data in chunks:
                    yield data
        except NotFound:
            raise CheckpointCorrupt(f"{where} is missing from storage",
                                    hint="restore another generation (--generation N)") from None
        except DecodeError as e:
            raise CheckpointCorrupt(f"{where} is corrupt: {e.message}", hint=e.hint) from None

    async def _read_cached(self, key: str, f: dict[str, Any], codec: Codec, sink: Sink | None,
                           where: str) -> AsyncIterator[Any]:
        """A template's object through this node's cache (services/storage/cache),
        which holds it decoded; its sha256 is checked as on any read. A cached
        copy that does not verify (altered or torn on the node's disk) is
        dropped and the object is read from storage once more, filling the
        cache again; only bytes that storage itself holds wrong fail the read."""
        assert self.cache is not None
        handed: list[bytes] = []
        skip: list[bytes] = []
        for attempt in (1, 2):
            cached = await self._cached(key, f, codec)
            try:
                # The second time, what the first read handed on is checked,
                # not handed on again.
                reader = decoded(cached, PLAIN, key, plain(f), sink, handed=handed, skip=skip) \
                    if cached is not None else \
                    decoded(self.backend, codec, key, f, sink, handed=handed, skip=skip)
                async with contextlib.aclosing(reader) as chunks:
                    async for data in chunks:
                        yield data
                return
            except Diverged:
                raise TemporaryError(
                    f"{where}: the node's template cache held an altered copy, and part of it "
                    "was already handed on before that showed", code="template-cache-corrupt",
                    hint="the copy was replaced by storage's; the restore is tried again"
                ) from None
            except DecodeError as e:
                if cached is None:
                    raise
                self.cache.forget(key, f)
                if attempt == 2:
                    raise
                log.warning("%s: the node's cached copy is corrupt (%s); removed, read from "
                            "storage again", where, e.message)
                skip, handed = handed, []
            finally:
                if cached is not None:
                    cached.close()

    async def _cached(self, key: str, f: dict[str, Any], codec: Codec) -> CachedObject | None:
        """The object's decoded copy in this node's cache, read from storage
        (decoded and verified) into it first if missing; a copy whose stored
        bytes do not verify never enters it (CheckpointCorrupt)."""
        assert self.cache is not None

        async def fill(fd: int) -> None:
            out = Scatter([fd], f["frames"])
            async with contextlib.aclosing(decoded(self.backend, codec, key, f, out)) as pieces:
                async for _ in pieces:
                    pass

        try:
            return await self.cache.open(key, f, fill)
        except DecodeError as e:
            raise CheckpointCorrupt(f"{f['path']} ({key}) is corrupt in storage: {e.message}",
                                    hint=e.hint) from None

    async def link_cached(self, gen: Generation, dst: Path, prefix: str = "images/"
                          ) -> asyncio.Task[None] | None:
        """Every file of template generation ``gen`` under ``prefix``, linked
        from this node's cache into ``dst`` (its path less ``prefix``), so that
        CRIU reads them as local files. None, with nothing left in ``dst``,
        unless all of them are cached on this file system and those that are
        not page images verify (sha256 of the inode linked). The page images
        are verified by the task returned, so that CRIU may read them
        meanwhile: the caller awaits it before the restored tree runs (as a
        streamed restore's last range waits for its sha256). The task raises
        TemporaryError if one was altered (its entry removed: the retry reads
        storage)."""
        m = gen.manifest
        if self.cache is None or not layout.is_template(m["checkpoint_id"]):
            return None
        check_paths(m)
        self.check_keys(m)
        cache = self.cache
        files = [f for f in m["files"] if f["path"].startswith(prefix)]
        keys = {f["path"]: layout.file_key(m["namespace"], m["checkpoint_id"], m["generation"],
                                           f["path"]) for f in files}
        if not files or not all(cache.has(keys[f["path"]], f) for f in files):
            return None
        slots = asyncio.Semaphore(FILES_AT_ONCE)

        def at(f: dict[str, Any]) -> Path:
            return dst / f["path"][len(prefix):]

        async def verify(f: dict[str, Any]) -> None:
            key = keys[f["path"]]
            async with slots:
                linked = CachedObject(at(f))
                try:
                    reader = decoded(linked, PLAIN, key, plain(f))
                    async with contextlib.aclosing(reader) as chunks:
                        async for _ in chunks:
                            pass
                except DecodeError as e:
                    cache.forget(key, f)
                    raise DecodeError(f"{f['path']}: {e.message}", hint=e.hint) from None
                finally:
                    linked.close()

        pages = [f for f in files if Path(f["path"]).name.startswith("pages-")]
        try:
            for f in files:
                at(f).parent.mkdir(parents=True, exist_ok=True)
                os.link(cache.path_of(keys[f["path"]], f), at(f))
            await asyncio.gather(*(verify(f) for f in files if f not in pages))
        except (OSError, DecodeError) as e:
            # Evicted meanwhile, another file system, or altered: the files
            # are read as before (an altered entry is caught and read again).
            log.info("template %s: not restored from the node's cached files (%s)",
                     m["checkpoint_id"], getattr(e, "message", e))
            await asyncio.to_thread(shutil.rmtree, dst, True)
            return None
        cache.stats["hits"] += len(files)
        cache.stats["linked"] += 1

        async def verify_pages() -> None:
            try:
                await asyncio.gather(*(verify(f) for f in pages))
            except DecodeError as e:
                raise TemporaryError(
                    f"a page image of {m['checkpoint_id']} generation {m['generation']} in "
                    f"this node's template cache was altered ({e.message})",
                    code="template-cache-corrupt",
                    hint="the copy was removed; the restore is tried again from storage"
                ) from None

        return asyncio.create_task(verify_pages())

    async def prepull(self, gen: Generation) -> int:
        """Every object of template generation ``gen`` into this node's cache
        (an image pre-pull: the replicas that start here later read local
        disk); the number of objects it had to download."""
        if self.cache is None:
            return 0
        m = gen.manifest
        check_paths(m)
        self.check_keys(m)
        codec = self.codec.for_namespace(m["namespace"])
        slots = asyncio.Semaphore(FILES_AT_ONCE)
        before = self.cache.stats["downloads"]

        async def one(f: dict[str, Any]) -> None:
            key = layout.file_key(m["namespace"], m["checkpoint_id"], m["generation"], f["path"])
            async with slots:
                if not self.cache.has(key, f):  # type: ignore[union-attr]
                    cached = await self._cached(key, f, codec)
                    if cached is not None:
                        cached.close()

        await asyncio.gather(*(one(f) for f in m["files"]))
        return self.cache.stats["downloads"] - before
