"""Running CRIU inside a container's namespaces.

The agent enters the container's mount, PID, network, IPC and UTS namespaces
(nsenter) and runs CRIU there. To CRIU the container's namespaces are then its
own: it dumps and restores the workload's process tree like any other, with
no mount table or namespace to describe, and a restore lands in the new
container's namespaces and root file system, whatever image and volumes the
kubelet gave it.

CRIU's files are the agent's own, never the container's: the agent opens its
CRIU binary, the dynamic loader and the library directory, and the process
that joined the namespaces executes them through those descriptors
(/proc/self/fd/N). A workload cannot swap a binary that root then runs with
all capabilities; nothing is copied into the pod.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from services.containers import host
from services.containers.host import Shim
from smr.criu import Criu
from smr.errors import PermanentError

NAMESPACES = ["-m", "-p", "-n", "-i", "-u"]
# A tree that maps System V shared memory (PostgreSQL) is dumped by a CRIU
# outside the container's IPC namespace: CRIU saves System V objects only with
# an IPC namespace not its own (criu/cr-dump.c, check_sysvipc_map_dump). The
# restore then gives the tree an IPC namespace of its own, with those objects.
NAMESPACES_SAVING_IPC = ["-m", "-p", "-n", "-u"]
# CRIU's own cgroup handling is off: the restored tree is moved into the new
# container's cgroups by the agent (host.move_to_cgroups_of).
OPTIONS = ["--manage-cgroups=ignore"]


class CriuBundle:
    """The agent's CRIU (under ``root``: usr/sbin/criu and its libraries), held
    open for running inside containers."""

    def __init__(self, root: Path, preload: str = "") -> None:
        self.root = root
        # criu-limits.so (smr.criu.Criu's preload), opened like CRIU's own files.
        self.preload = Path(preload) if preload else None
        self._preload_fd: int | None = None
        self.binary = root / "usr/sbin/criu"
        self.libdir = root / "usr/lib/x86_64-linux-gnu"
        self.loader = self.libdir / "ld-linux-x86-64.so.2"
        self._fds: tuple[int, int, int] | None = None

    def fds(self) -> tuple[int, int, int]:
        """Descriptors of the loader, the library directory and CRIU."""
        if self._fds is None:
            if not self.binary.is_file() or not self.loader.is_file():
                raise PermanentError(
                    f"no CRIU under {self.root} (looked for {self.binary} and {self.loader})",
                    code="criu-missing", hint="set SMR_CRIU_ROOT to the prefix CRIU is "
                    "installed in (/ in the smr image, .tools/root in a checkout)")
            self._fds = (os.open(self.loader, os.O_RDONLY),
                         os.open(self.libdir, os.O_PATH | os.O_DIRECTORY),
                         os.open(self.binary, os.O_RDONLY))
        return self._fds

    def inside(self, shim: Shim, timeout: float, work: Path, work_fd: int, *,
               charged: bool = False, namespaces: list[str] = NAMESPACES) -> Criu:
        """A CRIU that runs in ``shim``'s container and keeps its images in
        ``work``, a directory of the agent's (``work_fd``: held open by the
        caller). CRIU reaches it through that descriptor (/proc/self/fd/N),
        so the images are never in the container's file system: the workload
        cannot see, write or swap them, before or after CRIU wrote them.

        ``charged`` (restores): CRIU starts in the container's cgroups, so the
        tree it restores (its children) is charged to the pod's memory limit
        from its first page; moving the tasks afterwards leaves the charge
        with the agent (cgroup v1 never moves it, v2 by default neither)."""
        loader, libdir, criu = self.fds()
        extra: tuple[int, ...] = ()
        if self.preload:
            if self._preload_fd is None:
                self._preload_fd = os.open(self.preload, os.O_RDONLY)
            extra = (self._preload_fd,)

        def view(p: Path) -> str:
            rel = os.path.relpath(p, work)
            if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
                raise ValueError(f"{p} is not in the agent's work directory {work}")
            return f"/proc/self/fd/{work_fd}" + ("" if rel == "." else f"/{rel}")

        # nsenter forks into the PID namespace, so /proc/self there is the
        # child, which holds these descriptors.
        join = [] if not charged else [
            "sh", "-c", 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; '
            'shift; exec "$@"', "smr-join-cgroups", *map(str, host.cgroup_procs(shim.pid)), "--"]
        return Criu(f"/proc/self/fd/{criu}", timeout, view=view, options=OPTIONS,
                    fds=(loader, libdir, criu, work_fd, *extra),
                    preload=f"/proc/self/fd/{extra[0]}" if extra else "", prefix=[
                        *join, "nsenter", "-t", str(shim.pid), *namespaces, "--",
                        f"/proc/self/fd/{loader}", "--library-path", f"/proc/self/fd/{libdir}"])


async def set_last_pid(shim: Shim, last: int, init_binary: str) -> None:
    """Make the container's next PIDs start after ``last``: CRIU and nsenter,
    which join the namespace for a restore, must not take a PID the restored
    tree needs (smr-init keeps the namespace empty until then).

    ``init_binary`` is the agent's own smr-init, never the container's copy."""
    # Only the PID namespace is entered: the sysctl acts on the writer's PID
    # namespace, and the container's /proc/sys is mounted read-only.
    proc = await asyncio.create_subprocess_exec(
        "nsenter", "-t", str(shim.pid), "-p", "--", init_binary,
        "--set-last-pid", str(last), stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise PermanentError(
            f"cannot reserve PIDs in the container of pid {shim.pid}: "
            f"{err.decode(errors='replace').strip()}", code="pid-reserve-failed")
