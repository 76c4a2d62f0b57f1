"""The commit of a generation: claim, upload, manifest, then the latest
pointer moved forward, each step idempotent (a commit run again for a
request that already committed returns that generation)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from services.storage import layout, order
from services.storage.backend import Conflict, NotFound
from services.storage.claims import MAX_CLAIM_TRIES, claimed
from services.storage.generation import (
    CheckpointCorrupt,
    CheckpointNotFound,
    Generation,
    check_paths,
)
from services.storage.upload import Uploader
from smr import tracing
from smr.contract import schemas as contract
from smr.contract.messages import SCHEMA_VERSION, now

RECOMMIT_SCAN = 16  # newest generations looked at for a request's earlier commit


def pointer(data: bytes) -> int | None:
    """The generation a ``latest`` pointer names; None if it is torn."""
    try:
        gen = orjson.loads(data)["generation"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return None
    return gen if isinstance(gen, int) and gen > 0 else None


class Commit:
    """The commit steps of CheckpointStore (store.py)."""

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

    async def committed(self, namespace: str, checkpoint_id: str,
                        request_id: str) -> Generation | None:
        """The generation a commit for ``request_id`` wrote, if any (a step's
        recovery asks, when its work directory may be gone): also one that a
        final request took over, which names it ``final_request_id``."""
        for gen in reversed(await self.generations(namespace, checkpoint_id)):
            if request_id in (gen.manifest.get("request_id"),
                              gen.manifest.get("final_request_id")):
                return gen
        return None

    async def ensure_latest(self, namespace: str, checkpoint_id: str, gen: Generation) -> bool:
        """Move ``latest`` to ``gen`` unless it is there or on a later state
        already: a commit whose writer died after its manifest is finished
        so. False: ``latest`` names a later dump; ``gen`` is superseded."""
        return await self._advance_latest(namespace, checkpoint_id, gen.manifest)

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
        raise Conflict(f"latest pointer of {checkpoint_id} kept changing",
                       hint="other writers of this checkpoint id move it at the same time; "
                            "the step is retried. Jobs that should not share it need "
                            "checkpoint ids of their own")

    async def _later_than(self, namespace: str, checkpoint_id: str, manifest: dict[str, Any],
                          named: int) -> bool:
        """Does ``manifest`` hold a later state than generation ``named``?
        One whose manifest is gone or torn compares by number, as ever."""
        try:
            other = (await self.get(namespace, checkpoint_id, named)).manifest
        except (CheckpointNotFound, CheckpointCorrupt):
            other = {"generation": named}
        return order.compare(manifest, other) > 0
