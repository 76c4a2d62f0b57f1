"""The network lock undone (smr.process.netlock): a checkpoint that stores nothing gives
the job its kept connections back, every one of them, whatever kind of dump
locked them. Real CRIU, real redis-server and a real Python server, real
clients on the other end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from smr.natsserver import free_port
from smr.process import netlock
from smr.process.criu import CriuRun
from tests import nats_auth
from tests.test_local_smr import Harness, running
from tests.test_nothing_lost import FailingPuts, ckpt_step
from tests.test_sockets import (  # noqa: F401
    assert_counts_on,
    client,
    h,
    locked,
    start,
    start_redis,
    unstorable_final_checkpoint,
)

pytestmark = pytest.mark.criu

# Answers each request once its client has sent all of it (shut its writing
# side: the server's socket is in CLOSE_WAIT meanwhile), and only once told
# to (the file "go"), like a server still working on a request.
HALF_CLOSED_SERVER = """
import os, socket, sys, time
port, where = int(sys.argv[1]), sys.argv[2]
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", port))
l.listen()
while True:
    s, _ = l.accept()
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    if not data:  # a probe
        s.close()
        continue
    open(os.path.join(where, "got"), "w").close()
    while not os.path.exists(os.path.join(where, "go")):
        time.sleep(0.05)
    s.sendall(b"reply to " + data)
    s.close()
"""


def drop_locks(port: int) -> None:
    """Delete the CRIU lock tables that hold a connection to ``port`` (this
    test's own server: a failing run leaves no table on the node; another
    test's tables are not touched)."""
    out = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    table, ours = "", set()
    for line in out.splitlines():
        if line.startswith("table inet CRIU-"):
            table = line.split()[2]
        elif table and f". {port} ." in line:
            ours.add(table)
    for t in ours:
        subprocess.run(["nft", "delete", "table", "inet", t], check=False)


async def wait_file(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.05)


async def test_a_half_closed_connection_is_answered_after_a_final_checkpoint_that_cannot_be_stored(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str) -> None:
    """A client sent its request and shut its side (HTTP/1.0 style, rsync,
    a `nc -N`); the server's socket is in CLOSE_WAIT, not ESTABLISHED, when
    a final checkpoint keeps it and cannot be stored. CRIU put it in repair
    mode like the established ones: the server's answer must still reach
    the client once the job runs on."""
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       storage_path=str(tmp_path / "store"), commit_deadline=4.0) as node_h:
        script = tmp_path / "server.py"
        script.write_text(HALF_CLOSED_SERVER)
        port = free_port()
        job = await start(node_h, [sys.executable, str(script), str(port), str(tmp_path)],
                          port=port)
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        stack = contextlib.ExitStack()
        stack.callback(drop_locks, port)
        stack.callback(c.close)
        c.sendall(b"hello")
        c.shutdown(socket.SHUT_WR)
        await wait_file(tmp_path / "got")
        await unstorable_final_checkpoint(node_h, job.id)
        (tmp_path / "go").touch()
        got = b""
        with stack:
            try:
                while chunk := await asyncio.to_thread(c.recv, 4096):
                    got += chunk
            except OSError as e:
                raise AssertionError(f"the server ran on, its answer never came: "
                                     f"{type(e).__name__}: {e} (got {got!r})") from None
        assert got == b"reply to hello"


# A post-dump action script that hangs the first dump only: CRIU has dumped
# and locked the connections, then is killed at its timeout before it
# unlocks them (as a CRIU killed by the OOM killer, or past SMR_CRIU_TIMEOUT).
HANG_ONCE = """#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0
[ -e {marker} ] && exit 0
touch {marker}
exec sleep 1000
"""


async def redis_whose_first_dump_hangs(node_h: Harness) -> tuple[Any, Any, int]:
    """The node's checkpoint step, whose first dump hangs in its post-dump
    script until CRIU's timeout (3 s) kills it, and a redis job: (step, job,
    port). The marker file ``hung`` appears as the dump hangs."""
    step = ckpt_step(node_h)
    script = node_h.tmp / "hang-once"
    script.write_text(HANG_ONCE.format(marker=node_h.tmp / "hung"))
    script.chmod(0o755)
    step.criu.options = ["--action-script", str(script)]
    step.criu.timeout = 3.0
    job, port = await start_redis(node_h, keys=1000)
    return step, job, port


