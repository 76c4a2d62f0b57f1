"""Processes that hold sockets, checkpointed and restored for real: redis-server
and Python's http.server (programs nobody here wrote), driven through NATS
like every other test, with real clients on the other end of the sockets.

What a user relies on: a server keeps its port and its data; a client's
connection survives a checkpoint that leaves the server running, and a stop
and restore on the same node; on a migration the connection is closed (the
client sees it at once and reconnects) and the restored server answers the
reconnect with its data intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.gpu.driver import CudaError, CudaState
from smr.jobs import Job, launch
from smr.natsserver import free_port
from smr.process import sockets
from smr.process.criu import Criu
from smr.process.criu_log import explain
from tests import nats_auth
from tests.test_local_smr import Harness, running
from tests.test_nothing_lost import FailingPuts, StandInDriver, ckpt_step

pytestmark = pytest.mark.criu

REDIS = shutil.which("redis-server")


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       storage_path=str(tmp_path / "store")) as harness:
        yield harness


async def start(h: Harness, cmd: list[str], *, port: int, tcp: str = "auto") -> Job:
    job = launch(f"srv-{uuid.uuid4().hex[:6]}", cmd, log=h.tmp / "server.log", cwd=h.tmp,
                 node=h.settings.node)
    job.tcp = tcp
    h.pids.append(job.pid)
    await h.jobs.put(job)
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return job
        assert time.monotonic() < deadline, (h.tmp / "server.log").read_text()[-2000:]
        await asyncio.sleep(0.05)


async def start_redis(h: Harness, *, tcp: str = "auto", keys: int = 20000
                      ) -> tuple[Job, int]:
    if REDIS is None:
        pytest.fail("redis-server is missing: `make setup` installs it")
    port = free_port()
    job = await start(h, [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--enable-debug-command", "local"],
                      port=port, tcp=tcp)
    r = client(port)
    r.execute_command("DEBUG", "POPULATE", keys, "key", 64)  # a dataset with content
    r.close()
    return job, port


def client(port: int) -> redis.Redis:
    """One connection, no retries: a reset is seen, not hidden."""
    return redis.Redis(port=port, single_connection_client=True, socket_timeout=10,
                       retry=None)


def digest(port: int) -> str:
    r = client(port)
    try:
        return str(r.execute_command("DEBUG", "DIGEST"))
    finally:
        r.close()


async def test_redis_keeps_its_port_and_data_across_checkpoint_and_restore(h: Harness
                                                                           ) -> None:
    job, port = await start_redis(h)
    before = digest(port)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    assert done.sockets and f"tcp 127.0.0.1:{port}" in done.sockets["listening"]
    with pytest.raises(OSError):  # stopped: nothing listens any more
        socket.create_connection(("127.0.0.1", port), timeout=1)

    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    assert digest(port) == before, "the dataset changed across the restore"
    fresh = redis.Redis(port=port)  # a new client, a new connection
    assert fresh.set("after", "restore") and fresh.get("after") == b"restore"
    assert fresh.dbsize() == 20001
    fresh.close()


async def test_http_server_answers_on_its_port_after_restore(h: Harness) -> None:
    site = h.tmp / "site"
    site.mkdir()
    (site / "index.html").write_text("hello from before the checkpoint\n")
    port = free_port()
    job = await start(h, [sys.executable, "-m", "http.server", str(port), "--bind",
                          "127.0.0.1", "--directory", str(site)], port=port)

    def get() -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/index.html")
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    assert get() == (200, b"hello from before the checkpoint\n")
    assert (await h.checkpoint(job.id)).status == "succeeded"
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    assert restored.sockets and restored.sockets["listening"] == [f"tcp 127.0.0.1:{port}"]
    assert get() == (200, b"hello from before the checkpoint\n")


async def test_client_connection_survives_leave_running_checkpoint_and_same_node_restore(
        h: Harness) -> None:
    job, port = await start_redis(h)
    r = client(port)
    me = r.client_id()
    assert r.incr("n") == 1
    beat = await h.checkpoint(job.id, leave_running=True)
    assert beat.status == "succeeded", beat.error
    assert beat.sockets and beat.sockets["established"] >= 1
    assert beat.sockets["connections"] == "kept"
    # The same connection goes on: the server knows it under the same id.
    assert r.incr("n") == 2 and r.client_id() == me

    # Stopped and restored on this node: the connection comes back with it.
    stop = await h.checkpoint(job.id)
    assert stop.status == "succeeded" and stop.sockets["connections"] == "kept"
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    assert restored.sockets and restored.sockets["connections"] == "kept"
    assert r.incr("n") == 3 and r.client_id() == me
    r.close()


async def test_migration_closes_connections_and_clients_reconnect(
        h: Harness, criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path
        ) -> None:
    job, port = await start_redis(h)
    r = client(port)
    for _ in range(5):
        r.incr("n")
    before = digest(port)
    # The node is going away: its final checkpoint closes the connections.
    done = await h.checkpoint(job.id, reason="preemption")
    assert done.status == "succeeded", done.error
    assert done.sockets and done.sockets["connections"] == "closed"
    with pytest.raises(redis.ConnectionError):  # the client sees it at once
        r.incr("n")

    # Node b (another embedded node, the same storage) restores it.
    async with running(Harness, criu_binary, nats_users, tmp_path / "b",
                       f"node-b-{uuid.uuid4().hex[:6]}", 5.0,
                       storage_path=str(tmp_path / "store")) as b:
        restored = await b.restore(job.id)
        assert restored.status == "succeeded", restored.error
        assert restored.node != done.node
        assert restored.sockets and restored.sockets["connections"] == "closed"
        # The client reconnects (a new connection) and finds its data.
        again = client(port)
        assert digest(port) == before
        assert again.incr("n") == 6
        again.close()


async def test_close_policy_closes_connections_even_on_a_heartbeat(h: Harness) -> None:
    job, port = await start_redis(h, tcp="close")
    r = client(port)
    r.incr("n")
    beat = await h.checkpoint(job.id, leave_running=True)
    assert beat.status == "succeeded", beat.error
    assert beat.sockets and beat.sockets["tcp"] == "close"
    assert r.incr("n") == 2, "the running server's live connection is not touched"
    r.close()


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[Path]:
    """A unix socket served by this test process: outside any job's tree."""
    path = tmp_path / "peer.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()
    accepted: list[socket.socket] = []
    t = threading.Thread(target=lambda: accepted.append(srv.accept()[0]), daemon=True)
    t.start()
    yield path
    for s in (*accepted, srv):
        s.close()


