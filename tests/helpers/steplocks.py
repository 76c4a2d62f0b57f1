"""The step locks of a test's node (smr/bus/liveness.py): one directory per
node name, so every worker a test starts for one node shares it, as the
workers of a real node do (a helper process such as slow_worker.py too: it
inherits SMR_TEST_STEP_LOCKS). Under the test session's own temporary
directory (tests/conftest.py), never one that another session's tests share.

Also a job's lock held in the bus by a long step of another worker, alive."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import orjson

from smr.aio import wait_event
from smr.bus import KV_LOCKS, KV_STEPS, Bus, StepLocks, node_token

ENV = "SMR_TEST_STEP_LOCKS"


def node_locks(node: str) -> StepLocks:
    root = os.environ.get(ENV) or os.environ.setdefault(
        ENV, tempfile.mkdtemp(prefix="smr-step-locks-"))
    return StepLocks(Path(root) / node_token(node))


async def hold_lock(bus: Bus, job_id: str, holder: str, stop: asyncio.Event) -> None:
    """A long step of another worker on ``job_id``: it holds the job's lock
    and keeps its step state's heartbeat fresh until ``stop``."""
    await bus.kv(KV_LOCKS).put(job_id, orjson.dumps({"request_id": holder, "at": time.time()}))
    while not stop.is_set():
        await bus.kv(KV_STEPS).put(holder, orjson.dumps(
            {"state": "running", "owner": "elsewhere", "heartbeat": time.time(),
             "subject": "ckpt.requested.x", "checkpoint_id": job_id}))
        await wait_event(stop, 0.5)
    await bus.kv(KV_STEPS).put(holder, orjson.dumps({"state": "done", "result": {}}))
    await bus.kv(KV_LOCKS).delete(job_id)
