"""Request/reply: a caller waits for a step's result through the step-state
KV bucket (the result is stored there before it is published, so a waiter
that starts late still sees it), and asks the storage service over core NATS."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import nats
import orjson
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from smr import tracing
from smr.bus.topology import RESULT_OF
from smr.errors import TemporaryError
from smr.messages import CkptDone, RestoreDone, StorageQuery, StorageReply
from smr.retry import retry_nats


async def wait_result(steps: KeyValue, request_id: str, kind: str, *,
                      timeout: float | None = None,
                      on_progress: Callable[[dict[str, Any]], None] | None = None
                      ) -> CkptDone | RestoreDone:
    """Wait until the step of ``request_id`` has a result; ``on_progress``
    sees each running state on the way."""
    # Retried: the watch's consumer is created on the bucket's stream, which a
    # cluster may be electing a new leader for (a server just lost).
    async for attempt in retry_nats():
        with attempt:
            watcher = await steps.watch(request_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no result for request {request_id} within {timeout}s")
            try:
                e = await watcher.updates(timeout=min(left or 1.0, 1.0))
            except nats.errors.TimeoutError:
                continue
            if e is None or not e.value:
                continue
            st = orjson.loads(e.value)
            if st.get("state") in ("done", "failed"):
                return RESULT_OF[kind].from_dict(st["result"])
            if on_progress:
                on_progress(st)
    finally:
        await watcher.stop()


async def query(nc: NATS, what: str, q: StorageQuery, *, timeout: float = 10.0) -> StorageReply:
    """Ask the storage service (``QUERY_LATEST`` or ``QUERY_GENERATIONS``)."""
    hdrs = tracing.inject({})
    try:
        r = await nc.request(what, q.to_payload(), timeout=timeout, headers=hdrs)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise TemporaryError(f"no storage service answered {what}", code="storage-down",
                             hint="start the storage service (`smr up` runs one)") from None
    return StorageReply.from_payload(r.data)
