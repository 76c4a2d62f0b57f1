"""The node agent end to end: two simulated nodes on this machine.

Real: containerd 1.6 with runc running the workload containers, CRIU 4.2
inside them, nats-server, moto's S3 server over HTTP, the watcher, the
storage service, two node agents. FAKE: the Kubernetes API server
(tests/fake_apiserver.py) and the kubelets (tests/fake_kubelet.py), since
neither can run here; the test plays the scheduler and the Job controller.

The workload is a shell loop whose state lives in its memory: a step number
and the running sum of the squares of the steps. At its first start it writes
a random birth mark to its writable layer. A restored workload must go on
with the next step and a sum that matches it, and find its birth mark.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from kubernetes_asyncio import client

from services.agent import host
from services.agent.service import NodeAgent
from services.storage.codec import Codec
from services.storage.s3 import S3Backend
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from services.watcher.kube import api_client
from services.watcher.service import Watcher
from smr import config
from smr.bus import Bus
from smr.config import REPO_TOOLS
from smr.messages import CkptRequested, Target
from tests import oci_image
from tests.fake_apiserver import FakeApiServer, pod
from tests.fake_apiserver import node as a_node
from tests.fake_kubelet import Containerd, FakeKubelet, containerd_missing

COUNTER = b"""#!/bin/sh
# Its state is in memory: the step and the sum of the squares so far.
test -f /data/born || echo "born-$$-$(cat /proc/sys/kernel/random/uuid)" > /data/born
i=0; sum=0
while true; do
  i=$((i+1)); sum=$((sum+i*i))
  echo "step $i sum $sum born $(cat /data/born)"
  sleep 0.1
done
"""
IMAGE = "smr.test/counter:1"
OTHER_IMAGE = "smr.test/counter:2"  # the same files, another digest
REDIS_IMAGE = "smr.test/redis:7"  # this machine's redis-server and its libraries
CMD = ["/smr/smr-init", "--", "/bin/counter"]
STEP = re.compile(r"^step (\d+) sum (\d+) born (\S+)$", re.M)


def steps(log: str) -> list[tuple[int, int, str]]:
    return [(int(a), int(b), c) for a, b, c in STEP.findall(log)]


@pytest.fixture(scope="session")
def smr_init() -> Path:
    path = REPO_TOOLS / "smr-init"
    if not path.is_file():
        if os.environ.get("CI"):
            pytest.fail("smr-init is not built: `make setup` builds it")
        pytest.skip("smr-init is not built (make setup)")
    return path


@pytest.fixture(scope="session")
def containerd(criu_binary: str) -> Iterator[Containerd]:
    why = containerd_missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"containers unusable in CI: {why}")
        pytest.skip(why)
    ctd = Containerd(Path(f"/tmp/smr-ctd-{uuid.uuid4().hex[:6]}"),
                     str(Path(criu_binary).parent)).start()
    yield ctd
    ctd.stop()


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("images")
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.fail("redis-server is missing: `make setup` installs it")
    return [oci_image.build(d / "one.tar", IMAGE, files={"/bin/counter": COUNTER}),
            oci_image.build(d / "two.tar", OTHER_IMAGE, files={"/bin/counter": COUNTER},
                            label="two"),
            oci_image.build(d / "redis.tar", REDIS_IMAGE,
                            files=oci_image.host_program(redis_server))]


@dataclass
class Cluster:
    kube: FakeApiServer
    bus: Bus
    store: CheckpointStore
    kubelets: dict[str, FakeKubelet]
    core: client.CoreV1Api

    def log(self, name: str, node: str) -> str:
        return self.kubelets[node].log("default", name)

    async def until_steps(self, name: str, node: str, n: int = 3, timeout: float = 30
                          ) -> list[tuple[int, int, str]]:
        deadline = time.monotonic() + timeout
        while len(got := steps(self.log(name, node))) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"pod {name} on {node} did not run; log: "
                                     f"{self.log(name, node)[-2000:]!r}")
            await asyncio.sleep(0.1)
        return got

    async def latest(self, ckpt: str, after: int = 0, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            gen = await self.store.latest("default", ckpt)
            if gen and gen.number > after:
                return gen.manifest
            if time.monotonic() > deadline:
                raise AssertionError(f"no new checkpoint of {ckpt}")
            await asyncio.sleep(0.2)

    def schedule(self, name: str, node: str) -> None:
        """The scheduler's part: bind the pod to a node."""
        p = self.kube.get("pods", name, "default")
        assert p is not None
        p["spec"]["nodeName"] = node
        p["status"] = {"phase": "Pending"}
        self.kube.put("pods", p)

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.kube.list("events", "default") if e["reason"] == reason]