async def test_unix_socket_to_a_peer_outside_is_refused_naming_it(
        h: Harness, unix_server: Path) -> None:
    code = ("import socket, time; s = socket.socket(socket.AF_UNIX); "
            f"s.connect({str(unix_server)!r}); time.sleep(600)")
    job = launch(f"ux-{uuid.uuid4().hex[:6]}", [sys.executable, "-c", code],
                 log=h.tmp / "ux.log", cwd=h.tmp, node=h.settings.node)
    h.pids.append(job.pid)
    await h.jobs.put(job)
    await asyncio.sleep(0.5)
    done = await h.checkpoint(job.id)
    assert done.status == "failed"
    assert done.error and done.error["code"] == "external-unix-socket"
    assert str(unix_server) in done.error["message"]
    assert job.alive(), "a refused checkpoint leaves the job running"


# -- the decisions and the version check, without CRIU -------------------------------

@pytest.mark.parametrize(("policy", "leave_running", "reason", "netns", "want"), [
    ("auto", True, "heartbeat", True, "keep"),
    ("auto", True, "cordon", False, "keep"),    # a pod's cordon: live connections go on
    ("auto", False, "api", True, "keep"),       # stop, resume here
    ("auto", False, "preemption", True, "close"),
    ("auto", False, "drain", True, "close"),
    ("auto", False, "api", False, "close"),     # a pod: always a new network namespace
    ("close", True, "heartbeat", True, "close"),
])
def test_dump_mode(policy: str, leave_running: bool, reason: str, netns: bool,
                   want: str) -> None:
    assert sockets.dump_mode(policy=policy, leave_running=leave_running, reason=reason,
                             same_netns_possible=netns) == want
    assert sockets.dump_mode(policy=policy, leave_running=leave_running, reason=reason,
                             requested="close") == "close"


