"""Fixtures of the node agent's end-to-end tests (tests/agent/cluster.py says
what they hold)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from services.agent.__main__ import BUCKETS as AGENT_BUCKETS
from services.agent.service import NodeAgent
from services.kubeapi import api_client
from services.storage.codec import Codec
from services.storage.local import LocalBackend
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from services.watcher.__main__ import BUCKETS as WATCHER_BUCKETS
from services.watcher.service import Watcher
from services.webhook.service import Webhook
from smr import config
from smr.bus import BusConfig
from smr.config import REPO_TOOLS
from smr.natsserver import free_port
from smr.process.criu import Criu
from tests import nats_auth, oci_image
from tests.agent.agent_process import AgentProcess, env_of, memory_cgroup
from tests.agent.cluster import (
    COUNTER,
    ENTRY_IMAGE,
    GPU_IMAGE,
    IMAGE,
    OTHER_IMAGE,
    REDIS_IMAGE,
    SLOW,
    SLOW_IMAGE,
    TRAIN,
    USR_IMAGE,
    Cluster,
    held_by_us,
    stdio_pipes,
    webhook_configuration,
)
from tests.fake_apiserver import FakeApiServer
from tests.fake_apiserver import node as a_node
from tests.fake_controllers import FakeControllers
from tests.fake_kubelet import Containerd, FakeKubelet, containerd_missing
from tests.helpers.steplocks import node_locks
from tests.programs import node, pool
from tests.workloads import hf_generate, jax_mlp, torch_train

# The cluster's kubelet thresholds (--eviction-hard form): a small fixed floor.
HARNESS_EVICTION_HARD = "nodefs.available<4Mi,imagefs.available<4Mi"


@pytest.fixture(scope="session")
def smr_init() -> Path:
    path = REPO_TOOLS / "smr-init"
    if not path.is_file():
        if os.environ.get("CI"):
            pytest.fail("smr-init is not built: `make setup` builds it")
        pytest.skip("smr-init is not built (make setup)")
    return path


def runtime_state(node_bin: Path) -> Path:
    """smr-runtime's STATE in the tests (node_bin: the directory it is in)."""
    return node_bin / "run" / "smr" / "containers"


def agent_mark(node_bin: Path) -> Path:
    """The node agent's mark of life in the tests (services/agent/alive.py),
    beside smr-runtime as on a node. No AGENT_WAIT in smr-runtime.env: smr-init
    waits only its own timeout unless a test sets one."""
    return node_bin / "agent-alive"


