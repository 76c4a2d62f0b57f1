"""What the node agent's end-to-end tests share: two simulated nodes on this
machine, their workload images, and what a resumed workload must show.

Real: containerd 1.6 with runc running the workload containers, CRIU 4.2
inside them, nats-server with the NATS users and permissions deploy/kustomize
ships (each service logged in as its own user, tests/nats_auth.py), moto's S3
server over HTTP, the watcher, the storage service, the webhook, two node
agents. FAKE: the Kubernetes API server
(tests/fake_apiserver.py) and the kubelets (tests/fake_kubelet.py), since
neither can run here; the test plays the scheduler and the Job controller.

The workload is a shell loop whose state lives in its memory: a step number
and the running sum of the squares of the steps. At its first start it writes
a random birth mark to its writable layer. A restored workload must go on
with the next step and a sum that matches it, and find its birth mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client

from services.agent.service import NodeAgent
from services.containers import host
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from services.webhook.service import Webhook
from smr.bus import Bus
from tests.agent.agent_process import AgentProcess
from tests.fake_apiserver import FakeApiServer, pod
from tests.fake_kubelet import FakeKubelet, fd_link, log_pipes

REPO = Path(__file__).resolve().parents[2]

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
# A server with a slow start (tests/agent/test_warmstart.py): it warms up for
# SLOW_S seconds (10 by default), then draws a secret that lives only in its
# memory, says it is ready (/ready, its readiness probe) and serves: each
# answer names its number and the secret. A copy of its warm memory answers
# on from the next number with the same secret, without warming up; it says
# once what the agent's note (/smr/main/restored) tells it it was restored from.
SLOW = b"""#!/bin/sh
echo "warming up for ${SLOW_S:-10} s"
sleep "${SLOW_S:-10}"
secret=$(cat /proc/sys/kernel/random/uuid)
touch /ready
i=0
noticed=""
while true; do
  i=$((i+1))
  echo "answer $i secret $secret"
  if [ -z "$noticed" ] && [ -f /smr/main/restored ]; then
    noticed=1
    echo "restored from $(cat /smr/main/restored)"
  fi
  sleep 0.1
done
"""
SLOW_IMAGE = "smr.test/slow-server:1"
IMAGE = "smr.test/counter:1"
OTHER_IMAGE = "smr.test/counter:2"  # the same files, another digest
REDIS_IMAGE = "smr.test/redis:7"  # this machine's redis-server and its libraries
ENTRY_IMAGE = "smr.test/entry:1"  # ENTRYPOINT ["/bin/sh"], CMD ["/bin/counter"]
# Users, /lib links and a Node.js script; the programs (PostgreSQL, Node.js)
# and their libraries are the host's /usr, mounted as a hostPath volume.
USR_IMAGE = "smr.test/host-usr:1"
GPU_IMAGE = "smr.test/train-gpu:1"  # /app/train.py; Python and PyTorch from hostPath volumes
TRAIN = b"""
# A small PyTorch training loop: fixed seeds, deterministic algorithms, a
# ballast of GPU memory the checkpoint must carry. argv: steps, GiB, pause;
# optionally a count of helper processes, each a second CUDA process holding
# its own GPU memory, asked every step (through a pipe) whether it is intact;
# and the number of GPUs the ballast is spread over (the model is on the first);
# and a file it creates after its 5th step (a readiness probe's, for a template).
import hashlib, multiprocessing as mp, sys, time
import torch


