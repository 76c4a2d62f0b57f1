"""The pod containers of this node, as the Kubernetes API and /proc see them,
and what the node agent's checkpoint and restore steps share."""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.containers import host
from services.containers.host import Shim
from services.containers.incontainer import CriuBundle
from services.storage.store import CheckpointStore
from smr.bus import Progress
from smr.contract.errors import PermanentError, TemporaryError
from smr.contract.messages import Target, epoch
from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.jobs import JobLock
from smr.process.criu import Criu

log = logging.getLogger("smr.containers.pods")


def runtime_id(container_id: str) -> str:
    """``containerd://abc`` → ``abc``."""
    return container_id.split("://", 1)[-1]


_QUANTITY = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))"
                       r"([eE][+-]?[0-9]+|[KMGTPE]i|[kMGTPE]|m)?")
_SUFFIX = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
           "Ei": 1 << 60, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "E": 10**18}


def quantity_bytes(text: object) -> int | None:
    """A Kubernetes resource quantity (``1Gi``, ``500M``, ``2e9``) in bytes,
    rounded up; None when it is not one (the API server validates them)."""
    m = _QUANTITY.fullmatch(str(text).strip())
    if not m:
        return None
    try:
        n = Decimal(m.group(1))
    except InvalidOperation:
        return None
    suffix = m.group(2) or ""
    if suffix[:1] in ("e", "E"):
        n = n.scaleb(int(suffix[1:]))
    elif suffix == "m":
        n /= 1000
    else:
        n *= _SUFFIX.get(suffix, 1)
    return math.ceil(n)


@dataclass
class PodContainer:
    pod: dict[str, Any]
    name: str
    status: dict[str, Any]  # its entry in status.containerStatuses

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def container_id(self) -> str:
        return runtime_id(self.status.get("containerID") or "")

    @property
    def image_id(self) -> str:
        return str(self.status.get("imageID") or "")

    @property
    def image(self) -> str:
        return str(self.status.get("image") or "")

    def ephemeral_storage_limit(self) -> int | None:
        """The container's ``resources.limits.ephemeral-storage`` in bytes,
        None where it sets none."""
        for c in (self.pod.get("spec") or {}).get("containers") or []:
            if c.get("name") == self.name:
                limit = ((c.get("resources") or {}).get("limits") or {}).get(
                    "ephemeral-storage")
                return None if limit is None else quantity_bytes(limit)
        return None

    def target(self) -> Target:
        m = self.pod["metadata"]
        return Target(kind="pod", namespace=m["namespace"], pod=m["name"], container=self.name)

    def lock_key(self) -> str:
        m = self.pod["metadata"]
        return f"pod.{m['uid']}.{self.name}"


class Pods:
    def __init__(self, api: client.ApiClient, node: str) -> None:
        self.core = client.CoreV1Api(api)
        self.node = node

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API server has it now (None: gone)."""
        try:
            resp = await self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                       _request_timeout=10)
        except ApiException as e:
            if e.status == 404:
                return None
            raise TemporaryError(f"cannot read pod {namespace}/{name}: {e.reason}",
                                 code="kube-api") from None
        return orjson.loads(await resp.read())  # type: ignore[no-any-return]

    async def on_node(self) -> list[dict[str, Any]]:
        try:
            resp = await self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.node}", _preload_content=False)
        except ApiException as e:
            raise TemporaryError(f"cannot list the pods of node {self.node}: {e.reason}",
                                 code="kube-api") from None
        return orjson.loads(await resp.read())["items"]  # type: ignore[no-any-return]

    async def container(self, target: Target) -> PodContainer:
        """The target's container, which must run on this node."""
        if target.kind != "pod" or not (target.namespace and target.pod and target.container):
            raise PermanentError(f"the node agent handles pod containers; {target} is not one",
                                 code="target-unsupported",
                                 hint="local jobs are handled by `smr up`")
        pod = await self.read(target.namespace, target.pod)
        if pod is None:
            raise PermanentError(f"{target}: no such pod", code="pod-not-found")
        uid = pod["metadata"].get("uid")
        if target.pod_uid and uid != target.pod_uid:
            raise PermanentError(
                f"{target}: the request was for pod uid {target.pod_uid}, and the pod of that "
                f"name is now another one (uid {uid}); refused", code="stale-request",
                hint="a request made for an earlier pod of the same name is not carried out")
        on = (pod.get("spec") or {}).get("nodeName")
        if on != self.node:
            raise PermanentError(f"{target} runs on node {on}, not on {self.node}",
                                 code="wrong-node", hint=f"send the request to node {on}")
        for st in (pod.get("status") or {}).get("containerStatuses") or []:
            if st.get("name") == target.container and st.get("containerID"):
                return PodContainer(pod, target.container, st)
        raise TemporaryError(f"{target} has not started yet (no container ID in its status)",
                             code="container-not-started")


