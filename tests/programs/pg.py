"""PostgreSQL 15 (Debian's postgresql-15), for the program tests: a cluster
made by initdb as the `postgres` user, and the client-side checks of its data.

Run as the database's own user, as its init scripts do: the postmaster and
its workers are unprivileged processes, which is what smr must checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BIN = Path("/usr/lib/postgresql/15/bin")
USER = "postgres"


def need_postgres() -> None:
    if not (BIN / "postgres").is_file():
        pytest.fail("PostgreSQL 15 is missing: `make setup` installs Debian's postgresql-15")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        pytest.fail("the postgres user is missing: `make setup` installs Debian's postgresql-15")


@contextmanager
def cluster() -> Iterator[Path]:
    """A fresh cluster in a directory the postgres user can reach (pytest's
    tmp_path is root's, 0700)."""
    need_postgres()
    top = Path(tempfile.mkdtemp(prefix="smr-pg-", dir="/tmp"))
    pw = pwd.getpwnam(USER)
    os.chown(top, pw.pw_uid, pw.pw_gid)
    try:
        subprocess.run([*as_postgres(), str(BIN / "initdb"), "-D", str(top / "data"), "-A",
                        "trust", "-U", USER, "--no-sync"], check=True, cwd=top,
                       capture_output=True)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def as_postgres() -> list[str]:
    """Drop to the postgres user the way a service does (util-linux's setpriv)."""
    return ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups"]


def server_cmd(top: Path, port: int) -> list[str]:
    return [*as_postgres(), str(BIN / "postgres"), "-D", str(top / "data"), "-p", str(port),
            "-k", str(top), "-c", "listen_addresses=127.0.0.1"]


def dsn(port: int) -> str:
    return f"host=127.0.0.1 port={port} user={USER} dbname=postgres connect_timeout=10"


SUMMARY = ("SELECT count(*), coalesce(md5(string_agg(id::text || ':' || v, ',' ORDER BY id)), '')"
           " FROM t")


async def shut_down(pid: int, timeout: float = 30) -> None:
    """A fast shutdown (SIGINT, forwarded by the job's init): PostgreSQL removes
    its /dev/shm segments, which a SIGKILL would leave on the host."""
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, "PostgreSQL did not shut down"
        await asyncio.sleep(0.1)


def amcheck(port: int) -> subprocess.CompletedProcess[str]:
    """pg_amcheck over every table and index (heap and B-tree, all index
    tuples checked against the heap)."""
    return subprocess.run([str(BIN / "pg_amcheck"), "-h", "127.0.0.1", "-p", str(port), "-U",
                           USER, "--install-missing", "--heapallindexed", "--all"],
                          capture_output=True, text=True, timeout=120)
