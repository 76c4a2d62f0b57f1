"""Running CRIU inside a container's namespaces.

The agent enters the container's mount, PID, network, IPC and UTS namespaces
(nsenter) and runs CRIU there. To CRIU the container's namespaces are then its
own: it dumps and restores the workload's process tree like any other, with
no mount table or namespace to describe, and a restore lands in the new
container's namespaces and root file system, whatever image and volumes the
kubelet gave it.

CRIU must be reachable inside the container: the agent copies its own CRIU
(the binary, the dynamic loader and the libraries it needs, ~10 MB) into the
pod's smr volume once per agent version, and starts it through that loader,
so nothing in the workload's image matters.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
from pathlib import Path

from services.agent.host import Shim
from smr.criu import Criu
from smr.errors import PermanentError

NAMESPACES = ["-m", "-p", "-n", "-i", "-u"]
# CRIU's own cgroup handling is off: the restored tree is moved into the new
# container's cgroups by the agent (host.move_to_cgroups_of).
OPTIONS = ["--manage-cgroups=ignore"]


class CriuBundle:
    """The agent's CRIU, ready to be copied into containers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.binary = root / "usr/sbin/criu"
        self.libdir = root / "usr/lib/x86_64-linux-gnu"
        self.loader = self.libdir / "ld-linux-x86-64.so.2"
        self._files: list[Path] | None = None
        self._tag: str | None = None

    async def files(self) -> list[Path]:
        """The libraries CRIU loads, as the loader resolves them."""
        if self._files is None:
            if not self.binary.is_file() or not self.loader.is_file():
                raise PermanentError(
                    f"no CRIU under {self.root} (looked for {self.binary} and {self.loader})",
                    code="criu-missing", hint="set SMR_CRIU_ROOT to the prefix CRIU is "
                    "installed in (/ in the smr image, .tools/root in a checkout)")
            proc = await asyncio.create_subprocess_exec(
                str(self.loader), "--library-path", str(self.libdir), "--list",
                str(self.binary), stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            libs = re.findall(r"=> (\S+) \(", out.decode())
            self._files = [Path(p) for p in libs if Path(p).name != self.loader.name]
        return self._files

    async def tag(self) -> str:
        """Changes whenever the binary does: a stale copy is replaced."""
        if self._tag is None:
            self._tag = hashlib.sha256(self.binary.read_bytes()).hexdigest()[:12]
        return self._tag

    async def stage(self, shim: Shim) -> str:
        """Copy CRIU into the shim's volume (once); its directory inside."""
        inside = f"{shim.init_dir}/.criu-{await self.tag()}"
        dst = shim.host(inside)
        if (dst / ".complete").exists():
            return inside
        files = await self.files()

        def copy() -> None:
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "lib").mkdir(parents=True)
            shutil.copy2(self.binary, tmp / "criu")
            shutil.copy2(self.loader, tmp / "ld.so")
            for f in files:
                shutil.copy2(f, tmp / "lib" / f.name)
            (tmp / ".complete").write_text("")
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)

        await asyncio.to_thread(copy)
        return inside

    async def inside(self, shim: Shim, timeout: float) -> Criu:
        """A CRIU that runs in ``shim``'s container; paths given to it are
        host paths under the container's root."""
        staged = await self.stage(shim)
        root = str(shim.root)

        def view(p: Path) -> str:
            s = str(p)
            if not s.startswith(root + "/"):
                raise ValueError(f"{p} is not inside the container of pid {shim.pid}")
            return s[len(root):]

        return Criu(f"{staged}/criu", timeout, view=view, options=OPTIONS, prefix=[
            "nsenter", "-t", str(shim.pid), *NAMESPACES, "--",
            f"{staged}/ld.so", "--library-path", f"{staged}/lib"])


async def set_last_pid(shim: Shim, last: int) -> None:
    """Make the container's next PIDs start after ``last``: CRIU and nsenter,
    which join the namespace for a restore, must not take a PID the restored
    tree needs (smr-init keeps the namespace empty until then)."""
    # Only the PID namespace is entered: the sysctl acts on the writer's PID
    # namespace, and the container's /proc/sys is mounted read-only.
    proc = await asyncio.create_subprocess_exec(
        "nsenter", "-t", str(shim.pid), "-p", "--", str(shim.host(f"{shim.init_dir}/smr-init")),
        "--set-last-pid", str(last), stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise PermanentError(
            f"cannot reserve PIDs in the container of pid {shim.pid}: "
            f"{err.decode(errors='replace').strip()}", code="pid-reserve-failed",
            hint=f"is {shim.init_dir}/smr-init the smr-init of this smr version?")
