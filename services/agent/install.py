"""Installing smr-runtime on the agent's node, so that the `smr` RuntimeClass
(which the webhook gives opted-in pods) works there.

Idempotent; run by the agent at start when SMR_RUNTIME_INSTALL is not `off`:

1. the agent's own smr-runtime and smr-init are copied to
   ``<host>/var/lib/smr/bin`` with ``smr-runtime.env`` beside them (the real
   runtime: the host's runc; for `smr-nvidia`, the NVIDIA runtime, where the
   node has one; the agent's mark of life and how long to wait for an agent
   after it);
2. containerd gets the runtime handlers ``smr`` (and ``smr-nvidia``) in its
   ``<host>/etc/containerd/config.toml``, in a marked block at its end, in the
   form of the file's config version: 1 and 2 (containerd 1.x), 3
   (containerd 2.x). Not a drop-in: containerd 1.6 merges an imported file's
   CRI section over the main one whole, which drops the node's own runtimes
   (measured with `containerd config dump`). Where the file does not define
   the default ``runc`` runtime, the block defines it as containerd's default
   does, since a file that names any runtime replaces containerd's defaults;
3. the new config is checked before it replaces the old: parsed as TOML
   (tomllib; the runtimes table found by its keys, whichever quoting the file
   uses: containerd 2.x writes ``plugins.'io.containerd.cri.v1.runtime'``),
   and, where the node has a containerd binary, loaded by it
   (``containerd --config <new> config dump``), whose effective runtimes must
   hold smr's handlers: a file in ``imports`` (the NVIDIA toolkit's drop-in, a
   conf.d layout) replaces the main file's CRI section whole, so a config
   that loads can still leave smr's handlers out. A config that fails either
   way is not written and containerd is not restarted;
4. with SMR_RUNTIME_INSTALL=restart (the DaemonSet's default) containerd is
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
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("smr.agent")

BIN = "var/lib/smr/bin"
MARK = f"{BIN}/agent-alive"  # SMR_AGENT_MARK's default (smr/config.py)
STATE = "/run/smr/containers"
CONFIG = "etc/containerd/config.toml"
CONTAINERD = ("usr/bin/containerd", "usr/local/bin/containerd")
RUNC = ("usr/bin/runc", "usr/sbin/runc", "usr/local/bin/runc", "usr/local/sbin/runc")
NVIDIA = ("usr/bin/nvidia-container-runtime", "usr/local/bin/nvidia-container-runtime")
# The CRI plugin's runtimes table, by config version.
RUNTIMES = {1: "plugins.cri.containerd.runtimes",
            2: 'plugins."io.containerd.grpc.v1.cri".containerd.runtimes',
            3: 'plugins."io.containerd.cri.v1.runtime".containerd.runtimes'}
# The same tables as keys (how the parsed config holds them).
RUNTIME_KEYS = {1: ("plugins", "cri", "containerd", "runtimes"),
                2: ("plugins", "io.containerd.grpc.v1.cri", "containerd", "runtimes"),
                3: ("plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes")}
BEGIN = "# >>> smr runtime handlers (services/agent/install.py; delete this block to undo)"
END = "# <<< smr runtime handlers"
_BLOCK = re.compile(rf"\n*{re.escape(BEGIN)}.*?{re.escape(END)}\n?", re.S)


@dataclass
class Installed:
    changed: bool
    handlers: list[str]
    config_version: int


class ConfigError(ValueError):
    """containerd's config cannot take the handlers; it is left as it is."""


def _parse(text: str, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} is not valid TOML ({e})") from None


def config_version(text: str | None) -> int:
    """The config's ``version``: 2 for a node without a file (we write one),
    1 for a file without the key (containerd 1.x reads it so)."""
    if text is None:
        return 2
    version = _parse(_BLOCK.sub("\n", text), "containerd's config").get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise ConfigError(f"containerd's config has version = {version!r}")
    return min(version, 3)


def runtimes(data: dict[str, Any], version: int) -> dict[str, Any]:
    """The CRI runtimes table of a parsed config ({} where it has none)."""
    node: Any = data
    for key in RUNTIME_KEYS[version]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def with_handlers(text: str, version: int, handlers: dict[str, Path]) -> str:
    """``text`` with our block (replaced if there) declaring ``handlers``;
    ConfigError if the result would not be the config intended."""
    text = _BLOCK.sub("\n", text).rstrip("\n")
    have = runtimes(_parse(text, "containerd's config"), version)
    if clash := [n for n in handlers if n in have]:
        raise ConfigError(f"containerd's config already defines the runtime {clash[0]} "
                          "outside smr's block; remove it (or smr's handler would replace it)")
    table = RUNTIMES[version]
    block = [BEGIN]
    if "runc" not in have:
        block += [f"[{table}.runc]", '  runtime_type = "io.containerd.runc.v2"']
    for name, binary in handlers.items():
        block += [f"[{table}.{name}]", '  runtime_type = "io.containerd.runc.v2"',
                  f"[{table}.{name}.options]", f'  BinaryName = "{binary}"']
    block.append(END)
    out = (text + "\n\n" if text else "") + "\n".join(block) + "\n"
    got = runtimes(_parse(out, "containerd's config with smr's handlers"), version)
    for name, binary in handlers.items():
        if (got.get(name) or {}).get("options", {}).get("BinaryName") != str(binary):
            raise ConfigError(f"the runtime {name} would not be read from the config as written")
    if "runc" not in got:
        raise ConfigError("the config would lose containerd's runc runtime")
    return out


Check = Callable[[Path, str], str | None]


