"""Reading what is stored: a checkpoint's generations, its latest, the
whole inventory, and one generation picked by number or as the latest."""

from __future__ import annotations

import contextlib
import logging

import orjson

from services.storage import layout, order
from services.storage.backend import NotFound
from services.storage.commit import pointer
from services.storage.generation import (
    CheckpointCorrupt,
    CheckpointNotFound,
    Generation,
    check_paths,
    listed,
)
from smr.contract import schemas as contract
from smr.contract.errors import ContractError

log = logging.getLogger("smr.storage")


class Listing:
    """The listing and lookup of CheckpointStore (store.py)."""

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
