"""The Bus: one NATS connection and what smr does over it: the streams and
buckets it ensures (smr/bus/topology.py), publishing with dedupe and trace
context, step state, and the request/reply and
dead-letter paths (smr/bus/replies.py, smr/bus/deadletters.py). Events are
consumed in smr/bus/events.py, requests in smr/bus/worker.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import nats
import orjson
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import (
    APIError,
    BadRequestError,
    KeyNotFoundError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind

from smr import tracing
from smr.aio import quietly
from smr.bus import deadletters, replies, topology
from smr.bus.topology import (
    KV_STEPS,
    STREAM_EVENTS,
    STREAM_EXHAUSTED,
    STREAM_REQUESTS,
    BusConfig,
    kind_of,
)
from smr.contract.errors import SmrError, TemporaryError
from smr.contract.messages import (
    CkptDone,
    CkptRequested,
    Message,
    RestoreDone,
    RestoreRequested,
    StorageQuery,
    StorageReply,
)
from smr.retry import retry_nats

log = logging.getLogger("smr.bus")

# Between looks for a stream or consumer another service creates: doubling
# from the first, which is short (the watcher makes a new node's consumers
# within its first pass, a fraction of a second), up to the longest.
SETUP_FIRST_WAIT_S = 0.05
SETUP_WAIT_S = 1.0
ALL_BUCKETS = tuple(b for b, _, _ in topology.BUCKETS)


class Bus:
    """One NATS connection and everything smr does over it."""

    def __init__(self, nc: NATS, js: JetStreamContext, config: BusConfig,
                 buckets: Iterable[str] | None = None) -> None:
        self.nc = nc
        self.js = js
        self.config = config
        self.buckets = tuple(buckets) if buckets is not None else ALL_BUCKETS
        self._kv: dict[str, KeyValue] = {}

    @classmethod
    async def connect(cls, url: str, *, name: str = "smr", config: BusConfig | None = None,
                      buckets: Iterable[str] | None = None) -> Bus:
        """``url``: one server, or a cluster's servers comma-separated; the
        client connects to any of them and, when that one goes, reconnects to
        another (and to those the cluster tells it of). ``buckets``: the KV
        buckets this service uses (default: all); a NATS user is permitted
        those only (deploy/kustomize/components/nats-auth)."""
        config = config or BusConfig()
        servers = [u.strip() for u in url.split(",") if u.strip()]
        async for attempt in retry_nats():
            with attempt:
                nc = await nats.connect(
                    servers, name=name, connect_timeout=2, max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5, allow_reconnect=True,
                    user_credentials=config.credentials or None,
                    user=config.user or None, password=config.password or None,
                    token=_token_reader(config.token_file) if config.token_file
                    else config.token or None,
                    inbox_prefix=config.inbox_prefix,
                    # One line per event, not nats-py's traceback per reconnect attempt.
                    error_cb=_connection_error, disconnected_cb=_disconnected,
                    reconnected_cb=_reconnected,
                )
        bus = cls(nc, nc.jetstream(timeout=10), config, buckets)
        try:
            await bus.ensure()
        except BaseException:
            await quietly(nc.close())
            raise
        return bus

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        if self.nc.is_reconnecting or self.nc.is_connecting:
            # Nothing in flight can be drained to a server that is gone, and
            # drain() refuses then (ConnectionReconnectingError); the close
            # itself may find the socket reset.
            await quietly(self.nc.close())
            return
        await self.nc.drain()

    # -- topology -----------------------------------------------------------------

    async def ensure(self) -> None:
        """Create or update the streams and KV buckets (``config.setup``), or
        wait for them; then bind this service's buckets. Safe to call from
        every service."""
        if not self.config.setup:
            await self._wait_topology()
            return
        # Each is retried: on a NATS cluster a replicated stream's creation can
        # time out while its peers are busy (services starting at once), and
        # creating or updating one to the same config again is a no-op.
        for cfg in topology.streams(self.config):
            async for attempt in retry_nats():
                with attempt, self._replicas_refused(cfg.name or ""):
                    await self._ensure_stream(cfg)
        for bucket, history, ttl in topology.BUCKETS:
            if bucket not in self._kv:
                async for attempt in retry_nats():
                    with attempt, self._replicas_refused(f"KV bucket {bucket}"):
                        kv = await self._ensure_bucket(bucket, history, ttl)
                if bucket in self.buckets:
                    self._kv[bucket] = kv

    async def _wait_topology(self) -> None:
        """A user that may not create the streams and buckets (SMR_NATS_SETUP
        false) waits for the one that may (the storage service in the cluster)."""
        names = [*(cfg.name or "" for cfg in topology.streams(self.config)),
                 *(f"KV_{b}" for b in self.buckets)]
        for stream in names:
            for looks, wait in enumerate(_setup_waits()):
                try:
                    async for attempt in retry_nats():
                        with attempt:
                            await self.js.stream_info(stream)
                    break
                except NotFoundError:
                    if not looks:
                        log.warning("stream %s does not exist yet: waiting for the service "
                                    "that creates them (SMR_NATS_SETUP=true; in the cluster "
                                    "the storage service)", stream)
                    await asyncio.sleep(wait)
        for bucket in self.buckets:
            self._kv[bucket] = await self.js.key_value(bucket)

    @contextlib.contextmanager
    def _replicas_refused(self, what: str) -> Iterator[None]:
        """NATS refusing the replica count (more than its servers; a single
        server takes 1) as an error that names the setting."""
        try:
            yield
        except APIError as e:
            if self.config.replicas == 1 or isinstance(e, ServiceUnavailableError):
                raise
            raise SmrError(
                f"NATS refused {what} with {self.config.replicas} replicas: {e}",
                code="nats-replicas",
                hint="SMR_NATS_REPLICAS must not exceed the NATS cluster's servers "
                     "(1 on a single server)") from e

    async def _ensure_bucket(self, bucket: str, history: int, ttl: float) -> KeyValue:
        replicas = self.config.replicas
        try:
            return await self.js.create_key_value(js_api.KeyValueConfig(
                bucket=bucket, history=history, ttl=ttl or None,
                storage=js_api.StorageType.FILE, replicas=replicas))
        except BadRequestError:
            # It exists with other settings (made by an older smr, before its
            # TTL, or with another replica count): both are its stream's, and
            # JetStream updates both in place.
            info = await self.js.stream_info(f"KV_{bucket}")
            changed = False
            if (info.config.max_age or 0) != ttl:
                log.warning("KV bucket %s: its TTL is now %.0fs (was %s)", bucket, ttl,
                            info.config.max_age or "none")
                info.config.max_age = ttl
                changed = True
            if (info.config.num_replicas or 1) != replicas:
                log.warning("KV bucket %s: %d replicas now (was %d; SMR_NATS_REPLICAS)",
                            bucket, replicas, info.config.num_replicas or 1)
                info.config.num_replicas = replicas
                changed = True
            if changed:
                await self.js.update_stream(info.config)
            return await self.js.key_value(bucket)

    async def _ensure_stream(self, cfg: js_api.StreamConfig) -> None:
        try:
            info = await self.js.stream_info(cfg.name or "")
        except NotFoundError:
            await self.js.add_stream(cfg)
            return
        have = info.config
        if (have.num_replicas or 1) != (cfg.num_replicas or 1):
            log.warning("stream %s: %d replicas now (was %d; SMR_NATS_REPLICAS)",
                        cfg.name, cfg.num_replicas or 1, have.num_replicas or 1)
        elif (sorted(have.subjects or []) == sorted(cfg.subjects or [])
                and have.duplicate_window == cfg.duplicate_window
                and have.max_age == cfg.max_age):
            return
        await self.js.update_stream(cfg)



    async def ensure_consumer(self, kind: str, node: str, concurrency: int = 1) -> str:
        """The durable consumer of ``kind`` requests for ``node``; returns its
        name. Made here where this user sets the bus up (``config.setup``);
        else waited for: a node's user may create no consumer, and another
        party makes its node's (``make_node_consumers``)."""
        cfg = topology.request_consumer(kind, node, self.config, concurrency)
        if self.config.setup:
            await self.js.add_consumer(STREAM_REQUESTS, cfg)
        else:
            await self._wait_consumer(STREAM_REQUESTS, cfg)
        return cfg.durable_name or ""

    async def ensure_exhausted_consumer(self, consumer: str) -> str:
        cfg = topology.exhausted_consumer(consumer, self.config)
        if self.config.setup:
            await self.js.add_consumer(STREAM_EXHAUSTED, cfg)
        else:
            await self._wait_consumer(STREAM_EXHAUSTED, cfg)
        return cfg.durable_name or ""

    async def make_node_consumers(self, node: str, windows: Mapping[str, int]) -> None:
        """Create (or update to these settings) ``node``'s request durables,
        ``windows`` each kind's max_ack_pending (its worker's concurrency plus
        what it fetches ahead), and their max-deliveries durables. A
        privileged party's work: the watcher for each Node, the operator for
        `smr up` on a shared NATS (`smr node-consumers`). A node's own user
        may create none: nats-server does not hold a push consumer's deliver
        subject to its creator's permissions (github.com/nats-io/nats-server/issues/8274), and
        the node writes requests of its own into SMR_REQUESTS."""
        for kind, window in windows.items():
            cfg = topology.request_consumer(kind, node, self.config, window)
            await self.js.add_consumer(STREAM_REQUESTS, cfg)
            await self.js.add_consumer(STREAM_EXHAUSTED, topology.exhausted_consumer(
                cfg.durable_name or "", self.config))

    async def consumer_names(self, stream: str) -> set[str]:
        """The names of ``stream``'s consumers (CONSUMER.NAMES, page by page)."""
        return set(await self._paged(f"$JS.API.CONSUMER.NAMES.{stream}", {},
                                     lambda info: info.get("consumers") or [],
                                     f"the consumers of {stream}"))

    async def _paged(self, api: str, ask: dict[str, Any],
                     page_of: Callable[[dict[str, Any]], list[str]], what: str) -> list[str]:
        """Every item a paged JetStream API answers ``api`` with (``ask`` plus
        each page's offset), ``page_of`` the items of one answer."""
        items: list[str] = []
        while True:
            body = orjson.dumps({**ask, "offset": len(items)})
            async for attempt in retry_nats():
                with attempt:
                    r = await self.nc.request(api, body, timeout=10)
            info = orjson.loads(r.data)
            if "error" in info:
                raise TemporaryError(f"listing {what} failed: "
                                     f"{info['error'].get('description')}",
                                     code="nats-unavailable", hint="try again")
            page = page_of(info)
            items += page
            if not page or len(items) >= int(info.get("total") or 0):
                return items

    async def _wait_consumer(self, stream: str, cfg: js_api.ConsumerConfig) -> None:
        """Until durable ``cfg`` exists on ``stream`` (made by another party)."""
        name = cfg.durable_name or ""
        for looks, wait in enumerate(_setup_waits()):
            try:
                info = await self.js.consumer_info(stream, name)
                break
            except NotFoundError:
                if not looks:
                    log.warning(
                        "consumer %s on %s does not exist yet, and this user (%s) may not "
                        "create it: waiting for it. In the cluster the watcher makes each "
                        "Node's; for `smr up` on a shared NATS the operator does, with "
                        "`smr node-consumers <node>` as smr-admin", name, stream,
                        self.config.user or "a token's")
                await asyncio.sleep(wait)
        want = cfg.max_ack_pending
        if want and info.config.max_ack_pending not in (None, want):
            log.warning("consumer %s holds up to %s requests unacknowledged, its worker "
                        "%d: the party that made it runs other settings "
                        "(SMR_CHECKPOINTS_PER_NODE, SMR_RESTORES_PER_NODE)", name,
                        info.config.max_ack_pending, want)

    async def ensure_event_consumer(self, name: str, kind: str) -> str:
        await self.js.add_consumer(STREAM_EVENTS, topology.event_consumer(name, kind, self.config))
        return name

    def kv(self, bucket: str) -> KeyValue:
        try:
            return self._kv[bucket]
        except KeyError:
            raise KeyError(f"KV bucket {bucket} is not among this Bus's buckets "
                           f"{self.buckets}: name it in Bus.connect(buckets=...)") from None

    async def kv_keys(self, bucket: str) -> list[str]:
        """The keys ``bucket`` holds a message for, its deleted ones too (their
        tombstone: a get tells them apart). Asked of the bucket's stream
        (STREAM.INFO with a subjects filter), not listed with a consumer as
        ``KeyValue.keys`` does: a node's user may create no consumer on a bucket
        it writes (docs/security.md, github.com/nats-io/nats-server/issues/8274)."""
        prefix = f"$KV.{bucket}."
        subjects = await self._paged(
            f"$JS.API.STREAM.INFO.KV_{bucket}", {"subjects_filter": f"{prefix}>"},
            lambda info: list((info.get("state") or {}).get("subjects") or {}),
            f"the keys of bucket {bucket}")
        return [subj.removeprefix(prefix) for subj in subjects]

    # -- publishing ---------------------------------------------------------------

    async def publish(self, msg: Message, subj: str | None = None) -> js_api.PubAck:
        """Validate and publish; ``Nats-Msg-Id`` makes a repeat a no-op."""
        if subj is None:
            subj = topology.message_subject(msg)
        payload = msg.to_payload()
        msg_id = msg.request_id  # type: ignore[attr-defined]
        if isinstance(msg, CkptDone | RestoreDone):
            # The outcome is part of the id: a repeat of one result is dropped,
            # but a real success after a failure someone else recorded is not.
            msg_id = f"{msg_id}.{msg.SCHEMA}.{msg.status}"
        return await self.publish_raw(subj, payload, msg_id=msg_id)

    async def publish_raw(self, subj: str, payload: bytes, *, msg_id: str | None = None,
                          headers: dict[str, str] | None = None) -> js_api.PubAck:
        hdrs = dict(headers or {})
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        with tracing.tracer.start_as_current_span(
            f"publish {kind_of(subj)}", kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subj},
        ):
            tracing.inject(hdrs)
            async for attempt in retry_nats():
                with attempt:
                    return await self.js.publish(subj, payload, headers=hdrs)
        raise AssertionError("unreachable")

    async def dead_letter(self, subj: str, payload: bytes, error: SmrError, *, service: str,
                          deliveries: int | None = None, request_id: str | None = None) -> None:
        """Publish ``payload`` to ``dlq.<subj>`` with the reason (smr/bus/deadletters.py)."""
        await deadletters.dead_letter(self.publish_raw, self.nc.max_payload, subj, payload,
                                      error, service=service, deliveries=deliveries,
                                      request_id=request_id)

    # -- step state -----------------------------------------------------------------

    async def step_state(self, request_id: str) -> tuple[dict[str, Any] | None, int]:
        try:
            e = await self.kv(KV_STEPS).get(request_id)
        except KeyNotFoundError:
            return None, 0
        if not e.value:  # deleted: the step may run again
            return None, e.revision or 0
        return orjson.loads(e.value), e.revision or 0

    # -- request/reply (smr/bus/replies.py) -----------------------------------------

    async def request(self, req: CkptRequested | RestoreRequested, *,
                      timeout: float | None = None) -> CkptDone | RestoreDone:
        """Publish a request and wait for its result."""
        await self.publish(req)
        return await self.wait_result(req.request_id, req.SCHEMA, timeout=timeout)

    async def wait_result(
        self, request_id: str, kind: str, *, timeout: float | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> CkptDone | RestoreDone:
        """Wait until the step of ``request_id`` has a result (CLI, tests)."""
        return await replies.wait_result(self.kv(KV_STEPS), request_id, kind,
                                         timeout=timeout, on_progress=on_progress)

    async def query(self, what: str, query: StorageQuery, *, timeout: float = 10.0
                    ) -> StorageReply:
        """Ask the storage service (``QUERY_LATEST``, ``QUERY_GENERATIONS`` or
        ``QUERY_CHECKPOINTS``) on the subject of the query's namespace."""
        return await replies.query(self.nc, topology.query_subject(what, query.namespace),
                                   query, timeout=timeout)


def _token_reader(path: str) -> Callable[[], str]:
    """The token as the file holds it at each (re)connect: a projected
    ServiceAccount token is replaced before it expires."""
    def read() -> str:
        with open(path) as f:
            return f.read().strip()
    return read


async def _connection_error(e: Exception) -> None:
    log.warning("NATS: %s: %s", type(e).__name__, e)


async def _disconnected() -> None:
    # Every close says it too; a lost server is told by the error and the
    # reconnect lines, so this is chatter at the default level.
    log.debug("NATS: disconnected")


async def _reconnected() -> None:
    log.warning("NATS: reconnected")


def _setup_waits() -> Iterator[float]:
    """The waits between looks for what another service creates."""
    wait = SETUP_FIRST_WAIT_S
    while True:
        yield wait
        wait = min(wait * 2, SETUP_WAIT_S)
