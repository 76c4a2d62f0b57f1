"""A server in a pod container: redis-server (a program nobody here wrote),
with a redis-py client in the pod's network namespace, through a cordon and
a migration to the other node."""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from services.agent import host
from smr.messages import CkptRequested, Target
from tests.agent.cluster import REDIS_IMAGE, Cluster, workload


class PodNetConnection(redis.Connection):
    """redis-py's connection, made in the network namespace of a container (as
    a sidecar or a Service's backend would reach it); the namespace is joined
    by one short-lived thread, so the test's own threads stay on the host."""

    def __init__(self, *, netns_pid: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.netns_pid = netns_pid

    def _connect(self) -> Any:
        made: list[Any] = []

        def join_and_connect() -> None:
            fd = os.open(f"/proc/{self.netns_pid}/ns/net", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # NEWNET
                    made.append(OSError(ctypes.get_errno(), "setns"))
                    return
            finally:
                os.close(fd)
            try:
                made.append(redis.Connection._connect(self))
            except Exception as e:
                made.append(e)

        t = threading.Thread(target=join_and_connect)
        t.start()
        t.join()
        if isinstance(made[0], Exception):
            raise made[0]
        return made[0]


def pod_redis(cluster: Cluster, name: str) -> redis.Redis:
    p = cluster.kube.get("pods", name, "default")
    assert p is not None
    cid = p["status"]["containerStatuses"][0]["containerID"].split("://")[1]
    shim = host.find_shim(cid)
    assert shim is not None
    pool = redis.ConnectionPool(connection_class=PodNetConnection, netns_pid=shim.pid,
                                port=6379, socket_timeout=10)
    return redis.Redis(connection_pool=pool, single_connection_client=True)


def redis_pod(name: str, node: str, env: dict[str, str]) -> dict[str, Any]:
    p = workload(name, node, image=REDIS_IMAGE, env=env, owner="kv", restart="Never")
    p["spec"]["containers"][0]["command"] = [
        "/smr/smr-init", "--", "/usr/bin/redis-server", "--port", "6379", "--save", "",
        "--appendonly", "no", "--enable-debug-command", "local"]
    return p


async def until_redis(cluster: Cluster, name: str, timeout: float = 30) -> redis.Redis:
    deadline = time.monotonic() + timeout
    while True:
        p = cluster.kube.get("pods", name, "default")
        if p and (p.get("status") or {}).get("containerStatuses"):
            try:  # the client connects as it is made
                return pod_redis(cluster, name)
            except (redis.ConnectionError, OSError, AssertionError):
                pass
        assert time.monotonic() < deadline, (f"redis in pod {name} never answered; log: "
                                             f"{cluster.log(name, p['spec']['nodeName'])!r}")
        await asyncio.sleep(0.2)


async def test_redis_pod_keeps_its_client_on_cordon_and_resets_it_on_migration(
        cluster: Cluster) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is missing: `make setup` installs it")
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "kv-1"}
    cluster.kube.put("pods", redis_pod("kv-a", a, env))
    r = await until_redis(cluster, "kv-a")
    r.execute_command("DEBUG", "POPULATE", 20000, "key", 64)
    me = r.client_id()
    assert r.incr("n") == 1

    # kubectl cordon: a checkpoint that leaves the pod running; the client's
    # connection is kept through it (the network is locked during the dump).
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    cordon = await cluster.latest("kv-1")
    assert cordon["reason"] == "cordon"
    assert "tcp 0.0.0.0:6379" in cordon["sockets"]["listening"]
    assert cordon["sockets"]["established"] >= 1 and cordon["sockets"]["tcp"] == "keep"
    assert r.incr("n") == 2 and r.client_id() == me, "the same connection goes on"

    # The pod is drained: its final checkpoint closes the connection, which
    # the client sees at once instead of waiting for a TCP timeout.
    before = r.execute_command("DEBUG", "DIGEST")
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="kv-1", node=a, reason="drain",
        target=Target(kind="pod", namespace="default", pod="kv-a", container="main")),
        timeout=60)
    assert done.status == "succeeded", done.error
    assert done.sockets and done.sockets["connections"] == "closed"
    with pytest.raises(redis.ConnectionError):
        r.incr("n")
    r.close()

    # Its replacement on node b resumes from the checkpoint; the client
    # reconnects (to the new pod, as through a Service) and finds its data.
    cluster.kube.put("pods", redis_pod("kv-b", b, env))
    again = await until_redis(cluster, "kv-b")
    assert again.execute_command("DEBUG", "DIGEST") == before
    assert again.incr("n") == 3 and again.dbsize() == 20001
    again.close()
    await cluster.event("Restored", "kv-b")
