"""PostgreSQL 15 as a local job (`smr exec`), run as its own unprivileged
user: a heartbeat while a client writes on a live connection, a migration
(final checkpoint, restore by another node on the shared storage), and a
checkpoint in the middle of an open transaction. The data a client committed
is checked by count and checksum, and pg_amcheck checks the restored
cluster's heap and indexes.

Each test takes about 10 s here (initdb, start, two dumps, a restore).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from smr.natsserver import free_port
from smr.process.criu_log import explain
from tests import nats_auth
from tests.programs import pg
from tests.programs.conftest import other_node
from tests.test_local_smr import Harness
from tests.test_sockets import start

pytestmark = pytest.mark.criu


class Rows:
    """What the client committed, to check the server against."""

    def __init__(self) -> None:
        self.committed: dict[int, str] = {}

    def insert(self, conn: psycopg.Connection, ids: range) -> None:
        rows = [(i, uuid.uuid4().hex) for i in ids]
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO t (id, v) VALUES (%s, %s)", rows)
        conn.commit()
        self.committed.update(rows)

    def summary(self) -> tuple[int, str]:
        text = ",".join(f"{i}:{v}" for i, v in sorted(self.committed.items()))
        return len(self.committed), hashlib.md5(text.encode()).hexdigest() if text else ""


def summary(port: int) -> tuple[int, str]:
    """From a new connection: what the server holds."""
    with psycopg.connect(pg.dsn(port)) as conn:
        row = conn.execute(pg.SUMMARY).fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


async def first_connection(port: int, timeout: float = 30) -> psycopg.Connection:
    """PostgreSQL listens before it takes connections ("the database system is
    starting up"), and ``start`` waits for the port only."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return psycopg.connect(pg.dsn(port))
        except psycopg.OperationalError as e:
            if "starting up" not in str(e) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.1)


def report(what: str, **numbers: object) -> None:
    print(f"\n[compat] {what}: {json.dumps(numbers, default=str)}")


async def test_postgres_as_its_own_user_survives_a_heartbeat_and_a_migration(
        h: Harness, criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path) -> None:
    with pg.cluster() as top:
        port = free_port()
        job = await start(h, pg.server_cmd(top, port), port=port)
        rows = Rows()
        conn = await first_connection(port)
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL)")
        conn.commit()
        rows.insert(conn, range(0, 5000))
        backend = conn.info.backend_pid

        beat = await h.checkpoint(job.id, leave_running=True)
        assert beat.status == "succeeded", beat.error
        # The client's connection goes on, to the same backend process.
        rows.insert(conn, range(5000, 6000))
        assert conn.info.backend_pid == backend
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (6000,)

        final = await h.checkpoint(job.id, reason="preemption")
        assert final.status == "succeeded", final.error
        with pytest.raises(psycopg.OperationalError):  # the node is gone: so is the connection
            conn.execute("SELECT 1")
        conn.close()

        async with other_node(criu_binary, nats_users, tmp_path) as b:
            restored = await b.restore(job.id)
            assert restored.status == "succeeded", restored.error
            assert restored.node != final.node
            assert summary(port) == rows.summary(), "committed rows changed across the migration"
            with psycopg.connect(pg.dsn(port)) as again:  # it accepts writes
                rows.insert(again, range(6000, 6500))
            assert summary(port) == rows.summary()
            check = pg.amcheck(port)
            assert check.returncode == 0, check.stdout + check.stderr
            report("postgres local non-root migration", image_bytes=final.size_bytes,
                   heartbeat=beat.durations, final=final.durations, restore=restored.durations)
            await pg.shut_down(restored.pid or 0)


async def test_postgres_checkpointed_mid_transaction_restores_consistent(h: Harness) -> None:
    with pg.cluster() as top:
        port = free_port()
        job = await start(h, pg.server_cmd(top, port), port=port)
        rows = Rows()
        conn = await first_connection(port)
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL)")
        conn.commit()
        rows.insert(conn, range(0, 3000))
        # An open transaction: new rows and changed ones, not committed.
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO t (id, v) VALUES (%s, 'open')",
                            [(i,) for i in range(10000, 12000)])
            cur.execute("UPDATE t SET v = 'changed' WHERE id < 1000")

        final = await h.checkpoint(job.id, reason="preemption")
        assert final.status == "succeeded", final.error
        restored = await h.restore(job.id)
        assert restored.status == "succeeded", restored.error
        # The connection was closed with the tree: its transaction is rolled back.
        with pytest.raises(psycopg.OperationalError):
            conn.commit()
        conn.close()
        assert summary(port) == rows.summary(), "an uncommitted change is visible, or rows lost"
        with psycopg.connect(pg.dsn(port)) as again:
            rows.insert(again, range(10000, 10100))  # the ids the open transaction held
            again.execute("CHECKPOINT")
        assert summary(port) == rows.summary()
        check = pg.amcheck(port)
        assert check.returncode == 0, check.stdout + check.stderr
        report("postgres local non-root mid-transaction", image_bytes=final.size_bytes,
               final=final.durations, restore=restored.durations)
        await pg.shut_down(restored.pid or 0)


@pytest.mark.parametrize(("line", "code", "named"), [
    # The lines CRIU 4.2 wrote, in the order each was met and fixed.
    ("pie: 1: Error (criu/pie/parasite.c:641): can't dump unprivileged task whose /proc "
     "doesn't belong to it", "unprivileged-tree-root", "smr exec"),
    ("(00.289261) Error (criu/cr-dump.c:478): Task 23602 with SysVIPC shmem map "
     "@7fb4b621a000 doesn't live in IPC ns", "sysv-ipc-shared-namespace", "process 23602"),
    ("(00.262711) Error (criu/cr-dump.c:389): Can't get rlimit 0: Operation not permitted",
     "criu-limits-unreadable", "CAP_SYS_RESOURCE"),
])
def test_the_failures_of_a_program_that_drops_root_are_explained(
        tmp_path: Path, line: str, code: str, named: str) -> None:
    log = tmp_path / "dump.log"
    log.write_text(line + "\n(00.3) Error (criu/cr-dump.c:1975): Dumping FAILED.\n")
    what, got, hint = explain(log) or ("", "", "")
    assert got == code and named in what + hint and hint
