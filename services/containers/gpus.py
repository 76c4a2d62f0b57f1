"""The GPUs a pod container was given, as its runtime was told to give them.

A restore onto another GPU (smr.gpu.gpupairs) needs the new container's GPUs.
They are read from the OCI spec its runtime started it from: the bundle's
config.json that containerd writes, root's, beside (never inside) the
container's root file system. The bundle is found through the runtime's shim,
the container's first process's parent in the host's PID namespace: its
working directory is a bundle of the runtime's state directory (its own
container's, or its sandbox's where one shim runs a pod), so the container's
is ``<shim's cwd>/../<container ID>`` (containerd's
``/run/containerd/io.containerd.runtime.v2.task/<ns>/<id>``).

What counts, and why a tenant gains nothing by naming a GPU:

- the spec's ``linux.devices`` entries of the NVIDIA major (195) with a GPU's
  minor number (NVML's, ``gpuinfo.devices()["minor"]``): the device plugin's
  DeviceSpecs or CDI put them there, runc makes exactly these nodes in the
  container's /dev and lets its device cgroup open exactly these. A pod spec
  cannot add one (a privileged pod gets every device: it has every GPU
  anyway). Where there are any, they are the container's GPUs.
- otherwise ``NVIDIA_VISIBLE_DEVICES`` of the spec's process (or, where it
  is /var/run/nvidia-container-devices, the device plugin's volume-mounts
  strategy, the spec's mounts under that directory, one named for each GPU):
  the NVIDIA runtime hook (legacy mode) gives the container the GPUs it names. A pod
  spec can set that variable too (the kubelet puts a container's own env
  after the device plugin's), and the hook honours it unless told not to
  (``accept-nvidia-visible-devices-envvar-when-unprivileged = false``): that
  is the hook's known weakness, not smr's; the container has those GPUs
  either way. Each GPU it names must have its device node in the container's
  /dev (read through the container's root, no link followed); one without is
  refused. A node made by the tenant (CAP_MKNOD) would not help it: its
  device cgroup still refuses to open it, and the driver's restore, which
  runs in the container's processes, fails; the restored tree is killed.

smr never restores onto a GPU from a restore request (a tenant may publish
those for its own pods: docs/security.md): only from here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import orjson

from services.containers.confined import Root
from smr.contract.errors import PermanentError

log = logging.getLogger("smr.agent")

NVIDIA_MAJOR = 195  # /dev/nvidiaN, nvidiactl (255), nvidia-modeset (254)
SPEC_CAP = 4 << 20  # a config.json is some KiB; a bigger one is not the runtime's
# NVIDIA_VISIBLE_DEVICES under the device plugin's volume-mounts strategy.
VOLUME_MOUNTS = "/var/run/nvidia-container-devices"
CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class ContainerGpuError(PermanentError):
    code = "container-gpus-unknown"


def runtime_spec(init_pid: int, container_id: str) -> dict[str, Any] | None:
    """The OCI spec the container of ``init_pid`` (its first process, host PID)
    was started from; None where its runtime's bundle is not found (another
    runtime than containerd's shims, or the shim gone)."""
    if not CONTAINER_ID.fullmatch(container_id):
        return None
    shim = _parent(init_pid)
    # The shim is root's, outside the container: in another PID namespace.
    if shim is None or shim <= 1 or _uid(shim) != 0 or _pidns(shim) == _pidns(init_pid):
        return None
    fds: list[int] = []
    try:
        cwd = os.open(f"/proc/{shim}/cwd", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        fds.append(cwd)
        up = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cwd)
        fds.append(up)
        bundle = os.open(container_id, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                         | os.O_CLOEXEC, dir_fd=up)
        fds.append(bundle)
        f = os.open("config.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                    dir_fd=bundle)
        fds.append(f)
        st = os.fstat(f)
        # Written by the runtime as root; a file anyone else could have
        # written is not its.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022 \
                or st.st_size > SPEC_CAP:
            log.warning("container %s: its bundle's config.json is not the runtime's "
                        "(mode %o, uid %d, %d bytes); its GPUs are not read from it",
                        container_id, st.st_mode, st.st_uid, st.st_size)
            return None
        spec = orjson.loads(os.read(f, SPEC_CAP))
    except (OSError, orjson.JSONDecodeError):
        return None
    finally:
        for fd in fds:
            os.close(fd)
    return spec if isinstance(spec, dict) else None


def granted(spec: dict[str, Any], node: list[dict[str, Any]], init_pid: int | None = None
            ) -> list[dict[str, Any]] | None:
    """The GPUs of ``node`` (smr.gpu.gpuinfo.devices()) the spec gives the
    container, in the node's order; None where the spec names GPUs this
    cannot tell (MIG devices, an index or UUID this node lacks). ``init_pid``:
    the container's first process, through whose root the device nodes of
    the GPUs ``NVIDIA_VISIBLE_DEVICES`` names are checked."""
    by_minor = {d["minor"]: d for d in node if d.get("minor") is not None}
    minors = {int(dev["minor"]) for dev in (spec.get("linux") or {}).get("devices") or []
              if dev.get("type") == "c" and dev.get("major") == NVIDIA_MAJOR
              and dev.get("minor") in by_minor}
    if minors:
        return [d for d in node if d.get("minor") in minors]
    env = [e for e in (spec.get("process") or {}).get("env") or [] if isinstance(e, str)]
    named = None
    for e in env:  # the last one counts, as the NVIDIA hook reads them
        if e.startswith("NVIDIA_VISIBLE_DEVICES="):
            named = e.split("=", 1)[1].strip()
    if named == VOLUME_MOUNTS:
        # The device plugin's volume-mounts strategy: a mount per GPU, named
        # by it, under that directory.
        named = ",".join(m["destination"].removeprefix(VOLUME_MOUNTS + "/")
                         for m in spec.get("mounts") or []
                         if str(m.get("destination", "")).startswith(VOLUME_MOUNTS + "/"))
    if named is None or named in ("", "void", "none"):
        return []
    if named == "all":
        chosen = list(node)
    else:
        chosen = []
        for item in (x.strip() for x in named.split(",") if x.strip()):
            d = next((d for d in node if item in (d.get("uuid"), str(d.get("index")))), None)
            if d is None:
                log.warning("NVIDIA_VISIBLE_DEVICES names %r, not a GPU of this node; the "
                            "container's GPUs are not known", item)
                return None
            chosen.append(d)
    if init_pid is not None:
        if any(d.get("minor") is None for d in chosen):
            log.warning("NVML gives no minor number for a GPU NVIDIA_VISIBLE_DEVICES names: "
                        "its device node cannot be checked; the container's GPUs are not "
                        "known")
            return None
        for d in chosen:
            _check_node(init_pid, d)
    return [d for d in node if d in chosen]


def container_gpus(init_pid: int, container_id: str, node: list[dict[str, Any]]
                   ) -> list[dict[str, Any]] | None:
    """The container's GPUs (``granted``), or None where they cannot be read."""
    spec = runtime_spec(init_pid, container_id)
    if spec is None:
        log.info("container %s: no runtime spec found; its GPU state is restored onto "
                 "the GPUs it was checkpointed on", container_id)
        return None
    return granted(spec, node, init_pid)


def _check_node(init_pid: int, gpu: dict[str, Any]) -> None:
    """The GPU's device node is in the container's /dev, a character device
    of its numbers (no link followed)."""
    path = f"/dev/nvidia{gpu['minor']}"
    try:
        with Root.of_pid(init_pid) as root:
            fd = root.open(path, os.O_PATH | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
    except OSError as e:
        raise ContainerGpuError(
            f"the container's NVIDIA_VISIBLE_DEVICES names {gpu['uuid']} and it has no "
            f"{path} ({e.strerror})", code="gpu-not-granted",
            hint="a container's GPUs are those its device plugin gave it; its env "
                 "cannot add one") from None
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (
            NVIDIA_MAJOR, gpu["minor"]):
        raise ContainerGpuError(
            f"the container's {path} is not GPU {gpu['uuid']}'s device node",
            code="gpu-not-granted",
            hint="a container's GPUs are those its device plugin gave it")


def _parent(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat_line = Path(f"/proc/{pid}/stat").read_text()
        return int(stat_line.rsplit(")", 1)[1].split()[1])
    return None


def _uid(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    return None


def _pidns(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/pid")
    return None
