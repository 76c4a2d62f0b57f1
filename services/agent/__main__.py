"""``python -m services.agent`` (``smr agent``): the node agent DaemonSet's entry point."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from services.agent.service import NodeAgent
from services.watcher.kube import api_client
from smr import config, tracing
from smr.bus import Bus, BusConfig
from smr.embedded import make_store
from smr.errors import SmrError


async def serve(settings: config.Settings) -> None:
    if not settings.nats_url:
        raise SmrError("the node agent needs a NATS server", code="config-invalid",
                       hint="set SMR_NATS_URL (deploy/kustomize sets it)")
    tracing.setup("agent")
    bus = await Bus.connect(settings.nats_url, name=f"smr-agent-{settings.node}",
                            config=BusConfig.from_settings(settings))
    api = await api_client(settings.kube_api)
    store = make_store(settings)
    agent = NodeAgent(bus, api, store, settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)
    try:
        await agent.run()
    finally:
        await store.close()
        await api.close()
        await bus.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(serve(config.load()))
    except SmrError as e:
        print(f"smr agent: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
