"""A Jupyter kernel (ipykernel) as a local job, driven by a jupyter_client
client over ZeroMQ: a numpy array and a half-consumed generator survive a
heartbeat (the same client goes on) and a migration (a new client connects
with the kernel's connection file: the ports are kept). About 10 s here."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import jupyter_client
import pytest

from smr.jobs import launch
from smr.natsserver import free_port
from tests import nats_auth
from tests.programs.conftest import other_node
from tests.test_local_smr import Harness

pytestmark = pytest.mark.criu

CELLS = """
import numpy as np
a = np.arange(1_000_000, dtype=np.int64)
g = (i * i for i in range(100))
first = [next(g) for _ in range(3)]
"""


def client(conn_file: Path) -> Any:
    kc = jupyter_client.BlockingKernelClient(connection_file=str(conn_file))
    kc.load_connection_file()
    # The client's heartbeat gives a kernel 1 s to answer before calling it
    # dead: a loaded 2-core VM misses that while the kernel is alive.
    kc.hb_channel.time_to_dead = 10.0
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return kc


def run(kc: Any, code: str, **expressions: str) -> dict[str, str]:
    """Run a cell; the values of ``expressions`` after it, as the kernel prints them."""
    reply = kc.execute_interactive(code, user_expressions=expressions, timeout=60,
                                   output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", reply["content"]
    got = reply["content"]["user_expressions"]
    return {k: v["data"]["text/plain"] for k, v in got.items()}


async def test_jupyter_kernel_keeps_its_variables_through_a_heartbeat_and_a_migration(
        h: Harness, criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path) -> None:
    conn_file = h.tmp / "kernel.json"
    jupyter_client.connect.write_connection_file(
        str(conn_file), ip="127.0.0.1", key=uuid.uuid4().hex.encode(),
        shell_port=free_port(), iopub_port=free_port(), stdin_port=free_port(),
        control_port=free_port(), hb_port=free_port())
    job = launch(f"kernel-{uuid.uuid4().hex[:6]}",
                 [sys.executable, "-m", "ipykernel_launcher", "-f", str(conn_file)],
                 log=h.tmp / "kernel.log", cwd=h.tmp, node=h.settings.node)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    kc = await asyncio.to_thread(client, conn_file)
    assert await asyncio.to_thread(run, kc, CELLS, first="first") == {"first": "[0, 1, 4]"}

    beat = await h.checkpoint(job.id, leave_running=True)
    assert beat.status == "succeeded", beat.error
    got = await asyncio.to_thread(run, kc, "b = a * 2", b="int(b.sum())", g="next(g)")
    assert got == {"b": str(2 * sum(range(1_000_000))), "g": "9"}, "the same client goes on"

    final = await h.checkpoint(job.id, reason="preemption")
    assert final.status == "succeeded", final.error
    kc.stop_channels()
    async with other_node(criu_binary, nats_users, tmp_path) as b:
        restored = await b.restore(job.id)
        assert restored.status == "succeeded", restored.error
        again = await asyncio.to_thread(client, conn_file)  # the same ports
        try:
            got = await asyncio.to_thread(run, again, "", a="int(a.sum())", g="next(g)",
                                          first="first", b="int(b[-1])")
        finally:
            again.stop_channels()
        assert got == {"a": str(sum(range(1_000_000))), "g": "16", "first": "[0, 1, 4]",
                       "b": str(2 * 999_999)}
        print("\n[compat] jupyter kernel local root migration: " + json.dumps(dict(
            image_bytes=final.size_bytes, heartbeat=beat.durations, final=final.durations,
            restore=restored.durations)))
