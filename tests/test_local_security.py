"""An unprivileged local user against root's `smr up` (the local mode).

The attacker is the `nobody` user with Debian's own Python and a raw socket
speaking the NATS protocol: it finds the embedded server's port (anyone can,
in the list of listening sockets) and tries to write a job record naming a
root process and to ask for each kind of request. A second attacker holds the
bus but not the job key (another client of a shared NATS): its forged record
must not make root freeze, dump or kill the process it names.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from smr import config
from smr.bus import KV_JOBS
from smr.contract.messages import CkptDone, CkptRequested, RestoreRequested, Target
from smr.jobs import Job, proc_start_ticks
from smrctl import embedded
from smrctl.embedded import EmbeddedNode, url_file

pytestmark = pytest.mark.criu

NOBODY = 65534

# Runs as `nobody`: connects, then sends what a client of the bus would.
ATTACKER = r"""
import json, socket, sys
port, pid, ticks = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
record = {"id": "stolen", "cmd": ["sleep"], "cwd": "/", "log": "/tmp/x", "node": sys.argv[4],
          "pid": pid, "start_ticks": ticks, "checkpoint_id": "stolen"}
def req(kind, subject):
    body = {"request_id": kind + "-1", "checkpoint_id": "stolen", "node": sys.argv[4],
            "target": {"kind": "job", "job_id": "stolen"}}
    return subject, json.dumps(body)
sends = [("$KV.smr-jobs.stolen", json.dumps(record)),
         req("ckpt", "ckpt.requested." + sys.argv[4] + ".local"),
         req("restore", "restore.requested." + sys.argv[4] + ".local")]
s = socket.create_connection(("127.0.0.1", port), timeout=5)
out = [s.recv(4096).decode(errors="replace").split("\r\n")[0][:4]]  # INFO
try:
    s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
    for subj, body in sends:
        s.sendall(f"PUB {subj} {len(body)}\r\n{body}\r\n".encode())
    s.sendall(b"PING\r\n")
    while chunk := s.recv(4096):
        out.append(chunk.decode(errors="replace"))
except OSError as e:  # the server hung up: read what it said first
    out.append(f" closed: {e} ")
    try:
        out.append(s.recv(4096).decode(errors="replace"))
    except OSError:
        pass
print("".join(out))
"""


@pytest.fixture
async def root_node(tmp_path: Path, criu_binary: str, node: str
                    ) -> AsyncIterator[tuple[EmbeddedNode, config.Settings]]:
    """Root's `smr up`, with its own embedded nats-server as on a laptop."""
    s = config.load({}).replace(nats_url="", node_name=node, data_dir=str(tmp_path / "data"),
                                criu=criu_binary, metrics_port=0)
    async with EmbeddedNode(s) as n:
        yield n, s


