"""What the node agent reads from the host's /proc (it runs with hostPID):
which processes belong to a container, its smr-init shim, the shim's
workload, the container's writable layer and cgroups.

Runtime-agnostic on purpose: containerd, CRI-O and cgroup v1 or v2 all put a
container's processes in a cgroup whose path ends with the container ID.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.containers.confined import Root, UnsafePath
from smr.contract.errors import SmrError, TemporaryError
from smr.gpu.gpuinfo import ns_pid
from smr.jobs import proc_start_ticks
from smr.process import procfs
from smr.process.tree import process_tree as tree

log = logging.getLogger("smr.agent")

PROC = Path("/proc")
SHIM_NAME = "smr-init"
CGROUP_MAX = 64 << 10  # /proc/<pid>/cgroup: the kernel's text, a path per hierarchy
# smr-init's state directory, always: smr-runtime's nodev tmpfs or the
# manifest's volume. SMR_INIT_DIR is the pod's to set and is never read here.
INIT_DIR = "/smr"
# A container name, one path component (smr-runtime checks it the same way).
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,62}")


def container_id_of(pid: int) -> str | None:
    """The container ID in ``pid``'s cgroup path, e.g. ``.../cri-containerd-<id>.scope``."""
    raw = procfs.read(pid, "cgroup", limit=CGROUP_MAX)
    if raw is None:
        return None
    for line in raw.decode(errors="replace").splitlines():
        path = line.split(":", 2)[-1]
        last = path.rstrip("/").rsplit("/", 1)[-1]
        last = re.sub(r"^(cri-containerd|crio|docker|libpod)-|\.scope$", "", last)
        if last and last != "/":
            return last
    return None


def all_pids() -> list[int]:
    # os.listdir, not Path.iterdir: the agent lists /proc several times a
    # second (bench/shim_scan.py).
    return [int(p) for p in os.listdir(PROC) if p.isdigit()]


