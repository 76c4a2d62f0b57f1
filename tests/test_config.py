"""Settings: environment, file, defaults, and errors that name the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from smr import config, config_values
from smr.contract.errors import ConfigError


def test_defaults() -> None:
    s = config.load({})
    assert s.nats_url == "" and s.max_deliver == 5 and s.storage == "local"
    assert s.storage_root == s.data_path / "checkpoints"
    assert s.work_path == s.data_path / "work"
    # A GPU node points the dumps at RAM (docs/gpu.md, node tuning).
    assert config.load({"SMR_WORK_DIR": "/dev/shm/smr"}).work_path == Path("/dev/shm/smr")


def test_environment_wins_over_file(tmp_path: Path) -> None:
    f = tmp_path / "smr.toml"
    f.write_text('max_deliver = 9\nnode_name = "from-file"\n')
    s = config.load({"SMR_CONFIG": str(f), "SMR_NODE_NAME": "from-env"})
    assert s.max_deliver == 9 and s.node == "from-env"


@pytest.mark.parametrize("env,named", [
    ({"SMR_MAX_DELIVER": "zero"}, "SMR_MAX_DELIVER"),
    ({"SMR_MAX_DELIVER": "0"}, "SMR_MAX_DELIVER"),
    ({"SMR_ACK_WAIT": "-1"}, "SMR_ACK_WAIT"),
    ({"SMR_STORAGE": "floppy"}, "SMR_STORAGE"),
])
def test_invalid_values_name_the_setting(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as e:
        config.load(env)
    assert named in str(e.value) and e.value.hint


def test_unknown_key_in_file(tmp_path: Path) -> None:
    f = tmp_path / "smr.toml"
    f.write_text("max_delivr = 3\n")
    with pytest.raises(ConfigError) as e:
        config.load({"SMR_CONFIG": str(f)})
    assert "max_delivr" in str(e.value)


def test_missing_binary_says_how_to_install() -> None:
    s = config.load({"SMR_CRIU": ""}).replace(criu="")
    original = config.REPO_TOOLS
    try:
        config.REPO_TOOLS = Path("/nonexistent")
        import shutil

        if shutil.which("criu"):
            pytest.skip("a criu is on PATH")
        with pytest.raises(ConfigError) as e:
            s.criu_binary()
    finally:
        config.REPO_TOOLS = original
    assert "make setup" in e.value.hint


def test_the_kubelets_eviction_thresholds_are_read_in_its_own_flag_form() -> None:
    from services.checkpointer.admission import reserve

    hard = "memory.available<100Mi,nodefs.available<1Gi,imagefs.available<15%,nodefs.inodesFree<5%"
    assert config_values.eviction_hard(hard) == {"nodefs.available": (0.0, 1 << 30),
                                          "imagefs.available": (0.15, 0)}
    # The largest applies: the work directory shares the images' file system.
    assert reserve(100 << 30, hard) == 15 << 30
    assert reserve(4 << 30, hard) == 1 << 30
    assert reserve(100 << 30, "") == 0
    with pytest.raises(ConfigError) as e:
        config.load({"SMR_KUBELET_EVICTION_HARD": "nodefs.available>10%"})
    assert "SMR_KUBELET_EVICTION_HARD" in str(e.value)
