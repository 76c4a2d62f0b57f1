"""A 3-server NATS JetStream cluster on loopback: real nats-server processes,
each with its own store, routed to the others, as a production NATS runs.

``NatsCluster.url`` is the comma-separated server list smr takes as
SMR_NATS_URL. ``kill`` SIGKILLs a server (a node lost, no goodbye to its
peers); ``restart`` brings it back on the same ports and store.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from smr.errors import SmrError
from smr.natsserver import NatsServer, free_port


class NatsCluster:
    def __init__(self, binary: str, store_dir: Path, size: int = 3,
                 name: str = "smr-test") -> None:
        self.dir = Path(store_dir)
        cluster_ports = [free_port() for _ in range(size)]
        routes = ",".join(f"nats-route://127.0.0.1:{p}" for p in cluster_ports)
        self.monitor_ports = [free_port() for _ in range(size)]
        self.servers: list[NatsServer] = []
        for i in range(size):
            args = ["-n", f"n{i}", "--cluster_name", name,
                    "--cluster", f"nats://127.0.0.1:{cluster_ports[i]}", "--routes", routes,
                    "-m", str(self.monitor_ports[i])]
            self.servers.append(NatsServer(binary, self.dir / f"n{i}", extra_args=args))

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def server_named(self, name: str) -> NatsServer:
        """The server a stream info's ``cluster.leader`` names."""
        return self.servers[int(name.removeprefix("n"))]

    def start(self, timeout: float = 30.0) -> NatsCluster:
        for s in self.servers:
            s.start()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every running server knows the JetStream meta leader (before
        that, stream creation fails)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._meta_leader(i) for i, s in enumerate(self.servers) if self.running(s)):
                return
            time.sleep(0.1)
        raise SmrError(f"the NATS cluster elected no JetStream meta leader in {timeout}s",
                       code="nats-start-failed", hint=f"see the logs under {self.dir}")

    def _meta_leader(self, i: int) -> str:
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.monitor_ports[i]}/jsz", timeout=1) as r:
                return json.load(r).get("meta_cluster", {}).get("leader", "")
        except (OSError, ValueError):
            return ""

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

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
