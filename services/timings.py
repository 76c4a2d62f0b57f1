"""How long each workload's checkpoint takes, measured: the node agent records,
after each checkpoint it stores, the seconds from the workload's freeze to the
checkpoint stored (KV bucket ``smr-timings``, key ``<namespace>/<checkpoint
id>``, the last one only). The webhook reads them when a pod is created, to
make its grace period long enough for a final checkpoint
(services/webhook/admission). Both sides are best effort: a checkpoint never
fails for its record, and a pod is never held up for a read.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

log = logging.getLogger("smr.timings")

READ_TIMEOUT_S = 1.0  # within the API server's 5 s call to the webhook


def key(namespace: str, checkpoint_id: str) -> str:
    # Both are subject-safe (a DNS label; schemas/common.json's checkpoint_id).
    return f"{namespace}/{checkpoint_id}"


async def record(kv: KeyValue, namespace: str, checkpoint_id: str, seconds: float,
                 generation: int) -> None:
    try:
        await asyncio.wait_for(kv.put(key(namespace, checkpoint_id), orjson.dumps(
            {"seconds": round(seconds, 3), "generation": generation, "at": time.time()})),
            READ_TIMEOUT_S * 5)
    except Exception as e:  # NATS away: the next checkpoint records it
        log.warning("cannot record the checkpoint time of %s/%s: %s", namespace,
                    checkpoint_id, e)


async def slowest(kv: KeyValue, namespace: str, checkpoint_ids: list[str]) -> float | None:
    """The longest last measured time among ``checkpoint_ids`` (a pod's
    containers are checkpointed side by side), or None when none is known."""
    async def one(cid: str) -> float | None:
        try:
            entry = await kv.get(key(namespace, cid))
            return float(orjson.loads(entry.value or b"{}")["seconds"])
        except KeyNotFoundError:
            return None

    try:
        found = await asyncio.wait_for(
            asyncio.gather(*(one(c) for c in checkpoint_ids)), READ_TIMEOUT_S)
    except Exception as e:  # NATS away or slow: the setting alone decides
        log.warning("cannot read the checkpoint times of %s %s: %s", namespace,
                    checkpoint_ids, e)
        return None
    known = [s for s in found if s is not None]
    return max(known) if known else None
