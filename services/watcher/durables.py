"""Each Node's request durables, made by the watcher (a node's NATS user may
create no consumer: docs/security.md). For every Node it knows, the durable
pull consumers of its ckpt.requested and restore.requested requests and their
max-deliveries durables, with the node agent's windows
(services/checkpointer/admission.py: ``agent_windows``); made once a Node is
seen, and again whenever one is missing (an operator's ``nats consumer rm``, a
stream made again): the agent waits for them meanwhile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping

from smr.aio import cancelling, wait_event
from smr.bus import STREAM_EXHAUSTED, STREAM_REQUESTS, Bus
from smr.bus.topology import exhausted_consumer, request_consumer

log = logging.getLogger("smr.watcher")

RECONCILE_S = 10.0  # between looks for a missing durable (two CONSUMER.NAMES requests)


class NodeConsumers:
    def __init__(self, bus: Bus, nodes: Callable[[], Iterable[str]],
                 windows: Mapping[str, int], *, every_s: float | None = None) -> None:
        self.bus = bus
        self.nodes = nodes
        self.windows = dict(windows)
        self.every_s = every_s or RECONCILE_S
        self._made: set[str] = set()  # nodes whose durables this process made
        self._wake = asyncio.Event()

    def seen(self, node: str) -> None:
        """A Node added or changed: one not made yet is made now."""
        if node not in self._made:
            self._wake.set()

    def durables(self, node: str) -> set[str]:
        names = {request_consumer(k, node, self.bus.config).durable_name or ""
                 for k in self.windows}
        return names | {exhausted_consumer(n, self.bus.config).durable_name or ""
                        for n in names}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.reconcile()
            except Exception as e:
                if cancelling():
                    raise
                log.warning("watcher: making the nodes' request consumers failed (%s: %s); "
                            "retrying in %.0fs", type(e).__name__, e, self.every_s)
            await wait_event(self._wake, self.every_s)

    async def reconcile(self) -> None:
        have = (await self.bus.consumer_names(STREAM_REQUESTS)
                | await self.bus.consumer_names(STREAM_EXHAUSTED))
        for node in list(self.nodes()):
            # Made once by each watcher (to its settings, should they have
            # changed), then only when one is missing.
            if node in self._made and self.durables(node) <= have:
                continue
            try:
                await self.bus.make_node_consumers(node, self.windows)
            except Exception as e:
                # One node's durable JetStream refuses to update (made by
                # hand with other settings) must not keep the next Nodes'
                # from being made: their agents wait, not ready, meanwhile.
                if cancelling():
                    raise
                log.warning("watcher: making node %s's request consumers failed (%s: %s); "
                            "retrying in %.0fs. A durable made with other settings is "
                            "deleted with `nats consumer rm`, and made again here",
                            node, type(e).__name__, e, self.every_s)
                continue
            if node in self._made:
                log.warning("watcher: node %s's request consumers were missing (deleted, or "
                            "their stream made again): made again", node)
            self._made.add(node)
