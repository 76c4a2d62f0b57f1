"""A cluster service as its pod runs it (smr/serve.py): the probes' endpoints
answer, its /metrics is served, and SIGTERM stops it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.storage.__main__ import BUCKETS, make
from services.storage.local import LocalBackend
from services.storage.store import CheckpointStore
from smr import config, serve
from smr.contract.messages import Target, epoch
from smr.natsserver import free_port
from tests import nats_auth


def as_deployed(nats: nats_auth.SecuredNats, **kw: object) -> config.Settings:
    """The storage service's settings as its Deployment gives them: NATS with
    the shipped users, logged in as smr-storage (SMR_NATS_USER, SMR_NATS_PASSWORD).
    /metrics only where a test asks for it, on a port of its own: the default
    (9464) is every service's, and other tests' services run beside it."""
    kw.setdefault("metrics_port", 0)
    return config.load({}).replace(nats_url=nats.url, nats_user="smr-storage",
                                   nats_password=nats.passwords["smr-storage"], **kw)


async def until(check: Callable[[], Awaitable[bool]], task: asyncio.Task[None], what: str,
                timeout: float = 60) -> None:
    """Wait until ``check`` holds, while the service ``task`` runs: a service
    that ended (a port it could not bind) fails the test with its error."""
    deadline = time.monotonic() + timeout
    while True:
        if task.done():
            raise AssertionError(f"the service ended before {what}: {task.exception()!r}")
        with contextlib.suppress(aiohttp.ClientConnectionError):
            if await check():
                return
        assert time.monotonic() < deadline, f"never {what} in {timeout:.0f} s"
        await asyncio.sleep(0.1)


async def test_storage_service_answers_probes_and_stops_on_sigterm(
        nats_users: nats_auth.SecuredNats, tmp_path: Path) -> None:
    port = free_port()
    s = as_deployed(nats_users, health_port=port, storage_path=str(tmp_path / "store"),
                    node_name="probe-test")
    task = asyncio.create_task(serve.serve("storage", s, make, buckets=BUCKETS))
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        async def ready() -> bool:
            async with http.get(f"{url}/readyz") as r:
                return r.status == 200
        await until(ready, task, "/readyz answered 200")
        async with http.get(f"{url}/livez") as r:
            assert r.status == 200
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 15)
    assert task.exception() is None


async def test_a_service_serves_its_metrics_on_the_metrics_port(
        nats_users: nats_auth.SecuredNats, tmp_path: Path) -> None:
    """The storage service as its Deployment runs it: /metrics on
    SMR_METRICS_PORT, with what storage holds (read from storage at start)."""
    store = CheckpointStore(LocalBackend(tmp_path / "store"))
    src = tmp_path / "img"
    (src / "images").mkdir(parents=True)
    (src / "images" / "pages-1.img").write_bytes(os.urandom(4096))
    gen = await store.commit("local", "served", src, {
        "request_id": "served-1", "node": "n1", "reason": "api",
        "target": Target.job("served").to_dict(), "versions": {"criu": "4.2.1"}})
    port = free_port()
    s = as_deployed(nats_users, metrics_port=port, storage_path=str(tmp_path / "store"),
                    node_name="metrics-test")
    task = asyncio.create_task(serve.serve("storage", s, make, buckets=BUCKETS))
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    async with aiohttp.ClientSession() as http:
        async def served() -> bool:
            nonlocal samples
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                       for f in text_string_to_metric_families(text) for x in f.samples}
            return bool(samples.get(("smr_latest_checkpoint_timestamp_seconds", (
                ("checkpoint_id", "served"), ("checkpoint_namespace", "local")))))
        await until(served, task, "/metrics showed the stored checkpoint")
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 15)
    assert samples[("smr_storage_generations", ())] == 1
    assert samples[("smr_storage_stored_bytes", ())] == gen.manifest["stored_bytes"]
    assert samples[("smr_latest_checkpoint_timestamp_seconds", (
        ("checkpoint_id", "served"), ("checkpoint_namespace", "local")))] == pytest.approx(
        epoch(gen.manifest["created_at"]), abs=0.01)
