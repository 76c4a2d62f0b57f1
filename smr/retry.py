"""Retry policies, in one place: jittered exponential backoff, capped.

Use as ``@retry_nats`` / ``@retry_s3`` / ``@retry_kube`` on coroutines that
talk to those services, or ``async for attempt in policy(...)``.
"""

from __future__ import annotations

import asyncio
import logging

from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

log = logging.getLogger("smr.retry")

# NoStreamResponseError: a publish while its stream elects a leader (a NATS
# server of a cluster lost) finds no one to answer for a moment.
NATS_UNAVAILABLE = (
    NatsTimeout, NoRespondersError, NoStreamResponseError, ServiceUnavailableError,
    ConnectionClosedError,
)
NATS_TRANSIENT = (*NATS_UNAVAILABLE, asyncio.TimeoutError, ConnectionError)


def policy(
    transient: tuple[type[BaseException], ...], *, attempts: int = 6, max_wait: float = 5.0,
    deadline: float = 60.0,
) -> AsyncRetrying:
    return AsyncRetrying(
        retry=retry_if_exception_type(transient),
        wait=wait_exponential_jitter(multiplier=0.1, max=max_wait, jitter=0.2),
        stop=stop_after_attempt(attempts) | stop_after_delay(deadline),
        before_sleep=before_sleep_log(log, logging.WARNING),
        reraise=True,
    )


def retry_nats() -> AsyncRetrying:
    # 10 attempts wait ~21 s in all: longer than a JetStream leader election
    # after a server of a cluster is lost (election timeouts of 4-9 s; under
    # load, tests/test_cluster.py saw a publish outlast 6 attempts, ~3.5 s).
    return policy(NATS_TRANSIENT, attempts=10)


def retry_s3() -> AsyncRetrying:
    # botocore is imported lazily: only the S3 backend needs it.
    from aiohttp import ClientConnectionError, ClientPayloadError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import ReadTimeoutError

    # ClientPayloadError: a body cut midway, met when it is read, after botocore's
    # own retries are over.
    return policy((BotoConnectionError, ReadTimeoutError, asyncio.TimeoutError,
                   ClientPayloadError, ClientConnectionError), attempts=8)


def retry_kube() -> AsyncRetrying:
    from aiohttp import ClientError

    return policy((ClientError, asyncio.TimeoutError), attempts=8, max_wait=10.0)
