"""`smr status` reads every step the step-state bucket holds (a real
nats-server), however the read falls against the server's deliveries and
whatever steps write meanwhile. nats.py's end-of-values marker could come
first and make a read see nothing, and a step's keepalive written during a
read left that running step out."""

from __future__ import annotations

import asyncio
import random
import uuid

import orjson

from smr.bus import Bus
from smr.bus.topology import KV_STEPS
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
