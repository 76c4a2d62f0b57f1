"""`smr status` reads every step the step-state bucket holds (a real
nats-server), however the read falls against the server's deliveries and
whatever steps write meanwhile. nats.py's end-of-values marker could come
first and make a read see nothing, and a step's keepalive written during a
read left that running step out. A step that expires (the bucket's TTL) in
the middle of a read must not keep it waiting while others write."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats.js.errors
import orjson
import pytest

from smr import config
from smr.bus import Bus, BusConfig
from smr.bus.topology import KV_STEPS
from smr.natsserver import NatsServer
from smrctl.status import step_states

READS = 300


async def test_every_read_holds_every_step_while_steps_write(bus: Bus) -> None:
    kv = bus.kv(KV_STEPS)
    mine = [f"read-{uuid.uuid4().hex[:8]}-{i}" for i in range(20)]
    for k in mine:
        await kv.put(k, orjson.dumps({"state": "running", "beat": 0}))
    gone = f"read-{uuid.uuid4().hex[:8]}-deleted"
    await kv.put(gone, orjson.dumps({"state": "done"}))
    await kv.delete(gone)
    stop = asyncio.Event()

    async def keepalives() -> None:  # running steps refresh their state
        beat = 0
        while not stop.is_set():
            beat += 1
            await kv.put(random.choice(mine), orjson.dumps({"state": "running", "beat": beat}))
            await asyncio.sleep(0.002)

    writer = asyncio.create_task(keepalives())
    short = []
    try:
        for n in range(READS):
            got = await step_states(bus)
            if lost := [k for k in mine if k not in got]:
                short.append((n, len(lost)))
            assert gone not in got, "a deleted step was shown"
    finally:
        stop.set()
        await writer
        for k in mine:
            await kv.delete(k)
    assert not short, f"reads that left steps out (read, how many) of {READS}: {short}"


@pytest.fixture
async def own_bus(settings: config.Settings, tmp_path: Path) -> AsyncIterator[Bus]:
    """A nats-server of this test's own: it shortens the bucket's TTL, which
    would expire the steps of every other test on the session's server."""
    srv = NatsServer(settings.nats_server_binary(), tmp_path / "nats",
                     die_with_parent=True).start()
    bus = await Bus.connect(srv.url, name="test", config=BusConfig())
    try:
        yield bus
    finally:
        await bus.close()
        srv.stop()


async def test_a_read_ends_when_a_step_it_awaits_expires_while_others_write(
        own_bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    bus, kv = own_bus, own_bus.kv(KV_STEPS)
    old, running = "expiring", "running"
    await kv.put(old, orjson.dumps({"state": "done"}))
    await asyncio.sleep(1.5)  # older than the TTL below
    await kv.put(running, orjson.dumps({"state": "running", "beat": 0}))
    listed = bus.kv_keys

    async def listed_then_expired(bucket: str) -> list[str]:
        keys = await listed(bucket)
        if old not in keys:
            return keys
        # Right after it is listed, `old` reaches the bucket's TTL (shortened
        # for a moment): the server drops it and sends nothing for it.
        name = f"KV_{KV_STEPS}"
        cfg = (await bus.js.stream_info(name)).config
        ttl, window = cfg.max_age, cfg.duplicate_window
        cfg.max_age = cfg.duplicate_window = 1.0
        await bus.js.update_stream(cfg)
        try:
            for _ in range(100):
                try:
                    await kv.get(old)
                except nats.js.errors.KeyNotFoundError:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"{old} did not expire")
        finally:
            cfg.max_age, cfg.duplicate_window = ttl, window
            await bus.js.update_stream(cfg)
        return keys

    monkeypatch.setattr(bus, "kv_keys", listed_then_expired)
    stop = asyncio.Event()

    async def keepalive() -> None:  # more often than any idle timeout
        beat = 0
        while not stop.is_set():
            beat += 1
            await kv.put(running, orjson.dumps({"state": "running", "beat": beat}))
            await asyncio.sleep(0.2)

    writer = asyncio.create_task(keepalive())
    try:
        got = await asyncio.wait_for(step_states(bus), timeout=30)
    finally:
        stop.set()
        await writer
    assert running in got and old not in got, got
