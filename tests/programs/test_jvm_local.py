"""A JVM service as a local job, as nobody: its counter map survives a
heartbeat and a migration, with 30+ threads, and the restored JVM answers
with its hot method still compiled: the JIT compiles nothing of it again (its
own log says so). About 15 s here."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from smr.natsserver import free_port
from tests import nats_auth
from tests.programs import jvm
from tests.programs import node as http
from tests.programs.conftest import other_node
from tests.test_local_smr import Harness
from tests.test_sockets import start

pytestmark = pytest.mark.criu


def threads(pid: int) -> int:
    """Threads of the JVM: the job's init's child (smr-init --local runs it)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    child = int(kids[0])
    grand = Path(f"/proc/{child}/task/{child}/children").read_text().split()
    java = int(grand[0]) if grand else child  # setpriv execs java: no grandchild
    return len(os.listdir(f"/proc/{java}/task"))


async def test_jvm_keeps_its_map_threads_and_compiled_code_through_a_migration(
        h: Harness, criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="smr-jvm-") as d:  # nobody reads it
        os.chmod(d, 0o755)
        classes = jvm.compile_server(Path(d) / "classes")
        for p in (classes, *classes.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        port = free_port()
        job = await start(h, ["setpriv", "--reuid=nobody", "--regid=nogroup",
                              "--clear-groups", *jvm.java_cmd(classes, port)], port=port)
        log = Path(job.log)
        for i in range(400):  # warm-up: the JIT compiles Counter.work
            http.get(port, f"/inc/k{i % 3}")
        deadline = time.monotonic() + 30
        while not jvm.work_fully_compiled(log.read_text()):
            assert time.monotonic() < deadline, "Counter.work was never compiled"
            http.get(port, "/")
        n_threads = threads(job.pid)
        assert n_threads >= 30
        warm = http.get(port)["work_ns"]

        beat = await h.checkpoint(job.id, leave_running=True)
        assert beat.status == "succeeded", beat.error
        assert http.get(port, "/inc/k0")["counts"]["k0"] == 135

        compiled = jvm.compilations_of_work(log.read_text())
        final = await h.checkpoint(job.id, reason="preemption")
        assert final.status == "succeeded", final.error
        async with other_node(criu_binary, nats_users, tmp_path) as b:
            restored = await b.restore(job.id)
            assert restored.status == "succeeded", restored.error
            first = http.get(port)
            assert first["counts"] == {"k0": 135, "k1": 133, "k2": 133}
            for _ in range(50):
                http.get(port, "/inc/k1")
            assert http.get(port)["counts"]["k1"] == 183
            assert threads(restored.pid or 0) == n_threads
            # The JIT's log still reaches the file: a method first run now is compiled.
            deadline = time.monotonic() + 30
            while not jvm.cold(1).search(log.read_text()):
                assert time.monotonic() < deadline, "no compilation logged after the restore"
                http.get(port, "/cold1")
            assert jvm.compilations_of_work(log.read_text()) == compiled, (
                "Counter.work was compiled again after the restore: a second warm-up")
            print("\n[compat] jvm local non-root migration: " + json.dumps(dict(
                threads=n_threads, work_ns_warm=warm, work_ns_first_after=first["work_ns"],
                image_bytes=final.size_bytes, heartbeat=beat.durations,
                final=final.durations, restore=restored.durations)))
