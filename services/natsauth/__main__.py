"""``python -m services.natsauth`` (``smr natsauth``): the NATS auth callout's
entry point (deploy/kustomize/components/nats-callout)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
from kubernetes_asyncio import client

from services.kubeapi import api_client
from services.natsauth.callout import Callout
from services.natsauth.nkeys import KeyPair
from smr import config, serve
from smr.contract.errors import ConfigError

NEEDS_BUS = False  # core NATS only, as smr-natsauth: no stream, no bucket


class NatsAuth:
    def __init__(self, api: Any, settings: config.Settings) -> None:
        self.api, self.s = api, settings
        self.ready = asyncio.Event()
        self.callout: Callout | None = None
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        if not (self.s.nats_callout_seed_file and self.s.nats_agent_template):
            raise ConfigError("smr natsauth needs the issuer's seed and the agent's template",
                              hint="set SMR_NATS_CALLOUT_SEED_FILE and SMR_NATS_AGENT_TEMPLATE")
        issuer = KeyPair.from_seed(Path(self.s.nats_callout_seed_file).read_text())
        template = Path(self.s.nats_agent_template).read_text()
        nc = await nats.connect([u.strip() for u in self.s.nats_url.split(",") if u.strip()],
                                name="smr-natsauth", user=self.s.nats_user or None,
                                password=self.s.nats_password or None,
                                max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        try:
            self.callout = Callout(nc, client.AuthenticationV1Api(self.api), issuer, template)
            await self.callout.start()
            self.ready.set()
            await self._stop.wait()
        finally:
            await nc.drain()


async def make(_: Any, settings: config.Settings) -> tuple[serve.Service, list[serve.Cleanup]]:
    api = await api_client(settings.kube_api, settings.kube_token_file)
    return NatsAuth(api, settings), [api.close]


if __name__ == "__main__":
    serve.main("natsauth", make, needs_bus=NEEDS_BUS)
