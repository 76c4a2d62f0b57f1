"""The webhook's HTTPS server: POST /mutate takes an AdmissionReview
(services/webhook/admission) and always answers one. Its certificate comes
from the Secret it keeps (services/webhook/certs) or from cert-manager's
files (SMR_WEBHOOK_CERT_DIR), and is re-read every few hours: a renewed one
is served without a restart.

With SMR_NATS_URL set it also reads the checkpoint times the agents measured
(services/timings) to size a pod's grace period. It connects in
the background and serves meanwhile: pods are never held up for NATS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from kubernetes_asyncio import client

from services import timings
from services.webhook.admission import checkpoints, response, review, uid_of
from services.webhook.certs import CertKeeper, Tls
from smr.aio import quietly, stop_task, wait_event
from smr.bus import KV_TIMINGS, Bus, BusConfig
from smr.config import Settings

log = logging.getLogger("smr.webhook")

# kube-apiserver sends at most 3 MiB bodies; a bigger one is not a real review.
MAX_BODY = 3 * 2**20
# Reviews worked on at once, each only once its body is read: a client that
# sends slowly never holds one.
MAX_IN_FLIGHT = 8
# Requests of one source address read or reviewed at once; more wait in that
# source's own lane, so a pod that floods or trickles only delays itself,
# never the API server (whose reviews come from its own address). Memory
# stays under PER_SOURCE x MAX_BODY for each address that may reach the
# webhook (its NetworkPolicy).
PER_SOURCE = 4
# kube-apiserver sends a review's whole body at once: one not read within
# this is not its, and is cut off (408) well inside the API server's own
# timeoutSeconds (5).
READ_S = 1.0
RECHECK_S = 6 * 3600.0


@dataclass
class _Lane:
    slots: asyncio.Semaphore
    users: int = 0


class Webhook:
    def __init__(self, api: client.ApiClient | None, s: Settings, *, host: str = "0.0.0.0",
                 recheck_s: float = RECHECK_S, max_in_flight: int = MAX_IN_FLIGHT,
                 read_s: float = READ_S, per_source: int = PER_SOURCE) -> None:
        self.s = s
        self.keeper = CertKeeper(api, s) if api is not None and not s.webhook_cert_dir else None
        self.host = host
        self.recheck_s = recheck_s
        self.read_s = read_s
        self._slots = asyncio.Semaphore(max_in_flight)
        self.per_source = per_source
        self._lanes: dict[str, _Lane] = {}
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()  # its server is closed
        self.port = 0  # the bound port, once serving
        self._stop = asyncio.Event()
        self._dir = tempfile.TemporaryDirectory(prefix="smr-webhook-")
        self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.bus: Bus | None = None  # once connected

    async def _connect(self) -> None:
        self.bus = await Bus.connect(self.s.nats_url, name="smr-webhook",
                                     config=BusConfig.from_settings(self.s),
                                     buckets=(KV_TIMINGS,))
        log.info("webhook reading checkpoint times from %s", self.s.nats_url)

    async def measured(self, body: bytes) -> float | None:
        """The last measured checkpoint time of the pod's containers, if known."""
        if self.bus is None or (found := checkpoints(body, self.s)) is None:
            return None
        return await timings.slowest(self.bus.kv(KV_TIMINGS), *found)

    def stop(self) -> None:
        self._stop.set()

    async def _load(self) -> None:
        """(Re)load the serving certificate into the live TLS context."""
        if self.keeper:
            tls: Tls = await self.keeper.ensure()
            cert, key = Path(self._dir.name) / "tls.crt", Path(self._dir.name) / "tls.key"
            cert.write_bytes(tls.cert)
            key.touch(mode=0o600)
            key.write_bytes(tls.key)
        else:
            cert = Path(self.s.webhook_cert_dir) / "tls.crt"
            key = Path(self.s.webhook_cert_dir) / "tls.key"
        self._ssl.load_cert_chain(cert, key)

    async def mutate(self, request: web.Request) -> web.Response:
        async with self._lane(request.remote or ""):
            body = await self._read(request)
            if len(body) > MAX_BODY:
                log.warning("an AdmissionReview over %d bytes; allowed unchanged", MAX_BODY)
                return web.json_response(response(uid_of(body)))
            # Outside the slot: NATS answers slowly at times, and the slot
            # bounds the review's own work (a parsed body is many times its size).
            measured = await self.measured(body)
            async with self._slots:
                answer = review(body, self.s, measured)
            del body
        return web.json_response(answer)

    async def _read(self, request: web.Request) -> bytes:
        """The body, whole (or MAX_BODY + 1 bytes of it) within ``read_s``."""
        body = bytearray()  # read() returns what has arrived: loop to the end or the limit
        try:
            async with asyncio.timeout(self.read_s):
                while len(body) <= MAX_BODY and (chunk := await request.content.read(2**16)):
                    body += chunk
        except TimeoutError:
            log.warning("an AdmissionReview from %s not sent within %.1fs; dropped",
                        request.remote, self.read_s)
            raise web.HTTPRequestTimeout() from None
        return bytes(body)

    @contextlib.asynccontextmanager
    async def _lane(self, source: str) -> AsyncIterator[None]:
        """One of ``per_source`` places of this source address, waited for in
        its own queue; dropped once none of its requests is left."""
        lane = self._lanes.get(source)
        if lane is None:
            lane = self._lanes[source] = _Lane(asyncio.Semaphore(self.per_source))
        lane.users += 1
        try:
            async with lane.slots:
                yield
        finally:
            lane.users -= 1
            if not lane.users:
                del self._lanes[source]

    async def run(self) -> None:
        await self._load()
        app = web.Application(client_max_size=MAX_BODY + 1)
        app.router.add_post("/mutate", self.mutate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.s.webhook_port, ssl_context=self._ssl)
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1] if sockets else self.s.webhook_port
        log.info("webhook serving https://%s:%d/mutate", self.host, self.port)
        self.ready.set()
        connecting = asyncio.create_task(self._connect()) if self.s.nats_url else None
        try:
            while not await wait_event(self._stop, self.recheck_s):
                try:
                    await self._load()
                except Exception as e:  # keep serving the certificate we have
                    log.warning("could not renew the webhook certificate: %s", e)
        finally:
            if connecting is not None:
                await stop_task(connecting)
            if self.bus is not None:
                await quietly(self.bus.close())
            await runner.cleanup()
            with contextlib.suppress(OSError):
                self._dir.cleanup()
            self.stopped.set()
