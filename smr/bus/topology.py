"""The bus's names and shapes: subjects, streams, consumers, KV buckets.

Subjects (``<node>`` is ``node_token(node)``, ``<ns>`` the namespace of the
request's target: a pod's namespace, ``local`` for a job of `smr up`)::

    ckpt.requested.<node>.<ns>  restore.requested.<node>.<ns>  stream SMR_REQUESTS
    ckpt.done.<node>.<ns>       restore.done.<node>.<ns>       stream SMR_EVENTS
    node.draining.<node>                                       stream SMR_EVENTS
    dlq.<original subject>                                     stream SMR_DLQ
    $JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.SMR_REQUESTS.* stream SMR_EXHAUSTED
    storage.{latest,generations,checkpoints}.<ns>   request/reply, storage service
    storage.checkpoints                             every namespace's (admin)

The node and the namespace are in the subject so that a NATS permission can
match them (deploy/kustomize/components/nats-auth): a tenant's user may
publish ``ckpt.requested.*.<its ns>`` only, an agent's consume its node's.
A worker refuses a request whose subject names another namespace than its
target (``wrong-namespace``), so the permission on the subject is the
permission on the target.

Requests are published with ``Nats-Msg-Id = request_id``, so JetStream drops a
duplicate within the dedupe window. Each node has one durable pull consumer per
request kind; its worker runs a few steps at once and may hold more, fetched
ahead, to start the most urgent first (smr/bus/ahead.py). A node's NATS user
may create no consumer (a push one would deliver its own requests anywhere:
github.com/nats-io/nats-server/issues/8274), so the watcher, or the operator, makes them
(``Bus.make_node_consumers``) and the worker waits for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from nats.js import api as js_api

from smr.config import Settings
from smr.contract.errors import ContractError
from smr.contract.messages import (
    LOCAL_NAMESPACE,
    CkptDone,
    CkptRequested,
    Message,
    NodeDraining,
    RestoreDone,
    RestoreRequested,
)

STREAM_REQUESTS = "SMR_REQUESTS"
STREAM_EVENTS = "SMR_EVENTS"
STREAM_DLQ = "SMR_DLQ"
STREAM_EXHAUSTED = "SMR_EXHAUSTED"
EXHAUSTED_PREFIX = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{STREAM_REQUESTS}"
QUERY_LATEST = "storage.latest"  # core NATS request/reply, see schemas/storage.query.json
QUERY_GENERATIONS = "storage.generations"
QUERY_CHECKPOINTS = "storage.checkpoints"  # the latest generation of every checkpoint
KV_STEPS = "smr-steps"
KV_JOBS = "smr-jobs"
KV_LOCKS = "smr-locks"
KV_EPISODES = "smr-episodes"  # watcher: node drain episodes (node → episode id)
KV_BEATS = "smr-beats"  # watcher: the heartbeat schedule (pod uid → next beat)
KV_TIMINGS = "smr-timings"  # agent → webhook: each checkpoint's last measured time
KV_HEALTH = "smr-health"  # watcher → `smr status`: its last probe of the webhook

# The message class of each subject's first two tokens.
SUBJECT_TYPES: dict[str, type[Message]] = {
    "ckpt.requested": CkptRequested,
    "restore.requested": RestoreRequested,
    "ckpt.done": CkptDone,
    "restore.done": RestoreDone,
    "node.draining": NodeDraining,
}
# Kinds whose subjects end in the target's namespace.
PER_NAMESPACE = frozenset(("ckpt.requested", "restore.requested", "ckpt.done", "restore.done"))
RESULT_OF: dict[str, type[CkptDone] | type[RestoreDone]] = {
    "ckpt.requested": CkptDone,
    "restore.requested": RestoreDone,
}

MAX_DLQ_PAYLOAD = 64 * 1024
DAY = 86400.0


def node_token(node: str) -> str:
    """A node name as one subject token (Kubernetes names may hold dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", node)


def subject(kind: str, node: str, namespace: str | None = None) -> str:
    """``kind.<node>`` (node.draining), ``kind.<node>.<ns>`` (requests and
    results: ``namespace`` is then required)."""
    if kind not in SUBJECT_TYPES:
        raise KeyError(f"unknown subject kind {kind!r}")
    if kind not in PER_NAMESPACE:
        return f"{kind}.{node_token(node)}"
    if not namespace:
        raise ValueError(f"a {kind} subject names the target's namespace")
    return f"{kind}.{node_token(node)}.{node_token(namespace)}"


def node_filter(kind: str, node: str) -> str:
    """Every ``kind`` subject of ``node``: its consumer's filter."""
    return f"{kind}.{node_token(node)}.*" if kind in PER_NAMESPACE else subject(kind, node)


def message_subject(msg: Message) -> str:
    kind = next(k for k, t in SUBJECT_TYPES.items() if type(msg) is t)
    if isinstance(msg, NodeDraining):
        return subject(kind, msg.node)
    assert isinstance(msg, CkptRequested | RestoreRequested | CkptDone | RestoreDone)
    return subject(kind, msg.node, msg.target.namespace_name)


def namespace_of_subject(subj: str) -> str | None:
    """The namespace token of a request or result subject (None: it has none)."""
    parts = subj.split(".")
    return parts[3] if kind_of(subj) in PER_NAMESPACE and len(parts) == 4 else None


def misdelivered(subj: str, req: CkptRequested | RestoreRequested,
                 node: str) -> ContractError | None:
    """Why ``req``, which came on ``subj``, may not be served by ``node``'s
    worker; None: it may. The exact node name: two nodes whose names share a
    subject token ("a.b", "a_b") must not run each other's requests. The
    subject's namespace is what NATS permitted the publisher (a tenant's
    user: its own only): the target must be in it."""
    if req.node != node:
        return ContractError(f"request for node {req.node} arrived on {subj}",
                             code="wrong-node",
                             hint="publish to the subject that ends in the node's name")
    if namespace_of_subject(subj) != node_token(req.target.namespace_name):
        return ContractError(f"request for {req.target} arrived on {subj}",
                             code="wrong-namespace",
                             hint="publish to the subject that ends in the target's namespace "
                                  "(`local` for a job)")
    return None


def query_subject(what: str, namespace: str | None) -> str:
    """``storage.<what>.<ns>``; ``storage.checkpoints`` alone lists every namespace."""
    if namespace is None and what == QUERY_CHECKPOINTS:
        return what
    return f"{what}.{node_token(namespace or LOCAL_NAMESPACE)}"


def kind_of(subj: str) -> str:
    return ".".join(subj.split(".")[:2])


@dataclass
class BusConfig:
    max_deliver: int = 5
    ack_wait: float = 30.0
    dedupe_window: float = 3600.0
    nak_base_delay: float = 1.0
    nak_max_delay: float = 30.0
    credentials: str = ""  # a NATS .creds file (JWT + nkey)
    replicas: int = 1  # of every stream and KV bucket (SMR_NATS_REPLICAS)
    user: str = ""  # SMR_NATS_USER; its inbox prefix is _INBOX.<user>
    password: str = ""
    setup: bool = True  # create/update streams and buckets; False: wait for them
    token: str = ""  # a NATS token: an agent's ServiceAccount token (auth callout)
    token_file: str = ""  # where it is: read again at each (re)connect, as it rotates
    inbox: str = ""  # the user replies come to, when it has no name (a token login)

    @classmethod
    def from_settings(cls, s: Settings) -> BusConfig:
        return cls(max_deliver=s.max_deliver, ack_wait=s.ack_wait, dedupe_window=s.dedupe_window,
                   credentials=s.nats_creds, replicas=s.nats_replicas, user=s.nats_user,
                   password=s.nats_password, setup=s.nats_setup, token_file=s.nats_token_file,
                   # What the auth callout names a token's user: its node's agent.
                   inbox=f"smr-agent-{node_token(s.node)}" if s.nats_token_file else "")

    @property
    def inbox_prefix(self) -> str:
        """Where replies come: a user's own, so a permission can give each user
        its replies and no one else's (``_INBOX.<user>.>``)."""
        name = self.user or self.inbox
        return f"_INBOX.{node_token(name)}" if name else "_INBOX"

    @property
    def keepalive(self) -> float:
        """How often a running step says it is alive (in_progress + KV heartbeat)."""
        return max(0.2, min(self.ack_wait / 3, 2.0))

    @property
    def stale_after(self) -> float:
        """A running state whose heartbeat is older than this has lost its worker.
        Heartbeats go out with in_progress, so a redelivery (ack wait expired)
        finds one at least ack_wait old; a live worker's is under 2 keepalives."""
        return max(2 * self.keepalive, 0.8 * self.ack_wait)



def streams(config: BusConfig) -> tuple[js_api.StreamConfig, ...]:
    """Every stream smr uses, as ``Bus.ensure`` creates or updates them, each
    with ``config.replicas`` replicas."""
    return tuple(replace(s, num_replicas=config.replicas) for s in (
        js_api.StreamConfig(
            name=STREAM_REQUESTS, subjects=["ckpt.requested.*.*", "restore.requested.*.*"],
            duplicate_window=config.dedupe_window, max_age=7 * DAY,
            storage=js_api.StorageType.FILE,
        ),
        js_api.StreamConfig(
            name=STREAM_EVENTS,
            subjects=["ckpt.done.*.*", "restore.done.*.*", "node.draining.*"],
            duplicate_window=config.dedupe_window, max_age=7 * DAY,
            storage=js_api.StorageType.FILE,
        ),
        js_api.StreamConfig(
            name=STREAM_DLQ, subjects=["dlq.>"], max_age=30 * DAY,
            storage=js_api.StorageType.FILE,
        ),
        js_api.StreamConfig(
            name=STREAM_EXHAUSTED, subjects=[f"{EXHAUSTED_PREFIX}.*"], max_age=7 * DAY,
            storage=js_api.StorageType.FILE,
        ),
    ))


# Bucket, history kept per key, TTL (seconds; 0: none); each has
# ``BusConfig.replicas`` replicas, as the streams. A step's state lives
# a day longer than any request it answers can be redelivered (the requests
# stream keeps a message 7 days): a redelivery always finds it, and the
# bucket does not grow for ever.
STEP_STATE_TTL = 8 * DAY
# A checkpoint time not measured again for 30 days is forgotten (its workload gone).
BUCKETS = ((KV_STEPS, 1, STEP_STATE_TTL), (KV_JOBS, 5, 0.0), (KV_LOCKS, 1, 0.0),
           (KV_EPISODES, 1, 0.0), (KV_BEATS, 1, 0.0), (KV_TIMINGS, 1, 30 * DAY),
           (KV_HEALTH, 1, 0.0))


def request_consumer(kind: str, node: str, config: BusConfig,
                     concurrency: int = 1) -> js_api.ConsumerConfig:
    """The durable consumer of ``kind`` requests for ``node``; ``concurrency``
    requests unacknowledged at once: those running (steps serialise on their
    job's lock) and those fetched ahead."""
    name = f"{kind.replace('.', '-')}-{node_token(node)}"
    return js_api.ConsumerConfig(
        name=name, durable_name=name, filter_subject=node_filter(kind, node),
        ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=config.ack_wait, max_deliver=config.max_deliver,
        max_ack_pending=concurrency,
    )


def exhausted_consumer(consumer: str, config: BusConfig) -> js_api.ConsumerConfig:
    """A durable consumer of the max-deliveries advisories of ``consumer``."""
    name = f"exhausted-{consumer}"
    return js_api.ConsumerConfig(
        name=name, durable_name=name, filter_subject=f"{EXHAUSTED_PREFIX}.{consumer}",
        ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=config.ack_wait, max_deliver=-1,
    )


def event_consumer(name: str, kind: str, config: BusConfig) -> js_api.ConsumerConfig:
    """A durable consumer of ``kind`` events of every node (and namespace),
    shared by a service's replicas (each event goes to one of them)."""
    return js_api.ConsumerConfig(
        name=name, durable_name=name,
        filter_subject=f"{kind}.*.*" if kind in PER_NAMESPACE else f"{kind}.*",
        ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=config.ack_wait, max_deliver=config.max_deliver,
    )