@pytest.fixture(scope="session")
def smr_runtime(smr_init: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """smr-runtime as the agent installs it on a node: the binary, with its
    settings beside it (services/agent/init/smr-runtime.c)."""
    built = REPO_TOOLS / "smr-runtime"
    if not built.is_file():
        if os.environ.get("CI"):
            pytest.fail("smr-runtime is not built: `make setup` builds it")
        pytest.skip("smr-runtime is not built (make setup)")
    d = tmp_path_factory.mktemp("node-bin")
    shutil.copy2(built, d / "smr-runtime")
    # As on a node fresh from boot: /run is an empty tmpfs, so the state
    # directory's parents do not exist yet (smr-runtime creates them).
    (d / "smr-runtime.env").write_text(
        f"RUNTIME={shutil.which('runc')}\nINIT={smr_init}\nSTATE={runtime_state(d)}\n"
        f"LOG={d / 'smr-runtime.log'}\nAGENT_MARK={agent_mark(d)}\n")
    return d / "smr-runtime"


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


@dataclass(frozen=True)
class Ids:
    uid: int
    gid: int


def postgres_ids() -> Ids:
    """The host's postgres user (Debian's package makes it), the same in the image."""
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        return Ids(101, 104)  # its test fails, naming `make setup`
    return Ids(pw.pw_uid, pw.pw_gid)


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("images")
    built = [oci_image.build(d / "one.tar", IMAGE, files={"/bin/counter": COUNTER}),
             oci_image.build(d / "two.tar", OTHER_IMAGE, files={"/bin/counter": COUNTER},
                             label="two"),
             oci_image.build(d / "slow.tar", SLOW_IMAGE, files={"/bin/slow": SLOW}),
             oci_image.build(d / "entry.tar", ENTRY_IMAGE, files={"/bin/counter": COUNTER},
                             entrypoint=["/bin/sh"], cmd=["/bin/counter"]),
             # The host's /usr and /opt come in as hostPath volumes (Python,
             # PyTorch, the NVIDIA driver's libraries).
             oci_image.build(d / "gpu.tar", GPU_IMAGE,
                             files={"/app/train.py": TRAIN,
                                    # The frameworks' workloads.
                                    "/app/jax_mlp.py": Path(jax_mlp.__file__).read_bytes(),
                                    "/app/torch_train.py":
                                        Path(torch_train.__file__).read_bytes(),
                                    "/app/hf_generate.py":
                                        Path(hf_generate.__file__).read_bytes(),
                                    "/etc/passwd": b"root:x:0:0::/tmp:/bin/sh\n"},
                             # merged /usr, as the host: /sbin/ldconfig and the like
                             links={"lib": "usr/lib", "lib64": "usr/lib64",
                                    "sbin": "usr/sbin"})]
    # redis-server: a socket test's server (test_pod_sockets says if it is missing;
    # the GPU machine has none).
    if redis_server := shutil.which("redis-server"):
        built.append(oci_image.build(d / "redis.tar", REDIS_IMAGE,
                                     files=oci_image.host_program(redis_server)))
    pg = postgres_ids()
    # PostgreSQL 15 and Node.js (tests/agent/test_programs_pods.py): the host's
    # /usr comes in as a hostPath volume; the image has the users.
    built.append(oci_image.build(
        d / "host-usr.tar", USR_IMAGE, links={"lib": "usr/lib", "lib64": "usr/lib64"},
        files={"/app/server.js": node.SERVER, "/app/pool.py": Path(pool.__file__).read_bytes(),
               "/etc/passwd": f"root:x:0:0::/root:/bin/sh\npostgres:x:{pg.uid}:{pg.gid}::"
                              "/var/lib/postgresql:/bin/sh\n".encode(),
               "/etc/group": f"root:x:0:\npostgres:x:{pg.gid}:\n".encode()}))
    return built


@pytest.fixture
async def cluster(containerd: Containerd, images: list[Path], smr_init: Path,
                  smr_runtime: Path, tmp_path: Path, shipped_nats_users: nats_auth.Shipped,
                  bus_config: BusConfig, request: pytest.FixtureRequest,
                  settings: config.Settings) -> AsyncIterator[Cluster]:
    run = uuid.uuid4().hex[:6]
    nodes = [f"node-a-{run}", f"node-b-{run}"]
    # The kubelets end terminating pods; node and pod events come in no set order.
    kube = await FakeApiServer(bookmark_interval=0.5, kubelets=True, watch_jitter=0.05).start()
    if os.environ.get("SMR_TEST_STORAGE") == "local":
        # The GPU machine has no S3 server to run: a directory both nodes share.
        store = CheckpointStore(LocalBackend(tmp_path / "store"), Codec(level=1))
    else:
        from services.storage.s3 import S3Backend  # aioboto3 is not on the GPU machine

        bucket = f"smr-{run}"
        backend = S3Backend(bucket, prefix="ckpt", path_style=True,
                            endpoint_url=request.getfixturevalue("s3_endpoint"))
        async with backend._client() as c:
            await c.create_bucket(Bucket=bucket)
        store = CheckpointStore(backend, Codec(level=1))
    # NATS as a deployed cluster runs it: the users and permissions
    # deploy/kustomize ships (tests/nats_auth.py), each service logged in as
    # its own user (node a's agent as that node's user, from
    # agent-node.conf.template; node b's as the shipped all-nodes smr-agent,
    # the one a separate agent process logs in as), the test as smr-admin.
    # A permission a service lacks fails the test at its end (the server's log
    # names it), even where the service got by without it.
    secured = nats_auth.start(settings.nats_server_binary(), tmp_path / "nats-auth",
                              shipped_nats_users, agents={nodes[0]: f"pw-{run}"})
    base = settings.replace(
        nats_url=secured.url, lease_name=f"smr-watcher-{run}", lease_duration=3,
        lease_renew_deadline=2, lease_retry=1, max_deliver=2, ack_wait=5)
    if not request.node.get_closest_marker("kubelet_default_eviction"):
        # The agents' disk floor is the harness's own, not the kubelet's
        # default 15 % free: a test machine with less free disk than that
        # still checkpoints pods (every worker's pods share that disk).
        base = base.replace(kubelet_eviction_hard=HARNESS_EVICTION_HARD)
    bus = await secured.connect("smr-admin", bus_config)
    # The shipped permissions name the services' own durable consumers.
    durables = {"storage": "storage-retention", "watcher": "watcher"}
    users = {"storage": ("smr-storage", ()), "watcher": ("smr-watcher", WATCHER_BUCKETS),
             nodes[0]: (f"smr-agent-{nodes[0]}", AGENT_BUCKETS),
             nodes[1]: ("smr-agent", AGENT_BUCKETS)}
    buses = {who: await secured.connect(user, bus_config, buckets=buckets)
             for who, (user, buckets) in users.items()}
    webhook_user = secured.config("smr-webhook")
    base_webhook = base.replace(nats_user=webhook_user.user,
                                nats_password=webhook_user.password, nats_setup=False)
    # Each service as its own service account, held to the shipped RBAC (a
    # refused call fails the test at its end); the test as the operator.
    apis = [await api_client(kube.url, token=kube.token(account)) for account in
            ("smr-watcher", "smr-agent", "smr-agent")]
    apis += [await api_client(kube.url, token=kube.admin_token),
             await api_client(kube.url, token=kube.token("smr-webhook"))]
    # The webhook, installed as deploy/kustomize/base does: its configuration
    # (caBundle empty until the webhook fills it), reached as a Service.
    kube.put("mutatingwebhookconfigurations", webhook_configuration())
    webhook = Webhook(apis[4], base_webhook.replace(webhook_port=0), host="127.0.0.1")
    storage = StorageService(buses["storage"], store, durable=durables["storage"])
    watcher = Watcher(buses["watcher"], apis[0], base, durable_prefix=durables["watcher"])
    # A test marked agent_process(memory_limit=BYTES) gets the second node's
    # agent as a process of its own, held to that limit (tests/agent/agent_process).
    marker = request.node.get_closest_marker("agent_process")
    in_process = nodes[:1] if marker else nodes
    # Each node its own work directory, as on real nodes (its template cache is there).
    # Each node its own step locks (and starts lock: services/agent/alive.py).
    base = base.replace(agent_mark=str(agent_mark(smr_runtime.parent)))
    agents = [NodeAgent(buses[n], apis[1 + i], store,
                        base.replace(node_name=n, work_dir=str(tmp_path / f"work-{n}"),
                                     step_lock_dir=str(node_locks(n).root)))
              for i, n in enumerate(in_process)]
    kubelets = {}
    # Pulled by each kubelet when a pod first asks (not imported up front:
    # most tests run one or two of these images).
    registry = {oci_image.ref_of(tar): tar for tar in images}
    for n in nodes:
        kube.put("nodes", a_node(n))
        kubelets[n] = await FakeKubelet(kube, containerd, n, tmp_path, smr_init,
                                        runtime_classes={"smr": str(smr_runtime)},
                                        registry=registry).start()
    tasks = [asyncio.create_task(x.run()) for x in (storage, watcher, webhook, *agents)]
    await asyncio.wait_for(asyncio.gather(storage.ready.wait(), watcher.ready.wait(),
                                          webhook.ready.wait(),
                                          *(a.ready.wait() for a in agents)), 30)
    kube.services[("smr-system", "smr-webhook")] = ("127.0.0.1", webhook.port)
    stack = contextlib.ExitStack()
    try:
        if marker:
            if os.environ.get("SMR_TEST_STORAGE") == "local":
                where = {"STORAGE": "local", "STORAGE_PATH": str(tmp_path / "store")}
            else:
                where = {"STORAGE": "s3", "S3_BUCKET": bucket, "S3_PREFIX": "ckpt",
                         "S3_PATH_STYLE": "true",
                         "S3_ENDPOINT": request.getfixturevalue("s3_endpoint")}
            agent_user = secured.config("smr-agent")
            token_file = tmp_path / "agent-token"
            token_file.write_text(kube.token("smr-agent"))
            env = env_of(base.replace(node_name=nodes[1], nats_user=agent_user.user,
                                      step_lock_dir=str(node_locks(nodes[1]).root),
                                      nats_password=agent_user.password, nats_setup=False),
                         **where, ZSTD_LEVEL="1",
                         KUBE_API=kube.url, KUBE_TOKEN_FILE=str(token_file),
                         WORK_DIR=str(tmp_path / f"work-{nodes[1]}"),
                         HEALTH_PORT=str(free_port()), METRICS_PORT="0")
            cgroup = stack.enter_context(memory_cgroup(marker.kwargs["memory_limit"]))
            proc = AgentProcess(env, cgroup, tmp_path / f"agent-{nodes[1]}.log")
            stack.callback(proc.stop)
            await asyncio.to_thread(proc.ready)
        yield Cluster(kube, bus, store, kubelets, client.CoreV1Api(apis[3]), webhook, storage,
                      proc if marker else None,
                      {a.s.node: a for a in agents})
    finally:
        stdio = stdio_pipes(kubelets)
        stack.close()
        for k in kubelets.values():
            await k.stop()
        storage.stop()
        watcher.stop()
        webhook.stop()
        for a in agents:
            a.stop()
        for t in tasks:
            await asyncio.wait_for(t, 30)
        # Every step has ended: a descriptor of a container's log left open
        # in the agents' process (this one) is a leak, which holds the log
        # open after the container ends.
        leaked = held_by_us(stdio)
        for a in apis:
            await a.close()
        await store.close()
        await kube.stop()
        for b in (*buses.values(), bus):
            await b.close()
        secured.stop()
    refused = secured.violations()
    assert not refused, ("a service was refused a permission the shipped NATS users lack "
                         f"(deploy/kustomize/components/nats-auth): {refused[:5]}")
    assert not leaked, f"the agents kept descriptors {leaked} of containers' stdout or stderr"
    assert not kube.denied, ("a service was refused a call the shipped RBAC does not grant "
                             f"(deploy/kustomize/base): {kube.denied[:5]}")


@pytest.fixture
async def controllers(cluster: Cluster) -> AsyncIterator[FakeControllers]:
    """The FAKE workload controllers and scheduler (tests/fake_controllers.py)
    acting on this cluster's API server."""
    c = await FakeControllers(cluster.kube).start()
    yield c
    await c.stop()


@pytest.fixture
def criu_runs(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The arguments of every CRIU run the in-process agents start."""
    ran: list[list[str]] = []
    run = Criu._run

    async def logged(self: Criu, args: list[str], *rest: Any, **kw: Any) -> Any:
        ran.append(args)
        return await run(self, args, *rest, **kw)

    monkeypatch.setattr(Criu, "_run", logged)
    return ran
