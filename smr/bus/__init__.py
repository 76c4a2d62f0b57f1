"""The JetStream bus, by concept:

- ``topology``: subjects, streams, consumers, KV buckets (the names and shapes);
- ``client``: ``Bus``, one NATS connection: ensure, publish, step state;
  ``events``: ``consume_events``, a service's loop over validated events;
- ``worker``: ``Worker``, the loop that turns a request into exactly one
  executed step; ``ahead``: the requests it fetched ahead of a free slot,
  finals first; ``keepalive``: the heartbeat of a step's state while it acts;
- ``progress``: what it runs (``Step``) and hears back (``Progress``);
- ``replies``: waiting for a step's result, storage queries;
- ``deadletters``: dead letters;
- ``exhausted``: the requests JetStream gave up on, answered;
- ``liveness``: ``StepLocks``, which requests a live worker of this node runs.

Everything a service needs is importable from ``smr.bus``.
"""

from smr.bus.client import Bus
from smr.bus.events import consume_events
from smr.bus.liveness import StepLocks
from smr.bus.progress import Progress, Step
from smr.bus.topology import (
    KV_BEATS,
    KV_EPISODES,
    KV_HEALTH,
    KV_JOBS,
    KV_LOCKS,
    KV_STEPS,
    KV_TIMINGS,
    QUERY_CHECKPOINTS,
    QUERY_GENERATIONS,
    QUERY_LATEST,
    RESULT_OF,
    STREAM_DLQ,
    STREAM_EVENTS,
    STREAM_EXHAUSTED,
    STREAM_REQUESTS,
    SUBJECT_TYPES,
    BusConfig,
    kind_of,
    message_subject,
    node_filter,
    node_token,
    query_subject,
    subject,
)
from smr.bus.worker import Worker

__all__ = [
    "KV_BEATS",
    "KV_EPISODES",
    "KV_HEALTH",
    "KV_JOBS",
    "KV_LOCKS",
    "KV_STEPS",
    "KV_TIMINGS",
    "QUERY_CHECKPOINTS",
    "QUERY_GENERATIONS",
    "QUERY_LATEST",
    "RESULT_OF",
    "STREAM_DLQ",
    "STREAM_EVENTS",
    "STREAM_EXHAUSTED",
    "STREAM_REQUESTS",
    "SUBJECT_TYPES",
    "Bus",
    "BusConfig",
    "Progress",
    "Step",
    "StepLocks",
    "Worker",
    "consume_events",
    "kind_of",
    "message_subject",
    "node_filter",
    "node_token",
    "query_subject",
    "subject",
]
