"""``python -m services.watcher``: the watcher Deployment's entry point."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from services.watcher.kube import api_client
from services.watcher.service import Watcher
from smr import config, tracing
from smr.bus import Bus, BusConfig
from smr.errors import SmrError


async def serve(settings: config.Settings) -> None:
    if not settings.nats_url:
        raise SmrError("the watcher needs a NATS server", code="config-invalid",
                       hint="set SMR_NATS_URL (deploy/kustomize sets it)")
    tracing.setup("watcher")
    bus = await Bus.connect(settings.nats_url, name="smr-watcher",
                            config=BusConfig.from_settings(settings))
    api = await api_client(settings.kube_api)
    watcher = Watcher(bus, api, settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, watcher.stop)
    try:
        await watcher.run()
    finally:
        await api.close()
        await bus.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(serve(config.load()))
    except SmrError as e:
        print(f"smr watcher: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
