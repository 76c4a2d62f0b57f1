"""A FAKE kubelet over a REAL containerd: no kubelet can run here without a
kube-apiserver, so this plays its part for the node agent's tests.

`Containerd` runs containerd 1.6 (Debian's) with runc and CRIU under a private
directory. Each simulated node is one containerd namespace. `FakeKubelet`
starts the containers of the pods bound to its node (reading the FAKE API
server's objects directly), restarts them by their restartPolicy, kills them
when their pod goes, and reports containerStatuses (containerID, imageID,
state, restartCount) the way the kubelet does. A pod's volume named `smr`
(the hand-written manifest of docs/node-agent.md) is an emptyDir: a directory
per pod that outlives container restarts; smr-init is copied into it as the
pod's initContainer would. A pod's `runtimeClassName` selects the runtime
binary the way containerd's handler `BinaryName` does (`ctr --runc-binary`),
and a container's args are resolved as the kubelet does: `command` replaces
the image's ENTRYPOINT, `args` its CMD.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.fake_apiserver import FakeApiServer


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
        self.proc = subprocess.Popen(["containerd", "--config", str(cfg)], stdout=log,
                                     stderr=log, start_new_session=True, env=env)
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

    def stop(self) -> None:
        for ns in self.namespaces:
            tasks = subprocess.run(self._ctr(ns, "tasks", "ls", "-q"), capture_output=True,
                                   text=True).stdout.split()
            for t in tasks:
                subprocess.run(self._ctr(ns, "tasks", "kill", "-s", "KILL", t),
                               capture_output=True)
            time.sleep(0.3)
            for t in tasks:
                subprocess.run(self._ctr(ns, "tasks", "delete", "-f", t), capture_output=True)
            for c in subprocess.run(self._ctr(ns, "containers", "ls", "-q"),
                                    capture_output=True, text=True).stdout.split():
                subprocess.run(self._ctr(ns, "containers", "rm", c), capture_output=True)
        if self.proc:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()


@dataclass
class Running:
    name: str
    id: str
    log: Path
    restarts: int
    started_at: str
    exit_code: int | None = None


@dataclass
class PodState:
    uid: str
    volume: Path
    containers: dict[str, Running] = field(default_factory=dict)
    done: bool = False


class FakeKubelet:
    def __init__(self, kube: FakeApiServer, containerd: Containerd, node: str, workdir: Path,
                 smr_init: Path, runtime_classes: dict[str, str] | None = None) -> None:
        self.kube, self.ctd, self.node = kube, containerd, node
        self.runtime_classes = runtime_classes or {}  # RuntimeClass name → runtime binary
        self.ns = node
        self.dir = workdir / node
        self.smr_init = smr_init
        self.pods: dict[str, PodState] = {}  # uid → state
        self._task: asyncio.Task[None] | None = None
        self.digests: dict[str, str] = {}

    async def start(self) -> FakeKubelet:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        """Stop syncing and kill this node's containers (the node goes away)."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for st in self.pods.values():
            await self._kill_pod(st)
        self.pods.clear()

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as e:  # a test harness: say it, keep going
                print(f"fake kubelet {self.node}: {e!r}")
            await asyncio.sleep(0.2)

    # -- what the tests look at -----------------------------------------------------

    def state(self, namespace: str, name: str) -> PodState | None:
        pod = self.kube.get("pods", name, namespace)
        return self.pods.get(pod["metadata"]["uid"]) if pod else None

    def log(self, namespace: str, name: str, container: str = "main") -> str:
        st = self.state(namespace, name)
        if st is None or container not in st.containers:
            return ""
        with contextlib.suppress(OSError):
            return st.containers[container].log.read_text(errors="replace")
        return ""

    # -- the sync loop ----------------------------------------------------------------

    async def sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.kube.list("pods")
                if (p.get("spec") or {}).get("nodeName") == self.node}
        for uid, st in list(self.pods.items()):
            pod = pods.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                await self._kill_pod(st)
                del self.pods[uid]
                if pod is not None:
                    self.kube.remove("pods", pod["metadata"]["name"],
                                     pod["metadata"]["namespace"])
        _, out = await self.ctd.ctr(self.ns, "tasks", "ls")
        status = {parts[0]: parts[2] for line in out.splitlines()[1:]
                  if len(parts := line.split()) >= 3}
        for uid, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            st = self.pods.get(uid)
            if st is None:
                st = self.pods[uid] = PodState(uid, self.dir / "pods" / uid / "smr")
                if any(v.get("name") == "smr" for v in pod["spec"].get("volumes") or []):
                    st.volume.mkdir(parents=True)
                    shutil.copy2(self.smr_init, st.volume / "smr-init")  # the initContainer
            changed = False
            for c in pod["spec"]["containers"]:
                run = st.containers.get(c["name"])
                if run is None:
                    st.containers[c["name"]] = await self._run(pod, c, st, 0)
                    changed = True
                elif run.exit_code is None and status.get(run.id) == "STOPPED":
                    _, out = await self.ctd.ctr(self.ns, "tasks", "delete", run.id,
                                                check=False)
                    # ctr exits 0 and warns "exit with non-zero exit code N".
                    m = re.search(r"exit code (\d+)", out)
                    code = run.exit_code = int(m.group(1)) if m else 0
                    changed = True
                    policy = pod["spec"].get("restartPolicy", "Always")
                    if policy == "Always" or (policy == "OnFailure" and code != 0):
                        st.containers[c["name"]] = await self._run(pod, c, st,
                                                                   run.restarts + 1)
            if changed:
                self._report(pod, st)

    async def _image(self, ref: str) -> str:
        if ref not in self.digests:
            self.digests[ref] = await self.ctd.digest(self.ns, ref)
        return self.digests[ref]

    async def _run(self, pod: dict[str, Any], c: dict[str, Any], st: PodState,
                   restarts: int) -> Running:
        cid = uuid.uuid4().hex
        await self._image(c["image"])
        log = self.dir / "logs" / f"{pod['metadata']['name']}_{c['name']}_{restarts}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = [f"{e['name']}={e['value']}" for e in c.get("env") or []]
        args = ["run", "-d", "--log-uri", f"file://{log}"]
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
        if int(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0)):
            for dev in sorted(Path("/dev").glob("nvidia*")):
                if dev.is_char_device():
                    args += ["--device", str(dev)]
        if rc := pod["spec"].get("runtimeClassName"):
            if rc not in self.runtime_classes:
                raise RuntimeError(f"RuntimeClass {rc} not found on node {self.node}")
            args += ["--runc-binary", self.runtime_classes[rc]]
        for e in env:
            args += ["--env", e]
        process: list[str] = []  # empty: the image's ENTRYPOINT and CMD, as ctr reads them
        if c.get("command"):
            process = [*c["command"], *(c.get("args") or [])]
        elif c.get("args"):
            entry = (await self.ctd.image_config(self.ns, c["image"])).get("Entrypoint") or []
            process = [*entry, *c["args"]]
        await self.ctd.ctr(self.ns, *args, c["image"], cid, *process)
        return Running(c["name"], cid, log, restarts, _now())

    def _report(self, pod: dict[str, Any], st: PodState) -> None:
        fresh = self.kube.get("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])
        if fresh is None or fresh["metadata"]["uid"] != st.uid:
            return
        statuses = []
        for c in fresh["spec"]["containers"]:
            run = st.containers[c["name"]]
            state: dict[str, Any] = {"running": {"startedAt": run.started_at}}
            if run.exit_code is not None:
                state = {"terminated": {"exitCode": run.exit_code, "finishedAt": _now()}}
            statuses.append({
                "name": c["name"], "restartCount": run.restarts, "ready": "running" in state,
                "image": c["image"], "imageID": f"{c['image']}@{self.digests[c['image']]}",
                "containerID": f"containerd://{run.id}", "state": state})
        ended = [s["state"].get("terminated") for s in statuses]
        phase = "Running"
        if all(ended):
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in ended) else "Failed"
        fresh["status"] = {"phase": phase, "containerStatuses": statuses}
        self.kube.put("pods", fresh)

    async def _kill_pod(self, st: PodState) -> None:
        for run in st.containers.values():
            if run.exit_code is None:
                await self.ctd.ctr(self.ns, "tasks", "kill", "-s", "KILL", run.id, check=False)
        await asyncio.sleep(0.3)
        for run in st.containers.values():
            await self.ctd.ctr(self.ns, "tasks", "delete", "-f", run.id, check=False)
            await self.ctd.ctr(self.ns, "containers", "rm", run.id, check=False)


def containerd_missing() -> str | None:
    if os.geteuid() != 0:
        return "containers need root"
    for tool in ("containerd", "ctr", "runc", "busybox", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup installs it)"
    return None
