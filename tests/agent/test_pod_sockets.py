"""A server in a pod container: redis-server (a program nobody here wrote),
with a redis-py client in the pod's network namespace, through a cordon and
a migration to the other node.

The clients here block, and the node agents run on this test's event loop:
every client call goes to a thread (``off_loop``). On the loop, a connect
that reaches the restored listening socket while CRIU is still restoring
(its backlog takes it) would wait for an answer that never comes, holding
up the agent that serves CRIU its images until the client gives up."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import shutil
import socket
import time
import uuid
from typing import Any, TypeVar

import pytest
import redis

from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import REDIS_IMAGE, Cluster, netns_pid, workload
from tests.helpers.netns import in_netns

T = TypeVar("T")
off_loop = asyncio.to_thread


class PodNetConnection(redis.Connection):
    """redis-py's connection, made in a container's network namespace."""

    def __init__(self, *, netns_pid: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.netns_pid = netns_pid

    def _connect(self) -> Any:
        return in_netns(self.netns_pid, lambda: redis.Connection._connect(self))


def pod_redis(pid: int) -> redis.Redis:
    """A client of the redis in the network namespace of process ``pid``."""
    pool = redis.ConnectionPool(connection_class=PodNetConnection, netns_pid=pid, port=6379,
                                socket_timeout=10)
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
                return await off_loop(pod_redis, netns_pid(cluster, name))
            except (redis.ConnectionError, redis.TimeoutError, OSError, AssertionError):
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
    await off_loop(r.execute_command, "DEBUG", "POPULATE", 20000, "key", 64)
    me = await off_loop(r.client_id)
    assert await off_loop(r.incr, "n") == 1

    # kubectl cordon: a checkpoint that leaves the pod running; the client's
    # connection is kept through it (the network is locked during the dump).
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    cordon = await cluster.latest("kv-1")
    assert cordon["reason"] == "cordon"
    assert "tcp 0.0.0.0:6379" in cordon["sockets"]["listening"]
    assert cordon["sockets"]["established"] >= 1 and cordon["sockets"]["tcp"] == "keep"
    assert await off_loop(r.incr, "n") == 2, "the same connection goes on"
    assert await off_loop(r.client_id) == me

    # The pod is drained: its final checkpoint closes the connection, which
    # the client sees at once instead of waiting for a TCP timeout.
    before = await off_loop(r.execute_command, "DEBUG", "DIGEST")
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="kv-1", node=a, reason="drain",
        target=Target(kind="pod", namespace="default", pod="kv-a", container="main")),
        timeout=60)
    assert done.status == "succeeded", done.error
    assert done.sockets and done.sockets["connections"] == "closed"
    with pytest.raises(redis.ConnectionError):
        await off_loop(r.incr, "n")
    r.close()

    # Its replacement on node b resumes from the checkpoint; the client
    # reconnects (to the new pod, as through a Service) and finds its data.
    cluster.kube.put("pods", redis_pod("kv-b", b, env))
    again = await until_redis(cluster, "kv-b")
    assert await off_loop(again.execute_command, "DEBUG", "DIGEST") == before
    assert await off_loop(again.incr, "n") == 3
    assert await off_loop(again.dbsize) == 20001
    again.close()
    await cluster.event("Restored", "kv-b")


def http_get(pid: int, port: int = 8080) -> tuple[int, bytes]:
    """GET /index.html from port ``port`` in the network namespace of ``pid``."""
    sock = in_netns(pid, lambda: socket.create_connection(("127.0.0.1", port), timeout=10))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.sock = sock
    try:
        conn.request("GET", "/index.html")
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


async def until_http(cluster: Cluster, name: str, timeout: float = 30) -> tuple[int, bytes]:
    deadline = time.monotonic() + timeout
    while True:
        p = cluster.kube.get("pods", name, "default")
        if p and (p.get("status") or {}).get("containerStatuses"):
            with contextlib.suppress(OSError, AssertionError, http.client.HTTPException):
                return await off_loop(http_get, netns_pid(cluster, name))
        assert time.monotonic() < deadline, f"no HTTP answer from pod {name}"
        await asyncio.sleep(0.2)


async def test_http_server_in_a_pod_serves_on_its_port_after_migration(
        cluster: Cluster) -> None:
    """busybox httpd, its page written at its first start into its writable layer."""
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "web-http"}
    script = ("mkdir -p /tmp/www && echo page-$(cat /proc/sys/kernel/random/uuid) "
              "> /tmp/www/index.html && exec /bin/busybox httpd -f -p 8080 -h /tmp/www")

    def web(name: str, node: str) -> dict[str, Any]:
        p = workload(name, node, env=env, owner="web", restart="Never")
        p["spec"]["containers"][0]["command"] = ["/smr/smr-init", "--", "/bin/sh", "-c", script]
        return p

    cluster.kube.put("pods", web("web-a", a))
    status, page = await until_http(cluster, "web-a")
    assert status == 200 and page.startswith(b"page-")
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="web-http", node=a, reason="drain",
        target=Target(kind="pod", namespace="default", pod="web-a", container="main")),
        timeout=60)
    assert done.status == "succeeded", done.error
    assert done.sockets and any(s.endswith(":8080") for s in done.sockets["listening"])
    cluster.kube.put("pods", web("web-b", b))
    await cluster.event("Restored", "web-b")
    # The restored server answers on the same port, in the new pod, with the
    # page its first start wrote (not a new one: it did not start again).
    assert await until_http(cluster, "web-b") == (200, page)