def workload(name: str, node: str | None, *, image: str = IMAGE,
             labels: dict[str, str] | None = None, env: dict[str, str] | None = None,
             owner: str | None = None, restart: str = "Always") -> dict[str, Any]:
    p = pod(name, node, labels=labels, env=env, owner=owner)
    c = p["spec"]["containers"][0]
    c["image"], c["command"] = image, CMD
    p["spec"]["restartPolicy"] = restart
    p["status"] = {"phase": "Pending"}
    return p


@pytest.fixture
async def cluster(nats_server: Any, s3_endpoint: str, containerd: Containerd,
                  images: list[Path], smr_init: Path, tmp_path: Path, bus: Bus
                  ) -> AsyncIterator[Cluster]:
    run = uuid.uuid4().hex[:6]
    nodes = [f"node-a-{run}", f"node-b-{run}"]
    kube = await FakeApiServer(bookmark_interval=0.5).start()
    bucket = f"smr-{run}"
    backend = S3Backend(bucket, prefix="ckpt", endpoint_url=s3_endpoint, path_style=True)
    async with backend._client() as c:
        await c.create_bucket(Bucket=bucket)
    store = CheckpointStore(backend, Codec(level=1))
    base = config.load({}).replace(
        nats_url=nats_server.url, lease_name=f"smr-watcher-{run}", lease_duration=3,
        lease_renew_deadline=2, lease_retry=1, max_deliver=2, ack_wait=5)
    apis = [await api_client(kube.url) for _ in range(4)]
    storage = StorageService(bus, store, durable=f"retention-{run}")
    watcher = Watcher(bus, apis[0], base, durable_prefix=f"w-{run}")
    agents = [NodeAgent(bus, apis[1 + i], store, base.replace(node_name=n))
              for i, n in enumerate(nodes)]
    kubelets = {}
    for n in nodes:
        kube.put("nodes", a_node(n))
        for tar in images:
            await containerd.import_image(n, tar)
        kubelets[n] = await FakeKubelet(kube, containerd, n, tmp_path, smr_init).start()
    tasks = [asyncio.create_task(x.run()) for x in (storage, watcher, *agents)]
    await asyncio.wait_for(asyncio.gather(storage.ready.wait(), watcher.ready.wait(),
                                          *(a.ready.wait() for a in agents)), 30)
    try:
        yield Cluster(kube, bus, store, kubelets, client.CoreV1Api(apis[3]))
    finally:
        for k in kubelets.values():
            await k.stop()
        storage.stop()
        watcher.stop()
        for a in agents:
            a.stop()
        for t in tasks:
            await asyncio.wait_for(t, 30)
        for a in apis:
            await a.close()
        await store.close()
        await kube.stop()


def assert_continues(before: list[tuple[int, int, str]], after: list[tuple[int, int, str]],
                     saved_at_most: int) -> None:
    """The restored workload goes on from its frozen memory: the next step,
    the sum that belongs to it, the same birth mark; not a fresh start."""
    first, s, born = after[0]
    assert first > 1, f"it started over: {after[:3]}"
    assert first <= saved_at_most + 1, f"step {first} was never reached before: {before[-3:]}"
    assert s == sum(k * k for k in range(1, first + 1)), f"memory state wrong: {after[0]}"
    assert born == before[0][2], "the writable layer did not come along"
    assert [x[0] for x in after] == list(range(first, first + len(after)))


