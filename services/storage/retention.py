"""Retention and garbage collection: prune to the newest N generations,
delete a checkpoint, and remove what crashed writers left (uploads never
completed, generations that never got a manifest) after a grace period."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.storage import layout, order
from services.storage.claims import MISSED_RENEWALS, RENEW_S_MAX, claimed
from services.storage.generation import created_epoch

log = logging.getLogger("smr.storage")


@dataclass
class GcReport:
    uploads_aborted: int = 0
    generations_removed: list[str] = field(default_factory=list)


class Retention:
    """Retention and GC of CheckpointStore (store.py)."""

    async def delete_checkpoint(self, namespace: str, checkpoint_id: str) -> int:
        """Remove every generation of ``checkpoint_id``; returns the objects removed."""
        keys = await self.backend.list(layout.checkpoint_prefix(namespace, checkpoint_id))
        await self.backend.delete(keys)
        return len(keys)

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
