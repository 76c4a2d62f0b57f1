"""The CRIU engine: dump, pre-dump and restore of a process tree.

Every CRIU option smr uses is set here and nowhere else. Each run writes its
log beside the images; a failure raises CriuError quoting CRIU's own first
failing line, so the error event says what CRIU said.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import platform
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from smr.contract.errors import PermanentError, TemporaryError
from smr.process import linkremap, procfs, unstop
from smr.process.criu_log import ERROR_PREFIX, TEMPORARY, explain, failing_line
from smr.process.sockets import Tcp
from smr.process.tree import process_tree

# Linux 6.16 refuses SO_PASSCRED/SO_PASSSEC on INET sockets, which CRIU before
# 4.2 asks for on every socket it dumps (fixed in 4.2:
# github.com/checkpoint-restore/criu/issues/2705).
SOCKETS_KERNEL = (6, 16)
SOCKETS_CRIU = (4, 2)

logger = logging.getLogger("smr.process.criu")

# `criu --version` answers at once; a run stuck longer is given up ("unknown").
VERSION_TIMEOUT_S = 30.0



def parse_version(out: bytes) -> str:
    """The version in the output of `criu --version`, or "unknown"."""
    m = re.search(rb"Version:\s*(\S+)", out)
    return m.group(1).decode(errors="replace") if m else "unknown"

class CriuError(PermanentError):
    code = "criu-failed"


class CriuStopped(PermanentError):
    """A run failed or ran out of time while someone kept stopping CRIU."""

    code = "criu-stopped-by-tenant"


@dataclass(frozen=True)
class CriuRun:
    seconds: float
    log: Path


class Criu:
    """``prefix`` runs CRIU through another command (the node agent enters a
    container's namespaces with nsenter); ``view`` turns a host path into the
    path CRIU sees there; ``options`` go into every dump and restore; ``fds``
    stay open in every run; ``preload``, criu-limits.so (native/criu-limits.c)
    as CRIU sees it, lets CRIU read the limits of a task of another user where
    root lacks CAP_SYS_RESOURCE. ``env``: the whole environment of every run,
    built from nothing (the node agent's: no CRIU_CONFIG_FILE, CRIU_LIBS_DIR,
    HOME or LD_* of its own reach CRIU); None inherits this process's.
    ``programs``: the files of the programs a run consists of (the prefix's
    and CRIU's, as /proc/PID/exe names them; CRIU's binary without a prefix):
    one of them found stopped during a run is continued (smr.process.unstop)."""

    def __init__(self, binary: str, timeout: float = 600.0, *, prefix: Sequence[str] = (),
                 view: Callable[[Path], str] = str, options: Sequence[str] = (),
                 fds: Sequence[int] = (), network_lock: str = "nftables",
                 preload: str = "", env: Mapping[str, str] | None = None,
                 programs: Sequence[str] = (), kept_logs: Path | None = None,
                 version: str | None = None) -> None:
        self.binary = binary
        self.programs = unstop.programs(programs or ([] if prefix else [binary]))
        # A failed run's log is copied here: the step removes its work
        # directory, and with it the log, before the user reads the hint.
        self.kept_logs = kept_logs
        # nftables: CRIU locks connections through its own libnftables, so no
        # iptables binary is needed where it runs (inside a container too).
        self.network_lock = network_lock
        self.timeout = timeout
        self.prefix = list(prefix)
        self.view = view
        self.options = list(options)
        self.fds = tuple(fds)  # kept open in every run (the node agent's CRIU files)
        self.preload = preload
        self.env = dict(env) if env is not None else None
        self._tracks_memory: bool | None = None
        # Known beforehand where asking through the prefix is not safe: a
        # CRIU in a container's namespaces would read the image's
        # /etc/criu/default.conf (a FIFO there holds it for ever) and can be
        # stopped by the workload (services.containers.incontainer).
        self._version: str | None = version
        # Told the host PID of each run's first process as it starts (it
        # lives until its CRIU ends: nsenter waits for the CRIU it forks).
        self.on_start: Callable[[int], None] | None = None

    async def version(self) -> str:
        """CRIU's version (asked once: it goes into every manifest)."""
        if self._version is None:
            # Through the prefix, with the fds: a node agent's CRIU is a
            # descriptor (/proc/self/fd/N) that exists only there.
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.prefix, self.binary, "--version", stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT, pass_fds=self.fds, env=self._env(),
                    start_new_session=True,
                )
            except OSError:
                return "unknown"  # asked while explaining a failure: must not hide it
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), VERSION_TIMEOUT_S)
            except TimeoutError:
                kill_tree(proc.pid)
                await proc.wait()
                return "unknown"
            self._version = parse_version(out)
        return self._version

    async def problem(self) -> str | None:
        """Why this CRIU cannot checkpoint what people run on this kernel, or None."""
        version = await self.version()
        kernel = release_tuple(platform.release())
        if kernel >= SOCKETS_KERNEL and release_tuple(version) < SOCKETS_CRIU:
            return (f"CRIU {version} cannot checkpoint a process holding a TCP or UDP socket on "
                    f"Linux {platform.release()} (6.16 and later refuse the socket options it "
                    "reads; fixed in CRIU 4.2). Install CRIU 4.2 or newer: `make setup` does, "
                    "and the smr image has it; or point SMR_CRIU / SMR_CRIU_ROOT at one")
        return None

    async def tracks_memory(self) -> bool:
        """Can this kernel track dirty pages (CONFIG_MEM_SOFT_DIRTY)? Pre-dump needs it."""
        if self._tracks_memory is None:
            proc = await asyncio.create_subprocess_exec(
                self.binary, "check", "--feature", "mem_dirty_track",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await proc.communicate()
            self._tracks_memory = proc.returncode == 0 and b"OFF" not in out
        return self._tracks_memory

    async def pre_dump(self, pid: int, images: Path, *, parent: Path | None = None) -> CriuRun:
        """Copy memory while the tree runs; a later dump writes only what changed."""
        args = ["pre-dump", "-t", str(pid), "--track-mem"]
        if parent:
            args += ["--prev-images-dir", os.path.relpath(parent, images)]
        return await self._run(args, images, "pre-dump.log", code="criu-pre-dump-failed")

    def _tcp(self, tcp: Tcp) -> list[str]:
        if tcp == "keep":
            # The connections are saved with their sequence numbers; the
            # network is locked for them while the tree is frozen.
            return ["--tcp-established", "--network-lock", self.network_lock]
        return ["--tcp-close"]

    async def dump(self, pid: int, images: Path, *, leave_running: bool = False,
                   leave_stopped: bool = False, parent: Path | None = None,
                   tcp: Tcp = "close", carry: Path | None = None,
                   link_remap: bool = False) -> CriuRun:
        """Freeze and dump the tree rooted at ``pid``; CRIU kills it unless
        ``leave_running``, or ``leave_stopped`` (every task left in SIGSTOP,
        for the caller to kill once the images are stored, or to continue if
        they cannot be). On failure CRIU thaws the tree: it keeps running.

        ``tcp`` (smr.process.sockets): keep the established connections, or close
        them (not saved; peers see the close once the tree is gone).

        ``carry``: a file the tree maps under a deleted name while another
        name still links it (a 'spawn' multiprocessing semaphore) is saved
        through a link CRIU makes beside it (--link-remap), which is copied
        into ``carry`` while the tree is frozen and taken out of the file
        system (smr.process.linkremap: a local job's /dev/shm is the host's). Without
        it (or ``link_remap``: CRIU's links left where it makes them, for a
        caller that carries that directory) such a dump fails."""
        # --skip-in-flight: a server under load has half-open connections that
        # no process has accepted yet; their peers retry the handshake.
        # --ghost-limit: a file the tree holds or maps after its name was
        # deleted is saved in the images up to this size (CRIU's default is
        # 1 MiB): NCCL keeps a 33 MiB one in /dev/shm even over sockets.
        args = ["dump", "-t", str(pid), "--file-locks", "--skip-in-flight",
                "--ghost-limit", GHOST_LIMIT, *self._tcp(tcp)]
        if leave_running:
            args.append("--leave-running")
        elif leave_stopped:
            args.append("--leave-stopped")
        if parent:
            # Incremental: pages already in the pre-dump are referenced, not copied.
            args += ["--track-mem", "--prev-images-dir", os.path.relpath(parent, images)]
        if carry is None:
            if link_remap:
                args.append("--link-remap")
            return await self._run(args, images, "dump.log", code="criu-dump-failed")
        scripts = Path(tempfile.mkdtemp(prefix="smr-criu-"))
        try:
            script = linkremap.action_script(scripts, images, carry)
            args += ["--link-remap", "--action-script", self.view(script)]
            run = await self._run(args, images, "dump.log", code="criu-dump-failed")
        finally:
            shutil.rmtree(scripts, ignore_errors=True)
        if not leave_running:
            await asyncio.to_thread(linkremap.discard_left, carry)
        return run

    async def restore(self, images: Path, *, pidfile: Path,
                      inherit: dict[str, int] | None = None, tcp: Tcp = "close",
                      stream: Path | None = None, leave_stopped: bool = False) -> CriuRun:
        """Restore detached (the tree outlives this call); ``leave_stopped``:
        every task left in SIGSTOP (a GPU process gets its GPU state back
        before any of its threads runs: smr.gpu.frozen).

        ``inherit`` maps a file path as CRIU recorded it to an open descriptor
        of ours: the restored tree gets that descriptor instead of reopening the
        file, so a log that grew since the dump is still accepted. ``tcp``:
        bring saved connections back, or restore them closed (the process
        sees a reset on its next read or write). ``stream``: the directory of
        an smr.process.imagestream socket that CRIU asks for each image instead of
        reading files (its log still goes to ``images``).
        """
        args = ["restore", "-d", "--file-locks", "--pidfile", self.view(pidfile),
                *self._tcp(tcp)]
        if leave_stopped:
            args.append("--leave-stopped")
        if stream:
            args += ["--stream", "-W", self.view(images)]
        fds = []
        for path, fd in (inherit or {}).items():
            args.append(f"--inherit-fd=fd[{fd}]:{path.lstrip('/')}")
            fds.append(fd)
        return await self._run(args, images, "restore.log", code="criu-restore-failed",
                               pass_fds=tuple(fds), image_dir=stream)

    async def _run(self, args: list[str], images: Path, log_name: str, *, code: str,
                   pass_fds: tuple[int, ...] = (), image_dir: Path | None = None) -> CriuRun:
        images.mkdir(parents=True, exist_ok=True)
        log = images / log_name
        cmd = [*self.prefix, self.binary, *args, *self.options,
               "-D", self.view(image_dir or images),
               "-o", log_name, "-v4"]
        env = self._env()
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, pass_fds=(*pass_fds, *self.fds),
            start_new_session=True, env=env,
        )
        if self.on_start is not None:
            self.on_start(proc.pid)
        stops = unstop.Stops()
        watch = asyncio.create_task(unstop.keep_running(proc.pid, self.programs, stops))
        try:
            _, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            # CRIU itself, not only what runs it: nsenter forks CRIU into the
            # container's PID namespace, and a CRIU left behind keeps the tree
            # frozen, or restores it beside a fresh start.
            kill_tree(proc.pid)
            await proc.wait()
            if stops.count:
                raise self._stopped(args[0], stops, log, "did not finish within "
                                    f"{self.timeout:.0f}s") from None
            raise TemporaryError(
                f"criu {args[0]} did not finish within {self.timeout:.0f}s",
                code=f"{code}-timeout", detail=failing_line(log),
                hint="raise SMR_CRIU_TIMEOUT for large processes" + self._keep(log),
            ) from None
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        seconds = time.monotonic() - start
        if stops.count and proc.returncode != 0:
            raise self._stopped(args[0], stops, log, f"failed (exit {proc.returncode})")
        if stops.count:
            logger.warning("criu %s into %s was stopped %d times by someone else (pids %s) "
                           "and continued each time", args[0], images, stops.count,
                           sorted(stops.pids))
        if proc.returncode != 0:
            detail = failing_line(log) or err.decode(errors="replace").strip()[-500:]
            known = explain(log, stderr=detail)
            if known:
                what, code, hint = known
                error = TemporaryError if code in TEMPORARY else CriuError
                raise error(f"criu {args[0]} failed: {what}", code=code, detail=detail,
                            hint=hint + self._keep(log))
            hint = self._keep(log).removeprefix("; ")
            if why := await self.problem():
                hint = f"{why}; {hint}" if hint else why
            why = ERROR_PREFIX.sub("", detail.splitlines()[0]) if detail else ""
            raise CriuError(f"criu {args[0]} failed (exit {proc.returncode})"
                            + (f": {why}" if why else ""), code=code, detail=detail, hint=hint)
        return CriuRun(seconds, log)

    def _keep(self, log: Path) -> str:
        """The hint's "; full log: PATH", PATH a copy of ``log`` in
        ``kept_logs`` (the newest KEPT_LOGS are kept), or "" where none can
        be kept: a hint names only a file that is still there when read."""
        if self.kept_logs is None or not log.is_file():
            return ""
        try:
            self.kept_logs.mkdir(parents=True, exist_ok=True)
            # The step's directory is its request id: one name per failure.
            kept = self.kept_logs / (
                f"{time.strftime('%Y%m%dT%H%M%S')}-{log.parent.parent.name}-{log.parent.name}"
                f"-{log.name}")
            shutil.copyfile(log, kept)
            old = sorted(self.kept_logs.iterdir(), key=lambda p: p.stat().st_mtime)
            for p in old[:-KEPT_LOGS]:
                p.unlink(missing_ok=True)
        except OSError:
            return ""  # a full disk, say: the failure itself matters more
        return f"; full log: {kept}"


    def _stopped(self, action: str, stops: unstop.Stops, log: Path, what: str
                 ) -> CriuStopped:
        return CriuStopped(
            f"criu {action} {what} while it was stopped {stops.count} times (SIGSTOP) by a "
            "process that can signal it: one of the container's own, or of a pod sharing its "
            "PID namespace; the agent continued it each time", detail=failing_line(log),
            hint="find the workload's process that stops others (kill -STOP, a debugger) and "
            "stop it from doing so during checkpoints" + self._keep(log))

    def _env(self) -> dict[str, str] | None:
        """A run's environment: ``env`` or this process's, with the preload;
        None (inherited) where neither changes it."""
        if self.env is None and not self.preload:
            return None
        env = dict(os.environ if self.env is None else self.env)
        if self.preload:
            env["LD_PRELOAD"] = self.preload
        return env


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, every descendant (stopped ones too: SIGKILL needs no
    SIGCONT) and its process group. The tree is listed before any is killed,
    so none escapes the list by being reparented; a restore's half-restored
    tree, still CRIU's children, goes with it."""
    for _ in range(3):  # a fork racing the first pass is caught by the next
        for p in reversed(process_tree(pid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # its session: start_new_session=True


def release_tuple(version: str) -> tuple[int, ...]:
    """(6, 18) for "6.18.44-fc-v657", (4, 2) for "4.2.1"; () when unreadable."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else ()


# Failed runs' logs kept (smr.process.criu.Criu.kept_logs), the oldest removed first.
KEPT_LOGS = 50

GHOST_LIMIT = "512M"


def still_running(images: Path) -> list[int]:
    """CRIU processes still at work on ``images``: a worker that died leaves
    its CRIU running (each starts in its own session), and what it finishes
    (a dump leaving the tree stopped, a restored tree) must be waited for
    before recovery decides anything."""
    want = os.fsencode(images)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or (args := procfs.argv(int(name))) is None:
            continue
        # -D: a dump's images, a restore's; -W: a streamed restore's (its
        # -D is the streamer's socket directory, its log goes to -W).
        if any(a.endswith(b"criu") for a in args[:4]) and any(
                a in (b"-D", b"-W") and b == want for a, b in itertools.pairwise(args)):
            found.append(int(name))
    return found


async def _until_none(find: Callable[[], list[int]], timeout: float) -> list[int]:
    """Until ``find`` (a walk of /proc, run off the event loop) finds no
    process, at most ``timeout``: what it found last ([] when none is left)."""
    deadline = time.monotonic() + timeout
    while pids := await asyncio.to_thread(find):
        if time.monotonic() > deadline:
            return pids
        await asyncio.sleep(0.1)
    return []


async def wait_finished(images: Path, timeout: float) -> None:
    """Until no CRIU works on ``images`` (or ``timeout``: then it is killed)."""
    for pid in await _until_none(lambda: still_running(images), timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def dump_finished(images: Path) -> bool:
    """Did a dump into ``images`` complete? (used when recovering a crash)."""
    try:
        return "Dumping finished successfully" in (images / "dump.log").read_text(errors="replace")
    except OSError:
        return False
