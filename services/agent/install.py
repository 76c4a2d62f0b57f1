"""Installing smr-runtime on the agent's node, so that the `smr` RuntimeClass
(which the webhook gives opted-in pods) works there.

Idempotent; run by the agent at start when SMR_RUNTIME_INSTALL is not `off`:

1. the agent's own smr-runtime and smr-init are copied to
   ``<host>/var/lib/smr/bin`` with ``smr-runtime.env`` beside them (the real
   runtime: the host's runc; for `smr-nvidia`, the NVIDIA runtime, where the
   node has one);
2. containerd gets the runtime handlers ``smr`` (and ``smr-nvidia``) in its
   ``<host>/etc/containerd/config.toml``, in a marked block at its end, in the
   form of the file's config version: 1 and 2 (containerd 1.x), 3
   (containerd 2.x). Not a drop-in: containerd 1.6 merges an imported file's
   CRI section over the main one whole, which drops the node's own runtimes
   (measured with `containerd config dump`). Where the file does not define
   the default ``runc`` runtime, the block defines it as containerd's default
   does, since a file that names any runtime replaces containerd's defaults;
3. with SMR_RUNTIME_INSTALL=restart (the DaemonSet's default) containerd is
   restarted if anything changed, through the host's systemd; running
   containers keep running (their shims outlive containerd).

Undo (docs/node-agent.md): delete the marked block and /var/lib/smr/bin,
restart containerd.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("smr.agent")

BIN = "var/lib/smr/bin"
STATE = "/run/smr/containers"
CONFIG = "etc/containerd/config.toml"
RUNC = ("usr/bin/runc", "usr/sbin/runc", "usr/local/bin/runc", "usr/local/sbin/runc")
NVIDIA = ("usr/bin/nvidia-container-runtime", "usr/local/bin/nvidia-container-runtime")
# The CRI plugin's runtimes table, by config version.
RUNTIMES = {1: "plugins.cri.containerd.runtimes",
            2: 'plugins."io.containerd.grpc.v1.cri".containerd.runtimes',
            3: 'plugins."io.containerd.cri.v1.runtime".containerd.runtimes'}
BEGIN = "# >>> smr runtime handlers (services/agent/install.py; delete this block to undo)"
END = "# <<< smr runtime handlers"
_BLOCK = re.compile(rf"\n*{re.escape(BEGIN)}.*?{re.escape(END)}\n?", re.S)


@dataclass
class Installed:
    changed: bool
    handlers: list[str]
    config_version: int


def config_version(text: str | None) -> int:
    """The config's ``version``: 2 for a node without a file (we write one),
    1 for a file without the key (containerd 1.x reads it so)."""
    if text is None:
        return 2
    m = re.search(r"(?m)^\s*version\s*=\s*(\d+)", text)
    return min(int(m.group(1)), 3) if m else 1


def with_handlers(text: str, version: int, handlers: dict[str, Path]) -> str:
    """``text`` with our block (replaced if there) declaring ``handlers``."""
    text = _BLOCK.sub("\n", text).rstrip("\n")
    table = RUNTIMES[version]
    block = [BEGIN]
    if f"[{table}.runc]" not in text:
        block += [f"[{table}.runc]", '  runtime_type = "io.containerd.runc.v2"']
    for name, binary in handlers.items():
        block += [f"[{table}.{name}]", '  runtime_type = "io.containerd.runc.v2"',
                  f"[{table}.{name}.options]", f'  BinaryName = "{binary}"']
    block.append(END)
    return (text + "\n\n" if text else "") + "\n".join(block) + "\n"


def _write(path: Path, text: str, mode: int = 0o644) -> bool:
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".smr-tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.rename(path)
    return True


def _copy(src: Path, dst: Path) -> bool:
    if dst.is_file() and dst.read_bytes() == src.read_bytes():
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".smr-tmp")
    shutil.copyfile(src, tmp)
    tmp.chmod(0o755)
    tmp.rename(dst)  # a running container start keeps the old inode
    return True


def install(host: Path, runtime_binary: Path, init_binary: Path) -> Installed:
    """Install into the host's file system, seen at ``host`` (/proc/1/root
    from the agent's pod, which shares the host's PID namespace)."""
    def find(candidates: tuple[str, ...]) -> str | None:
        return next(("/" + c for c in candidates if (host / c).is_file()), None)

    runc = find(RUNC)
    if runc is None:
        raise FileNotFoundError(f"no runc on this node (looked for {', '.join(RUNC)})")
    bin_dir = host / BIN
    changed = _copy(runtime_binary, bin_dir / "smr-runtime")
    changed |= _copy(init_binary, bin_dir / "smr-init")
    handlers = {"smr": Path("/" + BIN) / "smr-runtime"}
    changed |= _write(bin_dir / "smr-runtime.env",
                      f"RUNTIME={runc}\nINIT=/{BIN}/smr-init\nSTATE={STATE}\n")
    if nvidia := find(NVIDIA):
        # A second copy, so it reads its own settings (the NVIDIA runtime).
        nv_dir = host / BIN / "nvidia"
        changed |= _copy(runtime_binary, nv_dir / "smr-runtime")
        changed |= _copy(init_binary, nv_dir / "smr-init")
        changed |= _write(nv_dir / "smr-runtime.env",
                          f"RUNTIME={nvidia}\nINIT=/{BIN}/nvidia/smr-init\nSTATE={STATE}\n")
        handlers["smr-nvidia"] = Path("/" + BIN) / "nvidia" / "smr-runtime"
    main = host / CONFIG
    text = main.read_text() if main.is_file() else None
    version = config_version(text)
    changed |= _write(main, with_handlers(text if text is not None else "version = 2",
                                          version, handlers))
    return Installed(changed, list(handlers), version)


async def restart_containerd() -> None:
    """Through the host's systemd (the agent shares the host's PID namespace)."""
    proc = await asyncio.create_subprocess_exec(
        "nsenter", "-t", "1", "-m", "-u", "-i", "-n", "-p", "--",
        "systemctl", "restart", "containerd",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"restarting containerd failed: {out.decode(errors='replace')}")


async def install_on_node(mode: str, host: Path, runtime_binary: Path,
                          init_binary: Path) -> None:
    """The agent's start-up step; a failure is logged, never fatal: the
    hand-written manifest path works without it."""
    if mode == "off":
        return
    try:
        done = install(host, runtime_binary, init_binary)
    except (OSError, ValueError) as e:
        log.error("smr-runtime not installed on this node (%s): pods opted in by label "
                  "only will start unprotected here; see docs/node-agent.md", e)
        return
    log.info("runtime handlers %s installed for containerd (config version %d)%s",
             ", ".join(done.handlers), done.config_version, "" if done.changed else "; unchanged")
    if done.changed and mode == "restart":
        try:
            await restart_containerd()
            log.info("containerd restarted to load them")
        except (OSError, RuntimeError) as e:
            log.error("%s; restart containerd on this node to enable the smr RuntimeClass", e)
    elif done.changed:
        log.warning("restart containerd on this node to load the smr runtime handlers")
