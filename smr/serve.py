"""Running one cluster service (the watcher, the node agent, the storage
service, the webhook) as a Kubernetes pod: its NATS connection, SIGTERM, the health
endpoint its probes ask (``SMR_HEALTH_PORT``: ``/livez`` while its loop
answers, ``/readyz`` once it has started serving) and its metrics
(``SMR_METRICS_PORT``: ``/metrics``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from aiohttp import web

from smr import config, metrics, tracing
from smr.aio import dump_tasks_on_signal
from smr.bus import Bus, BusConfig
from smr.contract.errors import SmrError

log = logging.getLogger("smr.serve")


class Service(Protocol):
    ready: asyncio.Event

    async def run(self) -> None: ...

    def stop(self) -> None: ...


Cleanup = Callable[[], Awaitable[object]]
# make(bus, settings): bus is a Bus, or None for a service that needs none.
Factory = Callable[[Any, config.Settings], Awaitable[tuple[Service, list[Cleanup]]]]


async def health_server(service: Service, port: int) -> web.AppRunner:
    async def livez(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if service.ready.is_set():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="starting\n")

    app = web.Application()
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def serve(name: str, settings: config.Settings, make: Factory, *,
                needs_bus: bool = True, buckets: Iterable[str] | None = None) -> None:
    """``needs_bus``: False for a service that talks to no NATS (the webhook);
    ``buckets``: the KV buckets it uses (its NATS user may read no others)."""
    if needs_bus and not settings.nats_url:
        raise SmrError(f"the {name} needs a NATS server", code="config-invalid",
                       hint="set SMR_NATS_URL (deploy/kustomize sets it)")
    tracing.setup(name)
    bus = None
    cleanups: list[Cleanup] = []
    if needs_bus:
        bus = await Bus.connect(settings.nats_url, name=f"smr-{name}-{settings.node}",
                                config=BusConfig.from_settings(settings), buckets=buckets)
        cleanups.append(bus.close)
    runner = None
    try:
        service, more = await make(bus, settings)
        cleanups[:0] = more
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        dump_tasks_on_signal()
        if settings.health_port:
            runner = await health_server(service, settings.health_port)
        if settings.metrics_port:
            cleanups.insert(0, (await metrics.serve(settings.metrics_port)).cleanup)
        await service.run()
    finally:
        if runner:
            await runner.cleanup()
        for c in cleanups:
            with contextlib.suppress(Exception):
                await c()


def main(name: str, make: Factory, *, needs_bus: bool = True,
         buckets: Iterable[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)
    try:
        asyncio.run(serve(name, config.load(), make, needs_bus=needs_bus, buckets=buckets))
    except SmrError as e:
        print(f"smr {name}: {e}", file=sys.stderr)
        sys.exit(2)
