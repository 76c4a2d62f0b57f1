"""Running CRIU inside a container's namespaces, never on the container's files.

The agent enters the container's mount, PID, network, IPC and UTS namespaces
(nsenter) and runs CRIU there. To CRIU the container's namespaces are then its
own: it dumps and restores the workload's process tree like any other, with
no mount table or namespace to describe, and a restore lands in the new
container's namespaces and root file system, whatever image and volumes the
kubelet gave it.

Everything the image holds is the tenant's, and nothing of it is loaded,
read as configuration or run by this root process with every capability:

- CRIU starts with the agent's root as `/` (nsenter --root=/), not the
  container's: the dynamic loader reads the agent's /etc/ld.so.preload and
  maps the agent's loader, libraries and CRIU, through descriptors the agent
  opened (/proc/self/fd/N), with no ld.so.cache (--inhibit-cache).
- Only then, before CRIU's main, criu-root.so (native/criu-root.c) takes the
  container's root as `/`: CRIU resolves the paths of the tree's files
  against its own root (criu/mount.c, __mntns_get_root_fd).
- CRIU reads no configuration file (--no-default-config; its environment is
  built from nothing, so no CRIU_CONFIG_FILE, CRIU_LIBS_DIR or HOME) and loads
  its plugins from an empty directory of the agent's (-L), never the image's
  /usr/lib/criu.
- It holds only the descriptors it needs: its own files, the work directory
  and those a restore hands to the tree.
- Its bounding set (setpriv, before nsenter) holds what CRIU uses and what
  the container holds (CRIU_CAPABILITIES), nothing inheritable.

Joining the container's mount namespace is what lets a restore land in the
kubelet's container. A CRIU outside it would dump that mount namespace (every
bind mount the kubelet made described as external) and make a new one at the
restore: CRIU's documented --join-ns takes ipc, net, time, user and uts (4.2's
code also accepts mnt, undocumented and untried here).

The same rule holds for every program the agent runs near a container: none
starts with the container's root as `/` (set_last_pid enters the PID
namespace only). What stays: in the container's root, glibc would load an
NSS module a lookup needed from there (CRIU makes none in a dump or a
restore: tests/agent/test_attacks.py names one for every database), and CRIU
runs in the container's PID namespace, where the workload's root can signal
it: a stopped CRIU (or nsenter) is continued by the agent (smr.process.unstop).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from services.containers import host, kdat, ptracers
from services.containers.host import Shim
from smr.contract.errors import PermanentError
from smr.process.criu import Criu

NAMESPACES = ["-m", "-p", "-n", "-i", "-u"]
# A tree that maps System V shared memory (PostgreSQL) is dumped by a CRIU
# outside the container's IPC namespace: CRIU saves System V objects only with
# an IPC namespace not its own (criu/cr-dump.c, check_sysvipc_map_dump). The
# restore then gives the tree an IPC namespace of its own, with those objects.
NAMESPACES_SAVING_IPC = ["-m", "-p", "-n", "-u"]
# CRIU's own cgroup handling is off: the restored tree is moved into the new
# container's cgroups by the agent (host.move_to_cgroups_of). No configuration
# file is read: /etc/criu/default.conf would be the image's.
OPTIONS = ["--manage-cgroups=ignore", "--no-default-config"]
# Linux's capabilities by number (linux/capability.h), as setpriv names them.
CAPABILITIES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid",
    "setuid", "setpcap", "linux_immutable", "net_bind_service", "net_broadcast", "net_admin",
    "net_raw", "ipc_lock", "ipc_owner", "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace",
    "sys_pacct", "sys_admin", "sys_boot", "sys_nice", "sys_resource", "sys_time",
    "sys_tty_config", "mknod", "lease", "audit_write", "audit_control", "setfcap",
    "mac_override", "mac_admin", "syslog", "wake_alarm", "block_suspend", "audit_read",
    "perfmon", "bpf", "checkpoint_restore")
# What CRIU 4.2 uses as root to dump and restore a tree (and nsenter to join
# its namespaces): namespaces, mounts and /proc/PID/map_files (sys_admin,
# checkpoint_restore), seizing tasks (sys_ptrace), TCP repair and the network
# lock (net_admin), files of other users and inotify handles (dac_*, fowner,
# fsetid, chown), the restored credentials (setuid, setgid, setpcap), signals
# (kill), its root (sys_chroot), ghost device nodes (mknod), the clock offsets
# of a restored time namespace (sys_time: /proc/PID/timens_offsets), sockets,
# locks, leases, memory locks, System V objects, scheduling and limits
# (net_raw, net_bind_service, ipc_lock, ipc_owner, lease, sys_nice,
# sys_resource). Everything else (modules, raw I/O, BPF, perf, reboot, the
# kernel log, audit and MAC administration) is dropped from its bounding set,
# unless the container holds it: a restore gives the tree the capabilities it
# was dumped with, which CRIU can only give when it holds them.
CRIU_CAPABILITIES = frozenset({
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid",
    "setuid", "setpcap", "net_bind_service", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
    "sys_chroot", "sys_ptrace", "sys_admin", "sys_nice", "sys_resource", "sys_time", "mknod",
    "lease", "checkpoint_restore"})
# nsenter into a PID namespace (opening /proc/PID/ns/pid of a process that may
# hold more capabilities: sys_ptrace) and smr-init writing its ns_last_pid.
SET_LAST_PID_CAPABILITIES = frozenset({"sys_admin", "sys_ptrace", "checkpoint_restore"})

# How long an exec's runtime init may hold the runtime's capabilities in a
# container's PID namespace (refuse_ptracers); runc's takes milliseconds.
PTRACE_SETTLE_S = 3.0

# criu-root.so acts only where this is set: the agent's CRIU runs, and only in
# CRIU (the loader preloads it; sh and nsenter in front never load it).
ENTER_ROOT = {"SMR_CRIU_ENTER_ROOT": "1"}


class CriuBundle:
    """The agent's CRIU (under ``root``: usr/sbin/criu and its libraries), held
    open for running inside containers; ``root_switch`` is criu-root.so;
    ``plugins``, a directory of the agent's (made here, kept empty), is the
    only one CRIU loads plugins from; ``kept_logs``: where a failed run's
    log is kept (smr.process.criu.Criu)."""

    def __init__(self, root: Path, preload: str = "", root_switch: str = "",
                 plugins: Path | None = None, kept_logs: Path | None = None) -> None:
        self.root = root
        self.plugins = plugins
        self.kept_logs = kept_logs
        # criu-limits.so (smr.process.criu.Criu's preload), opened like CRIU's own files.
        self.preload = Path(preload) if preload else None
        self.root_switch = Path(root_switch) if root_switch else None
        self.binary = root / "usr/sbin/criu"
        self.libdir = root / "usr/lib/x86_64-linux-gnu"
        self.loader = self.libdir / "ld-linux-x86-64.so.2"
        self._fds: tuple[int, ...] | None = None
        self._preloads: tuple[int, ...] = ()
        # CRIU's kernel-feature cache (services.containers.kdat), once made.
        self._kdat: int | None = None
        self._kdat_tried = False
        self._version: str | None = None

    def fds(self) -> tuple[int, ...]:
        """Descriptors of the loader, the library directory, CRIU, an empty
        plugin directory, then the libraries preloaded into CRIU."""
        if self._fds is None:
            if not self.binary.is_file() or not self.loader.is_file():
                raise PermanentError(
                    f"no CRIU under {self.root} (looked for {self.binary} and {self.loader})",
                    code="criu-missing", hint="set SMR_CRIU_ROOT to the prefix CRIU is "
                    "installed in (/ in the smr image, .tools/root in a checkout)")
            if self.root_switch is None or not self.root_switch.is_file():
                raise PermanentError(
                    "no criu-root.so: the agent runs CRIU in a container only with it "
                    "(native/criu-root.c), never with the container's root as `/`",
                    code="criu-missing", hint="run `make setup` (it builds "
                    ".tools/lib/criu-root.so); the smr image has it in /usr/lib/smr")
            plugins = _empty_dir(self.plugins)
            self._preloads = tuple(os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                                   for p in (self.root_switch, self.preload) if p)
            self._fds = (os.open(self.loader, os.O_RDONLY | os.O_CLOEXEC),
                         os.open(self.libdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC),
                         os.open(self.binary, os.O_RDONLY | os.O_CLOEXEC),
                         plugins, *self._preloads)
        return self._fds

    def close(self) -> None:
        """Closes what ``fds`` and ``kdat`` opened (an agent that stops; the
        suite starts many in one process). Opened again if used after."""
        for fd in (*(self._fds or ()), *((self._kdat,) if self._kdat is not None else ())):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds, self._preloads, self._kdat, self._kdat_tried = None, (), None, False

    async def kdat(self) -> int | None:
        """A descriptor of CRIU's kernel-feature cache, made outside every
        container (services.containers.kdat), or None where it cannot be."""
        if not self._kdat_tried:
            assert self.plugins is not None
            data = await asyncio.to_thread(kdat.cache, self.loader, self.libdir, self.binary,
                                           self.plugins)
            if not self._kdat_tried and data is not None:
                self._kdat = kdat.descriptor(data)
            self._kdat_tried = True
        return self._kdat

    async def version(self) -> str:
        """This CRIU's version, asked once outside every container (the agent's
        loader and libraries, no configuration read): a `criu --version` in a
        container's namespaces would read the image's /etc/criu/default.conf
        (--version takes no --no-default-config from the options of a run),
        where a FIFO holds it for ever and any text makes it fail or say
        another version; and the workload could stop it."""
        if self._version is None:
            self._version = await asyncio.to_thread(
                kdat.version, self.loader, self.libdir, self.binary)
        return self._version

    def programs(self) -> list[str]:
        """The programs a run of ``inside`` consists of (smr.process.unstop):
        the agent's sh, setpriv and nsenter, and CRIU's loader."""
        return [_which("sh"), _which("setpriv"), _which("nsenter"), str(self.loader)]

    async def inside(self, shim: Shim, timeout: float, work: Path, work_fd: int, *,
                     pod: dict[str, Any], container: str, charged: bool = False,
                     namespaces: list[str] = NAMESPACES) -> Criu:
        """A CRIU that runs in ``shim``'s container and keeps its images in
        ``work``, a directory of the agent's (``work_fd``: held open by the
        caller). CRIU reaches it through that descriptor (/proc/self/fd/N),
        so the images are never in the container's file system: the workload
        cannot see, write or swap them, before or after CRIU wrote them.

        ``charged`` (restores): CRIU starts in the container's cgroups, so the
        tree it restores (its children) is charged to the pod's memory limit
        from its first page; moving the tasks afterwards leaves the charge
        with the agent (cgroup v1 never moves it, v2 by default neither).

        ``pod`` (the pod as the API server has it, read just before) and
        ``container`` decide first: CRIU never starts where the pod's spec
        lets a process of the namespace ptrace (services/containers/ptracers);
        the live processes are looked at after, for a runtime's defaults."""
        ptracers.refuse(pod, container)
        fds = self.fds()
        loader, libdir, criu, plugins = fds[:4]
        env = dict(ENTER_ROOT)
        if (cache := await self.kdat()) is not None:
            fds = (*fds, cache)
            env["SMR_CRIU_KDAT_FD"] = str(cache)

        def view(p: Path) -> str:
            rel = os.path.relpath(p, work)
            if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
                raise ValueError(f"{p} is not in the agent's work directory {work}")
            return f"/proc/self/fd/{work_fd}" + ("" if rel == "." else f"/{rel}")

        # The agent's own sh, setpriv and nsenter, by full path: the
        # environment is built from nothing (no PATH).
        sh, setpriv, nsenter, _ = self.programs()
        join = [] if not charged else [
            sh, "-c", 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; '
            'shift; exec "$@"', "smr-join-cgroups", *map(str, host.cgroup_procs(shim.pid)), "--"]
        preload = ":".join(f"/proc/self/fd/{fd}" for fd in self._preloads)
        # nsenter opens --root and --wd before it joins the namespaces (the
        # agent's `/`) and forks into the PID namespace, so /proc/self there
        # is the child, which holds these descriptors.
        await asyncio.to_thread(refuse_ptracers, shim.pid)
        caps = CRIU_CAPABILITIES | container_capabilities(shim.pid)
        return Criu(f"/proc/self/fd/{criu}", timeout, view=view, version=await self.version(),
                    options=[*OPTIONS, "-L", f"/proc/self/fd/{plugins}"],
                    fds=(*fds, work_fd), env=env, kept_logs=self.kept_logs,
                    programs=self.programs(), prefix=[
                        *join, *bounded(setpriv, caps),
                        nsenter, "-t", str(shim.pid), *namespaces, "--root=/", "--wd=/",
                        "--", f"/proc/self/fd/{loader}", "--inhibit-cache",
                        "--library-path", f"/proc/self/fd/{libdir}", "--preload", preload])


