"""Request/reply: a caller waits for a step's result through the step-state
KV bucket (the result is stored there before it is published, so a waiter
that starts late still sees it), and asks the storage service over core NATS."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import nats
import orjson
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js.errors import KeyNotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from smr import tracing
from smr.bus.topology import RESULT_OF, kind_of
from smr.contract.errors import SmrError, TemporaryError
from smr.contract.messages import CkptDone, RestoreDone, StorageQuery, StorageReply

# How often a waiter asks for a step's state: soon at first (most steps the
# CLI and tests wait on are short), then at most this often.
POLL_FIRST_S, POLL_MAX_S = 0.02, 0.25
WHAT = {"ckpt.requested": "checkpoint", "restore.requested": "restore"}


async def wait_result(steps: KeyValue, request_id: str, kind: str, *,
                      timeout: float | None = None,
                      on_progress: Callable[[dict[str, Any]], None] | None = None
                      ) -> CkptDone | RestoreDone:
    """Wait until the step of ``request_id`` has a result; ``on_progress``
    sees each running state it finds on the way."""
    # Polled with direct gets, not watched: a watch is a push consumer on the
    # bucket's stream, and a user that may create one may aim its deliveries
    # at any subject (github.com/nats-io/nats-server/issues/8274), so the node users get no
    # consumer on the buckets they write (docs/security.md).
    deadline = None if timeout is None else time.monotonic() + timeout
    pause, seen = POLL_FIRST_S, -1
    while True:
        try:
            e = await steps.get(request_id)
        except KeyNotFoundError:  # not started yet, or deleted: it may run again
            e = None
        except (nats.errors.TimeoutError, NoRespondersError, ServiceUnavailableError):
            e = None  # the bucket's stream electing a leader (a server lost): ask again
        if e is not None and e.value and (e.revision or 0) != seen:
            seen = e.revision or 0
            st = orjson.loads(e.value)
            theirs = st.get("kind") or kind_of(st.get("subject", ""))
            if theirs and theirs != kind:
                # JetStream deduplicates by request id whatever the subject:
                # the step that runs under this id is another kind's, and its
                # result read as ours would report a step that never ran.
                raise SmrError(
                    f"request id {request_id} belongs to a {WHAT.get(theirs, theirs)}, "
                    f"not a {WHAT.get(kind, kind)}", code="request-id-reused",
                    hint="give this request another --request-id (or none: each request "
                    "gets its own)")
            if st.get("state") in ("done", "failed"):
                return RESULT_OF[kind].from_dict(st["result"])
            if on_progress:
                on_progress(st)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"no result for request {request_id} within {timeout}s")
        await asyncio.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, POLL_MAX_S)


async def query(nc: NATS, what: str, q: StorageQuery, *, timeout: float = 10.0) -> StorageReply:
    """Ask the storage service (``QUERY_LATEST`` or ``QUERY_GENERATIONS``)."""
    hdrs = tracing.inject({})
    try:
        r = await nc.request(what, q.to_payload(), timeout=timeout, headers=hdrs)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise TemporaryError(f"no storage service answered {what}", code="storage-down",
                             hint="start the storage service (`smr up` runs one)") from None
    return StorageReply.from_payload(r.data)