def helper(conn, gib):
    t = torch.full((int(gib * 2**30) // 4,), 7.0, device="cuda")
    want = float(t[:: 2**20].sum())
    while conn.recv():
        conn.send(float(t[:: 2**20].sum()) == want)


if __name__ == "__main__":
    steps, gib, pause = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    helpers = []
    for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 0):
        mine, theirs = mp.get_context("spawn").Pipe()
        mp.get_context("spawn").Process(target=helper, args=(theirs, gib / 2), daemon=True).start()
        helpers.append(mine)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    dev = "cuda"
    gpus = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    ballast = [torch.arange(int(gib * 2**30) // 4, device=f"cuda:{i}", dtype=torch.float32)
               for i in range(gpus)]
    check = [float(b[:: 2**20].sum()) for b in ballast]
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device=dev).manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(64, 256, device=dev, generator=gen)
        y = torch.randint(0, 10, (64,), device=dev, generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ok = [float(b[:: 2**20].sum()) for b in ballast] == check
        for h in helpers:
            h.send(True)
            ok = ok and h.recv()
        print(f"step {step} loss {loss.item():.6f} ballast_ok {ok}", flush=True)
        if step == 5 and len(sys.argv) > 6:  # warm: a readiness probe may look for it
            open(sys.argv[6], "w").close()
        time.sleep(pause)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    print(f"final {h.hexdigest()}", flush=True)
"""
CMD = ["/smr/smr-init", "--", "/bin/counter"]
STEP = re.compile(r"^step (\d+) sum (\d+) born (\S+)$", re.M)


def steps(log: str) -> list[tuple[int, int, str]]:
    return [(int(a), int(b), c) for a, b, c in STEP.findall(log)]


def container_id(cluster: Cluster, name: str) -> str:
    """The runtime's ID of pod ``name``'s (first) container."""
    p = cluster.kube.get("pods", name, "default")
    assert p is not None
    return str(p["status"]["containerStatuses"][0]["containerID"].split("://")[1])


def netns_pid(cluster: Cluster, name: str) -> int:
    """A process in the network namespace of pod ``name``'s container (its
    shim's workload side), for a client that reaches it as a Service would."""
    shim = host.find_shim(container_id(cluster, name))
    assert shim is not None
    return shim.pid


@dataclass
class Cluster:
    kube: FakeApiServer
    bus: Bus
    store: CheckpointStore
    kubelets: dict[str, FakeKubelet]
    core: client.CoreV1Api
    webhook: Webhook
    storage: StorageService
    # The second node's agent where a test runs it as a process (agent_process).
    agent_process: AgentProcess | None = None
    agents: dict[str, NodeAgent] = field(default_factory=dict)  # those in this process

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

    async def latest(self, ckpt: str, after: int = 0, timeout: float = 30,
                     reason: str | None = None) -> dict[str, Any]:
        """The manifest of ``ckpt``'s latest generation once it is past
        ``after`` (and, with ``reason``, once one taken for it is latest: a
        pod's heartbeat may come before, its first one jittered over an
        interval)."""
        deadline = time.monotonic() + timeout
        while True:
            gen = await self.store.latest("default", ckpt)
            if gen and gen.number > after and reason in (None, gen.manifest.get("reason")):
                return gen.manifest
            if time.monotonic() > deadline:
                raise AssertionError(f"no new checkpoint of {ckpt}")
            await asyncio.sleep(0.2)

    async def recreated(self, name: str, timeout: float = 30) -> dict[str, Any]:
        """The bare pod the watcher creates again once it is gone (not yet bound)."""
        deadline = time.monotonic() + timeout
        while not ((p := self.kube.get("pods", name, "default"))
                   and "nodeName" not in p["spec"]):
            assert time.monotonic() < deadline, "the watcher did not recreate the pod"
            await asyncio.sleep(0.1)
        return p

    async def drained_to(self, name: str, a: str, b: str,
                         before: list[tuple[int, int, str]]) -> None:
        """The pod goes from node a (a drain); the watcher creates the bare pod
        again once its last checkpoint is stored; the scheduler binds it to node
        b, where it continues from where it stopped."""
        self.kube.remove("pods", name, "default", disruption="EvictionByEvictionAPI")
        await self.recreated(name)
        before = steps(self.log(name, a)) or before
        self.schedule(name, b)
        after = await self.until_steps(name, b, 5)
        assert_continues(before, after, before[-1][0])

    def schedule(self, name: str, node: str) -> None:
        """The scheduler's part: bind the pod to a node."""
        p = self.kube.get("pods", name, "default")
        assert p is not None
        p["spec"]["nodeName"] = node
        p["status"] = {"phase": "Pending"}
        self.kube.put("pods", p)

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.kube.list("events", "default") if e["reason"] == reason]

    async def event(self, reason: str, pod: str, timeout: float = 15) -> dict[str, Any]:
        """The first Event ``reason`` on ``pod`` (the watcher posts it from a result)."""
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events(reason):
                if e["involvedObject"]["name"] == pod:
                    return e
            if time.monotonic() > deadline:
                raise AssertionError(f"no {reason} Event on pod {pod}")
            await asyncio.sleep(0.1)


def workload(name: str, node: str | None, *, image: str = IMAGE,
             labels: dict[str, str] | None = None, env: dict[str, str] | None = None,
             owner: str | None = None, restart: str = "Always",
             final_wait: int | None = None, grace: int | None = None) -> dict[str, Any]:
    """The hand-written manifest (docs/node-agent.md); ``final_wait``: its
    preStop hook waits that long for the final checkpoint (what the webhook
    gives an injected pod), ``grace``: terminationGracePeriodSeconds."""
    p = pod(name, node, labels=labels, env=env, owner=owner)
    c = p["spec"]["containers"][0]
    c["image"], c["command"] = image, CMD  # the hand-written manifest: smr-init in front
    if final_wait is not None:
        c["lifecycle"] = {"preStop": {"exec": {
            "command": ["/smr/smr-init", "--wait-final", str(final_wait)]}}}
    if grace is not None:
        p["spec"]["terminationGracePeriodSeconds"] = grace
    p["spec"]["volumes"] = [{"name": "smr", "emptyDir": {}}]
    p["spec"]["restartPolicy"] = restart
    p["status"] = {"phase": "Pending"}
    return p


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


@contextlib.contextmanager
def store_puts_through(cluster: Cluster, through: Callable[..., Awaitable[Any]]
                       ) -> Iterator[None]:
    """Every write to the store within the block goes through
    ``through(real, key, data, **kw)``, ``real`` the backend's own write: a
    fault where the test puts it. The agents' stores share the test's
    backend (the S3 server), so theirs go through it too."""
    backend: Any = cluster.store.backend
    real = backend.put_bytes

    async def put(key: str, data: bytes, **kw: Any) -> Any:
        return await through(real, key, data, **kw)

    backend.put_bytes = put
    try:
        yield
    finally:
        backend.put_bytes = real


def webhook_configuration(failure_policy: str = "Ignore") -> dict[str, Any]:
    """The MutatingWebhookConfiguration of deploy/kustomize/base/webhook.yaml,
    each entry with ``failure_policy``."""
    docs = yaml.safe_load_all((REPO / "deploy/kustomize/base/webhook.yaml").read_text())
    cfg = next(d for d in docs if d and d["kind"] == "MutatingWebhookConfiguration")
    for hook in cfg["webhooks"]:
        hook["failurePolicy"] = failure_policy
    return cfg  # type: ignore[no-any-return]


def stdio_pipes(kubelets: dict[str, FakeKubelet]) -> set[str]:
    """The log pipes of every container the kubelets run."""
    return log_pipes({run.id for k in kubelets.values() for st in k.pods.values()
                      for run in st.containers.values()})


def held_by_us(links: set[str]) -> list[str]:
    """This process's descriptors that are one of ``links``."""
    return [fd for fd in os.listdir("/proc/self/fd") if fd_link(f"/proc/self/fd/{fd}") in links]