def test_a_final_pod_checkpoint_asked_to_keep_its_connections_closes_them() -> None:
    """A pod is restored in a new network namespace (restore_mode closes its
    connections whatever the checkpoint did): connections kept by its final
    dump would only stay locked, their peers waiting for a TCP timeout
    instead of a reset, and if the dump cannot be stored the workload runs on
    with them dead (nothing unlocks a pod's: smr.process.netlock is local jobs')."""
    assert sockets.dump_mode(policy="auto", leave_running=False, reason="api",
                             requested="keep", same_netns_possible=False) == "close"
    assert sockets.dump_mode(policy="auto", leave_running=False, reason="drain",
                             requested="keep") == "keep", "a local job's choice"


def test_restore_mode() -> None:
    final_kept = {"sockets": {"tcp": "keep"}, "leave_running": False}
    assert sockets.restore_mode(final_kept, same_place=True) == "keep"
    assert sockets.restore_mode(final_kept, same_place=False) == "close"
    beat = {"sockets": {"tcp": "keep"}, "leave_running": True}
    assert sockets.restore_mode(beat, same_place=True) == "close"
    assert sockets.restore_mode({}, same_place=True) == "close"  # older manifests


def test_inventory_reads_the_sockets_a_process_holds() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    peer, _ = srv.accept()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    try:
        held = sockets.inventory([os.getpid()])
        assert f"tcp 127.0.0.1:{port}" in held["listening"]
        assert held["established"] >= 2 and held["udp"] >= 1
    finally:
        for s in (srv, cli, peer, udp):
            s.close()


@pytest.mark.parametrize(("criu", "kernel", "bad"), [
    ("4.1.1", "6.18.44-fc", True), ("4.2.1", "6.18.44-fc", False),
    ("4.1.1", "6.12.0", False), ("3.17.1", "6.16.0-rc1", True),
])
async def test_criu_too_old_for_the_kernel_is_named(criu: str, kernel: str, bad: bool,
                                                     monkeypatch: Any) -> None:
    c = Criu("criu")
    c._version = criu
    monkeypatch.setattr("smr.process.criu.platform.release", lambda: kernel)
    problem = await c.problem()
    assert bool(problem) == bad
    if bad:
        assert problem and f"CRIU {criu}" in problem and "4.2" in problem


