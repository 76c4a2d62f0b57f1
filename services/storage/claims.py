"""Claims and their leases: a writer claims a generation number with a
conditional create, renews its claim while it works (its heartbeat, which GC
ages it by) and checks that it still holds it before it writes a manifest."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from services.storage import layout
from services.storage.backend import Conflict, NotFound, StorageError
from smr.contract.errors import TemporaryError

log = logging.getLogger("smr.storage")


MAX_CLAIM_TRIES = 16
HEARTBEAT_S = 900.0  # SMR_GC_GRACE's default / 4; make_store passes the setting's
# A writer records in its claim how often it renews it (``renew_s``): GC takes
# it for dead only once it missed this many renewals, whatever GC's own
# grace (the storage Deployment's SMR_GC_GRACE may be shorter than a node's).
MISSED_RENEWALS = 4
RENEW_S_MAX = 86_400.0  # a claim naming more is read as this


class ClaimLost(TemporaryError):
    code = "claim-lost"


def claimed(claim: dict[str, Any]) -> float:
    """When a claim was taken; 0 where it does not say."""
    try:
        return float(claim.get("claimed_at", 0))
    except (TypeError, ValueError):
        return 0.0


class Claims:
    """The claim steps of CheckpointStore (store.py)."""

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
                       f"{MAX_CLAIM_TRIES} tries",
                       hint="too many writers of this checkpoint id at once; the step is "
                            "retried. Jobs that should not share it need checkpoint ids "
                            "of their own")

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
