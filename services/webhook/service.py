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
# Reviews read at once: the webhook's memory stays under MAX_IN_FLIGHT x
# MAX_BODY whoever floods it; the rest wait, unread, for a slot.
MAX_IN_FLIGHT = 8
# A body that takes longer is not kube-apiserver's (whose call times out at
# the configuration's timeoutSeconds, 5): its slot goes to the next request.
READ_S = 5.0
RECHECK_S = 6 * 3600.0


class Webhook:
    def __init__(self, api: client.ApiClient | None, s: Settings, *, host: str = "0.0.0.0",
                 recheck_s: float = RECHECK_S, max_in_flight: int = MAX_IN_FLIGHT,
                 read_s: float = READ_S) -> None:
        self.s = s
        self.keeper = CertKeeper(api, s) if api is not None and not s.webhook_cert_dir else None
        self.host = host
        self.recheck_s = recheck_s
        self.read_s = read_s
        self._slots = asyncio.Semaphore(max_in_flight)
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
        async with self._slots:
            body = bytearray()  # read() returns what has arrived: loop to the end or the limit
            try:
                async with asyncio.timeout(self.read_s):
                    while len(body) <= MAX_BODY and (chunk := await request.content.read(2**16)):
                        body += chunk
            except TimeoutError:
                log.warning("an AdmissionReview not sent within %.0fs; dropped", self.read_s)
                raise web.HTTPRequestTimeout() from None
            if len(body) > MAX_BODY:
                log.warning("an AdmissionReview over %d bytes; allowed unchanged", MAX_BODY)
                answer = response(uid_of(bytes(body)))
            else:
                answer = review(bytes(body), self.s, await self.measured(bytes(body)))
            del body
        return web.json_response(answer)

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