async def test_cordoned_pod_resumes_on_another_node(cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("counter", a, labels={"smr.dev/node-restore": "true"}))
    await cluster.until_steps("counter", a, 5)

    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})  # kubectl cordon
    manifest = await cluster.latest("counter.main")
    assert manifest["reason"] == "cordon" and manifest["node"] == a
    assert manifest["container"]["image_id"].endswith(
        await cluster.kubelets[a].ctd.digest(a, IMAGE))
    before = steps(cluster.log("counter", a))
    assert before[-1][0] > 5, "a cordon checkpoint leaves the pod running"

    # The pod goes (a drain); the watcher creates the bare pod again once its
    # last checkpoint is stored; the scheduler binds it to node b.
    cluster.kube.remove("pods", "counter", "default")
    deadline = time.monotonic() + 30
    while not ((p := cluster.kube.get("pods", "counter", "default"))
               and "nodeName" not in p["spec"]):
        assert time.monotonic() < deadline, "the watcher did not recreate the pod"
        await asyncio.sleep(0.1)
    before = steps(cluster.log("counter", a)) or before
    cluster.schedule("counter", b)
    after = await cluster.until_steps("counter", b, 5)
    assert_continues(before, after, before[-1][0])
    assert cluster.events("Restored"), "the restore is an Event on the pod"


async def test_job_pod_resumes_in_its_retry_on_another_node(cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "train-7"}
    cluster.kube.put("pods", workload("train-x1", a, env=env, owner="train", restart="Never"))
    await cluster.until_steps("train-x1", a, 5)
    # A checkpoint through the API (a published message): the final state.
    await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="train-7", node=a,
        target=Target(kind="pod", namespace="default", pod="train-x1", container="main")),
        timeout=60)
    before = steps(cluster.log("train-x1", a))
    manifest = await cluster.latest("train-7")
    assert manifest["leave_running"] is False
    # The Job's next pod runs on node b, with the same checkpoint id.
    cluster.kube.put("pods", workload("train-x2", b, env=env, owner="train", restart="Never"))
    after = await cluster.until_steps("train-x2", b, 5)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "a final checkpoint loses no step"


async def test_restore_into_another_image_is_refused(cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "img-1"}
    cluster.kube.put("pods", workload("first", a, env=env, owner="j"))
    await cluster.until_steps("first", a, 3)
    await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="img-1", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="first", container="main")),
        timeout=60)
    # Another image: refused with an Event; this pod's policy allows a fresh start.
    cluster.kube.put("pods", workload("second", b, env=env, owner="j", image=OTHER_IMAGE))
    after = await cluster.until_steps("second", b, 3)
    assert after[0][0] == 1, "a refused restore starts the container fresh"
    [event] = cluster.events("RestoreFailed")
    assert "image-mismatch" in event["message"] or "image" in event["message"]
    assert OTHER_IMAGE in event["message"] and IMAGE in event["message"]
    # With restore-failure: fail the container does not start over.
    cluster.kube.put("pods", workload("third", b, env=env, owner="j", image=OTHER_IMAGE,
                                      labels={"smr.dev/restore-failure": "fail"},
                                      restart="Never"))
    deadline = time.monotonic() + 30
    while (p := cluster.kube.get("pods", "third", "default")) and \
            p["status"].get("phase") != "Failed":
        assert time.monotonic() < deadline, "the container did not fail"
        await asyncio.sleep(0.2)
    assert p is not None
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 70
    log = cluster.log("third", b)
    assert "forbids a fresh start" in log and steps(log) == []


# -- a server in a pod: redis-server, with a client in the pod's network namespace ----

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
    assert any("kv-b" in e["involvedObject"]["name"] for e in cluster.events("Restored"))
