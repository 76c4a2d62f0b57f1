"""A Kubernetes API client from the settings, for every program that talks to
the API server (the watcher, the webhook, the node agent, the NATS auth
callout). The watcher's informers (services/watcher/kube.py) take one."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kubernetes_asyncio import client, config

from smr.contract.errors import ConfigError

TOKEN_REREAD_S = 60  # a projected service account token is rotated in its file


def _read_token(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the Kubernetes API token: {e}",
                          hint="point SMR_KUBE_TOKEN_FILE at a service account token, or "
                               "leave it empty") from None


async def api_client(url: str = "", token_file: str = "", *,
                     token: str = "") -> client.ApiClient:
    """``url`` (tests, ``kubectl proxy``), as the bearer ``token`` or the one
    in ``token_file`` (a service account's) if given; else in-cluster; else
    ~/.kube/config."""
    cfg = client.Configuration()
    if url:
        cfg.host = url
        if token_file:
            token = _read_token(token_file)
            read_at = time.monotonic()

            def refresh(c: client.Configuration) -> None:
                nonlocal read_at
                if time.monotonic() - read_at > TOKEN_REREAD_S:
                    c.api_key["BearerToken"] = _read_token(token_file)
                    read_at = time.monotonic()

            cfg.refresh_api_key_hook = refresh
        if token:
            cfg.api_key = {"BearerToken": token}
            cfg.api_key_prefix = {"BearerToken": "Bearer"}
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