def pids_of(container_id: str) -> list[int]:
    return [p for p in all_pids() if container_id_of(p) == container_id]


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in (PROC / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def is_shim(pid: int) -> bool:
    """Is ``pid`` a container's smr-init: named so, and PID 1 of a PID
    namespace directly below the agent's, as the runtime makes it? PID 1 of a
    namespace a workload nested inside (`unshare` needs no privilege in a
    user namespace) has a third NSpid field, and is the tenant's."""
    argv0 = procfs.argv0(pid)  # bounded: a tenant's may be gigabytes
    return argv0 is not None \
        and os.path.basename(argv0.decode(errors="replace")) == SHIM_NAME \
        and _nspids(pid)[1:] == [1]


def _nspids(pid: int) -> list[int]:
    """``pid`` in each PID namespace from the agent's down to its own."""
    fixed = _fixed(pid)
    return fixed[0] if fixed else []


# What the agent keeps of a process, by PID and start tick: its PID in each
# namespace (status's NSpid) and, for a shim, its SMR_CONTAINER. Read again
# at most every FIXED_REREAD_S, not at every scan: a tenant sizes both files
# (65536 groups make status half a MiB, which the kernel builds whole at each
# read; an environment of 8 MiB), and nothing it can change in its own
# process (an exec, its environment moved or rewritten) makes the agent read
# them sooner. A shim that execs again with another SMR_CONTAINER is seen
# with it within that time.
FIXED_REREAD_S = 30.0
_FIXED: dict[tuple[int, int], tuple[float, list[int], str]] = {}
_FIXED_MAX = 4096


def _fixed(pid: int) -> tuple[list[int], str] | None:
    ticks = proc_start_ticks(pid)
    if ticks is None:
        return None
    now = time.monotonic()
    if (got := _FIXED.get((pid, ticks))) is not None and now - got[0] < FIXED_REREAD_S:
        return got[1], got[2]
    nspids: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                nspids = [int(x) for x in line.split()[1:]]
                break
    # The first SMR_CONTAINER, as smr-init's getenv() finds it: of a shim
    # only (PID 1 of a namespace below the agent's), not of every process
    # that a tenant names smr-init and forks by the thousand.
    container = (procfs.env_value(pid, "SMR_CONTAINER") or "main") \
        if nspids[1:] == [1] else ""
    if proc_start_ticks(pid) != ticks:
        return None  # gone (or another process) meanwhile: nothing read is known
    if len(_FIXED) >= _FIXED_MAX:
        # What is due to be read again goes first; all of it only where more
        # processes than that were read within FIXED_REREAD_S.
        # (Scans run in threads: a copy is iterated, made in one step.)
        for key, (when, _, _) in list(_FIXED.items()):
            if now - when >= FIXED_REREAD_S:
                _FIXED.pop(key, None)
        if len(_FIXED) >= _FIXED_MAX:
            _FIXED.clear()
    _FIXED[(pid, ticks)] = (now, nspids, container)
    return nspids, container


# ioctl NS_GET_USERNS (linux/nsfs.h): the user namespace owning a namespace.
_NS_GET_USERNS = 0xB701


def check_mount_namespace(pid: int) -> None:
    """Refuse ``pid`` (a shim) unless its mount namespace belongs to the
    agent's own user namespace. Only there were its mounts made by the
    runtime: a container's root without CAP_SYS_ADMIN on the node makes a
    mount namespace only inside a user namespace of its own, where it mounts
    what it likes, an overlay whose upperdir option names any host path
    included. Neither its mount table nor CRIU joining it is then trusted."""
    try:
        ns = os.open(PROC / str(pid) / "ns" / "mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # gone: nothing of it is read
    try:
        owner = fcntl.ioctl(ns, _NS_GET_USERNS)
        try:
            st = os.fstat(owner)
        finally:
            os.close(owner)
    except OSError as e:  # EPERM: owned by a user namespace outside the agent's
        st = None
        log.debug("NS_GET_USERNS of pid %d: %s", pid, e)
    finally:
        os.close(ns)
    mine = os.stat("/proc/self/ns/user")
    if st is None or (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
        raise UnsafePath(
            f"smr-init (pid {pid}) runs in a mount namespace it made in a user namespace "
            "of its own: the node agent takes neither the container's writable layer "
            "from its mounts nor runs CRIU there",
            hint="run smr-init unchanged as the container's first process; its workload "
                 "may make namespaces of its own")


def upperdir(pid: int) -> Path | None:
    """The writable layer of ``pid``'s root file system (overlayfs upperdir),
    from the mounts of a namespace the runtime made (check_mount_namespace)."""
    check_mount_namespace(pid)
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


def maps_sysv_memory(pid: int) -> bool:
    """Does any process of ``pid``'s tree map System V shared memory? The
    kernel names such a mapping /SYSV<key> in /proc/PID/maps. A file the
    workload itself names so and maps matches too: that only makes CRIU save
    the container's IPC namespace, which is harmless."""
    for p in tree(pid):
        with contextlib.suppress(OSError):
            with open(PROC / str(p) / "maps", "rb") as f:
                if any(b" /SYSV" in line for line in f):
                    return True
    return False


def cgroup_procs(pid: int) -> list[Path]:
    """The cgroup.procs file of every cgroup ``pid`` is in (v1 controllers and
    v2), those this agent can see."""
    try:
        text = (PROC / str(pid) / "cgroup").read_text()
    except OSError:
        return []
    out = []
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
        if procs.is_file():
            out.append(procs)
    return out


def move_to_cgroups_of(pid: int, like: int) -> None:
    """Put ``pid`` into every cgroup ``like`` is in (v1 controllers and v2)."""
    for procs in cgroup_procs(like):
        with contextlib.suppress(OSError):
            procs.write_text(str(pid))


@dataclass
class Shim:
    """An smr-init process: PID 1 of a container, with its state directory
    (seen from the host through /proc/<pid>/root)."""

    pid: int
    init_dir: str  # inside the container: INIT_DIR (tests run smr-init elsewhere)
    container: str  # SMR_CONTAINER: the pod's to set, so checked in ``dir``

    @classmethod
    def of(cls, pid: int) -> Shim:
        fixed = _fixed(pid)
        return cls(pid, INIT_DIR, fixed[1] if fixed else "main")

    @property
    def root(self) -> Path:
        return PROC / str(self.pid) / "root"

    def confined(self) -> Root:
        """The container's root, held open: every path under it is the
        tenant's and is opened without following links (agent/confined)."""
        return Root.of_pid(self.pid)

    @property
    def dir(self) -> str:
        """/smr/<container>: one directory of /smr, whatever the pod set."""
        if not _NAME.fullmatch(self.container):
            raise UnsafePath(f"SMR_CONTAINER={self.container!r} is not a container name; the "
                             f"node agent reads smr-init's files only in {INIT_DIR}/<name>",
                             hint="set SMR_CONTAINER to the container's name (the webhook "
                                  "does)")
        return f"{self.init_dir}/{self.container}"

    def status(self) -> list[str]:
        """smr-init's status line, split; [] while there is none. A status
        the workload replaced by a link, a FIFO or a large file raises
        UnsafePath (the read never blocks and never leaves the container)."""
        try:
            with self.confined() as root:
                return root.read(f"{self.dir}/status").decode(errors="replace").split()
        except UnsafePath:
            raise
        except OSError:
            return []

    def unanswered(self) -> bool:
        """Whether smr-init started the workload fresh for want of an agent's
        answer (its file ``unanswered``; only its presence is read, never its
        text, which is the tenant's to change)."""
        try:
            with self.confined() as root:
                root.read(f"{self.dir}/unanswered")
            return True
        except (UnsafePath, OSError):
            return False

    def decide(self, decision: str) -> None:
        with self.confined() as root:
            root.replace(f"{self.dir}/decision", (decision + "\n").encode())

    def restored(self, note: bytes | None) -> None:
        """Write (None: remove) the note a restored workload may read
        (services/restorer/pod: what it was restored from)."""
        with self.confined() as root:
            if note is None:
                root.unlink(f"{self.dir}/restored")
            else:
                root.replace(f"{self.dir}/restored", note)

    def workload(self) -> tuple[int, int] | None:
        """The workload's (host pid, namespace pid) once the shim runs it; None
        once it has ended, also while it is a zombie smr-init has yet to reap
        (a final dump's kill: its status says "running" a moment longer). A
        process whose first thread exited while others run shows as a zombie
        too, and runs."""
        st = self.status()
        if len(st) < 2 or st[0] != "running":
            return None
        try:
            inner = int(st[1])
        except ValueError:
            return None
        for kid in children(self.pid):
            if ns_pid(kid) == inner:
                return None if procfs.ended(kid) else (kid, inner)
        return None

    def hold(self, on: bool) -> int | None:
        """While held, the shim outlives its workload (a final dump kills the
        workload; the container must stay until its checkpoint is stored) and
        forwards no signal to it (one pending in the workload would be saved
        in the image and stop every restored copy; smr-init.c says how).

        Taking the hold returns the signal smr-init already forwarded (SIGTERM,
        SIGINT or SIGQUIT: the workload was asked to stop), else None.

        Every file here is the tenant's (``signal.lock``, ``signalled``,
        ``hold``): opened confined, never followed; blocking, so callers run
        it off the event loop."""
        with self.confined() as root:
            if not on:
                root.unlink(f"{self.dir}/hold")
                return None
            with _locked(root, f"{self.dir}/signal.lock", f"smr-init {self.pid}"):
                # Under the lock smr-init forwards nothing: `signalled` is read
                # before the hold exists, so a refused read leaves no hold.
                signalled = _signal_in(root, f"{self.dir}/signalled")
                root.write_new(f"{self.dir}/hold", b"")
            return signalled

    def refresh_hold(self) -> None:
        """Touch ``hold`` in place (smr-init ignores a stale one); it never
        disappears meanwhile, which would let smr-init forward a held signal."""
        with self.confined() as root:
            root.touch(f"{self.dir}/hold")

    def final(self, outcome: str) -> None:
        """Tell the preStop hook (``smr-init --wait-final``) how the final
        checkpoint ended: ``done GENERATION`` or ``failed CODE``. Written
        confined and atomically (a new file renamed over ``final``: a link
        there is replaced, never followed). Never raises: the checkpoint's
        own outcome stands; without ``final`` the hook waits out its time."""
        try:
            with self.confined() as root:
                root.replace(f"{self.dir}/final", (outcome + "\n").encode())
        except (OSError, SmrError) as e:  # the container may be gone already
            log.warning("cannot tell smr-init %s the final checkpoint's outcome (%s): %s",
                        self.pid, outcome, e)


@contextlib.contextmanager
def _locked(root: Root, path: str, whose: str) -> Iterator[None]:
    """``path`` flocked exclusively, waiting 0.5 s at most (only smr-init and
    the agent take it; a workload holding it fails the step, retried)."""
    # A regular file only, made if missing; anything else there is refused
    # before it is opened for the lock.
    fd = root.file(path, os.O_RDONLY | os.O_NONBLOCK, create=0o644)
    try:
        deadline = time.monotonic() + 0.5
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TemporaryError(f"{path} of {whose} stays locked", code="shim-busy",
                                         hint="only smr-init and the agent take it; "
                                              "retried") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def _signal_in(root: Root, path: str) -> int | None:
    try:
        return int(root.read(path).split()[0])
    except (OSError, ValueError, IndexError):
        return None


# How old a scan the agent's loops take (host.shims): under the 0.25 s
# between two looks for container starts, so an answer waits one look more
# at most.
SCAN_MAX_AGE_S = 0.2
# The last scan's shims: (when, their PIDs). One tuple, replaced whole: the
# scan runs in worker threads.
_scanned: tuple[float, list[int]] = (-math.inf, [])


def shims(max_age: float = 0.0) -> list[Shim]:
    """The host's shims, found by a scan of every process at most
    ``max_age`` seconds old: the agent's loops (container starts, preStop
    waits) share one, rather than each reading all of /proc
    (bench/shim_scan.py). A shim the scan found is checked again now (its PID
    may be another process's since); one started since is found by the next."""
    global _scanned
    when, pids = _scanned
    now = time.monotonic()
    if now - when <= max_age:
        return [Shim.of(p) for p in pids if is_shim(p)]
    pids = [p for p in all_pids() if is_shim(p)]
    _scanned = (now, pids)
    return [Shim.of(p) for p in pids]


def find_shim(container_id: str) -> Shim | None:
    for p in pids_of(container_id):
        if is_shim(p):
            return Shim.of(p)
    return None
