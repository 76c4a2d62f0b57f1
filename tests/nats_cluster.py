"""A 3-server NATS JetStream cluster on loopback: real nats-server processes,
each with its own store, routed to the others, as a production NATS runs.

``NatsCluster.url`` is the comma-separated server list smr takes as
SMR_NATS_URL. ``kill`` SIGKILLs a server (a node lost, no goodbye to its
peers); ``restart`` brings it back on the same ports and store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import nats

from smr.contract.errors import SmrError
from smr.natsserver import NatsServer, free_port
from tests import nats_auth

# How long a server may go without knowing the meta leader its peers elected
# before it is restarted.
NUDGE_AFTER_S = 15.0


class NatsCluster:
    def __init__(self, binary: str, store_dir: Path, size: int = 3,
                 name: str = "smr-test", users: nats_auth.Rendered | None = None) -> None:
        """``users``: every server runs with that accounts.conf (the shipped
        NATS users, tests/nats_auth.py); this class's own probes log in as
        smr-admin."""
        self.dir = Path(store_dir)
        self.login: dict[str, str] = {}
        if users:
            self.login = {"user": "smr-admin", "password": users.passwords["smr-admin"]}
        cluster_ports = [free_port() for _ in range(size)]
        routes = ",".join(f"nats-route://127.0.0.1:{p}" for p in cluster_ports)
        self.monitor_ports = [free_port() for _ in range(size)]
        self.servers: list[NatsServer] = []
        for i in range(size):
            args = ["-n", f"n{i}", "--cluster_name", name,
                    "--cluster", f"nats://127.0.0.1:{cluster_ports[i]}", "--routes", routes,
                    "-m", str(self.monitor_ports[i])]
            if users:
                args += ["-c", str(users.conf)]
            self.servers.append(NatsServer(binary, self.dir / f"n{i}", extra_args=args,
                                           env=users.env if users else None))

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def server_named(self, name: str) -> NatsServer:
        """The server a stream info's ``cluster.leader`` names."""
        return self.servers[int(name.removeprefix("n"))]

    def start(self, timeout: float = 60.0) -> NatsCluster:
        try:
            for s in self.servers:
                s.start()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()  # none left running behind a failed start
            raise
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until a stream replicated on every running server can be made: the
        meta leader is elected and knows its peers online (until then stream
        creation fails: "no suitable peers for placement")."""
        start = time.monotonic()
        deadline, nudge = start + timeout, start + NUDGE_AFTER_S
        while time.monotonic() < deadline:
            leaders = {i: self._meta_leader(i) for i, s in enumerate(self.servers)
                       if self.running(s)}
            if all(leaders.values()):
                break
            if time.monotonic() > nudge and any(leaders.values()):
                # A server left out of the meta group at bootstrap (seen on
                # a loaded machine: "has not established contact with a meta
                # leader" for good, while its peers had elected one) is
                # restarted, as a liveness probe on its health would.
                for i in (i for i, leader in leaders.items() if not leader):
                    self._bounce(self.servers[i])
                nudge = time.monotonic() + NUDGE_AFTER_S
            time.sleep(0.1)
        # In a thread of its own: callers may be sync code inside an event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            error = ex.submit(asyncio.run, self._probe(deadline)).result()
        if error:
            raise SmrError(f"the NATS cluster was not ready for streams in {timeout}s: {error}",
                           code="nats-start-failed", detail=self.describe(),
                           hint=f"see the logs under {self.dir}")

    async def _probe(self, deadline: float) -> str:
        running = [s for s in self.servers if self.running(s)]
        name = f"probe-{uuid.uuid4().hex[:8]}"
        error = "no meta leader"
        nudge = time.monotonic() + NUDGE_AFTER_S
        nc = await nats.connect([s.url for s in running], connect_timeout=2, **self.login)
        try:
            js = nc.jetstream(timeout=5)
            while time.monotonic() < deadline:
                try:
                    await js.add_stream(name=name, subjects=[name], num_replicas=len(running))
                    await js.delete_stream(name)
                    return ""
                except Exception as e:
                    error = str(e)
                    if time.monotonic() > nudge:
                        # Placement refused for long: a server the meta leader
                        # does not see current is restarted, as a liveness
                        # probe on its health would.
                        for i in self.lagging():
                            await asyncio.to_thread(self._bounce, self.servers[i])
                        nudge = time.monotonic() + NUDGE_AFTER_S
                    await asyncio.sleep(0.2)
            return error
        finally:
            await nc.close()

    @staticmethod
    def _bounce(s: NatsServer) -> None:
        s.stop()
        s.start()

    def lagging(self) -> list[int]:
        """The running servers the meta leader does not see as current."""
        leader = self.meta_leader()
        if not leader:
            return []
        meta = self._jsz(int(leader.removeprefix("n"))).get("meta_cluster", {})
        current = {r.get("name") for r in meta.get("replicas") or []
                   if r.get("current") and not r.get("offline")}
        return [i for i, s in enumerate(self.servers)
                if self.running(s) and f"n{i}" != leader and f"n{i}" not in current]

    def describe(self) -> str:
        """Each server: running or its exit code, the meta leader it sees,
        and its log's last errors (a failed start says why)."""
        lines = []
        for i, s in enumerate(self.servers):
            state = "running" if self.running(s) else \
                f"exited {s.proc.returncode if s.proc else '(never started)'}"
            errors = []
            with contextlib.suppress(OSError):
                errors = [x for x in s.log_file.read_text(errors="replace").splitlines()
                          if "[ERR]" in x or "[FTL]" in x or "[WRN]" in x][-3:]
            lines.append(f"n{i}: {state}, meta leader {self._meta_leader(i) or 'none'}; "
                         + ("; ".join(errors) or "no error logged"))
        return "\n".join(lines)

    def meta_leader(self) -> str:
        """The JetStream meta leader's name, as a running server sees it."""
        for i, s in enumerate(self.servers):
            if self.running(s) and (name := self._meta_leader(i)):
                return name
        return ""

    def _meta_leader(self, i: int) -> str:
        return str(self._jsz(i).get("meta_cluster", {}).get("leader", ""))

    def _jsz(self, i: int) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.monitor_ports[i]}/jsz", timeout=1) as r:
                got = json.load(r)
                return got if isinstance(got, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def running(s: NatsServer) -> bool:
        return s.proc is not None and s.proc.poll() is None

    def kill(self, s: NatsServer) -> None:
        """SIGKILL: the server dies as with its node, mid-write if it was writing."""
        assert s.proc is not None
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait()

    def restart(self, s: NatsServer) -> None:
        s.start()
        self.wait_ready()

    def violations(self) -> list[str]:
        """What the servers refused a client (their logs): with the shipped
        users, a permission one of smr's services lacks."""
        found = []
        for s in self.servers:
            try:
                text = s.log_file.read_text(errors="replace")
            except FileNotFoundError:
                continue
            found += [f"{s.store_dir.name}: {line}" for line in text.splitlines()
                      if "Violation" in line]
        return found

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