class PodStep:
    """What the pod checkpoint and restore steps share."""

    def __init__(self, *, bundle: CriuBundle, criu: Criu, store: CheckpointStore,
                 lock: JobLock, pods: Pods, node: str, criu_timeout: float,
                 init_binary: str, label_prefix: str, work_dir: Path,
                 cuda: CudaCheckpoint | None = None, commit_deadline: float = 1800.0) -> None:
        self.bundle = bundle
        self.criu = criu  # the host's: its version goes into manifests
        self.store = store
        self.lock = lock
        self.pods = pods
        self.node = node
        self.criu_timeout = criu_timeout
        self.init_binary = init_binary  # the agent's own smr-init
        self.label_prefix = label_prefix  # for the pod's labels (services/policy)
        self.cuda = cuda  # None on a node without the CUDA checkpoint API
        self.commit_deadline = commit_deadline  # see services/checkpointer/durable
        # The agent's own directory, never the pod's volume: CRIU's images
        # and the layer's tar must be out of the workload's reach (a workload
        # that edits core-N.img before it is stored chooses its credentials).
        self.work_dir = work_dir

    @staticmethod
    def shim_of(c: PodContainer) -> Shim:
        shim = host.find_shim(c.container_id)
        if shim is None and not host.pids_of(c.container_id):
            # Every container runs a process until it ends (the API server
            # may not say so yet): its smr-init is gone with its workload.
            raise PermanentError(f"{c.target()} has ended: no process of it is left, so "
                                 "there is nothing to save", code="job-exited")
        if shim is None:
            raise PermanentError(
                f"{c.target()} does not run smr-init as its first process, so smr cannot "
                "checkpoint or restore it", code="no-smr-init",
                hint="label the pod for the smr webhook, or start the container's command "
                     "through /smr/smr-init (docs/node-agent.md)")
        host.check_mount_namespace(shim.pid)
        return shim

    async def criu_in(self, c: PodContainer, shim: Shim, work: Path, work_fd: int,
                      **kw: Any) -> Criu:
        """The agent's CRIU in ``c``'s container (CriuBundle.inside), judged on
        the pod as the API server has it now, not as the step first read it:
        an ephemeral container added while the step waited for its lock or
        downloaded is in the spec before the kubelet starts it."""
        meta = c.pod["metadata"]
        try:
            pod = await self.pods.read(c.namespace, meta["name"])
        except (TemporaryError, OSError, TimeoutError, aiohttp.ClientError) as e:
            # A final checkpoint must not hang on the API server: the spec as
            # the step read it judges, and a container added since went
            # through the webhook, which refuses one that could ptrace.
            log.warning("%s: cannot read the pod again before CRIU (%s); judged on the spec "
                        "read at the step's start", c.target(), e)
            pod = c.pod
        if pod is None or (pod.get("metadata") or {}).get("uid") != meta.get("uid"):
            raise PermanentError(f"{c.target()}: the pod is gone; CRIU was not started",
                                 code="pod-not-found")
        return await self.bundle.inside(shim, self.criu_timeout, work, work_fd, pod=pod,
                                        container=c.name, **kw)

    def work(self, request_id: str) -> Path:
        """A request's directory (the agent's, on the host side)."""
        return self.work_dir / request_id

    @staticmethod
    def open_work(work: Path) -> int:
        """``work`` (created if missing), mode 0700, held open for CRIU."""
        work.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(work, 0o700)
        return os.open(work, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


class Fresh:
    """A step that refuses a request whose deadline has passed before doing
    anything (a queued request must not act long after its cause; the
    pod's uid is checked where the pod is read, ``Pods.container``)."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.kind: str = step.kind

    async def run(self, req: Any, progress: Progress) -> Any:
        if req.deadline and epoch(req.deadline) < time.time():
            raise PermanentError(f"request {req.request_id} for {req.target} expired at "
                                 f"{req.deadline}; refused", code="request-expired",
                                 hint="its cause is long past: ask again if still wanted")
        return await self.step.run(req, progress)

    async def recover(self, req: Any, state: dict[str, Any]) -> Any:
        return await self.step.recover(req, state)