def container_capabilities(pid: int) -> frozenset[str]:
    """The bounding set of ``pid`` (a container's first process): no process of
    that container holds a capability outside it."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError as e:
        raise PermanentError(f"cannot read the capabilities of the container of pid {pid}: "
                             f"{e}", code="container-gone",
                             hint="the container stopped; the step is not retried") from None
    mask = int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("CapBnd:")), 16)
    return frozenset(n for i, n in enumerate(CAPABILITIES) if mask >> i & 1)


def refuse_ptracers(pid: int, settle: float = PTRACE_SETTLE_S) -> None:
    """Refuse to run CRIU in the PID namespace of ``pid`` (a container's first
    process) while a process there, of the node's user namespace, holds or
    may gain CAP_SYS_PTRACE (bounding or permitted set): with it the process
    could read CRIU's descriptors (the agent's own directories, whose `..`
    is the host's tree) or take CRIU over, which runs there as root with
    more capabilities than the container. Without it the kernel denies both
    (CRIU holds sys_ptrace, which such a process lacks). Checked before
    anything is frozen or restored; a pod sharing its PID namespace
    (shareProcessNamespace, an ephemeral debug container) counts too.

    The runtime's own init of an exec (runc:[2:INIT], a probe's or a
    `kubectl exec`'s) is in the namespace with the runtime's capabilities for
    a moment, before it takes the container's and runs the command: the
    namespace is looked at again for up to ``settle`` seconds, and refused
    only if no look finds it clean. A tenant's process holds the capability
    only where its container grants it, for as long as it runs."""
    deadline = time.monotonic() + settle
    while (found := _ptracer(pid)) is not None:
        if time.monotonic() > deadline:
            p, name = found
            raise PermanentError(
                f"process {p} ({name}) shares the container's PID namespace and may hold "
                "CAP_SYS_PTRACE: with it, it could take over the node agent's CRIU, which runs "
                "in that namespace as root; nothing was frozen", code="container-can-ptrace",
                hint="remove SYS_PTRACE (and privileged: true) from the securityContext of "
                     "every container of the pod to checkpoint it (docs/compatibility.md)")
        time.sleep(0.1)


def _ptracer(pid: int) -> tuple[int, str] | None:
    """A process of ``pid``'s PID namespace, in the node's user namespace, that
    holds or may gain CAP_SYS_PTRACE, and its name; or None."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        raise PermanentError(f"the container of pid {pid} is gone", code="container-gone",
                             hint="the container stopped; the step is not retried") from None
    ours = os.readlink("/proc/self/ns/user")
    bit = 1 << CAPABILITIES.index("sys_ptrace")
    for p in host.all_pids():
        try:
            if os.readlink(f"/proc/{p}/ns/pid") != ns or \
                    os.readlink(f"/proc/{p}/ns/user") != ours:
                continue
            fields = dict(ln.split(":\t", 1) for ln in
                          Path(f"/proc/{p}/status").read_text().splitlines() if ":\t" in ln)
        except OSError:
            continue  # gone meanwhile
        if (int(fields.get("CapBnd", "0"), 16) | int(fields.get("CapPrm", "0"), 16)) & bit:
            return p, fields.get("Name", "?").strip()
    return None


