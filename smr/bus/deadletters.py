"""Dead letters: a message smr cannot act on goes to ``dlq.<subject>`` with
the reason, and nothing else breaks. The requests JetStream gave up on are
answered with one too (smr/bus/exhausted.py).

It takes the publishing it needs as arguments, so the Bus (smr/bus/client.py)
can use it without a circle.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from smr import metrics
from smr.bus.topology import MAX_DLQ_PAYLOAD, kind_of
from smr.contract.errors import SmrError
from smr.contract.messages import DeadLetter

log = logging.getLogger("smr.bus")


async def dead_letter(publish_raw: Callable[[str, bytes], Awaitable[Any]], max_payload: int,
                      subj: str, payload: bytes, error: SmrError, *, service: str,
                      deliveries: int | None = None, request_id: str | None = None) -> None:
    letter = DeadLetter(
        subject=subj, error=error.as_dict(), service=service, deliveries=deliveries,
        payload=payload[:MAX_DLQ_PAYLOAD].decode("utf-8", errors="replace"),
        request_id=request_id,
    )
    body = letter.to_payload()
    if len(body) > max_payload:
        # Undecodable bytes and control characters grow when escaped into JSON:
        # keep the start of the payload, never a letter the server refuses.
        letter.payload = letter.payload[:1024]
        body = letter.to_payload()
    log.warning("dead-lettered a message on %s: %s", subj, error.message)
    metrics.DEAD_LETTERS.labels(kind_of(subj)).inc()
    await publish_raw(f"dlq.{subj}", body)


def peek_request_id(payload: bytes) -> str | None:
    """The request_id of a payload that did not pass the contract, if it has one."""
    try:
        rid = orjson.loads(payload).get("request_id")
        return rid if isinstance(rid, str) else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
