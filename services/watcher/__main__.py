"""``python -m services.watcher`` (``smr watcher``): the watcher Deployment's entry point."""

from __future__ import annotations

from services.kubeapi import api_client
from services.watcher.service import Watcher
from smr import config, serve
from smr.bus import KV_BEATS, KV_EPISODES, KV_HEALTH, KV_STEPS, Bus

# The KV buckets it uses: its NATS user may read no others. smr-steps only
# read (its user may not write it), to recreate a drained bare pod once its
# checkpoint is over; smr-health holds its probe of the webhook.
BUCKETS = (KV_BEATS, KV_EPISODES, KV_HEALTH, KV_STEPS)


async def make(bus: Bus, settings: config.Settings) -> tuple[serve.Service, list[serve.Cleanup]]:
    api = await api_client(settings.kube_api, settings.kube_token_file)
    return Watcher(bus, api, settings), [api.close]


if __name__ == "__main__":
    serve.main("watcher", make, buckets=BUCKETS)