async def test_a_heartbeat_whose_criu_was_killed_leaves_the_connections_working(
        h: Harness) -> None:  # noqa: F811
    _, job, port = await redis_whose_first_dump_hangs(h)
    r = client(port)
    try:
        assert r.incr("n") == 1
        mine = r.connection._sock.getsockname()[1]  # type: ignore[union-attr]
        beat = await h.checkpoint(job.id, leave_running=True)
        assert (h.tmp / "hung").exists(), "the first dump never reached its post-dump script"
        assert beat.status == "succeeded", beat.error  # its retry
        assert_counts_on(r, 2)
        assert f". {mine} ." not in locked(), f"port {mine} still in CRIU's lock: {locked()}"
    finally:
        r.close()
        drop_locks(port)


def test_repair_off_leaves_a_socket_not_in_repair_mode_as_it_is() -> None:
    """A pid listed in the tree may be a stranger's by the time it is opened
    (a child killed from outside, its pid taken again): only sockets in
    repair mode, which only CRIU's dump put there, are touched. Turning it
    off on any other would clear its SO_REUSEADDR and send a window probe.
    This process stands in for the stranger, its sockets real."""
    listener = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(listener.getsockname())
    s, _ = listener.accept()
    locked_one = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    try:
        for x in (c, s, locked_one):
            x.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        locked_one.setsockopt(socket.IPPROTO_TCP, netlock.TCP_REPAIR, 1)  # as CRIU does
        assert netlock.repair_off([os.getpid()]) == 1
        assert locked_one.getsockopt(socket.IPPROTO_TCP, netlock.TCP_REPAIR) == 0
        assert [x.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) for x in (c, s)] \
            == [1, 1], "a socket not in repair mode was changed"
    finally:
        for x in (c, s, locked_one, peer, listener):
            x.close()


async def test_a_final_dump_its_recovery_refuses_gives_the_job_its_connection_back(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str) -> None:
    """A final dump kept a client's connection, its worker died and its page
    image is cut short, the job held stopped: the recovery refuses the dump
    and the job runs on to be dumped again. CRIU's lock goes first (its
    table is named in the dump's log, which the refusal must not have
    dropped before): the client is answered on the connection it had."""
    from tests.test_recovery_order import cut_page_image, dump_then_die, request

    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       commit_deadline=20.0) as node_h:
        job, port = await start_redis(node_h, keys=1000)
        r = client(port)
        stack = contextlib.ExitStack()
        stack.callback(drop_locks, port)
        stack.callback(r.close)
        with stack:
            assert r.ping()
            step = ckpt_step(node_h)
            a = request(node_h, job)  # final: its connection kept
            await dump_then_die(step, a)
            table = netlock.table_of(step.work_dir / a.request_id / "images" / "dump.log")
            assert table is not None
            cut_page_image(step, a, 4096)
            recovered = await step.recover(a, {"state": "running", "heartbeat": 0})
            assert recovered is None and job.alive()
            nft = (await asyncio.to_thread(
                subprocess.run, ["nft", "list", "tables"], capture_output=True, text=True,
                check=True)).stdout
            assert table not in nft, f"CRIU's lock {table} stayed after the refusal"
            try:
                assert await asyncio.to_thread(r.ping)
            except OSError as e:
                raise AssertionError(f"the job ran on, its connection dead: {e}") from None


def dumps_tables(node_h: Harness) -> list[str | None]:
    """The lock table each dump of the node's checkpoint step made, named
    from its log as the dump ends (the step drops the log with its work)."""
    step = ckpt_step(node_h)
    real, tables = step.criu.dump, []

    async def dump(*args: Any, **kwargs: Any) -> CriuRun:
        run = await real(*args, **kwargs)
        tables.append(netlock.table_of(run.log))
        return run

    step.criu.dump = dump  # type: ignore[method-assign]
    return tables


def table_shown(table: str) -> str | None:
    r = subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


async def test_a_final_checkpoint_that_kept_no_connection_leaves_no_lock_table(
        h: Harness) -> None:  # noqa: F811
    """A server with no client: CRIU kept its (no) connections and made its
    lock table in the node's network namespace all the same. Stored and
    ended, the job leaves no table behind (each one stays for good
    otherwise: two chains every packet of the node walks), and a restore
    on this node, which would have deleted it, still brings the job back."""
    tables = dumps_tables(h)
    port = free_port()
    job = await start(h, [sys.executable, "-m", "http.server", str(port), "--bind",
                          "127.0.0.1", "--directory", str(h.tmp)], port=port)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    assert done.sockets and done.sockets["tcp"] == "keep"
    assert len(tables) == 1 and tables[0] is not None, f"the dump made no lock table: {tables}"
    assert table_shown(tables[0]) is None, f"CRIU's lock stayed: {table_shown(tables[0])}"
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    socket.create_connection(("127.0.0.1", port), timeout=10).close()