@pytest.fixture
def victim() -> subprocess.Popen[bytes]:
    """A process root started, not smr."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)  # as CRIU needs
    yield p
    p.kill()
    p.wait()


async def test_nobody_cannot_reach_roots_smr(
        root_node: tuple[EmbeddedNode, config.Settings],
        victim: subprocess.Popen[bytes]) -> None:
    n, s = root_node
    assert n.server
    ticks = proc_start_ticks(victim.pid)
    assert ticks is not None
    out = await asyncio.to_thread(
        subprocess.run,
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         "/usr/bin/python3", "-c", ATTACKER, str(n.server.port), str(victim.pid), str(ticks),
         s.node], capture_output=True, text=True, timeout=30, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "Authorization Violation" in out.stdout, out.stdout
    # Nothing it sent landed: no record, no request was served, the victim runs on.
    assert n.bus
    with pytest.raises(Exception, match=r"not found|NotFound"):
        await n.bus.kv(KV_JOBS).get("stolen")
    await asyncio.sleep(1.0)
    assert victim.poll() is None and proc_start_ticks(victim.pid) == ticks
    for rid in ("ckpt-1", "restore-1"):
        assert (await n.bus.step_state(rid))[0] is None, f"{rid} was served"

    # And the way in is root's alone: the data dir, the URL file with its
    # token and the server's config; the token is not in any command line.
    assert stat.S_IMODE(s.data_path.stat().st_mode) == 0o700
    assert stat.S_IMODE(url_file(s).stat().st_mode) == 0o600
    assert stat.S_IMODE((s.data_path / "nats" / "auth.conf").stat().st_mode) == 0o600
    assert stat.S_IMODE(s.job_key_path.stat().st_mode) == 0o600
    assert n.server.proc
    cmdline = Path(f"/proc/{n.server.proc.pid}/cmdline").read_bytes()
    assert n.server.token.encode() not in cmdline


async def test_a_job_record_smr_did_not_write_is_refused(
        root_node: tuple[EmbeddedNode, config.Settings],
        victim: subprocess.Popen[bytes]) -> None:
    """A client that holds the bus but not the job key names a root process."""
    n, s = root_node
    assert n.bus
    ticks = proc_start_ticks(victim.pid)
    assert ticks is not None
    forged = Job(id="stolen", cmd=["sleep", "1000"], cwd="/", log="/tmp/stolen.log",
                 node=s.node, pid=victim.pid, start_ticks=ticks, checkpoint_id="stolen")
    record = {k: v for k, v in vars(forged).items() if k != "sig"}
    await n.bus.kv(KV_JOBS).put("stolen", orjson.dumps(record))
    for leave_running in (False, True):
        req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id="stolen",
                            target=Target.job("stolen"), node=s.node,
                            leave_running=leave_running)
        result = await n.bus.request(req, timeout=60)
        assert isinstance(result, CkptDone)
        assert result.status == "failed"
        assert result.error and result.error["code"] == "job-not-verified", result.error
    assert victim.poll() is None and proc_start_ticks(victim.pid) == ticks
    assert not list(s.storage_root.rglob("*.img*")), "something of the victim was stored"
    # A restore under that job's name finds no checkpoint; it never kills the victim.
    r = await n.bus.request(RestoreRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="stolen", target=Target.job("stolen"),
        node=s.node), timeout=60)
    assert r.status == "failed"
    assert victim.poll() is None


async def test_smr_commands_still_work_with_the_token(
        root_node: tuple[EmbeddedNode, config.Settings], tmp_path: Path) -> None:
    """Root's own `smr exec`, `smr checkpoint` and `smr ps` find the token."""
    _, s = root_node
    env = {**os.environ, "SMR_DATA_DIR": str(s.data_path), "SMR_NODE_NAME": s.node,
           "SMR_NATS_URL": "", "SMR_CRIU": s.criu}
    smr = [str(Path(sys.executable).parent / "smr")]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*smr, *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    r = await asyncio.to_thread(run, "exec", "-i", "mine", "--", "sleep", "1000")
    assert r.returncode == 0, r.stderr
    try:
        r = await asyncio.to_thread(run, "checkpoint", "mine", "--leave-running")
        assert r.returncode == 0, r.stdout + r.stderr
        r = await asyncio.to_thread(run, "ps")
        assert "mine" in r.stdout and "running" in r.stdout, r.stdout
    finally:
        await asyncio.to_thread(run, "kill", "mine")


async def test_smr_exec_without_the_job_key_starts_nothing(
        root_node: tuple[EmbeddedNode, config.Settings], tmp_path: Path) -> None:
    """A record `smr exec` could not sign would be refused by every checkpoint
    of the job it started: it is refused before the command runs."""
    n, s = root_node
    assert n.bus
    marker = f"{1000 + uuid.uuid4().int % 1000}.25"  # a command line to look for
    env = {**os.environ, "SMR_DATA_DIR": str(s.data_path), "SMR_NODE_NAME": s.node,
           "SMR_NATS_URL": "", "SMR_CRIU": s.criu, "SMR_JOB_KEY": str(tmp_path / "absent")}
    r = await asyncio.to_thread(
        subprocess.run, [str(Path(sys.executable).parent / "smr"), "exec", "-i", "unsigned",
                         "--", "sleep", marker],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and "no job key" in r.stderr, r.stdout + r.stderr
    found = await asyncio.to_thread(subprocess.run, ["pgrep", "-f", f"sleep {marker}"],
                                    capture_output=True, text=True)
    assert found.returncode == 1, f"the command was started: {found.stdout}"
    with pytest.raises(Exception, match=r"not found|NotFound"):
        await n.bus.kv(KV_JOBS).get("unsigned")


async def test_the_job_key_is_made_before_a_command_can_reach_smr_up(
        tmp_path: Path, criu_binary: str, node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`smr exec` run the moment `smr up`'s URL file appears signs with the
    key: the key is there before the URL file is written."""
    s = config.load({}).replace(nats_url="", node_name=node, data_dir=str(tmp_path / "data"),
                                criu=criu_binary, metrics_port=0)
    seen: list[bool] = []
    write = embedded.write_private

    def spying(path: Path, text: str) -> None:
        if path == url_file(s):
            seen.append(s.job_key_path.exists())
        write(path, text)

    monkeypatch.setattr(embedded, "write_private", spying)
    async with EmbeddedNode(s):
        assert seen == [True]
