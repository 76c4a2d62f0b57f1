"""What the node agent reads from the host's /proc (it runs with hostPID):
which processes belong to a container, its smr-init shim, the shim's
workload, the container's writable layer and cgroups.

Runtime-agnostic on purpose: containerd, CRI-O and cgroup v1 or v2 all put a
container's processes in a cgroup whose path ends with the container ID.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from smr.errors import TemporaryError
from smr.gpuinfo import process_tree as tree

PROC = Path("/proc")
SHIM_NAME = "smr-init"
DEFAULT_INIT_DIR = "/smr"


def container_id_of(pid: int) -> str | None:
    """The container ID in ``pid``'s cgroup path, e.g. ``.../cri-containerd-<id>.scope``."""
    try:
        text = (PROC / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        last = path.rstrip("/").rsplit("/", 1)[-1]
        last = re.sub(r"^(cri-containerd|crio|docker|libpod)-|\.scope$", "", last)
        if last and last != "/":
            return last
    return None


def all_pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def pids_of(container_id: str) -> list[int]:
    return [p for p in all_pids() if container_id_of(p) == container_id]


def ns_pid(pid: int) -> int | None:
    """``pid`` as its own PID namespace sees it (the last NSpid field)."""
    with contextlib.suppress(OSError):
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return None


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in (PROC / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def environ(pid: int) -> dict[str, str]:
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.decode(errors="replace").partition("=")
        if sep:
            env[k] = v
    return env


def is_shim(pid: int) -> bool:
    try:
        argv0 = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(argv0.decode(errors="replace")) == SHIM_NAME \
        and ns_pid(pid) == 1


def upperdir(pid: int) -> Path | None:
    """The writable layer of ``pid``'s root file system (overlayfs upperdir)."""
    try:
        text = (PROC / str(pid) / "mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/" and " - overlay " in line:
            m = re.search(r"(?:^|,)upperdir=([^,]+)", line.split(" - ", 1)[1].split()[-1])
            if m:
                return Path(m.group(1))
    return None


def stdio(pid: int) -> dict[str, str]:
    """fd → what it points to, for the pipes among fds 0-2 (a restore
    connects them to the new container's)."""
    out = {}
    for fd in ("0", "1", "2"):
        with contextlib.suppress(OSError):
            target = os.readlink(PROC / str(pid) / "fd" / fd)
            if target.startswith("pipe:["):
                out[fd] = target
    return out


def holds_gpu(pid: int) -> bool:
    """Does any process of ``pid``'s tree have an NVIDIA device open?"""
    for p in tree(pid):
        with contextlib.suppress(OSError):
            for fd in (PROC / str(p) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith("/dev/nvidia"):
                        return True
    return False


def move_to_cgroups_of(pid: int, like: int) -> None:
    """Put ``pid`` into every cgroup ``like`` is in (v1 controllers and v2)."""
    try:
        text = (PROC / str(like) / "cgroup").read_text()
    except OSError:
        return
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.startswith("name="):
            mount = f"/sys/fs/cgroup/{controllers[5:]}"
        elif controllers:
            mount = f"/sys/fs/cgroup/{controllers}"
        else:
            mount = "/sys/fs/cgroup/unified"
            if not os.path.isdir(mount):
                mount = "/sys/fs/cgroup"
        procs = Path(mount) / path.lstrip("/") / "cgroup.procs"
        with contextlib.suppress(OSError):
            procs.write_text(str(pid))


@dataclass
class Shim:
    """An smr-init process: PID 1 of a container, with its state directory
    (seen from the host through /proc/<pid>/root)."""

    pid: int
    init_dir: str  # inside the container, e.g. /smr
    container: str

    @classmethod
    def of(cls, pid: int) -> Shim:
        env = environ(pid)
        return cls(pid, env.get("SMR_INIT_DIR") or DEFAULT_INIT_DIR,
                   env.get("SMR_CONTAINER") or "main")

    @property
    def root(self) -> Path:
        return PROC / str(self.pid) / "root"

    def host(self, inside: str) -> Path:
        """A path inside the container, as the host reaches it."""
        return self.root / inside.lstrip("/")

    @property
    def dir(self) -> str:
        return f"{self.init_dir}/{self.container}"

    def status(self) -> list[str]:
        try:
            return self.host(f"{self.dir}/status").read_text().split()
        except OSError:
            return []

    def decide(self, decision: str) -> None:
        path = self.host(f"{self.dir}/decision")
        tmp = path.with_name("decision.tmp")
        tmp.write_text(decision + "\n")
        tmp.rename(path)

    def workload(self) -> tuple[int, int] | None:
        """The workload's (host pid, namespace pid) once the shim runs it."""
        st = self.status()
        if len(st) < 2 or st[0] != "running":
            return None
        inner = int(st[1])
        for kid in children(self.pid):
            if ns_pid(kid) == inner:
                return kid, inner
        return None

    def hold(self, on: bool) -> int | None:
        """While held, the shim outlives its workload (a final dump kills the
        workload; the images in the shim's volume must stay reachable) and
        forwards no signal to it (one pending in the workload would be saved
        in the image and stop every restored copy; smr-init.c says how).

        Taking the hold returns the signal smr-init already forwarded (SIGTERM,
        SIGINT or SIGQUIT: the workload was asked to stop), else None."""
        path = self.host(f"{self.dir}/hold")
        if not on:
            path.unlink(missing_ok=True)
            return None
        # The lock file is in the tenant's volume: never followed, never waited on long.
        fd = os.open(self.host(f"{self.dir}/signal.lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            deadline = time.monotonic() + 0.5
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TemporaryError(
                            f"{self.dir}/signal.lock of smr-init {self.pid} stays locked",
                            code="shim-busy",
                            hint="only smr-init and the agent take it; retried") from None
                    time.sleep(0.01)
            path.write_text("")
            with contextlib.suppress(OSError, ValueError):
                return int(self.host(f"{self.dir}/signalled").read_text().split()[0])
            return None
        finally:
            os.close(fd)

    def final(self, outcome: str) -> None:
        """Tell the preStop hook (``smr-init --wait-final``) how the final
        checkpoint ended: ``done GENERATION`` or ``failed CODE``."""
        with contextlib.suppress(OSError):  # the container may be gone already
            path = self.host(f"{self.dir}/final")
            tmp = path.with_name("final.tmp")
            tmp.write_text(outcome + "\n")
            tmp.rename(path)


def shims() -> list[Shim]:
    return [Shim.of(p) for p in all_pids() if is_shim(p)]


def find_shim(container_id: str) -> Shim | None:
    for p in pids_of(container_id):
        if is_shim(p):
            return Shim.of(p)
    return None