async def test_a_final_checkpoint_keeps_the_lock_of_a_connection_until_its_restore(
        h: Harness) -> None:  # noqa: F811
    """A client's connection kept by a final checkpoint: its table stays with
    the connection in it, so a request the client sends while the job is
    stored and gone is held (its packets dropped, then sent again), not
    answered with a reset, and the restored server answers it."""
    tables = dumps_tables(h)
    job, port = await start_redis(h, keys=1000)
    r = client(port)
    try:
        assert r.incr("n") == 1
        mine = r.connection._sock.getsockname()[1]  # type: ignore[union-attr]
        done = await h.checkpoint(job.id)
        assert done.status == "succeeded", done.error
        assert len(tables) == 1 and tables[0] is not None
        assert (shown := table_shown(tables[0])) and f". {mine} ." in shown, \
            f"the connection from port {mine} is not in CRIU's lock: {shown}"
        asked = asyncio.create_task(asyncio.to_thread(r.incr, "n"))
        await asyncio.sleep(1)  # the request's packets meet the lock
        assert not asked.done(), f"the stored job's connection answered: {asked}"
        restored = await h.restore(job.id)
        assert restored.status == "succeeded", restored.error
        assert await asyncio.wait_for(asked, 60) == 2
        assert table_shown(tables[0]) is None, "the restore left CRIU's lock"
    finally:
        r.close()
        drop_locks(port)


async def test_a_final_whose_latest_landed_unbeknown_keeps_its_lock_when_the_job_is_killed(
        h: Harness) -> None:  # noqa: F811
    """A final checkpoint of a server with a client: its ``latest`` write
    lands, the answer is lost, storage stays away past the commit deadline;
    meanwhile the job, held stopped, is killed. The step gives up, but that
    dump is ``latest``: the lock of its connection stays for a restore on
    this node, which answers the client's request sent meanwhile."""
    from services.storage.backend import StorageError
    from services.storage.layout import LOCAL_NAMESPACE
    from smr.bus import Progress
    from smr.contract.errors import SmrError
    from smr.contract.messages import CkptRequested, Target

    tables = dumps_tables(h)
    step = ckpt_step(h)
    step.commit_deadline = 3.0
    job, port = await start_redis(h, keys=1000)
    r = client(port)
    backend: Any = step.store.backend
    real = backend.put_bytes, backend.get_bytes, backend.list
    down = asyncio.Event()

    def failing(call: Any) -> Any:
        async def storage(key: str, *args: Any, **kw: Any) -> Any:
            if down.is_set():
                raise StorageError(f"injected: storage down ({key})", hint="a test fault")
            got = await call(key, *args, **kw)
            if call is real[0] and key.rsplit("/", 1)[-1].startswith("latest"):
                down.set()  # written; its answer lost; storage away from here
                raise StorageError(f"injected: answer lost ({key})", hint="a test fault")
            return got
        return storage

    try:
        assert r.incr("n") == 1
        req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                            target=Target.job(job.id), node=h.settings.node)
        backend.put_bytes, backend.get_bytes, backend.list = (failing(c) for c in real)
        try:
            run = asyncio.create_task(step.run(req, Progress()))
            await asyncio.wait_for(down.wait(), 60)
            os.kill(job.pid, signal.SIGKILL)  # killed while held stopped
            with pytest.raises(SmrError) as failed:
                await run
            assert failed.value.code == "storage-unavailable", failed.value
        finally:
            backend.put_bytes, backend.get_bytes, backend.list = real
        latest = await step.store.latest(LOCAL_NAMESPACE, job.id)
        assert latest is not None and latest.manifest["request_id"] == req.request_id
        assert len(tables) == 1 and tables[0] is not None
        assert table_shown(tables[0]) is not None, (
            f"the lock {tables[0]} of the connection in the stored latest was dropped")
        asked = asyncio.create_task(asyncio.to_thread(r.incr, "n"))
        restored = await h.restore(job.id)
        assert restored.status == "succeeded", restored.error
        assert await asyncio.wait_for(asked, 60) == 2
    finally:
        r.close()
        drop_locks(port)


