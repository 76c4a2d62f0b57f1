"""A cluster service as its pod runs it (smr/serve.py): the probes' endpoints
answer, and SIGTERM stops it cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp

from services.storage.__main__ import make
from smr import config, serve
from smr.natsserver import NatsServer, free_port


async def test_storage_service_answers_probes_and_stops_on_sigterm(
        nats_server: NatsServer, tmp_path: Path) -> None:
    port = free_port()
    s = config.load({}).replace(nats_url=nats_server.url, health_port=port,
                                storage_path=str(tmp_path / "store"), node_name="probe-test")
    task = asyncio.create_task(serve.serve("storage", s, make))
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            try:
                async with http.get(f"{url}/readyz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("/readyz never answered 200")
        async with http.get(f"{url}/livez") as r:
            assert r.status == 200
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 15)
    assert task.exception() is None
