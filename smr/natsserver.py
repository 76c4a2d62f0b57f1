"""A nats-server child process with JetStream, for the embedded mode and tests."""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from smr.contract.errors import SmrError

# Ports handed out by this process lately, not handed out again while their
# server may still be starting.
_GIVEN: dict[int, float] = {}
_GIVEN_FOR_S = 120.0
_LOWEST = 10000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server about to bind it.
    Below the kernel's ephemeral range (ip_local_port_range), from which
    every outgoing connection and bind(0) takes its port: one of those took
    a port picked there before its server bound it (nats-server's route
    port, several test processes at once). Where that range leaves none
    below it, a port the kernel picks."""
    low = _ephemeral_low()
    now = time.monotonic()
    for port, when in list(_GIVEN.items()):
        if now - when > _GIVEN_FOR_S:
            _GIVEN.pop(port, None)
    rng = random.SystemRandom()
    for _ in range(200 if low - _LOWEST > 1000 else 0):
        port = rng.randrange(_LOWEST, low)
        if port not in _GIVEN and _bindable(port):
            _GIVEN[port] = now
            return port
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            break
    _GIVEN[port] = now
    return port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    # Without SO_REUSEADDR: a port any socket holds, even in TIME_WAIT, is not.
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class NatsServer:
    def __init__(self, binary: str, store_dir: Path, port: int | None = None,
                 log_file: Path | None = None, token: str = "",
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 jetstream_flags: bool = True, die_with_parent: bool = False) -> None:
        """``token``: clients must present it (in a root-only config file, not
        in argv, which any local user reads in /proc). ``extra_args``: more
        nats-server options (a cluster's name and routes, tests/nats_cluster.py).
        ``jetstream_flags``: False where the configuration file (``-c`` in
        ``extra_args``) enables JetStream on ``store_dir`` itself, for a server
        that reloads it: nats-server 2.10 forgets the command line's -js and -sd
        on a reload and shuts JetStream down (github.com/nats-io/nats-server/issues/6606).
        ``die_with_parent``: the kernel ends the server when the thread that
        started it ends, however it ends (`smr up` killed with SIGKILL leaves
        no server behind on its data directory); start it from a thread that
        lives as long as its owner (the event loop's)."""
        self.die_with_parent = die_with_parent
        self.extra_args = list(extra_args)
        self.jetstream_flags = jetstream_flags
        self.env = dict(env) if env is not None else None  # the server's (None: ours)
        self.binary = binary
        self.token = token
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where it listens, without the token: safe to print."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def client_url(self) -> str:
        """What a client connects with: the token rides as the URL's user."""
        return f"nats://{self.token}@127.0.0.1:{self.port}" if self.token else self.url

    def _auth_args(self) -> list[str]:
        if not self.token:
            return []
        conf = self.store_dir / "auth.conf"
        conf.unlink(missing_ok=True)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"authorization {{ token: {json.dumps(self.token)} }}\n")
        return ["-c", str(conf)]

    def _jetstream_args(self) -> list[str]:
        return ["-js", "-sd", str(self.store_dir)] if self.jetstream_flags else []

    def start(self, timeout: float = 15.0) -> NatsServer:
        return self.spawn().wait_listening(timeout)

    def spawn(self) -> NatsServer:
        """Start the process; `wait_listening` waits for its port."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, *self._auth_args(), *self._jetstream_args(),
                 "-a", "127.0.0.1", "-p", str(self.port), *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches smr, which stops the server in order
                env=self.env, preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        return self

    def wait_listening(self, timeout: float = 15.0) -> NatsServer:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SmrError(
                    f"nats-server exited at start with code {self.proc.returncode}",
                    code="nats-start-failed", detail=_tail(self.log_file),
                    hint=f"is port {self.port} free? see {self.log_file}",
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise SmrError(f"nats-server did not listen on {self.port} within {timeout}s",
                       code="nats-start-failed", detail=_tail(self.log_file))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


PR_SET_PDEATHSIG = 1
# Looked up before any fork: the child runs only this call before exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _tail(path: Path, n: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
