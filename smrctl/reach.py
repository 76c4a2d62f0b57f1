"""How a command reaches the running smr: the bus of this machine's `smr up`
(its embedded NATS) or of SMR_NATS_URL. Without the services: a command that
only publishes or reads (checkpoint, restore, list, status) imports no
checkpointer, storage or Kubernetes client, about a second and a half of CPU
at every start."""

from __future__ import annotations

import asyncio

from smr.bus import KV_JOBS, KV_LOCKS, KV_STEPS, Bus, BusConfig
from smr.config import Settings
from smr.config_docs import without_credentials
from smr.contract.errors import SmrError
from smrctl.uplock import url_of_running

# The KV buckets a node uses: its NATS user on a shared NATS may read no others
# (local-node.conf.template).
BUCKETS = (KV_JOBS, KV_LOCKS, KV_STEPS)


async def connect(settings: Settings) -> Bus:
    """The bus of the running `smr up` (or SMR_NATS_URL) for CLI commands."""
    url = settings.nats_url
    if not url:
        url = await url_of_running(settings)
    if not url:
        # Name the data directory: a `smr up` run with another SMR_DATA_DIR
        # (or HOME, or user) is invisible here, and starting one more is
        # not what the user needs then.
        raise SmrError(f"smr is not running on this machine (no `smr up` holds "
                       f"{settings.data_path})", code="not-running",
                       hint="start it with `smr up` (or set SMR_NATS_URL); if it runs with "
                       "another SMR_DATA_DIR or HOME, run this command with the same")
    try:
        # The node's buckets only: on a shared NATS the CLI logs in as its
        # node's `smr up` (SMR_NATS_USER), which may read no others.
        return await asyncio.wait_for(Bus.connect(url, name="smr-cli",
                                                  config=BusConfig.from_settings(settings),
                                                  buckets=BUCKETS), 10)
    except (TimeoutError, OSError) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise SmrError(f"cannot reach smr's NATS at {without_credentials(url)}: {why}",
                       code="not-running",
                       hint="start it with `smr up` (or fix SMR_NATS_URL)") from None