async def test_a_final_whose_criu_was_killed_with_its_job_gone_leaves_no_lock(
        h: Harness) -> None:  # noqa: F811
    """A final dump kept a client's connection, then hung (a post-dump script)
    and was killed at CRIU's timeout; the job was killed meanwhile. No
    restore can ever use that dump: CRIU's lock table goes, and the client
    is told at once that its server is gone (a reset), not left waiting on
    packets the node drops for good."""
    from smr.bus import Progress
    from smr.contract.errors import SmrError
    from smr.contract.messages import CkptRequested, Target

    step, job, port = await redis_whose_first_dump_hangs(h)
    r = client(port)
    try:
        assert r.incr("n") == 1
        req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                            target=Target.job(job.id), node=h.settings.node)
        run = asyncio.create_task(step.run(req, Progress()))
        await wait_file(h.tmp / "hung")  # dumped and locked; CRIU hangs
        table = netlock.table_of(step.work_dir / req.request_id / "images" / "dump.log")
        assert table is not None and table_shown(table) is not None
        os.kill(job.pid, signal.SIGKILL)
        with pytest.raises(SmrError):
            await run
        assert table_shown(table) is None, f"CRIU's lock stayed: {table_shown(table)}"
        t = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            r.incr("n")
        assert time.monotonic() - t < 5, "the client waited on dropped packets"
    finally:
        r.close()
        drop_locks(port)


async def test_a_stored_final_checkpoint_is_answered_stored_when_nft_cannot_run(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The lock table's cleanup comes after the job was stored and ended: nft
    failing to start then (a pids limit, the package being upgraded) leaves
    the table, and never turns the stored checkpoint into a failure or the
    job's record into a running job that is gone."""
    real = netlock.asyncio.create_subprocess_exec

    async def no_nft(program: str, *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(program) == "nft":
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return await real(program, *args, **kwargs)

    monkeypatch.setattr(netlock.asyncio, "create_subprocess_exec", no_nft)
    tables = dumps_tables(h)
    port = free_port()
    job = await start(h, [sys.executable, "-m", "http.server", str(port), "--bind",
                          "127.0.0.1", "--directory", str(h.tmp)], port=port)
    try:
        done = await h.checkpoint(job.id)
        assert done.status == "succeeded", done.error
        record, _ = await h.jobs.get(job.id)
        assert (record.state, record.generation) == ("checkpointed", 1)
    finally:
        monkeypatch.undo()
        for t in filter(None, tables):  # this test's own table, which the cleanup left
            await asyncio.to_thread(subprocess.run, ["nft", "delete", "table", "inet", t],
                                    capture_output=True)


async def test_a_final_checkpoint_that_cannot_be_stored_never_leaves_the_job_stopped_when_nft_cannot_run(  # noqa: E501
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A final checkpoint whose manifest cannot be stored gives up: the job,
    held stopped since its dump, runs on. nft failing to start then (a pids
    limit) must not keep it stopped: its sockets get repair mode off all the
    same, and the step says the storage failed, not an internal error."""
    real = netlock.asyncio.create_subprocess_exec

    async def no_nft(program: str, *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(program) == "nft":
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return await real(program, *args, **kwargs)

    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       storage_path=str(tmp_path / "store"), commit_deadline=4.0) as node_h:
        tables = dumps_tables(node_h)
        port = free_port()
        job = await start(node_h, [sys.executable, "-m", "http.server", str(port), "--bind",
                                   "127.0.0.1", "--directory", str(tmp_path)], port=port)
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            monkeypatch.setattr(netlock.asyncio, "create_subprocess_exec", no_nft)
            fault = FailingPuts(ckpt_step(node_h).store.backend, "manifest.json", times=None)
            try:
                done = await node_h.checkpoint(job.id)
            finally:
                fault.restore()
                monkeypatch.undo()
            state = Path(f"/proc/{job.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state != "T", f"job {job.id} left stopped; answered {done.status} {done.error}"
            assert done.status == "failed" and done.error and \
                done.error["code"] == "storage-unavailable", done
        finally:
            c.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.pid, signal.SIGCONT)
            for t in filter(None, tables):  # this test's own table
                await asyncio.to_thread(subprocess.run, ["nft", "delete", "table", "inet", t],
                                        capture_output=True)