def test_explain_quotes_the_external_socket(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text("(00.06) unix: \tRunaway socket: ino 14503 peer_ino 14561 family    1 "
                   "type    1 state  1 name /run/app.sock\n(00.06) Error (criu/sk-unix.c:874): "
                   "unix: External socket is used. Consider using --ext-unix-sk option.\n")
    what, code, hint = explain(log) or ("", "", "")
    assert code == "external-unix-socket" and "/run/app.sock" in what and hint



def test_a_taken_proc_mount_point_is_named_and_retried(tmp_path: Path) -> None:
    """CRIU's parasite mounts a /proc at proc.crtools in the working directory
    of a tree whose first process does not see its own namespace's /proc (a
    local job under smr-init --local); the fresh-clone CI saw that name taken
    once, as a bare permanent `criu-dump-failed`. The log line is CRIU 4.2's
    (criu/pie/parasite.c:634), as the CI's dump.log quoted it."""
    from smr.process.criu_log import TEMPORARY

    log = tmp_path / "dump.log"
    log.write_text("pie: 1: Error (criu/pie/parasite.c:634): Can't create a directory (-17)\n")
    what, code, hint = explain(log) or ("", "", "")
    assert code == "criu-proc-mountpoint-taken" and code in TEMPORARY
    assert "proc.crtools" in what and "proc.crtools" in hint


# Python's socketserver as its defaults are: no SO_REUSEADDR, and the server
# closes each connection first, so each one it served waits in TIME_WAIT on
# the listening port for a minute after the job is gone.
COUNTER_SERVER = """
import socketserver, sys
served = 0
class Count(socketserver.StreamRequestHandler):
    def handle(self):
        global served
        served += 1
        self.wfile.write(b"%d\\n" % served)
socketserver.TCPServer(("127.0.0.1", int(sys.argv[1])), Count).serve_forever()
"""


async def test_a_server_restored_on_its_host_waits_out_the_time_wait_of_its_own_connections(
        h: Harness) -> None:
    port = free_port()
    job = await start(h, [sys.executable, "-c", COUNTER_SERVER, str(port)], port=port)

    def ask() -> int:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            f = c.makefile("rb")
            served = int(f.readline())
            # Closed only after the server's own close (its EOF): the server
            # closes first, so its end waits in TIME_WAIT, whoever runs first.
            assert f.read() == b""
            return served

    first = ask()  # start() connected once too
    assert first >= 1
    assert (await h.checkpoint(job.id)).status == "succeeded"
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    assert restored.durations.get("time_wait", 0) > 0, restored.durations
    assert ask() == first + 1, "the restored server lost its count"

# -- connections of a job whose dump leaves it stopped: a GPU job's heartbeat
# (--leave-stopped, so its GPU state comes back before it runs) and a final
# checkpoint that cannot be stored. CRIU unlocks the TCP connections it dumped
# only for a tree it lets run: a GPU job's connections (a parameter server,
# NCCL's TCP bootstrap, a data service) must go on as a CPU job's do. The CUDA
# driver is the stand-in of tests/test_nothing_lost.py (no GPU here).

class OldDriver(StandInDriver):
    """A driver without cuCheckpointProcessGetRestoreThreadId (before 570):
    the stopped tree is continued, then its GPU state restored."""

    def restore_tid(self, pid: int) -> int | None:
        if pid not in self.states:
            raise CudaError(f"{pid}: no CUDA context (stand-in)")
        return None


async def test_a_gpu_jobs_connection_goes_on_after_a_heartbeat(h: Harness) -> None:
    """A GPU job's heartbeat leaves its tree stopped until its GPU state is
    back; its client's connection goes on after it as a CPU job's does."""
    step = ckpt_step(h)
    drv = OldDriver()
    step.cuda = CudaCheckpoint(drv)  # type: ignore[arg-type]
    job, port = await start_redis(h, keys=1000)
    drv.states[job.pid] = CudaState.RUNNING  # "holds a GPU"
    r = client(port)
    me = r.client_id()
    assert r.incr("n") == 1
    beat = await h.checkpoint(job.id, leave_running=True)
    assert beat.status == "succeeded", beat.error
    assert drv.states[job.pid] is CudaState.RUNNING
    assert beat.sockets and beat.sockets["connections"] == "kept"
    try:
        n = r.incr("n")
    except Exception as e:
        raise AssertionError(f"the GPU job's client connection died at its heartbeat: "
                             f"{type(e).__name__}: {e}") from None
    assert n == 2 and r.client_id() == me
    r.close()


async def test_a_final_checkpoint_that_cannot_be_stored_leaves_the_connections_working(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str) -> None:
    """Storage stays down past the commit deadline after a final dump that
    kept the job's connections (held stopped, for a restore on this node):
    the request fails and the job runs on where it was (nothing lost), and
    so must its clients' connections."""
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       storage_path=str(tmp_path / "store"), commit_deadline=6.0) as node_h:
        job, port = await start_redis(node_h, keys=1000)
        r = client(port)
        assert r.incr("n") == 1
        await unstorable_final_checkpoint(node_h, job.id)
        assert_counts_on(r, 2)
        # Nor is the connection left in CRIU's lock table on the node (its
        # packets dropped should the 4-tuple come back, the table kept for ever).
        mine = r.connection._sock.getsockname()[1]  # type: ignore[union-attr]
        assert f". {mine} ." not in locked(), f"port {mine} still in CRIU's lock: {locked()}"
        r.close()


async def unstorable_final_checkpoint(node_h: Harness, job_id: str) -> None:
    """A final checkpoint of ``job_id`` whose manifest storage refuses past
    the commit deadline: it fails as storage-unavailable."""
    fault = FailingPuts(ckpt_step(node_h).store.backend, "manifest.json", times=None)
    try:
        done = await node_h.checkpoint(job_id)
    finally:
        fault.restore()
    assert done.status == "failed" and done.error, done
    assert done.error["code"] == "storage-unavailable", done.error


def assert_counts_on(r: Any, n: int) -> None:
    """The job's client, on the connection it had, gets its next count."""
    try:
        got = r.incr("n")
    except Exception as e:
        raise AssertionError(f"the job runs on, its client's connection does not: "
                             f"{type(e).__name__}: {e}") from None
    assert got == n


def locked() -> str:
    """The connections CRIU's lock tables on this node drop (their set elements)."""
    out = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True,
                         check=True).stdout
    return "\n".join(line for line in out.splitlines() if "elements" in line or ". " in line)
