"""Checkpoint generations on top of a backend: the store, composed of its parts.

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

Each part is a module of its own: ``commit`` (claim, upload, manifest,
latest), ``claims`` (claims and their leases), ``listing`` (generations,
latest, pick), ``fetching`` (a generation's files onto disk or into a sink),
``streamed`` (images for ``criu restore --stream``), ``retention`` (prune,
GC) and ``generation`` (what a generation is, and a hostile manifest refused).
"""

from __future__ import annotations

import copy

from services.storage.backend import Backend
from services.storage.buffers import keep_transfer_buffers
from services.storage.cache import ObjectCache
from services.storage.claims import HEARTBEAT_S, Claims
from services.storage.codec import Codec
from services.storage.commit import Commit
from services.storage.fetching import Fetching
from services.storage.generation import Generation
from services.storage.listing import Listing
from services.storage.retention import Retention


class CheckpointStore(Claims, Commit, Listing, Fetching, Retention):
    """Checkpoint generations on a backend: the commit (commit.py), the claims
    and their leases (claims.py), listing and reading (listing.py,
    fetching.py), retention and GC (retention.py), over one backend and codec."""

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
