"""Checkpoint generations on top of a backend.

Commit order, so that a crash at any point leaves nothing half-visible:
claim the generation number (conditional create), upload the files (streamed
while CRIU writes them, see ``upload``), write the manifest (conditional
create), then move the latest pointer forward with a conditional write.
Readers only see generations that have a manifest. A writer keeps its claim
alive while it works (a heartbeat in the claim, which GC ages it by), and
writes no manifest once its claim is gone. Each step is idempotent: a
conditional write whose answer was lost is recognised as ours by its
request id, and a commit run again for a request that already committed
returns that generation.

Manifests are read as hostile: paths that leave the directory they are
restored into, and files in clear on a node that holds a key, are refused
before anything is written.

Retention removes a generation manifest first, so it disappears at once;
garbage collection removes what crashed writers left: uploads never
completed and generations that never got a manifest, after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from services.storage import layout, order
from services.storage.backend import Backend, Conflict, NotFound, StorageError
from services.storage.buffers import keep_transfer_buffers
from services.storage.cache import CachedObject, ObjectCache
from services.storage.codec import Codec, DecodeError
from services.storage.download import PLAIN, Chunk, Diverged, Sink, decoded, plain
from services.storage.upload import Uploader
from smr import tracing
from smr.contract import schemas as contract
from smr.contract.errors import ContractError, PermanentError, TemporaryError
from smr.contract.messages import SCHEMA_VERSION, epoch, now
from smr.process.imagestream import Chunk as StreamChunk
from smr.process.imagestream import FileRange

log = logging.getLogger("smr.storage")

MAX_CLAIM_TRIES = 16
RECOMMIT_SCAN = 16  # newest generations looked at for a request's earlier commit
HEARTBEAT_S = 900.0  # SMR_GC_GRACE's default / 4; make_store passes the setting's
# A writer records in its claim how often it renews it (``renew_s``): GC takes
# it for dead only once it missed this many renewals, whatever GC's own
# grace (the storage Deployment's SMR_GC_GRACE may be shorter than a node's).
MISSED_RENEWALS = 4
RENEW_S_MAX = 86_400.0  # a claim naming more is read as this
FILES_AT_ONCE = 4  # fetched concurrently; each has its own ranged GETs ahead
# Decoded frames a streamed restore queues before CRIU asks for them, beside
# the download's own AHEAD_BYTES: the agent's memory, bounded.
EARLY_CHUNKS = 2
SCRATCH_FILES = 16  # written in parallel (see Scatter)


class CheckpointNotFound(PermanentError):
    code = "checkpoint-not-found"


class ScratchFull(TemporaryError):
    code = "scratch-full"


class CheckpointCorrupt(PermanentError):
    code = "checkpoint-corrupt"


class Unencrypted(PermanentError):
    code = "checkpoint-not-encrypted"


class ClaimLost(TemporaryError):
    code = "claim-lost"


@dataclass(frozen=True)
class Generation:
    manifest: dict[str, Any]
    location: str

    @property
    def number(self) -> int:
        return int(self.manifest["generation"])

    @property
    def size_bytes(self) -> int:
        return int(self.manifest["size_bytes"])


@dataclass
class GcReport:
    uploads_aborted: int = 0
    generations_removed: list[str] = field(default_factory=list)


class CheckpointStore:
    def __init__(self, backend: Backend, codec: Codec | None = None, *,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.backend = backend
        self.codec = codec or Codec()
        # How often a writer renews its claim: well under GC's grace.
        self.heartbeat_s = heartbeat_s
        keep_transfer_buffers()  # this process moves images: see buffers
        # inventory()'s manifests: written once (If-None-Match), so a generation
        # still listed still has the manifest read before.
        self._seen: dict[tuple[str, str, int], Generation] = {}
        self.cache: ObjectCache | None = None  # a node's template cache (with_cache)

    def with_cache(self, cache: ObjectCache) -> CheckpointStore:
        """This store, reading warm-start templates through ``cache`` (a node agent's)."""
        other = copy.copy(self)
        other.cache = cache
        return other

    async def close(self) -> None:
        await self.backend.close()

    async def commit(self, namespace: str, checkpoint_id: str, src: Path,
                     meta: dict[str, Any], *, writer: asyncio.Future[Any] | None = None,
                     on_bytes: Callable[[int], None] | None = None) -> Generation:
        """Store every file under ``src`` as the next generation of
        ``checkpoint_id``. ``writer``: the task (a CRIU dump) still writing
        into ``src``; its images are uploaded as they are written."""
        with tracing.tracer.start_as_current_span(
                "upload", attributes={"smr.checkpoint_id": checkpoint_id,
                                      "smr.storage": self.backend.url("")}) as span:
            gen = await self._commit(namespace, checkpoint_id, src, meta, writer, on_bytes)
            span.set_attribute("smr.generation", gen.number)
            span.set_attribute("smr.size_bytes", gen.size_bytes)
            span.set_attribute("smr.stored_bytes", gen.manifest["stored_bytes"])
            return gen

    async def _commit(self, namespace: str, checkpoint_id: str, src: Path,
                      meta: dict[str, Any], writer: asyncio.Future[Any] | None,
                      on_bytes: Callable[[int], None] | None) -> Generation:
        rid = meta["request_id"]
        keys = await self.backend.list(layout.checkpoint_prefix(namespace, checkpoint_id))
        earlier = await self._earlier(namespace, checkpoint_id, rid, keys)
        if isinstance(earlier, Generation):  # committed before: the same answer
            if writer is not None:
                await writer
            await self._advance_latest(namespace, checkpoint_id, earlier.manifest)
            return earlier
        if earlier is not None:  # claimed before, never committed: that number again
            gen, etag, claimed_at = earlier
            # Renewed at once, so that a GC does not reap it under us; if one
            # did already, a number of our own.
            if not (etag := await self._renew(namespace, checkpoint_id, gen, rid,
                                              (etag, claimed_at))):
                gen, etag, claimed_at = await self._claim(namespace, checkpoint_id, rid, keys)
        else:
            gen, etag, claimed_at = await self._claim(namespace, checkpoint_id, rid, keys)
        lost = asyncio.Event()
        beat = asyncio.create_task(self._keep_claim(namespace, checkpoint_id, gen, rid,
                                                    (etag, claimed_at), lost))
        try:
            codec = self.codec.for_namespace(namespace)
            files = await Uploader(self.backend, codec, on_bytes=on_bytes).upload_dir(
                src, lambda rel: layout.file_key(namespace, checkpoint_id, gen, rel), writer)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
        # The links once the writer is done: CRIU makes images/parent itself.
        links = [{"path": p.relative_to(src).as_posix(), "target": os.readlink(p)}
                 for p in sorted(src.rglob("*")) if p.is_symlink()]
        manifest = {
            "schema_version": SCHEMA_VERSION, "namespace": namespace,
            "checkpoint_id": checkpoint_id, "generation": gen, "created_at": now(),
            "files": files, "symlinks": links, "size_bytes": sum(f["size"] for f in files),
            "stored_bytes": sum(f["stored_size"] for f in files), **meta,
        }
        if parent := tracing.traceparent():
            manifest["traceparent"] = parent
        contract.validate("manifest", manifest)
        check_paths(manifest)
        await self._still_ours(namespace, checkpoint_id, gen, rid, lost)
        mkey = layout.manifest_key(namespace, checkpoint_id, gen)
        try:
            await self.backend.put_bytes(mkey, orjson.dumps(manifest, option=orjson.OPT_INDENT_2),
                                         if_none_match=True)
        except Conflict:
            # Ours, if an earlier try of this very PUT went through and only
            # its answer was lost (botocore's retry then meets 412).
            stored = await self.get(namespace, checkpoint_id, gen)
            if stored.manifest.get("request_id") != rid:
                raise
            manifest = stored.manifest
        await self._advance_latest(namespace, checkpoint_id, manifest)
        return Generation(manifest, self.backend.url(layout.generation_prefix(
            namespace, checkpoint_id, gen)))

    async def _earlier(self, namespace: str, checkpoint_id: str, rid: str, keys: list[str]
                       ) -> Generation | tuple[int, str, float] | None:
        """What an earlier run of request ``rid`` left among the newest
        generations: its committed Generation, or (number, etag, claimed_at)
        of a claim it never committed, or None."""
        names: dict[int, set[str]] = {}
        for k in keys:
            if (where := layout.parse(k)) and where[2]:
                names.setdefault(where[2], set()).add(where[3])
        newest = [g for g in sorted(names, reverse=True) if "claim" in names[g]][:RECOMMIT_SCAN]
        claims = await asyncio.gather(*(self._read_claim(namespace, checkpoint_id, g)
                                        for g in newest))
        for gen, (claim, etag) in zip(newest, claims, strict=True):
            if claim.get("request_id") != rid:
                continue
            if "manifest.json" not in names[gen]:
                return gen, etag, claimed(claim)
            with contextlib.suppress(CheckpointNotFound):  # torn by a crash: a new number
                return await self.get(namespace, checkpoint_id, gen)
        return None

    async def _read_claim(self, ns: str, ckpt: str, gen: int) -> tuple[dict[str, Any], str]:
        """A claim's content and etag; ({}, "") where it is gone or torn."""
        try:
            data, etag = await self.backend.get_bytes(layout.claim_key(ns, ckpt, gen))
            claim = orjson.loads(data)
        except (NotFound, orjson.JSONDecodeError):
            return {}, ""
        return (claim, etag) if isinstance(claim, dict) else ({}, "")

    async def _claim(self, namespace: str, checkpoint_id: str, request_id: str,
                     keys: list[str]) -> tuple[int, str, float]:
        gen = max((g for k in keys if (g := layout.generation_of(k, namespace, checkpoint_id))),
                  default=0) + 1
        for _ in range(MAX_CLAIM_TRIES):
            at = time.time()
            try:
                etag = await self.backend.put_bytes(
                    layout.claim_key(namespace, checkpoint_id, gen),
                    orjson.dumps({"request_id": request_id, "claimed_at": at, "alive_at": at,
                                  "renew_s": self.heartbeat_s}),
                    if_none_match=True)
                return gen, etag, at
            except Conflict:
                claim, etag = await self._read_claim(namespace, checkpoint_id, gen)
                if claim.get("request_id") == request_id:
                    return gen, etag, claimed(claim)  # ours: the answer to our PUT was lost
                gen += 1  # another writer took it: the next one
        raise Conflict(f"could not claim a generation of {checkpoint_id} after "
                       f"{MAX_CLAIM_TRIES} tries", hint="too many concurrent writers")

    async def committed(self, namespace: str, checkpoint_id: str,
                        request_id: str) -> Generation | None:
        """The generation a commit for ``request_id`` wrote, if any (a step's
        recovery asks, when its work directory may be gone)."""
        for gen in reversed(await self.generations(namespace, checkpoint_id)):
            if gen.manifest.get("request_id") == request_id:
                return gen
        return None

    async def ensure_latest(self, namespace: str, checkpoint_id: str, gen: Generation) -> bool:
        """Move ``latest`` to ``gen`` unless it is there or on a later state
        already: a commit whose writer died after its manifest is finished
        so. False: ``latest`` names a later dump; ``gen`` is superseded."""
        return await self._advance_latest(namespace, checkpoint_id, gen.manifest)

    async def _keep_claim(self, ns: str, ckpt: str, gen: int, rid: str,
                          held: tuple[str, float], lost: asyncio.Event) -> None:
        """Renew the claim's heartbeat (``alive_at``) every ``heartbeat_s``
        while the commit runs, so that GC never takes a slow writer for a
        dead one; sets ``lost`` if the claim was removed or taken."""
        etag, claimed_at = held
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                etag = await self._renew(ns, ckpt, gen, rid, (etag, claimed_at))
            except StorageError as e:  # the next beat may get through
                log.warning("could not renew the claim of %s generation %d: %s", ckpt, gen, e)
                continue
            if not etag:
                log.warning("the claim of %s generation %d is gone: a GC took its writer "
                            "for dead; this commit will not be written", ckpt, gen)
                lost.set()
                return

    async def _renew(self, ns: str, ckpt: str, gen: int, rid: str,
                     held: tuple[str, float]) -> str:
        """Write a fresh ``alive_at`` into our claim; its new etag, or "" if
        the claim is gone or another's."""
        etag, claimed_at = held
        body = orjson.dumps({"request_id": rid, "claimed_at": claimed_at,
                             "alive_at": time.time(), "renew_s": self.heartbeat_s})
        try:
            return await self.backend.put_bytes(layout.claim_key(ns, ckpt, gen), body,
                                                if_match=etag)
        except Conflict:
            claim, etag = await self._read_claim(ns, ckpt, gen)
            return etag if claim.get("request_id") == rid else ""  # a lost answer: ours

    async def _still_ours(self, ns: str, ckpt: str, gen: int, rid: str,
                          lost: asyncio.Event) -> None:
        """Right before the manifest: a claim reaped by GC may have taken
        uploads or files with it, so such a generation is never committed."""
        claim, _ = await self._read_claim(ns, ckpt, gen)
        if lost.is_set() or claim.get("request_id") != rid:
            raise ClaimLost(f"the claim of {ckpt} generation {gen} was removed while its "
                            "files went up (a garbage collection took the writer for dead); "
                            "nothing was committed",
                            hint="the step is retried; if this repeats, raise SMR_GC_GRACE")

    async def _advance_latest(self, namespace: str, checkpoint_id: str,
                              manifest: dict[str, Any]) -> bool:
        """Move ``latest`` to the generation of ``manifest`` unless it names
        one whose dump is later (see services/storage/order): only ever
        forward in time. True if ``latest`` names it now; False if it stays
        on a later state (the generation is superseded)."""
        gen = int(manifest["generation"])
        key = layout.latest_key(namespace, checkpoint_id)
        body = orjson.dumps({"generation": gen})
        for _ in range(MAX_CLAIM_TRIES):
            try:
                data, etag = await self.backend.get_bytes(key)
            except NotFound:
                try:
                    await self.backend.put_bytes(key, body, if_none_match=True)
                    return True
                except Conflict:
                    continue
            named = pointer(data)
            if named == gen:
                return True
            if named is not None and not await self._later_than(
                    namespace, checkpoint_id, manifest, named):
                return False
            try:  # a torn pointer is overwritten
                await self.backend.put_bytes(key, body, if_match=etag)
                return True
            except Conflict:
                continue  # moved meanwhile, or our own PUT whose answer was lost
        raise Conflict(f"latest pointer of {checkpoint_id} kept changing")

    async def _later_than(self, namespace: str, checkpoint_id: str, manifest: dict[str, Any],
                          named: int) -> bool:
        """Does ``manifest`` hold a later state than generation ``named``?
        One whose manifest is gone or torn compares by number, as ever."""
        try:
            other = (await self.get(namespace, checkpoint_id, named)).manifest
        except (CheckpointNotFound, CheckpointCorrupt):
            other = {"generation": named}
        return order.compare(manifest, other) > 0

    async def generations(self, namespace: str, checkpoint_id: str) -> list[Generation]:
        """Committed generations, oldest first."""
        keys = await self.backend.list(layout.checkpoint_prefix(namespace, checkpoint_id))
        out = []
        for k in keys:
            if k.endswith("/manifest.json"):
                gen = layout.generation_of(k, namespace, checkpoint_id)
                if gen:
                    with listed():
                        out.append(await self.get(namespace, checkpoint_id, gen))
        return sorted(out, key=lambda g: g.number)

    async def checkpoint_ids(self, namespace: str, prefix: str) -> list[str]:
        """The checkpoint ids of ``namespace`` that begin with ``prefix``."""
        ids = set()
        for key in await self.backend.list(f"{namespace}/{prefix}"):
            if (where := layout.parse(key)) and where[1].startswith(prefix):
                ids.add(where[1])
        return sorted(ids)

    async def inventory(self) -> dict[tuple[str, str], list[Generation]]:
        """Every committed generation in storage, by (namespace, checkpoint_id),
        oldest first: one listing, then each manifest not read by an earlier call."""
        found: dict[tuple[str, str], list[int]] = {}
        for key in await self.backend.list(""):
            where = layout.parse(key)
            if where and where[2] is not None and where[3] == "manifest.json":
                found.setdefault((where[0], where[1]), []).append(where[2])
        out: dict[tuple[str, str], list[Generation]] = {}
        seen: dict[tuple[str, str, int], Generation] = {}
        for (ns, ckpt), numbers in sorted(found.items()):
            gens = []
            for n in sorted(numbers):
                with listed():
                    gen = self._seen.get((ns, ckpt, n)) or await self.get(ns, ckpt, n)
                    seen[ns, ckpt, n] = gen
                    gens.append(gen)
            if gens:
                out[ns, ckpt] = gens
        self._seen = seen
        return out

    async def latest(self, namespace: str, checkpoint_id: str) -> Generation | None:
        try:
            data, _ = await self.backend.get_bytes(layout.latest_key(namespace, checkpoint_id))
        except NotFound:
            return None
        if (gen := pointer(data)) is not None:
            with contextlib.suppress(CheckpointNotFound):
                return await self.get(namespace, checkpoint_id, gen)
        # Torn by a crash (or naming a manifest that is): the newest that reads.
        log.warning("the latest pointer of %s is torn or names no readable generation "
                    "(%r); using the newest valid one", checkpoint_id, bytes(data[:64]))
        gens = order.newest_first(await self.generations(namespace, checkpoint_id))
        return gens[0] if gens else None

    async def pick(self, namespace: str, checkpoint_id: str, generation: int | None,
                   *, hint: str = "") -> Generation:
        """``generation`` of ``checkpoint_id``, or its latest when None (a restore's choice)."""
        if generation is not None:
            return await self.get(namespace, checkpoint_id, generation)
        gen = await self.latest(namespace, checkpoint_id)
        if gen is None:
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} has no stored generation",
                                     hint=hint)
        return gen

    async def get(self, namespace: str, checkpoint_id: str, generation: int) -> Generation:
        try:
            data, _ = await self.backend.get_bytes(
                layout.manifest_key(namespace, checkpoint_id, generation))
        except NotFound:
            raise CheckpointNotFound(
                f"checkpoint {checkpoint_id} has no generation {generation}",
                hint=f"`smr checkpoints {checkpoint_id}` lists the stored generations",
            ) from None
        where = f"the manifest of {checkpoint_id} generation {generation}"
        try:
            manifest = orjson.loads(data)
        except orjson.JSONDecodeError:
            # A manifest the local backend wrote before it fsynced (power
            # loss): its generation never finished committing.
            log.warning("%s is torn (%d bytes, not valid JSON): treated as not committed",
                        where, len(data))
            raise CheckpointNotFound(f"{where} is torn: the generation was never committed",
                                     hint="restore another generation (--generation N)"
                                     ) from None
        try:
            contract.validate("manifest", manifest)
        except ContractError as e:
            raise CheckpointCorrupt(f"{where} is not valid: {e.message}",
                                    hint="restore another generation (--generation N)") from None
        # Where it was read from is what it is: a manifest moved to another
        # namespace or checkpoint would have its files read from the old one.
        moved = {k: manifest.get(k) for k, v in (("namespace", namespace), (
            "checkpoint_id", checkpoint_id), ("generation", generation)) if manifest.get(k) != v}
        if moved:
            raise CheckpointCorrupt(
                f"{where} names another checkpoint ({moved}); nothing was restored from it",
                hint="the manifest was copied or altered: restore another generation "
                     "(--generation N)")
        check_paths(manifest)
        return Generation(manifest, self.backend.url(
            layout.generation_prefix(namespace, checkpoint_id, generation)))

    async def delete_checkpoint(self, namespace: str, checkpoint_id: str) -> int:
        """Remove every generation of ``checkpoint_id``; returns the objects removed."""
        keys = await self.backend.list(layout.checkpoint_prefix(namespace, checkpoint_id))
        await self.backend.delete(keys)
        return len(keys)

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

    async def prune(self, namespace: str, checkpoint_id: str, *, keep: int = 0,
                    max_age_s: float = 0, at: float | None = None) -> list[int]:
        """Retention: remove generations beyond the newest ``keep`` or older
        than ``max_age_s`` (0: no limit), ranked by when they were dumped
        (a superseded generation below the later one that supersedes it,
        whatever their numbers). The generation ``latest`` names is
        always kept, and a warm-start template is never pruned (a replica may
        be starting from any of its generations; it goes only when deleted).
        Returns the numbers removed."""
        if layout.is_template(checkpoint_id):
            return []
        at = time.time() if at is None else at
        latest = await self.latest(namespace, checkpoint_id)
        removed = []
        for rank, g in enumerate(order.newest_first(
                await self.generations(namespace, checkpoint_id))):
            if latest and g.number == latest.number:
                continue
            age = at - created_epoch(g)
            if (keep and rank >= keep) or (max_age_s and age > max_age_s):
                await self._remove_generation(namespace, checkpoint_id, g.number)
                removed.append(g.number)
        return sorted(removed)

    async def _remove_generation(self, namespace: str, checkpoint_id: str, gen: int) -> None:
        # The manifest first: the generation vanishes for readers in one step.
        await self.backend.delete([layout.manifest_key(namespace, checkpoint_id, gen)])
        keys = await self.backend.list(layout.generation_prefix(namespace, checkpoint_id, gen))
        await self.backend.delete(keys)

    async def gc(self, *, grace_s: float, at: float | None = None) -> GcReport:
        """Remove what crashed writers left behind, once older than ``grace_s``:
        uploads never completed, and generations that never got a manifest.
        A claimed generation's writer is dead only once it is silent for
        longer than ``grace_s`` and than MISSED_RENEWALS of the renewals its
        claim says it makes: a grace set shorter here than on the writer's
        node never aborts a live writer."""
        at = time.time() if at is None else at
        report = GcReport()
        claims: dict[tuple[str, str, int], float] = {}

        async def claimed_at(ns: str, ckpt: str, gen: int) -> float:
            if (ns, ckpt, gen) not in claims:
                claims[ns, ckpt, gen] = await self._alive_at(ns, ckpt, gen, grace_s)
            return claims[ns, ckpt, gen]

        for up in await self.backend.pending_uploads(""):
            old = at - up.started > grace_s
            where = layout.parse(up.key)
            if old and where and where[2] is not None:
                # The claim dates the writer too (some S3 servers misreport Initiated).
                old = at - await claimed_at(where[0], where[1], where[2]) > grace_s
            if old:
                await self.backend.abort_upload(up)
                report.uploads_aborted += 1
        gens: dict[tuple[str, str, int], set[str]] = {}
        for key in await self.backend.list(""):
            if (where := layout.parse(key)) and where[2] is not None:
                gens.setdefault((where[0], where[1], where[2]), set()).add(where[3])
        for (ns, ckpt, gen), names in sorted(gens.items()):
            if "manifest.json" in names:
                continue
            # Read again, not from the uploads' pass: a writer may have beaten since.
            if "claim" in names and at - await self._alive_at(ns, ckpt, gen, grace_s) \
                    <= grace_s:
                continue  # a writer may still be at work
            await self._remove_generation(ns, ckpt, gen)
            report.generations_removed.append(f"{ns}/{ckpt}/{gen}")
        if report.uploads_aborted or report.generations_removed:
            log.info("gc: aborted %d uploads, removed generations %s",
                     report.uploads_aborted, report.generations_removed)
        return report

    async def _alive_at(self, ns: str, ckpt: str, gen: int, grace_s: float) -> float:
        """When the claim's writer last showed it was alive (its heartbeat),
        moved later by what its renewals need beyond ``grace_s``: judged
        against ``grace_s``, it is dead only once silent for the longer of
        the two."""
        claim, _ = await self._read_claim(ns, ckpt, gen)
        try:
            alive = max(float(claim.get("alive_at", 0)), claimed(claim))
            renew = min(max(float(claim.get("renew_s", 0)), 0.0), RENEW_S_MAX)
        except (TypeError, ValueError):
            return 0.0
        return alive + max(MISSED_RENEWALS * renew - grace_s, 0.0)


