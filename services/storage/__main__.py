"""``python -m services.storage`` (``smr storage``): the storage Deployment's entry point."""

from __future__ import annotations

from services.kubeapi import api_client
from services.storage.mirror import Mirror
from services.storage.settings import make_storage_service, make_store
from smr import config, serve
from smr.bus import Bus

BUCKETS = ()  # it creates every stream and bucket, but reads none


async def make(bus: Bus, settings: config.Settings) -> tuple[serve.Service, list[serve.Cleanup]]:
    store = make_store(settings)
    if settings.checkpoint_resources == "off":
        return make_storage_service(bus, store, settings), [store.close]
    api = await api_client(settings.kube_api, settings.kube_token_file)
    mirror = Mirror(api, store)
    return make_storage_service(bus, store, settings, mirror), [store.close, api.close]


if __name__ == "__main__":
    serve.main("storage", make, buckets=BUCKETS)