def bounded(setpriv: str, caps: frozenset[str]) -> list[str]:
    """A prefix that runs a command with only ``caps`` in its bounding set and
    none inheritable (root's next exec gets no other), for it and all it runs."""
    keep = ",".join(f"+{c}" for c in CAPABILITIES if c in caps)
    return [setpriv, "--inh-caps=-all", f"--bounding-set=-all,{keep}", "--"]


def _empty_dir(path: Path | None) -> int:
    """A descriptor of ``path``, a directory of the agent's, made if missing;
    refused unless it is a real directory of this user, and empty."""
    if path is None:
        raise PermanentError("no directory for CRIU's (empty) plugin directory",
                             code="criu-missing", hint="pass CriuBundle a plugins path")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022 or os.listdir(fd):
        os.close(fd)
        raise PermanentError(
            f"{path}, where the agent's CRIU looks for plugins, is not an empty directory "
            "of the agent's own", code="criu-missing",
            hint="empty it (smr's CRIU loads no plugin) or remove it: the agent makes it")
    return fd


def _which(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise PermanentError(f"no {name} on the agent's PATH", code="criu-missing",
                             hint="install util-linux (nsenter) and a POSIX sh")
    return found


async def set_last_pid(shim: Shim, last: int, init_binary: str) -> None:
    """Make the container's next PIDs start after ``last``: CRIU and nsenter,
    which join the namespace for a restore, must not take a PID the restored
    tree needs (smr-init keeps the namespace empty until then).

    ``init_binary`` is the agent's own smr-init, never the container's copy."""
    # Only the PID namespace is entered: the sysctl acts on the writer's PID
    # namespace, and the container's /proc/sys is mounted read-only.
    proc = await asyncio.create_subprocess_exec(
        *bounded(_which("setpriv"), SET_LAST_PID_CAPABILITIES),
        _which("nsenter"), "-t", str(shim.pid), "-p", "--", init_binary,
        "--set-last-pid", str(last), stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise PermanentError(
            f"cannot reserve PIDs in the container of pid {shim.pid}: "
            f"{err.decode(errors='replace').strip()}", code="pid-reserve-failed")
