"""The node agent installs smr-runtime and containerd's runtime handlers on a
node: into a host file system laid out in a temporary directory, then read
back by the REAL containerd 1.6 (its `config dump`, with the host's
/etc/containerd bind-mounted in a private mount namespace)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from services.agent.install import (
    BEGIN,
    ConfigError,
    config_version,
    install,
    runtimes,
    with_handlers,
)
from services.agent.nodelabel import installed_handlers
from smr.config import REPO_TOOLS
from tests.helpers.containerd_host import put_containerd

MAIN = 'version = 2\nroot = "/var/lib/containerd"\n\n[grpc]\n  address = "/run/c.sock"\n'


@pytest.fixture
def node(tmp_path: Path) -> Path:
    host = tmp_path / "host"
    (host / "usr/bin").mkdir(parents=True)
    (host / "usr/bin/runc").write_text("#!/bin/sh\n")
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text(MAIN)
    return host


def binaries() -> tuple[Path, Path]:
    runtime, init = REPO_TOOLS / "smr-runtime", REPO_TOOLS / "smr-init"
    if not (runtime.is_file() and init.is_file()):
        if os.environ.get("CI"):
            pytest.fail("smr-runtime and smr-init are built by `make setup`")
        pytest.skip("make setup builds smr-runtime and smr-init")
    return runtime, init


def test_install_is_idempotent_and_containerd_reads_the_handlers(node: Path) -> None:
    runtime, init = binaries()
    first = install(node, runtime, init, agent_wait=600)
    assert first.changed and first.handlers == ["smr"] and first.config_version == 2
    assert (node / "var/lib/smr/bin/smr-runtime").read_bytes() == runtime.read_bytes()
    env = (node / "var/lib/smr/bin/smr-runtime.env").read_text()
    assert "RUNTIME=/usr/bin/runc" in env and "INIT=/var/lib/smr/bin/smr-init" in env
    # smr-init waits for an agent up to 600 s after the agent's last touch of its mark.
    assert "AGENT_MARK=/var/lib/smr/bin/agent-alive\nAGENT_WAIT=600\n" in env
    main = (node / "etc/containerd/config.toml").read_text()
    assert main.startswith(MAIN) and main.count(BEGIN) == 1
    again = install(node, runtime, init, agent_wait=600)
    assert not again.changed, "a second install changes nothing"
    assert (node / "etc/containerd/config.toml").read_text() == main

    if shutil.which("containerd") is None or os.geteuid() != 0:
        pytest.skip("containerd and root are needed to read the config back")
    dump = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount --bind {node}/etc/containerd /etc/containerd && "
         "containerd --config /etc/containerd/config.toml config dump"],
        capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    assert '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.smr]' in dump.stdout
    assert 'BinaryName = "/var/lib/smr/bin/smr-runtime"' in dump.stdout
    assert '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]' in dump.stdout, \
        "the node's own runtimes stay"


def test_gpu_node_gets_the_nvidia_handler(node: Path) -> None:
    runtime, init = binaries()
    (node / "usr/bin/nvidia-container-runtime").write_text("#!/bin/sh\n")
    done = install(node, runtime, init)
    assert done.handlers == ["smr", "smr-nvidia"]
    env = (node / "var/lib/smr/bin/nvidia/smr-runtime.env").read_text()
    assert "RUNTIME=/usr/bin/nvidia-container-runtime" in env
    assert "runtimes.smr-nvidia" in (node / "etc/containerd/config.toml").read_text()


def test_a_node_without_runc_is_reported(node: Path) -> None:
    runtime, init = binaries()
    (node / "usr/bin/runc").unlink()
    with pytest.raises(FileNotFoundError, match="no runc"):
        install(node, runtime, init)


def test_config_forms() -> None:
    assert config_version(None) == 2 and config_version("") == 1
    assert config_version("version = 3\n") == 3
    v3 = with_handlers("version = 3\n", 3, {"smr": Path("/x/smr-runtime")})
    assert '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.smr]' in v3
    assert '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]' in v3
    v1 = with_handlers("", 1, {"smr": Path("/x/smr-runtime")})
    assert "[plugins.cri.containerd.runtimes.smr]" in v1
    # A node that defines its runc keeps it as it is; the block is replaced,
    # never repeated.
    own = 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
    once = with_handlers(own, 2, {"smr": Path("/a")})
    assert once.count("runtimes.runc]") == 1
    twice = with_handlers(once, 2, {"smr": Path("/b")})
    assert twice.count(BEGIN) == 1 and 'BinaryName = "/b"' in twice
    assert 'BinaryName = "/a"' not in twice


DATA = Path(__file__).parent / "data" / "containerd"
# Each default config, and the containerd binary of its release: the
# system's (Debian 12), or trixie's and forky's, which `make setup` unpacks
# into .tools (scripts/install-tools.sh).
DEFAULTS = {"1.6": ("containerd", " 1.6."),
            "1.7": (str(REPO_TOOLS.parent / "containerd/1.7/containerd"), " 1.7."),
            "2.1": (str(REPO_TOOLS.parent / "containerd/2/containerd"), " 2.")}


@pytest.mark.parametrize("release", list(DEFAULTS))
def test_handlers_in_each_containerds_default_config(release: str, tmp_path: Path) -> None:
    """containerd 1.6, 1.7 and 2.x as they come (2.x quotes the plugin keys
    with single quotes): the handler is read where containerd reads it, runc
    is declared once, and the real containerd of that release loads it."""
    text = (DATA / f"default-{release}.toml").read_text()
    version = config_version(text)
    assert version == (3 if release.startswith("2.") else 2)
    out = with_handlers(text, version, {"smr": Path("/var/lib/smr/bin/smr-runtime")})
    parsed = runtimes(tomllib.loads(out), version)
    assert parsed["smr"]["options"]["BinaryName"] == "/var/lib/smr/bin/smr-runtime"
    assert parsed["runc"] == runtimes(tomllib.loads(text), version)["runc"], \
        "the node's runc stays as it was"
    name, want = DEFAULTS[release]
    binary = shutil.which(name)
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"containerd {release} is unpacked by `make setup`")
        pytest.skip(f"no containerd {release} binary here to load the result (the TOML "
                    "checks above passed)")
    ver = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    assert want in ver, ver
    (tmp_path / "config.toml").write_text(out)
    dump = subprocess.run([binary, "--config", str(tmp_path / "config.toml"), "config", "dump"],
                          capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    assert "/var/lib/smr/bin/smr-runtime" in dump.stdout


def test_a_config_that_would_not_load_is_left_alone(node: Path) -> None:
    """No config containerd would reject is written (so none is restarted
    into): one that cannot take the block, and one containerd refuses."""
    runtime, init = binaries()
    config = node / "etc/containerd/config.toml"
    inline = MAIN + ('[plugins."io.containerd.grpc.v1.cri".containerd]\n'
                     '  runtimes = { runc = { runtime_type = "io.containerd.runc.v2" } }\n')
    config.write_text(inline)
    with pytest.raises(ConfigError):
        install(node, runtime, init)
    assert config.read_text() == inline
    config.write_text(MAIN)
    with pytest.raises(ConfigError, match=r"would not load.*unknown key"):
        install(node, runtime, init, check=lambda host, path: "unknown key")
    assert config.read_text() == MAIN
    assert not list(config.parent.glob("*.smr-check")), "the trial config stays behind"


# A node whose CRI section comes from a drop-in, as the NVIDIA toolkit's
# `nvidia-ctk runtime configure --drop-in` and conf.d layouts make it: the
# main file imports it, and containerd replaces the main file's CRI section
# with the drop-in's whole.
IMPORTS_MAIN = ('version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
                '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
                '  runtime_type = "io.containerd.runc.v2"\n'
                '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
                '    SystemdCgroup = true\n')
NVIDIA_DROP_IN = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
                  '  default_runtime_name = "nvidia"\n'
                  '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
                  '    runtime_type = "io.containerd.runc.v2"\n'
                  '    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
                  '      BinaryName = "/usr/bin/nvidia-container-runtime"\n')


def with_drop_in(host: Path) -> None:
    (host / "etc/containerd/config.toml").write_text(IMPORTS_MAIN)
    (host / "etc/containerd/conf.d").mkdir(parents=True, exist_ok=True)
    (host / "etc/containerd/conf.d/99-nvidia.toml").write_text(NVIDIA_DROP_IN)


def test_a_config_whose_runtimes_come_from_an_imports_drop_in_is_left_alone(
        node: Path) -> None:
    """containerd loads the main file with smr's block (exit 0), but its
    effective runtimes are only the drop-in's: the block is not written, and
    the node's containerd would not be restarted for nothing."""
    runtime, init = binaries()
    if not put_containerd(node):
        pytest.skip("containerd and root are needed to read the config back")
    with_drop_in(node)
    with pytest.raises(ConfigError, match=r"effective runtimes \(nvidia\b.*lack smr.*imports"):
        install(node, runtime, init)
    assert (node / "etc/containerd/config.toml").read_text() == IMPORTS_MAIN
    assert not list((node / "etc/containerd").glob("*.smr-check"))


def test_the_handlers_are_read_back_from_containerds_effective_config(node: Path) -> None:
    """What labels a node: the handlers containerd's `config dump` has, not
    the text of smr's block."""
    runtime, init = binaries()
    if not put_containerd(node):
        pytest.skip("containerd and root are needed to read the config back")
    install(node, runtime, init)  # a plain config: containerd has the handler
    assert installed_handlers(node) == (["smr"], "")
    # The toolkit's drop-in added later, smr's block kept in the main file.
    with_drop_in(node)
    (node / "etc/containerd/config.toml").write_text(with_handlers(
        IMPORTS_MAIN, 2, {"smr": Path("/var/lib/smr/bin/smr-runtime")}))
    handlers, why = installed_handlers(node)
    assert handlers == [], "labelled for a handler containerd does not have"
    assert "lack smr" in why and "imports" in why, why
