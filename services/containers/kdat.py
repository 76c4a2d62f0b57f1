"""CRIU's kernel-feature cache, made by the agent outside every container.

At start CRIU reads its cache of what the kernel can do, /run/criu.kdat, and
without one probes the kernel (criu/kerndat.c) and writes the cache back. In
a container's namespaces, with the container's root as `/`, that file is the
tenant's, and the probes run programs (`iptables`, `sh`: the image's) and
fork helpers in the tenant's PID namespace, where the workload can stop them
and so fail the run. criu-root.so (native/criu-root.c) therefore answers the
agent's CRIU's reads of /run/criu.kdat from a descriptor made here, refuses
its writes, and refuses every program.

The cache is made once per process (the kernel cannot change under it) for
each CRIU, by that CRIU with the agent's own loader and libraries (the cache
holds facts about them too: their rseq layout), in a mount namespace of its
own with a private tmpfs on /run (CRIU keeps its cache only on a tmpfs),
among the agent's files and processes only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

from smr.process.criu import parse_version

log = logging.getLogger("smr.containers.kdat")

# CRIU's struct kerndat_s is under 1 KiB (912 bytes for 4.2 on x86_64);
# criu-root.so ignores anything larger.
MAX_BYTES = 65536
# CRIU's probes take about 0.1 s here; generous for a loaded node.
TIMEOUT_S = 60.0

# The shell that runs CRIU there: a tmpfs on /run, CRIU's `check` (which
# probes, then saves the cache), then the cache on stdout.
_SCRIPT = ('"$1" -t tmpfs -o size=1m,mode=0700 smr-kdat /run && cd /run || exit 125; '
           'cat=$2; shift 2; "$@" >/dev/null 2>&1; exec "$cat" /run/criu.kdat')

_made: dict[tuple[int, ...], bytes | None] = {}
_lock = threading.Lock()


def cache(loader: Path, libdir: Path, binary: Path, plugins: Path) -> bytes | None:
    """The kernel-feature cache of the CRIU ``binary`` (run through ``loader``
    with ``libdir``), made on first use and kept; None if it cannot be made
    (said once): CRIU then probes in the container, with no program run."""
    key = _identity(binary, libdir)
    with _lock:
        if key not in _made:
            _made[key] = _make(loader, libdir, binary, plugins)
        return _made[key]


def _identity(binary: Path, libdir: Path) -> tuple[int, ...]:
    b, d = os.stat(binary), os.stat(libdir)
    return (b.st_dev, b.st_ino, b.st_mtime_ns, d.st_dev, d.st_ino, d.st_mtime_ns)


def _make(loader: Path, libdir: Path, binary: Path, plugins: Path) -> bytes | None:
    tools = {name: shutil.which(name) for name in ("unshare", "sh", "mount", "cat")}
    if None in tools.values():
        missing = [n for n, p in tools.items() if p is None]
        log.warning("cannot make CRIU's kernel-feature cache: no %s on the agent's PATH; "
                    "each CRIU run in a container then probes the kernel itself (slower, "
                    "and a workload that stops its helpers can fail it). Install util-linux "
                    "and coreutils in the agent's image", ", ".join(missing))
        return None
    plugins.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Absolute: the shell changes into /run first.
    loader, libdir, binary, plugins = (p.absolute() for p in (loader, libdir, binary, plugins))
    cmd = [str(tools["unshare"]), "--mount", "--propagation", "private", "--",
           str(tools["sh"]), "-c", _SCRIPT, "smr-kdat", str(tools["mount"]), str(tools["cat"]),
           *_criu(loader, libdir, binary), "check", "--no-default-config", "-L", str(plugins),
           "--feature", "mem_dirty_track"]
    try:
        out = subprocess.run(cmd, capture_output=True, env={}, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot make CRIU's kernel-feature cache (%s); each CRIU run in a "
                    "container then probes the kernel itself", e)
        return None
    if out.returncode != 0 or not 0 < len(out.stdout) <= MAX_BYTES:
        log.warning("cannot make CRIU's kernel-feature cache: `criu check` in a mount "
                    "namespace of the agent's own ended %d with %d bytes of cache (%s); each "
                    "CRIU run in a container then probes the kernel itself", out.returncode,
                    len(out.stdout), out.stderr.decode(errors="replace").strip()[-300:])
        return None
    return out.stdout


def version(loader: Path, libdir: Path, binary: Path) -> str:
    """The version of the CRIU ``binary`` (run through ``loader`` with
    ``libdir``, in the agent's own namespaces, reading no configuration file),
    or "unknown"."""
    cmd = [*_criu(loader, libdir, binary), "--version", "--no-default-config"]
    try:
        out = subprocess.run(cmd, capture_output=True, env={}, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot ask CRIU %s its version: %s", binary, e)
        return "unknown"
    return parse_version(out.stdout)


def _criu(loader: Path, libdir: Path, binary: Path) -> list[str]:
    """The command line that runs ``binary`` with the agent's own loader and
    libraries, not those of wherever it runs."""
    return [str(loader), "--inhibit-cache", "--library-path", str(libdir), str(binary)]


def descriptor(data: bytes) -> int:
    """A sealed, read-only memfd holding ``data`` (close-on-exec: a run keeps
    it by naming it)."""
    fd = os.memfd_create("smr-criu-kdat", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except OSError:
        os.close(fd)
        raise
    return fd
