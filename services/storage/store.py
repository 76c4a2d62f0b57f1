"""Checkpoint generations on top of a backend.

Commit order, so that a crash at any point leaves nothing half-visible:
claim the generation number (conditional create), upload the files, write the
manifest (conditional create), then move the latest pointer forward with a
conditional write. Readers only see generations that have a manifest.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from services.storage import layout
from services.storage.backend import Backend, Conflict, NotFound
from smr import contract
from smr.errors import PermanentError
from smr.messages import SCHEMA_VERSION, now

MAX_CLAIM_TRIES = 16


class CheckpointNotFound(PermanentError):
    code = "checkpoint-not-found"


class CheckpointCorrupt(PermanentError):
    code = "checkpoint-corrupt"


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


class CheckpointStore:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def commit(self, namespace: str, checkpoint_id: str, src: Path,
                     meta: dict[str, Any], *, on_bytes: Any = None) -> Generation:
        """Store every file under ``src`` as the next generation of ``checkpoint_id``."""
        gen = await self._claim(namespace, checkpoint_id, meta["request_id"])
        files, links, total = [], [], 0
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src).as_posix()
            if path.is_symlink():
                links.append({"path": rel, "target": os.readlink(path)})
                continue
            if not path.is_file():
                continue
            size, digest = await self.backend.put_file(
                layout.file_key(namespace, checkpoint_id, gen, rel), path)
            files.append({"path": rel, "size": size, "sha256": digest, "compression": "none"})
            total += size
            if on_bytes:
                on_bytes(total)
        manifest = {
            "schema_version": SCHEMA_VERSION, "namespace": namespace,
            "checkpoint_id": checkpoint_id, "generation": gen, "created_at": now(),
            "files": files, "symlinks": links, "size_bytes": total, **meta,
        }
        contract.validate("manifest", manifest)
        mkey = layout.manifest_key(namespace, checkpoint_id, gen)
        await self.backend.put_bytes(mkey, orjson.dumps(manifest, option=orjson.OPT_INDENT_2),
                                     if_none_match=True)
        await self._advance_latest(namespace, checkpoint_id, gen)
        return Generation(manifest, self.backend.url(layout.generation_prefix(
            namespace, checkpoint_id, gen)))

    async def _claim(self, namespace: str, checkpoint_id: str, request_id: str) -> int:
        gen = max(await self._numbers(namespace, checkpoint_id), default=0) + 1
        for _ in range(MAX_CLAIM_TRIES):
            try:
                await self.backend.put_bytes(layout.claim_key(namespace, checkpoint_id, gen),
                                             orjson.dumps({"request_id": request_id}),
                                             if_none_match=True)
                return gen
            except Conflict:
                gen += 1  # another writer took it: the next one
        raise Conflict(f"could not claim a generation of {checkpoint_id} after "
                       f"{MAX_CLAIM_TRIES} tries", hint="too many concurrent writers")

    async def _advance_latest(self, namespace: str, checkpoint_id: str, gen: int) -> None:
        key = layout.latest_key(namespace, checkpoint_id)
        body = orjson.dumps({"generation": gen})
        for _ in range(MAX_CLAIM_TRIES):
            try:
                data, etag = await self.backend.get_bytes(key)
            except NotFound:
                try:
                    await self.backend.put_bytes(key, body, if_none_match=True)
                    return
                except Conflict:
                    continue
            if orjson.loads(data)["generation"] >= gen:
                return  # only ever forward
            try:
                await self.backend.put_bytes(key, body, if_match=etag)
                return
            except Conflict:
                continue
        raise Conflict(f"latest pointer of {checkpoint_id} kept changing")

    async def _numbers(self, namespace: str, checkpoint_id: str) -> set[int]:
        keys = await self.backend.list(layout.checkpoint_prefix(namespace, checkpoint_id))
        return {g for k in keys if (g := layout.generation_of(k, namespace, checkpoint_id))}

    async def generations(self, namespace: str, checkpoint_id: str) -> list[Generation]:
        """Committed generations, oldest first."""
        keys = await self.backend.list(layout.checkpoint_prefix(namespace, checkpoint_id))
        out = []
        for k in keys:
            if k.endswith("/manifest.json"):
                gen = layout.generation_of(k, namespace, checkpoint_id)
                if gen:
                    out.append(await self.get(namespace, checkpoint_id, gen))
        return sorted(out, key=lambda g: g.number)

    async def latest(self, namespace: str, checkpoint_id: str) -> Generation | None:
        try:
            data, _ = await self.backend.get_bytes(layout.latest_key(namespace, checkpoint_id))
        except NotFound:
            return None
        return await self.get(namespace, checkpoint_id, orjson.loads(data)["generation"])

    async def get(self, namespace: str, checkpoint_id: str, generation: int) -> Generation:
        try:
            data, _ = await self.backend.get_bytes(
                layout.manifest_key(namespace, checkpoint_id, generation))
        except NotFound:
            raise CheckpointNotFound(
                f"checkpoint {checkpoint_id} has no generation {generation}",
                hint=f"`smr checkpoints {checkpoint_id}` lists the stored generations",
            ) from None
        manifest = orjson.loads(data)
        contract.validate("manifest", manifest)
        return Generation(manifest, self.backend.url(
            layout.generation_prefix(namespace, checkpoint_id, generation)))

    async def delete_checkpoint(self, namespace: str, checkpoint_id: str) -> int:
        """Remove every generation of ``checkpoint_id``; returns the objects removed."""
        keys = await self.backend.list(layout.checkpoint_prefix(namespace, checkpoint_id))
        await self.backend.delete(keys)
        return len(keys)

    async def fetch(self, gen: Generation, dst: Path, *, on_bytes: Any = None) -> None:
        """Download a generation into ``dst``, every file checked against its
        sha256 before it gets its final name: CRIU never reads an unverified byte."""
        m = gen.manifest
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        done = 0
        for f in m["files"]:
            final = dst / f["path"]
            part = final.with_name(final.name + ".unverified")
            key = layout.file_key(m["namespace"], m["checkpoint_id"], m["generation"], f["path"])
            try:
                size, digest = await self.backend.get_file(key, part)
            except NotFound:
                raise CheckpointCorrupt(
                    f"generation {m['generation']} of {m['checkpoint_id']} lacks {f['path']}",
                    hint="restore another generation (--generation N)") from None
            if digest != f["sha256"] or size != f["size"]:
                part.unlink(missing_ok=True)
                raise CheckpointCorrupt(
                    f"{f['path']} of {m['checkpoint_id']} generation {m['generation']} is "
                    f"corrupt: sha256 {digest[:16]}… expected {f['sha256'][:16]}…",
                    hint="restore another generation (--generation N); this one is unusable")
            part.rename(final)
            done += size
            if on_bytes:
                on_bytes(done)
        for link in m.get("symlinks", []):
            (dst / link["path"]).symlink_to(link["target"])
