"""Template pre-pull: the templates a node is told to hold (SMR_TEMPLATE_PREPULL)
read into its template cache before any replica of them starts there, as an
image pre-pull; a replica then restores from the node's disk instead of
waiting on storage (docs/warm-start.md).

Storage is looked at every INTERVAL_S for each named template's containers
(``template_<name>.<container>``) and their latest generation: one taken anew
is pulled when it appears. What is pulled is read and verified as any read
(CheckpointStore.prepull, services/storage/fetching.py); a pull that fails is logged and tried at
the next look. The cache's bound and eviction apply as to any entry.
"""

from __future__ import annotations

import asyncio
import logging

from services.storage import layout
from services.storage.store import CheckpointStore
from smr.aio import wait_event
from smr.contract.errors import SmrError

log = logging.getLogger("smr.agent")

INTERVAL_S = 30.0


class Prepull:
    def __init__(self, store: CheckpointStore, templates: tuple[str, ...]) -> None:
        self.store = store
        self.templates = [parse(t) for t in templates]
        self.pulled: dict[tuple[str, str], int] = {}  # (namespace, checkpoint id) → generation

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` (as the agent's other loops: ending sooner would
        read as a worker ending on its own)."""
        while not stop.is_set():
            if self.templates:
                await self.once()
            await wait_event(stop, INTERVAL_S)

    async def once(self) -> int:
        """Pull what is new; the number of objects downloaded."""
        got = 0
        for ns, name in self.templates:
            try:
                ids = await self.store.checkpoint_ids(ns, layout.template_id(name, ""))
                for ckpt in ids:
                    gen = await self.store.latest(ns, ckpt)
                    if gen is None or self.pulled.get((ns, ckpt)) == gen.number:
                        continue
                    n = await self.store.prepull(gen)
                    self.pulled[ns, ckpt] = gen.number
                    got += n
                    log.info("template pre-pull: %s/%s generation %d on this node "
                             "(%d objects downloaded)", ns, ckpt, gen.number, n)
            except Exception as e:  # storage away, a full disk: never the agent's end
                log.warning("template pre-pull of %s/%s failed (tried again in %gs): %s",
                            ns, name, INTERVAL_S, getattr(e, "message", None) or repr(e))
        return got


def parse(value: str) -> tuple[str, str]:
    ns, sep, name = value.partition("/")
    if not sep or not ns or not name:
        raise SmrError(f"SMR_TEMPLATE_PREPULL: {value!r} is not namespace/name",
                       code="config", hint="e.g. SMR_TEMPLATE_PREPULL=default/llama-8b")
    return ns, name
