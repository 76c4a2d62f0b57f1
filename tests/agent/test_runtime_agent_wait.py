"""smr-runtime tells smr-init how long to wait for a coming agent
(SMR_INIT_AGENT_WAIT, services/agent/alive.py): from the age of the agent's
mark of life at the container's creation, never from the pod's manifest.
The real smr-runtime, with /bin/true as the real runtime: only the
config.json it hands on is looked at."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.agent.test_runtime_state import _node_bin


def created_env(smr_runtime: Path, tmp_path: Path, mark_age: float | None,
                own: dict[str, str] | None = None) -> dict[str, str]:
    """The environment smr-runtime gives a container created when the
    agent's mark was ``mark_age`` seconds old (None: no mark), AGENT_WAIT 600."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    mark = tmp_path / "agent-alive"
    if mark_age is not None:
        mark.touch()
        then = time.time() - mark_age
        os.utime(mark, (then, then))
    state = tmp_path / "state"
    runtime = _node_bin(smr_runtime, tmp_path / "node-bin", RUNTIME="/bin/true",
                        STATE=str(state), AGENT_MARK=str(mark), AGENT_WAIT="600")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    env = [f"{k}={v}" for k, v in {"PATH": "/bin", "SMR_CONTAINER": "main",
                                   **(own or {})}.items()]
    (bundle / "config.json").write_text(json.dumps(
        {"ociVersion": "1.0.2", "process": {"args": ["/bin/counter"], "env": env,
                                            "user": {"uid": 0, "gid": 0}},
         "root": {"path": "rootfs"}, "mounts": []}))
    cid = f"wait-{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run([str(runtime), "create", "--bundle", str(bundle), cid], check=True,
                       timeout=30)
        spec = json.loads((bundle / "config.json").read_text())
        assert spec["process"]["args"][0] == "/smr/smr-init", "the container was not wrapped"
        return dict(e.split("=", 1) for e in spec["process"]["env"])
    finally:
        subprocess.run([str(runtime), "delete", cid], check=False, timeout=30)


def test_an_agent_alive_a_moment_ago_is_waited_for_the_rest_of_agent_wait(
        smr_runtime: Path, tmp_path: Path) -> None:
    env = created_env(smr_runtime, tmp_path, mark_age=100)
    # 600 s less the mark's age (and the moments the create took).
    assert 400 < int(env["SMR_INIT_AGENT_WAIT"]) <= 500, env


@pytest.mark.parametrize("mark_age", [700, None], ids=["long-gone", "never-ran"])
def test_no_agent_is_waited_for_when_none_ran_within_agent_wait(
        smr_runtime: Path, tmp_path: Path, mark_age: float | None) -> None:
    env = created_env(smr_runtime, tmp_path, mark_age)
    assert "SMR_INIT_AGENT_WAIT" not in env, env


def test_the_pods_own_agent_wait_is_replaced_by_the_nodes(
        smr_runtime: Path, tmp_path: Path) -> None:
    """A manifest cannot make its container wait for ever (or not at all)
    for an agent: the node's setting decides."""
    env = created_env(smr_runtime, tmp_path, mark_age=None,
                      own={"SMR_INIT_AGENT_WAIT": "999999"})
    assert "SMR_INIT_AGENT_WAIT" not in env, env
    env = created_env(smr_runtime, tmp_path / "again", mark_age=0,
                      own={"SMR_INIT_AGENT_WAIT": "999999"})
    assert 500 < int(env["SMR_INIT_AGENT_WAIT"]) <= 600, env
