"""A Kubernetes API client from the settings, for every program that talks to
the API server (the watcher, the webhook, the node agent, the NATS auth
callout). The watcher's informers (services/watcher/kube.py) take one."""

from __future__ import annotations

import os

from kubernetes_asyncio import client, config

from smr.errors import ConfigError


async def api_client(url: str = "") -> client.ApiClient:
    """``url`` (tests, ``kubectl proxy``); else in-cluster; else ~/.kube/config."""
    cfg = client.Configuration()
    if url:
        cfg.host = url
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        try:
            await config.load_kube_config(client_configuration=cfg)
        except Exception as e:
            raise ConfigError(f"no Kubernetes API to talk to: {e}",
                              hint="run in a cluster, provide ~/.kube/config, or set "
                                   "SMR_KUBE_API") from None
    return client.ApiClient(configuration=cfg)
