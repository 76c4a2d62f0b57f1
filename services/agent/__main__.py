"""``python -m services.agent`` (``smr agent``): the node agent DaemonSet's entry point."""

from __future__ import annotations

from services.agent.service import NodeAgent
from services.kubeapi import api_client
from services.storage.settings import make_store
from smr import config, serve
from smr.bus import KV_LOCKS, KV_STEPS, KV_TIMINGS, Bus

# The KV buckets it uses: its NATS user may read no others.
BUCKETS = (KV_LOCKS, KV_STEPS, KV_TIMINGS)


async def make(bus: Bus, settings: config.Settings) -> tuple[serve.Service, list[serve.Cleanup]]:
    api = await api_client(settings.kube_api, settings.kube_token_file)
    store = make_store(settings)
    return NodeAgent(bus, api, store, settings), [store.close, api.close]


if __name__ == "__main__":
    serve.main("agent", make, buckets=BUCKETS)
