"""A FAKE kubelet over a REAL containerd: no kubelet can run here without a
kube-apiserver, so this plays its part for the node agent's tests.

`Containerd` runs containerd 1.6 (Debian's) with runc and CRIU under a private
directory. Each simulated node is one containerd namespace. `FakeKubelet`
starts the containers of the pods bound to its node (reading the FAKE API
server's objects directly), restarts them by their restartPolicy, and reports
containerStatuses (containerID, imageID, state, restartCount, lastState) the
way the kubelet does. A pod's volume named `smr` (the hand-written manifest of
docs/node-agent.md) is an emptyDir: a directory per pod that outlives
container restarts; smr-init is copied into it as the pod's initContainer
would (mode 0777, as the kubelet makes an emptyDir). A pod's
`runtimeClassName` selects the runtime binary the way containerd's handler
`BinaryName` does (`ctr --runc-binary`), and a container's args are resolved
as the kubelet does: `command` replaces the image's ENTRYPOINT, `args` its CMD.

The container's user comes from ``securityContext`` (the container's fields
over the pod's) as the kubelet and containerd's CRI plugin set it:
``runAsUser`` (else the image's, here always root), ``runAsGroup`` (else the
user's group in the image's /etc/passwd), ``supplementalGroups`` and
``fsGroup`` as additional groups. Its PID 1 (smr-init, for a wrapped
container) and every exec in it run as that user. ctr 1.6 cannot set a
user, so tests/fake_cri_user.py writes it into the bundle in front of the
handler's runtime. ``runAsNonRoot`` with uid 0 is refused with the kubelet's
own message: the container stays waiting, ``CreateContainerConfigError``.

It stops a container the way the kubelet does (killContainer), because smr's
timing depends on it:

- a pod with a ``deletionTimestamp`` (an eviction or a delete) or one gone
  from the API (a forced delete) is stopped: each container's preStop exec
  hook runs (inside the container, bounded by the grace period), then
  SIGTERM goes to the container's PID 1, then SIGKILL once the grace
  (``deletionGracePeriodSeconds``, else ``terminationGracePeriodSeconds``,
  default 30 s; at least 2 s after the hook) has run out. SIGKILL of PID 1
  ends every process in its PID namespace. The kubelet then deletes the pod
  (grace 0), which is when it leaves the API;
- ``shutdown(grace)`` is graceful node shutdown (``shutdownGracePeriod``; GKE
  gives ordinary pods 15 s): the node turns ``Ready=False`` "node is shutting
  down", each pod is stopped as above within that grace, and ends
  ``Failed`` with the ``DisruptionTarget`` condition (reason
  ``TerminationByKubelet``), with no deletion;
- ``evict(pod)`` is a node-pressure eviction past a hard threshold (the
  eviction manager): grace 0, so no preStop hook, SIGTERM and SIGKILL 2 s
  later (the kubelet's minimum); the pod ends ``Failed``, reason ``Evicted``,
  with the same ``DisruptionTarget`` reason, and is not deleted;
- exec liveness probes (initialDelaySeconds, periodSeconds, timeoutSeconds,
  failureThreshold), held back until an exec startupProbe succeeds: a
  container that fails either is stopped as above and restarted by the pod's
  restartPolicy;
- exec readiness probes, held back the same way: a container with one is
  ``ready: false`` until it succeeds (``successThreshold`` 1), and false again
  after ``failureThreshold`` failures or a restart; without one it is ready
  while it runs. The pod's ``Ready`` and ``ContainersReady`` conditions are
  True while every container is ready, as the kubelet reports them.

GPUs (``nvidia.com/gpu`` in a container's limits) come from a FAKE of the
NVIDIA device plugin and container toolkit, where the kubelet is given
``gpus`` (``FakeGpu``: a UUID and its /dev/nvidiaN; ``node_gpus()`` lists
this machine's): a container asking for N gets N GPUs no other running pod's
container holds, in the order listed, kept across its restarts and freed
once its pod has terminated or is stopped (as the kubelet's device manager
does). It gets their
device nodes only, plus nvidiactl, nvidia-uvm, nvidia-uvm-tools and
nvidia-modeset (those of them the host has), as the real plugin and toolkit
do, and ``NVIDIA_VISIBLE_DEVICES=<their UUIDs>`` ahead of the pod's own env
(the kubelet puts the device plugin's env first, so a pod spec that sets it
comes last). Too few free: the container is not created and the pod waits
(``UnexpectedAdmissionError``'s message; the real kubelet fails such a pod at
admission instead). Without ``gpus`` (the default), a container asking for
any gets every /dev/nvidia* of the host and no variable, as before.

``actions`` records what it did, (monotonic time, pod, container, what), for
the tests to check (``prestop``, ``prestop-done``, ``TERM``, ``KILL``,
``exited``, ``liveness-ok`` (the first), ``liveness-failed``,
``startup-failed``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.containers import host
from tests.fake_apiserver import PRESSURE, SHUTDOWN, FakeApiServer, kubelet_failed
from tests.helpers.lifetime import die_with_parent

USER_WRAPPER = Path(__file__).with_name("fake_cri_user.py")
LOG_DRIVER = Path(__file__).with_name("fake_cri_log.sh")


class ContainerConfigError(Exception):
    """The kubelet's CreateContainerConfigError: the container is not created
    (the message is the kubelet's own)."""


def _pod_ref(pod: dict[str, Any]) -> str:
    meta = pod["metadata"]  # the kubelet's format.Pod
    return f'"{meta["name"]}_{meta["namespace"]}({meta.get("uid", "")})"'


def run_as(pod: dict[str, Any], c: dict[str, Any], image_user: str
           ) -> dict[str, Any] | None:
    """The user the container runs as, as the kubelet resolves it (each field
    of the container's securityContext over the pod's) and its
    verifyRunAsNonRoot checks it: None where nothing is asked (the image's
    user, which ctr applies itself)."""
    psc = (pod.get("spec") or {}).get("securityContext") or {}
    csc = c.get("securityContext") or {}

    def setting(key: str) -> Any:
        return csc[key] if csc.get(key) is not None else psc.get(key)

    uid, gid = setting("runAsUser"), setting("runAsGroup")
    where = f"(pod: {_pod_ref(pod)}, container: {c['name']})"
    if uid is None:
        head = image_user.split(":")[0]
        if head and not head.isdigit():
            if setting("runAsNonRoot"):
                raise ContainerConfigError(
                    f"container has runAsNonRoot and image has non-numeric user ({head}), "
                    f"cannot verify user is non-root {where}")
        elif setting("runAsNonRoot") and int(head or 0) == 0:
            raise ContainerConfigError(
                f"container has runAsNonRoot and image will run as root {where}")
    elif setting("runAsNonRoot") and int(uid) == 0:
        raise ContainerConfigError(f"container's runAsUser breaks non-root policy {where}")
    groups = [*([psc["fsGroup"]] if psc.get("fsGroup") is not None else []),
              *(psc.get("supplementalGroups") or [])]
    if uid is None and gid is None and not groups:
        return None
    if uid is None:  # the kubelet passes the image's numeric user (none: root)
        head = image_user.split(":")[0]
        if head and not head.isdigit():  # CRI would resolve the name: none here has one
            raise RuntimeError(f"fake kubelet: image user {head!r} by name with a "
                               "securityContext group is not supported")
        uid = int(head or 0)
    return {"uid": int(uid), "gid": None if gid is None else int(gid),
            "groups": [int(g) for g in groups]}


@dataclass(frozen=True)
class FakeGpu:
    """A GPU the FAKE device plugin hands out: its UUID and its device node
    (/dev/nvidiaN on a GPU machine; a test without one makes a node of the
    NVIDIA major elsewhere)."""
    uuid: str
    device: Path


# What the NVIDIA toolkit adds beside the GPUs' own device nodes.
GPU_COMPANIONS = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


def node_gpus() -> list[FakeGpu]:
    """This machine's GPUs as a device plugin lists them (NVML's order)."""
    from smr.gpu import gpuinfo

    return [FakeGpu(d["uuid"], Path(f"/dev/nvidia{d['minor']}")) for d in gpuinfo.devices()]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Containerd:
    def __init__(self, root: Path, criu_dir: str) -> None:
        self.root = root
        self.criu_dir = criu_dir  # runc, under containerd, finds CRIU on PATH
        self.sock = root / "containerd.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self.namespaces: set[str] = set()

    def start(self) -> Containerd:
        self.root.mkdir(parents=True, exist_ok=True)
        cfg = self.root / "config.toml"
        cfg.write_text(
            'version = 2\n'
            f'root = "{self.root}/root"\nstate = "{self.root}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.sock}"\n'
            f'[ttrpc]\n  address = "{self.sock}.ttrpc"\n')
        log = open(self.root / "containerd.log", "ab")
        env = {**os.environ, "PATH": f"{self.criu_dir}:{os.environ['PATH']}"}
        # It ends with the thread that started it (tests/helpers/lifetime.py).
        self.proc = subprocess.Popen(["containerd", "--config", str(cfg)], stdout=log,
                                     stderr=log, start_new_session=True, env=env,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + 20
        while subprocess.run(self._ctr("default", "version"), capture_output=True).returncode:
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start; see {self.root}/containerd.log")
            time.sleep(0.1)
        return self

    def _ctr(self, ns: str, *args: str) -> list[str]:
        return ["ctr", "-a", str(self.sock), "-n", ns, *args]

    async def ctr(self, ns: str, *args: str, check: bool = True) -> tuple[int, str]:
        self.namespaces.add(ns)
        proc = await asyncio.create_subprocess_exec(
            *self._ctr(ns, *args), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        text = out.decode(errors="replace")
        if check and proc.returncode:
            raise RuntimeError(f"ctr {' '.join(args)}: {text}")
        return proc.returncode or 0, text

    async def import_image(self, ns: str, tar: Path) -> None:
        await self.ctr(ns, "images", "import", str(tar))

    async def digest(self, ns: str, ref: str) -> str:
        _, out = await self.ctr(ns, "images", "ls")
        for line in out.splitlines()[1:]:
            parts = line.split()
            if parts and parts[0] == ref:
                return parts[2]
        raise KeyError(ref)

    async def image_config(self, ns: str, ref: str) -> dict[str, Any]:
        """The image's config (Entrypoint, Cmd, Env, …), read from the content store."""
        _, manifest = await self.ctr(ns, "content", "get", await self.digest(ns, ref))
        _, config = await self.ctr(ns, "content", "get", json.loads(manifest)["config"]["digest"])
        return json.loads(config).get("config") or {}

    def _run_bounded(self, ns: str, *args: str) -> str:
        """A ctr call at teardown that cannot hang it (a task stuck frozen)."""
        try:
            return subprocess.run(self._ctr(ns, *args), capture_output=True, text=True,
                                  timeout=30).stdout
        except subprocess.TimeoutExpired:
            print(f"containerd teardown: ctr {' '.join(args)} hung for 30 s")
            return ""

    def _clear(self, ns: str) -> None:
        if tasks := self._run_bounded(ns, "tasks", "ls", "-q").split():
            for t in tasks:
                self._run_bounded(ns, "tasks", "kill", "-s", "KILL", t)
            time.sleep(0.3)
            for t in tasks:
                self._run_bounded(ns, "tasks", "delete", "-f", t)
        for c in self._run_bounded(ns, "containers", "ls", "-q").split():
            self._run_bounded(ns, "containers", "rm", c)

    def stop(self) -> None:
        # A session leaves hundreds of namespaces, nearly all cleared by their
        # test already: looked at a few at a time, with no pause where no task
        # was left, this takes seconds, not the minute it took one by one.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(self._clear, sorted(self.namespaces)))
        if self.proc:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
        # Its images and snapshots (1-3 GB a test session) go; its log stays.
        # Left behind, runs of the suite filled the disk (ENOSPC in CI).
        with open("/proc/self/mountinfo") as f:
            under = [m for line in f if (m := line.split()[4]).startswith(f"{self.root}/")]
        for m in sorted(under, key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        for d in ("root", "state"):
            shutil.rmtree(self.root / d, ignore_errors=True)


@dataclass
class Running:
    name: str
    id: str
    log: Path
    restarts: int
    started_at: str
    exit_code: int | None = None
    started: float = field(default_factory=time.monotonic)
    probe_failures: int = 0
    probe_due: float = 0.0
    probing: bool = False
    startup_done: bool = False  # its startupProbe succeeded (liveness probes run from then)
    live_ok: bool = False  # a liveness probe has succeeded
    ready: bool = False  # its readiness probe has succeeded (and not failed since)
    ready_due: float = 0.0
    ready_probing: bool = False
    ready_failures: int = 0
    stopping: bool = False
    last: dict[str, Any] | None = None  # lastState.terminated of the run before


@dataclass
class PodState:
    uid: str
    volume: Path
    pod: dict[str, Any]
    containers: dict[str, Running] = field(default_factory=dict)
    stopping: asyncio.Task[None] | None = None
    waiting: dict[str, str] = field(default_factory=dict)  # CreateContainerConfigError's


MIN_GRACE_AFTER_HOOK = 2.0  # the kubelet's minimum grace, after a preStop hook too


def grace_of(pod: dict[str, Any]) -> float:
    meta, spec = pod["metadata"], pod.get("spec") or {}
    if meta.get("deletionGracePeriodSeconds") is not None:
        return float(meta["deletionGracePeriodSeconds"])
    return float(spec.get("terminationGracePeriodSeconds", 30))


class FakeKubelet:
    def __init__(self, kube: FakeApiServer, containerd: Containerd, node: str, workdir: Path,
                 smr_init: Path, runtime_classes: dict[str, str] | None = None,
                 gpus: list[FakeGpu] | None = None, gpu_dev: Path = Path("/dev"),
                 registry: dict[str, Path] | None = None) -> None:
        self.kube, self.ctd, self.node = kube, containerd, node
        # The fake registry (image name → its tarball): an image a pod asks
        # for is pulled, imported into this node's namespace, on first use,
        # as a kubelet pulls with imagePullPolicy IfNotPresent.
        self.registry = registry or {}
        self._pulling = asyncio.Lock()
        # The fake device plugin's GPUs (None: every /dev/nvidia* to a pod
        # that asks); gpu_dev: where the toolkit's companion nodes are.
        self.gpus, self.gpu_dev = gpus, gpu_dev
        self.gpus_given: dict[tuple[str, str], list[FakeGpu]] = {}  # (pod uid, container)
        self.runtime_classes = runtime_classes or {}  # RuntimeClass name → runtime binary
        self.ns = node
        self.dir = workdir / node
        self.smr_init = smr_init
        self.pods: dict[str, PodState] = {}  # uid → state
        self._task: asyncio.Task[None] | None = None
        self._work: set[asyncio.Task[Any]] = set()
        self.digests: dict[str, str] = {}
        self.configs: dict[str, dict[str, Any]] = {}  # image → its config (ENTRYPOINT, User)
        self.shutting_down = False
        self.actions: list[tuple[float, str, str, str]] = []

    async def start(self) -> FakeKubelet:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        """Stop syncing and kill this node's containers (the node goes away)."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._work):
            t.cancel()
        for t in list(self._work):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for st in self.pods.values():
            await self._kill_now(st)
        self.pods.clear()

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as e:  # a test harness: say it, keep going
                print(f"fake kubelet {self.node}: {e!r}")
            await asyncio.sleep(0.2)

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._work.add(task)
        task.add_done_callback(self._work.discard)
        return task

    def _did(self, pod: dict[str, Any], container: str, what: str) -> None:
        self.actions.append((time.monotonic(), pod["metadata"]["name"], container, what))

    # -- what the tests look at -----------------------------------------------------

    def state(self, namespace: str, name: str) -> PodState | None:
        pod = self.kube.get("pods", name, namespace)
        if pod is not None and pod["metadata"]["uid"] in self.pods:
            return self.pods[pod["metadata"]["uid"]]
        # Gone from the API or from this node: the last one of that name this kubelet ran.
        known = [st for st in self.pods.values() if st.pod["metadata"]["name"] == name
                 and st.pod["metadata"]["namespace"] == namespace]
        return known[-1] if known else None

    def log(self, namespace: str, name: str, container: str = "main") -> str:
        st = self.state(namespace, name)
        if st is None or container not in st.containers:
            return ""
        with contextlib.suppress(OSError):
            return st.containers[container].log.read_text(errors="replace")
        return ""

    def log_of(self, uid: str, container: str = "main") -> str:
        """The log of the pod of ``uid`` this kubelet ran (a StatefulSet's pods
        share their names)."""
        st = self.pods.get(uid)
        if st is None or container not in st.containers:
            return ""
        with contextlib.suppress(OSError):
            return st.containers[container].log.read_text(errors="replace")
        return ""

    def did(self, name: str, what: str) -> list[tuple[float, str, str, str]]:
        return [a for a in self.actions if a[1] == name and a[3] == what]

    # -- graceful node shutdown -------------------------------------------------------

    async def shutdown(self, grace: float = 15) -> None:
        """Graceful node shutdown, as the kubelet's shutdown manager does it
        when systemd-logind announces the shutdown."""
        self.shutting_down = True
        node = self.kube.get("nodes", self.node)
        assert node is not None
        conds = [c for c in node["status"].get("conditions") or [] if c["type"] != "Ready"]
        node["status"]["conditions"] = [*conds, {
            "type": "Ready", "status": "False", "reason": "KubeletNotReady",
            "message": "node is shutting down", "lastTransitionTime": _now()}]
        self.kube.put("nodes", node)
        stops = []
        for st in list(self.pods.values()):
            if st.stopping is not None:
                continue
            pod = self.kube.get("pods", st.pod["metadata"]["name"],
                                st.pod["metadata"]["namespace"])
            if pod is None or pod["metadata"]["uid"] != st.uid:
                continue
            # The DisruptionTarget condition comes with the terminal status.
            st.stopping = self._spawn(self._stop_pod(st, min(grace, grace_of(pod)),
                                                     delete=False, why=SHUTDOWN))
            stops.append(st.stopping)
        await asyncio.gather(*stops, return_exceptions=True)

    async def evict(self, name: str, namespace: str = "default") -> None:
        """A node-pressure eviction past a hard threshold, as the eviction
        manager does it: grace 0, the pod left Failed (``Evicted``)."""
        pod = self.kube.get("pods", name, namespace)
        assert pod is not None
        st = self.pods[pod["metadata"]["uid"]]
        if st.stopping is None:
            st.stopping = self._spawn(self._stop_pod(st, 0, delete=False, why=PRESSURE))
        await st.stopping

    # -- the sync loop ----------------------------------------------------------------

    async def sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.kube.list("pods")
                if (p.get("spec") or {}).get("nodeName") == self.node}
        for uid, st in list(self.pods.items()):
            pod = pods.get(uid)
            if st.stopping is None and (pod is None or pod["metadata"].get("deletionTimestamp")):
                st.stopping = self._spawn(self._stop_pod(
                    st, grace_of(pod or st.pod), delete=pod is not None))
            if pod is not None:
                st.pod = pod
        # The runtime's task list only where a container runs to look at: an
        # idle node's sync (five a second) runs no `ctr`.
        status: dict[str, str] = {}
        if any(r.exit_code is None for st in self.pods.values() for r in st.containers.values()):
            _, out = await self.ctd.ctr(self.ns, "tasks", "ls")
            status = {parts[0]: parts[2] for line in out.splitlines()[1:]
                      if len(parts := line.split()) >= 3}
        for uid, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp") or self.shutting_down:
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") \
                    and uid not in self.pods:
                continue
            st = self.pods.get(uid)
            if st is None:
                st = self.pods[uid] = PodState(uid, self.dir / "pods" / uid / "smr", pod)
                if any(v.get("name") == "smr" for v in pod["spec"].get("volumes") or []):
                    st.volume.mkdir(parents=True)
                    st.volume.chmod(0o777)  # an emptyDir, whatever the pod's user
                    shutil.copy2(self.smr_init, st.volume / "smr-init")  # the initContainer
            if st.stopping is not None:
                continue
            changed = False
            for c in pod["spec"]["containers"]:
                run = st.containers.get(c["name"])
                if run is None:
                    try:
                        st.containers[c["name"]] = await self._run(pod, c, st, 0)
                        st.waiting.pop(c["name"], None)
                        changed = True
                    except ContainerConfigError as e:  # retried each sync, as with backoff
                        changed = changed or st.waiting.get(c["name"]) != str(e)
                        st.waiting[c["name"]] = str(e)
                elif run.exit_code is None and status.get(run.id) == "STOPPED" \
                        and not run.stopping:
                    await self._reap(pod, run)
                    changed = True
                    policy = pod["spec"].get("restartPolicy", "Always")
                    if policy == "Always" or (policy == "OnFailure" and run.exit_code != 0):
                        new = await self._run(pod, c, st, run.restarts + 1)
                        new.last = {"exitCode": run.exit_code, "finishedAt": _now()}
                        st.containers[c["name"]] = new
                elif run.exit_code is None and not run.stopping:
                    if not run.probing and (c.get("livenessProbe") or c.get("startupProbe")):
                        self._probe(pod, c, run, st)
                    if not run.ready_probing and c.get("readinessProbe") \
                            and (run.startup_done or not c.get("startupProbe")):
                        self._readiness(pod, c, run, st)
            if changed:
                self._report(pod, st)

    async def _reap(self, pod: dict[str, Any], run: Running) -> None:
        _, out = await self.ctd.ctr(self.ns, "tasks", "delete", run.id, check=False)
        # ctr exits 0 and warns "exit with non-zero exit code N".
        m = re.search(r"exit code (\d+)", out)
        run.exit_code = int(m.group(1)) if m else 0
        self._did(pod, run.name, "exited")

    # -- stopping a container, as killContainer does -----------------------------------

    async def _stop_pod(self, st: PodState, grace: float, *, delete: bool,
                        why: tuple[str, str] | None = None) -> None:
        pod = st.pod
        deadline = time.monotonic() + grace
        specs = {c["name"]: c for c in pod["spec"]["containers"]}
        await asyncio.gather(*(self._stop_container(pod, specs.get(run.name) or {}, run,
                                                    deadline)
                               for run in st.containers.values() if run.exit_code is None))
        for run in st.containers.values():
            await self.ctd.ctr(self.ns, "containers", "rm", run.id, check=False)
        self._free_gpus(st.uid)
        fresh = self.kube.get("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])
        if fresh is not None and fresh["metadata"]["uid"] == st.uid:
            self._report(fresh, st, failed_because=why)
            if delete:  # the kubelet's own delete, grace 0: now the pod is gone
                self.kube.remove("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])

    async def _stop_container(self, pod: dict[str, Any], spec: dict[str, Any], run: Running,
                              deadline: float) -> None:
        run.stopping = True
        hook = (((spec.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {})
        if hook.get("command") and deadline > time.monotonic():  # grace 0: no hook
            self._did(pod, run.name, "prestop")
            rc, out = await self._exec(run, hook["command"], deadline - time.monotonic())
            self._did(pod, run.name, f"prestop-done {rc} {out.strip()[-200:]}")
        deadline = max(deadline, time.monotonic() + MIN_GRACE_AFTER_HOOK)
        self._did(pod, run.name, "TERM")
        await self.ctd.ctr(self.ns, "tasks", "kill", "-s", "TERM", run.id, check=False)
        if not await self._stopped(run, deadline):
            self._did(pod, run.name, "KILL")
            await self.ctd.ctr(self.ns, "tasks", "kill", "-s", "KILL", run.id, check=False)
            if not await self._stopped(run, time.monotonic() + 30):
                # A task in a frozen cgroup (a dump) dies only once thawed: say so, go on.
                print(f"fake kubelet {self.node}: {run.id} outlived SIGKILL by 30 s")
        await self._reap(pod, run)

    async def _stopped(self, run: Running, until: float) -> bool:
        """Wait for the task to stop, until ``until``."""
        while True:
            if await self._task_stopped(run):
                return True
            if time.monotonic() >= until:
                return False
            await asyncio.sleep(0.1)

    async def _task_stopped(self, run: Running) -> bool:
        _, out = await self.ctd.ctr(self.ns, "tasks", "ls", check=False)
        for line in out.splitlines()[1:]:
            parts = line.split()
            if parts and parts[0] == run.id:
                return len(parts) >= 3 and parts[2] == "STOPPED"
        return True  # no task: nothing left to stop

    async def _exec(self, run: Running, cmd: list[str], timeout: float) -> tuple[int, str]:
        """Run ``cmd`` inside the container (``ctr tasks exec``, as the CRI's
        ExecSync does); (-1, "timeout") when it outlasts ``timeout``."""
        proc = await asyncio.create_subprocess_exec(
            *self.ctd._ctr(self.ns, "tasks", "exec", "--exec-id", uuid.uuid4().hex[:12],
                           run.id, *cmd),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        self.ctd.namespaces.add(self.ns)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), max(timeout, 0.01))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return -1, "timeout"
        return proc.returncode or 0, out.decode(errors="replace")

    # -- liveness probes ------------------------------------------------------------------

    def _probe(self, pod: dict[str, Any], c: dict[str, Any], run: Running,
               st: PodState) -> None:
        # A startupProbe holds the liveness probe back until it succeeds.
        kind = "startup" if c.get("startupProbe") and not run.startup_done else "liveness"
        probe = c.get(f"{kind}Probe")
        if not probe:
            return
        now = time.monotonic()
        if not run.probe_due:
            run.probe_due = run.started + float(probe.get("initialDelaySeconds", 0))
        if now < run.probe_due or "exec" not in probe:
            return
        run.probing = True
        run.probe_due = now + float(probe.get("periodSeconds", 10))

        async def probe_once() -> None:
            try:
                rc, _ = await self._exec(run, probe["exec"]["command"],
                                         float(probe.get("timeoutSeconds", 1)))
                if rc == 0:
                    run.probe_failures = 0
                    if kind == "liveness" and not run.live_ok:
                        run.live_ok = True
                        self._did(pod, run.name, "liveness-ok")  # the first success
                    if kind == "startup":
                        run.startup_done = True
                        live = c.get("livenessProbe") or {}
                        run.probe_due = time.monotonic() + float(
                            live.get("initialDelaySeconds", 0))
                    return
                run.probe_failures += 1
                if run.probe_failures < int(probe.get("failureThreshold", 3)) or run.stopping:
                    return
                self._did(pod, run.name, f"{kind}-failed")
                await self._stop_container(pod, c, run, time.monotonic() + grace_of(pod))
                await self.ctd.ctr(self.ns, "containers", "rm", run.id, check=False)
                policy = pod["spec"].get("restartPolicy", "Always")
                if st.stopping is None and policy in ("Always", "OnFailure"):
                    new = await self._run(pod, c, st, run.restarts + 1)
                    new.last = {"exitCode": run.exit_code, "reason": "Error",
                                "finishedAt": _now()}
                    st.containers[c["name"]] = new
                self._report(pod, st)
            finally:
                run.probing = False

        self._spawn(probe_once())

    def _readiness(self, pod: dict[str, Any], c: dict[str, Any], run: Running,
                   st: PodState) -> None:
        probe = c["readinessProbe"]
        now = time.monotonic()
        if not run.ready_due:
            run.ready_due = run.started + float(probe.get("initialDelaySeconds", 0))
        if now < run.ready_due or "exec" not in probe:
            return
        run.ready_probing = True
        run.ready_due = now + float(probe.get("periodSeconds", 10))

        async def probe_once() -> None:
            try:
                rc, _ = await self._exec(run, probe["exec"]["command"],
                                         float(probe.get("timeoutSeconds", 1)))
                was = run.ready
                if rc == 0:
                    run.ready_failures = 0
                    run.ready = True
                else:
                    run.ready_failures += 1
                    if run.ready_failures >= int(probe.get("failureThreshold", 3)):
                        run.ready = False
                if run.ready != was and run.exit_code is None and not run.stopping:
                    self._did(pod, run.name, "ready" if run.ready else "not-ready")
                    self._report(pod, st)
            finally:
                run.ready_probing = False

        self._spawn(probe_once())

    async def pull(self, ref: str) -> str:
        """The digest of image ``ref`` on this node, pulled first if missing."""
        if ref not in self.digests:
            async with self._pulling:  # one pull of an image at a time, as the kubelet's
                try:
                    self.digests[ref] = await self.ctd.digest(self.ns, ref)
                except KeyError:
                    if ref not in self.registry:
                        raise
                    await self.ctd.import_image(self.ns, self.registry[ref])
                    self.digests[ref] = await self.ctd.digest(self.ns, ref)
        return self.digests[ref]

    async def _run(self, pod: dict[str, Any], c: dict[str, Any], st: PodState,
                   restarts: int) -> Running:
        cid = uuid.uuid4().hex
        await self.pull(c["image"])
        # By uid too, as the kubelet's /var/log/pods/<ns>_<name>_<uid>: a
        # StatefulSet's pod of the same name back on this node has its own log.
        log = self.dir / "logs" / (f"{pod['metadata']['name']}_{pod['metadata']['uid']}_"
                                   f"{c['name']}_{restarts}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        env = [f"{e['name']}={e['value']}" for e in c.get("env") or []]
        # Written by a log driver that copies until the streams end, as CRI's
        # own copy does (tests/fake_cri_log.sh says why not ctr's file://).
        args = ["run", "-d", "--log-uri",
                f"binary://{LOG_DRIVER}?log={urllib.parse.quote(str(log), safe='/')}"]
        if st.volume.is_dir():
            args += ["--mount", f"type=bind,src={st.volume},dst=/smr,options=rbind:rw"]
        # hostPath volumes, as the pod mounts them.
        paths = {v["name"]: v["hostPath"]["path"] for v in pod["spec"].get("volumes") or []
                 if "hostPath" in v}
        for m in c.get("volumeMounts") or []:
            if m["name"] in paths:
                mode = "ro" if m.get("readOnly") else "rw"
                args += ["--mount", f"type=bind,src={paths[m['name']]},dst={m['mountPath']},"
                                    f"options=rbind:{mode}"]
        # nvidia.com/gpu: the device nodes, as the NVIDIA device plugin and
        # runtime give them (the driver's libraries come with a hostPath here).
        want = int(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
        if want and self.gpus is None:
            for dev in sorted(Path("/dev").glob("nvidia*")):
                if dev.is_char_device():
                    args += ["--device", str(dev)]
        elif want:
            given = self._allocate_gpus(pod, c, want)
            devs = [g.device for g in given] + [self.gpu_dev / n for n in GPU_COMPANIONS]
            for dev in devs:
                if dev.is_char_device():
                    args += ["--device", str(dev)]
            # The device plugin's env goes ahead of the pod's own.
            env = [f"NVIDIA_VISIBLE_DEVICES={','.join(g.uuid for g in given)}", *env]
        # securityContext.capabilities and privileged, as the kubelet hands them to CRI.
        csc = c.get("securityContext") or {}
        caps = csc.get("capabilities") or {}
        args += [f"--cap-add=CAP_{n.upper()}" for n in caps.get("add") or []]
        args += [f"--cap-drop=CAP_{n.upper()}" for n in caps.get("drop") or []]
        if csc.get("privileged"):
            args.append("--privileged")
        runtime = "runc"
        if rc := pod["spec"].get("runtimeClassName"):
            if rc not in self.runtime_classes:
                raise RuntimeError(f"RuntimeClass {rc} not found on node {self.node}")
            runtime = self.runtime_classes[rc]
        if c["image"] not in self.configs:
            self.configs[c["image"]] = await self.ctd.image_config(self.ns, c["image"])
        image = self.configs[c["image"]]
        user = run_as(pod, c, str(image.get("User") or ""))
        if user is not None:
            (self.dir / "users").mkdir(parents=True, exist_ok=True)
            (self.dir / "users" / cid).write_text(json.dumps(user))
            runtime = self._user_runtime(runtime)
        if runtime != "runc":
            args += ["--runc-binary", runtime]
        for e in env:
            args += ["--env", e]
        process: list[str] = []  # empty: the image's ENTRYPOINT and CMD, as ctr reads them
        if c.get("command"):
            process = [*c["command"], *(c.get("args") or [])]
        elif c.get("args"):
            process = [*(image.get("Entrypoint") or []), *c["args"]]
        await self.ctd.ctr(self.ns, *args, c["image"], cid, *process)
        return Running(c["name"], cid, log, restarts, _now())

    def _allocate_gpus(self, pod: dict[str, Any], c: dict[str, Any], want: int
                       ) -> list[FakeGpu]:
        """The fake device plugin's Allocate: ``want`` GPUs no other running
        container holds; a restarted container keeps its own."""
        key = (pod["metadata"]["uid"], c["name"])
        if key in self.gpus_given:
            return self.gpus_given[key]
        held = {g.uuid for gs in self.gpus_given.values() for g in gs}
        free = [g for g in self.gpus or [] if g.uuid not in held]
        if len(free) < want:
            raise ContainerConfigError(
                "UnexpectedAdmissionError: Allocate failed due to requested number of devices "
                f"unavailable for nvidia.com/gpu. Requested: {want}, Available: {len(free)}, "
                "which is unexpected")
        self.gpus_given[key] = free[:want]
        return free[:want]

    def _free_gpus(self, uid: str) -> None:
        for key in [k for k in self.gpus_given if k[0] == uid]:
            del self.gpus_given[key]

    def _user_runtime(self, real: str) -> str:
        """``real`` (a runtime binary) behind tests/fake_cri_user.py, which
        writes the container's user into its bundle as CRI would."""
        path = self.dir / "runtimes" / (Path(real).name + "-as-user")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"#!/bin/sh\nexec {sys.executable} {USER_WRAPPER} "
                            f"{self.dir / 'users'} {real} \"$@\"\n")
            path.chmod(0o755)
        return str(path)

    def _report(self, pod: dict[str, Any], st: PodState,
                failed_because: tuple[str, str] | None = None) -> None:
        fresh = self.kube.get("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])
        if fresh is None or fresh["metadata"]["uid"] != st.uid:
            return
        statuses = []
        for c in fresh["spec"]["containers"]:
            run = st.containers.get(c["name"])
            if run is None:
                continue
            state: dict[str, Any] = {"running": {"startedAt": run.started_at}}
            if run.exit_code is not None:
                state = {"terminated": {"exitCode": run.exit_code, "finishedAt": _now()}}
            ready = "running" in state and (run.ready or not c.get("readinessProbe"))
            status = {
                "name": c["name"], "restartCount": run.restarts, "ready": ready,
                "image": c["image"], "imageID": f"{c['image']}@{self.digests[c['image']]}",
                "containerID": f"containerd://{run.id}", "state": state}
            if run.last:
                status["lastState"] = {"terminated": run.last}
            statuses.append(status)
        waiting = [{"name": c["name"], "restartCount": 0, "ready": False, "image": c["image"],
                    "imageID": "", "state": {"waiting": {
                        "reason": "CreateContainerConfigError",
                        "message": st.waiting[c["name"]]}}}
                   for c in fresh["spec"]["containers"]
                   if c["name"] in st.waiting and c["name"] not in st.containers]
        ended = [s["state"].get("terminated") for s in statuses]
        phase = "Pending" if waiting else "Running"
        statuses += waiting
        if statuses and not waiting and all(ended):
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in ended) else "Failed"
        new = {**(fresh.get("status") or {}), "phase": phase, "containerStatuses": statuses}
        all_ready = "True" if statuses and all(x["ready"] for x in statuses) else "False"
        new["conditions"] = [
            *[c for c in new.get("conditions") or []
              if c["type"] not in ("Ready", "ContainersReady")],
            *[{"type": t, "status": all_ready, "lastTransitionTime": _now()}
              for t in ("ContainersReady", "Ready")]]
        if failed_because:  # stopped by the kubelet itself: Failed, whatever the exit codes
            new = kubelet_failed(new, failed_because)
        fresh["status"] = new
        self.kube.put("pods", fresh)
        if new["phase"] in ("Succeeded", "Failed"):  # terminated: its devices are free
            self._free_gpus(st.uid)

    async def _kill_now(self, st: PodState) -> None:
        """The node loses power: SIGKILL, no hook, no grace."""
        pipes = log_pipes({run.id for run in st.containers.values()})
        for run in st.containers.values():
            if run.exit_code is None:
                await self.ctd.ctr(self.ns, "tasks", "kill", "-s", "KILL", run.id, check=False)
        await asyncio.sleep(0.3)
        for run in st.containers.values():
            started = time.monotonic()
            await self.ctd.ctr(self.ns, "tasks", "delete", "-f", run.id, check=False)
            if (took := time.monotonic() - started) > SLOW_DELETE_S:
                # containerd's shim waits (12 s) for the log to close: someone
                # outside the container still holds its stdout or stderr.
                warnings.warn(f"fake kubelet {self.node}: deleting container {run.id} of pod "
                              f"{st.pod['metadata']['name']} took {took:.0f}s; its log pipes "
                              f"{sorted(pipes)} held by {holders(pipes)}", stacklevel=1)
            await self.ctd.ctr(self.ns, "containers", "rm", run.id, check=False)
        self._free_gpus(st.uid)


SLOW_DELETE_S = 5.0


def log_pipes(container_ids: set[str]) -> set[str]:
    """The pipes the processes of these containers hold as their stdin,
    stdout and stderr (the container's log), as /proc names them."""
    found = set()
    for p in host.all_pids():
        if host.container_id_of(p) in container_ids:
            for fd in (0, 1, 2):
                with contextlib.suppress(OSError):
                    if (link := os.readlink(f"/proc/{p}/fd/{fd}")).startswith("pipe:"):
                        found.add(link)
    return found


def holders(links: set[str]) -> list[str]:
    """Each process holding one of ``links``: its PID and command."""
    found = []
    for p in host.all_pids():
        with contextlib.suppress(OSError):
            if any(fd_link(f"/proc/{p}/fd/{fd}") in links for fd in os.listdir(f"/proc/{p}/fd")):
                found.append(f"{p} {Path(f'/proc/{p}/cmdline').read_bytes()[:120]!r}")
    return found


def fd_link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile (the listing's own descriptor, for one)
        return ""


def containerd_missing() -> str | None:
    if os.geteuid() != 0:
        return "containers need root"
    for tool in ("containerd", "ctr", "runc", "busybox", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup installs it)"
    return None