@contextlib.contextmanager
def listed() -> Iterator[None]:
    """For listings: a generation retired since the listing, or torn, is not
    one; a corrupt manifest is left out (and logged), not fatal to the list."""
    try:
        yield
    except CheckpointNotFound:
        pass
    except CheckpointCorrupt as e:
        log.error("left out of the listing: %s", e.message)


def claimed(claim: dict[str, Any]) -> float:
    """When a claim was taken; 0 where it does not say."""
    try:
        return float(claim.get("claimed_at", 0))
    except (TypeError, ValueError):
        return 0.0


def pointer(data: bytes) -> int | None:
    """The generation a ``latest`` pointer names; None if it is torn."""
    try:
        gen = orjson.loads(data)["generation"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return None
    return gen if isinstance(gen, int) and gen > 0 else None


def check_paths(m: dict[str, Any]) -> None:
    """Refuse a manifest whose files or links would be written outside the
    directory it is restored into (by root): every path plain and relative,
    none under a link, and every link's target inside, through no link."""
    where = f"the manifest of {m.get('checkpoint_id')} generation {m.get('generation')}"
    links = {link["path"] for link in m.get("symlinks", [])}

    def bad(what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{where} {what}; nothing was restored from it",
                                 hint="the manifest was altered: restore another generation "
                                      "(--generation N)")

    seen: set[str] = set()
    for p in [f["path"] for f in m["files"]] + [link["path"] for link in m.get("symlinks", [])]:
        parts = p.split("/")
        if "\0" in p or any(c in ("", ".", "..") for c in parts):
            raise bad(f"names {p!r}, which is not a plain relative path")
        if p in seen:
            raise bad(f"names {p!r} twice")
        seen.add(p)
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise bad(f"puts {p!r} under a symlink")
    for link in m.get("symlinks", []):
        target = link["target"]
        if target.startswith("/") or "\0" in target:
            raise bad(f"links {link['path']!r} to {target!r}, outside the restore")
        at = link["path"].split("/")[:-1]
        for c in target.split("/"):
            if c in ("", "."):
                continue
            if c == "..":
                if not at:
                    raise bad(f"links {link['path']!r} to {target!r}, outside the restore")
                at.pop()
                continue
            at.append(c)
            if "/".join(at) in links:
                raise bad(f"links {link['path']!r} to {target!r}, through another link")


def created_epoch(g: Generation) -> float:
    return epoch(g.manifest["created_at"])


def streamable(manifest: dict[str, Any]) -> bool:
    """Can CRIU restore this generation from a stream? Not an incremental
    dump: its images link to a parent directory that CRIU reads by path."""
    return not manifest.get("symlinks")


SPACE_HINT = ("free space there, or point SMR_WORK_DIR (SMR_DATA_DIR for pods) at a larger "
              "disk; the restore is retried")


def out_of_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


class StreamedImages:
    """A generation's CRIU images for ``criu restore --stream``
    (smr.process.imagestream): the small ones fetched and verified into memory at
    once, in parallel; each page image streamed from storage, verified as
    ``read_file`` does, when CRIU asks for it."""

    def __init__(self, store: CheckpointStore, gen: Generation, subdir: str = "images",
                 scratch: Path | None = None) -> None:
        check_paths(gen.manifest)
        store.check_keys(gen.manifest)  # before a task starts
        self.store = store
        self.manifest = gen.manifest
        self.scratch = scratch
        prefix = subdir.rstrip("/") + "/"
        self.files = {f["path"][len(prefix):]: f for f in gen.manifest["files"]
                      if f["path"].startswith(prefix)}
        self._small = {name: asyncio.create_task(self._read(f))
                       for name, f in self.files.items() if not name.startswith("pages-")}
        # CRIU asks for page images last, after it has set the tree up: the
        # largest (most often the one that matters) starts downloading now,
        # into ``scratch`` (RAM-backed where it fits) from which the kernel
        # splices it into CRIU's pipe, or else a bounded queue ahead of CRIU.
        # The others start when asked for.
        pages = [n for n in self.files if n.startswith("pages-")]
        self._early: dict[str, asyncio.Queue[StreamChunk | BaseException | None]] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self._scatter: Scatter | None = None
        if pages:
            big = max(pages, key=lambda n: int(self.files[n]["size"]))
            if scratch:
                self._scatter = Scatter.open(scratch, self.files[big]["frames"])
            self._early[big] = asyncio.Queue(maxsize=0 if self._scatter else EARLY_CHUNKS)
            self._pumps.append(asyncio.create_task(self._pump(self.files[big],
                                                              self._early[big], self._scatter)))

    async def _read(self, f: dict[str, Any]) -> bytes:
        parts = [bytes(c) async for c in self.store.read_file(self.manifest, f)]
        return b"".join(parts)

    async def _pump(self, f: dict[str, Any], q: asyncio.Queue[StreamChunk | BaseException | None],
                    scatter: Scatter | None) -> None:
        try:
            async for piece in self.store.read_file(self.manifest, f, scatter):
                await q.put(piece)
            await q.put(None)
        except Exception as e:  # handed to whoever reads the image
            if out_of_space(e):
                e = ScratchFull(f"no space left in {self.scratch} for {f['path']} "
                                f"({f['size']} bytes)", hint=SPACE_HINT)
            await q.put(e)

    def __call__(self, name: str) -> AsyncIterator[StreamChunk] | None:
        if name not in self.files:
            return None
        if name in self._small:
            return self._from_memory(name)
        if q := self._early.pop(name, None):  # once: a second read starts over
            return self._from_queue(q)
        return self.store.read_file(self.manifest, self.files[name])

    @staticmethod
    async def _from_queue(q: asyncio.Queue[StreamChunk | BaseException | None]
                          ) -> AsyncIterator[StreamChunk]:
        while (item := await q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def _from_memory(self, name: str) -> AsyncIterator[Chunk]:
        yield await self._small[name]

    async def aclose(self) -> None:
        tasks = [*self._small.values(), *self._pumps]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._scatter:
            # Freeing scratch files of many GiB takes a second: not on the
            # way to the process running again.
            asyncio.get_running_loop().run_in_executor(None, self._scatter.close)
            self._scatter = None


class Scatter:
    """A sink (see download.decoded) that writes frame i, in the thread that
    decoded it, into file i % len(fds) after the earlier frames there, and
    returns the FileRange it wrote. One file for a fetch; SCRATCH_FILES for a
    page image staged on its way to CRIU, because tmpfs takes one writer per
    file at a time."""

    def __init__(self, fds: list[int], frames: list[list[int]]) -> None:
        self.fds = fds
        self.at: list[int] = []
        ends = [0] * len(fds)
        for i, (_, raw, _) in enumerate(frames):
            self.at.append(ends[i % len(fds)])
            ends[i % len(fds)] += raw
        # A decoding thread outlives the cancel of the task that awaited it:
        # the files close only once no thread writes, or a write could land
        # in whatever reuses the descriptor.
        self._writers = threading.Condition()
        self._busy = 0
        self._closed = False

    @classmethod
    def open(cls, where: Path, frames: list[list[int]]) -> Scatter | None:
        fds: list[int] = []
        try:
            while len(fds) < SCRATCH_FILES:
                fds.append(os.open(where, os.O_RDWR | os.O_TMPFILE, 0o600))
        except OSError as e:  # a filesystem without O_TMPFILE: through memory
            log.info("no scratch file in %s (%s); streaming from memory", where, e)
            _close_all(fds)
            return None
        return cls(fds, frames)

    def __call__(self, i: int, frame: Chunk) -> FileRange:
        with self._writers:
            if self._closed:
                raise OSError(errno.EBADF, "the scratch files were closed")
            self._busy += 1
        try:
            fd = self.fds[i % len(self.fds)]
            _pwrite_all(fd, frame, self.at[i])
        finally:
            with self._writers:
                self._busy -= 1
                self._writers.notify_all()
        return FileRange(fd, self.at[i], len(frame))

    def close(self) -> None:
        """Blocks until no thread writes, then closes the files."""
        with self._writers:
            self._closed = True
            self._writers.wait_for(lambda: self._busy == 0)
        _close_all(self.fds)


def _pwrite_all(fd: int, data: Chunk, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)

