"""``python -m services.webhook`` (``smr webhook``): the webhook Deployment's entry point."""

from __future__ import annotations

from typing import Any

from services.kubeapi import api_client
from services.webhook.service import Webhook
from smr import config, serve

NEEDS_BUS = False  # it answers the API server first; NATS it reaches in the background


async def make(_: Any, settings: config.Settings) -> tuple[serve.Service, list[serve.Cleanup]]:
    api = None if settings.webhook_cert_dir else await api_client(
        settings.kube_api, settings.kube_token_file)
    return Webhook(api, settings), [api.close] if api else []


if __name__ == "__main__":
    serve.main("webhook", make, needs_bus=NEEDS_BUS)