def block_handlers(text: str) -> dict[str, str]:
    """Each runtime handler smr's block in ``text`` declares → its BinaryName."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        return {}
    return dict(re.findall(r'\.([\w-]+)\.options\]\s*BinaryName = "([^"]+)"',
                           text[begin:end]))


class NoContainerd(LookupError):
    """The node has no containerd binary where smr looks for one."""


def effective_runtimes(host: Path, config: str) -> dict[str, Any]:
    """The CRI runtimes the node's containerd has with ``config`` (a path on
    the host), from its ``config dump``: the main file with its ``imports``
    merged as containerd merges them. NoContainerd where the node has no
    binary to ask; ConfigError where it refuses the config."""
    binary = next((c for c in CONTAINERD if (host / c).is_file()), None)
    if binary is None:
        raise NoContainerd(f"no containerd binary on this node (looked for "
                           f"{', '.join('/' + c for c in CONTAINERD)})")
    try:
        r = subprocess.run(["chroot", str(host), "/" + binary, "--config", config,
                            "config", "dump"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"could not run the node's containerd to read its config: {e}"
                          ) from None
    if r.returncode:
        raise ConfigError(r.stderr.strip()[-500:] or f"exit {r.returncode}")
    dump = _parse(r.stdout, "containerd's config dump")
    # containerd 1.x dumps version 2, 2.x version 3, whatever the file's.
    return runtimes(dump, 3) or runtimes(dump, 2)


def missing_handlers(have: dict[str, Any], wanted: dict[str, str]) -> str | None:
    """Why the runtimes ``have`` (containerd's effective ones) lack a handler
    of ``wanted`` (name → BinaryName), or None."""
    lost = [n for n, binary in wanted.items()
            if ((have.get(n) or {}).get("options") or {}).get("BinaryName") != binary]
    if not lost:
        return None
    return (f"containerd's effective runtimes ({', '.join(sorted(have)) or 'none'}, from "
            f"`containerd config dump`) lack {', '.join(lost)}, which smr's block in "
            f"/{CONFIG} declares: its CRI section comes from a file in `imports` (the "
            "NVIDIA toolkit's drop-in, a conf.d layout), which replaces the main file's "
            "whole; put smr's handlers in that file")


def containerd_rejects(host: Path, config: str) -> str | None:
    """Why the node's containerd would not load ``config`` (a path on the
    host) or would load it without smr's handlers, or None; None too where
    the node has no containerd binary to ask."""
    try:
        have = effective_runtimes(host, config)
    except NoContainerd:
        return None
    except ConfigError as e:
        return str(e)
    try:
        text = (host / config.lstrip("/")).read_text()
    except OSError as e:
        return f"could not read back {config}: {e.strerror}"
    return missing_handlers(have, block_handlers(text))


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


def install(host: Path, runtime_binary: Path, init_binary: Path,
            check: Check = containerd_rejects, agent_wait: int = 0) -> Installed:
    """Install into the host's file system, seen at ``host`` (/proc/1/root
    from the agent's pod, which shares the host's PID namespace). ``check``:
    why containerd would reject a config file (host, path on the host);
    ``agent_wait``: SMR_AGENT_WAIT, for smr-runtime (it reads the age of
    MARK, which the agent touches while it runs: services/agent/alive.py)."""
    def find(candidates: tuple[str, ...]) -> str | None:
        return next(("/" + c for c in candidates if (host / c).is_file()), None)

    runc = find(RUNC)
    if runc is None:
        raise FileNotFoundError(f"no runc on this node (looked for {', '.join(RUNC)})")
    bin_dir = host / BIN
    changed = _copy(runtime_binary, bin_dir / "smr-runtime")
    changed |= _copy(init_binary, bin_dir / "smr-init")
    handlers = {"smr": Path("/" + BIN) / "smr-runtime"}
    waits = f"AGENT_MARK=/{MARK}\nAGENT_WAIT={agent_wait}\n"
    changed |= _write(bin_dir / "smr-runtime.env",
                      f"RUNTIME={runc}\nINIT=/{BIN}/smr-init\nSTATE={STATE}\n{waits}")
    if nvidia := find(NVIDIA):
        # A second copy, so it reads its own settings (the NVIDIA runtime).
        nv_dir = host / BIN / "nvidia"
        changed |= _copy(runtime_binary, nv_dir / "smr-runtime")
        changed |= _copy(init_binary, nv_dir / "smr-init")
        changed |= _write(nv_dir / "smr-runtime.env",
                          f"RUNTIME={nvidia}\nINIT=/{BIN}/nvidia/smr-init\nSTATE={STATE}\n"
                          f"{waits}")
        handlers["smr-nvidia"] = Path("/" + BIN) / "nvidia" / "smr-runtime"
    main = host / CONFIG
    text = main.read_text() if main.is_file() else None
    version = config_version(text)
    new = with_handlers(text if text is not None else "version = 2", version, handlers)
    if new != text:
        trial = main.with_name(main.name + ".smr-check")
        _write(trial, new)
        try:
            if why := check(host, "/" + CONFIG + ".smr-check"):
                raise ConfigError(f"containerd would not load its config with smr's handlers "
                                  f"({why}); {main} is left as it was")
        finally:
            trial.unlink(missing_ok=True)
    changed |= _write(main, new)
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
                          init_binary: Path, agent_wait: int = 0) -> None:
    """The agent's start-up step; a failure is logged, never fatal: the
    hand-written manifest path works without it."""
    if mode == "off":
        return
    try:
        done = install(host, runtime_binary, init_binary, agent_wait=agent_wait)
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
