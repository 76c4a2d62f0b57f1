"""A generation's images for ``criu restore --stream``: small ones read
into memory at once, page images streamed from storage as CRIU asks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.storage.download import Chunk
from services.storage.generation import (
    SPACE_HINT,
    Generation,
    ScratchFull,
    check_paths,
    out_of_space,
)
from services.storage.scatter import Scatter
from smr.process.imagestream import Chunk as StreamChunk

if TYPE_CHECKING:  # the store imports nothing of this module: no cycle at run time
    from services.storage.store import CheckpointStore

# Decoded frames a streamed restore queues before CRIU asks for them, beside
# the download's own AHEAD_BYTES: the agent's memory, bounded.
EARLY_CHUNKS = 2


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
