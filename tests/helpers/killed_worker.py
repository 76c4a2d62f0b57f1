"""A pytest worker killed in the middle of its session (run by
tests/test_parallel_safety.py, as ``pytest tests/helpers/killed_worker.py``):
it starts the session's nats-server, moto and containerd, writes their pids
to $SMR_TEST_KILLED_PIDS, and SIGKILLs itself, so no teardown runs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from smr.natsserver import NatsServer
from tests.agent.conftest import containerd  # noqa: F401  (the session fixture)
from tests.fake_kubelet import Containerd


def test_killed_with_its_servers_running(nats_server: NatsServer, s3_endpoint: str,
                                         containerd: Containerd) -> None:  # noqa: F811
    assert nats_server.proc is not None and containerd.proc is not None
    moto = next(p for p in os.listdir("/proc") if p.isdigit() and _is_moto(p, s3_endpoint))
    pids = [nats_server.proc.pid, int(moto), containerd.proc.pid]
    Path(os.environ["SMR_TEST_KILLED_PIDS"]).write_text(
        " ".join(map(str, pids)) + f"\n{containerd.root}")
    os.kill(os.getpid(), signal.SIGKILL)


def _is_moto(pid: str, endpoint: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"moto_s3.py") for a in argv) and \
        endpoint.rsplit(":", 1)[1].encode() in argv
