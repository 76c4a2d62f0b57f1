"""Node.js as a local job, as an unprivileged user: its in-memory state and
its timer through a heartbeat and a migration (a final checkpoint, the
restore by another node). About 5 s here."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from smr.natsserver import free_port
from tests import nats_auth
from tests.programs import node as nodejs
from tests.programs.conftest import other_node
from tests.test_local_smr import Harness
from tests.test_sockets import start

pytestmark = pytest.mark.criu


async def test_nodejs_keeps_its_map_and_its_timer_through_a_heartbeat_and_a_migration(
        h: Harness, criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="smr-node-") as d:  # nobody reads it
        os.chmod(d, 0o755)
        script = Path(d) / "server.js"
        script.write_bytes(nodejs.SERVER)
        script.chmod(0o644)
        await run_through(h, script, criu_binary, nats_users, tmp_path)


async def run_through(h: Harness, script: Path, criu_binary: str, nats_users: nats_auth.SecuredNats,
                      tmp_path: Path) -> None:
    port = free_port()
    job = await start(h, ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                          nodejs.node_binary(), str(script), str(port)], port=port)
    for k in ("a", "b", "a"):
        nodejs.get(port, f"/inc/{k}")
    beat = await h.checkpoint(job.id, leave_running=True)
    assert beat.status == "succeeded", beat.error
    assert nodejs.get(port, "/inc/c")["counts"] == {"a": 2, "b": 1, "c": 1}

    before, t = nodejs.get(port)["ticks"], time.monotonic()
    final = await h.checkpoint(job.id, reason="preemption")
    assert final.status == "succeeded", final.error
    async with other_node(criu_binary, nats_users, tmp_path) as b:
        restored = await b.restore(job.id)
        assert restored.status == "succeeded", restored.error
        state = nodejs.get(port)
        nodejs.assert_timer_kept_its_rhythm(before, state["ticks"], time.monotonic() - t)
        assert state["counts"] == {"a": 2, "b": 1, "c": 1}
        assert nodejs.get(port, "/inc/a")["counts"]["a"] == 3  # and it goes on counting
        print("\n[compat] nodejs local non-root migration: " + json.dumps(dict(
            image_bytes=final.size_bytes, heartbeat=beat.durations, final=final.durations,
            restore=restored.durations)))
