"""A hostile pod against smr-runtime's SMR_INIT_AGENT_WAIT (how long smr-init
waits for a coming agent: services/agent/alive.py). The node decides it from
the age of the agent's mark of life; whatever the pod's manifest or image
puts in the environment under that name (duplicates, empty, huge, negative,
infinite, not a number), or under the names of the node's own settings
(SMR_AGENT_WAIT, AGENT_WAIT, AGENT_MARK), never reaches smr-init, so a pod can neither stretch
the node's wait nor be cut short by it, and smr-init still starts the
workload (writing ``unanswered``) once the node's wait is over.

Real parts: smr-runtime and smr-init built from the repository, runc running
a busybox container in the foreground (no agent: nobody answers smr-init).
The workload prints its own environment and smr-init's ``unanswered``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.agent.runc_bundle import busybox_bundle
from tests.agent.test_runtime_state import _node_bin

NAME = "SMR_INIT_AGENT_WAIT"
NODE_WAIT_S = 3  # AGENT_WAIT in smr-runtime.env here (600 s by default)
INIT_TIMEOUT_S = 1  # the pod's own SMR_INIT_TIMEOUT
# Bounds the run only: a smr-init that waits for ever is seen as a timeout.
RUN_LIMIT_S = 90

# What a pod may put in its environment (manifest or image ENV) to make
# smr-init wait for ever, or not at all.
HOSTILE = {
    "huge": [f"{NAME}=99999999999"],
    "infinite": [f"{NAME}=inf"],
    "not-a-number": [f"{NAME}=nan"],
    "negative": [f"{NAME}=-1"],
    "empty": [f"{NAME}="],
    "overflowing": [f"{NAME}=1e999"],
    "duplicates": [f"{NAME}=99999999999", f"{NAME}=0", f"{NAME}=99999999999"],
    # The node's own settings' names: smr-runtime reads them from its file only.
    "node-settings": ["SMR_AGENT_WAIT=99999999999", "AGENT_WAIT=99999999999",
                      "AGENT_MARK=/proc/self/exe"],
}


def run_container(smr_runtime: Path, top: Path, own: list[str], mark_age: float | None
                  ) -> tuple[str, list[str]]:
    """Run a busybox container through smr-runtime, with ``own`` entries
    added to its environment and the agent's mark ``mark_age`` seconds old
    (None: no mark). Its output, and the environment smr-runtime handed on."""
    mark = top / "agent-alive"
    if mark_age is not None:
        mark.touch()
        then = time.time() - mark_age
        os.utime(mark, (then, then))
    runtime = _node_bin(smr_runtime, top / "node-bin", STATE=str(top / "state"),
                        AGENT_MARK=str(mark), AGENT_WAIT=str(NODE_WAIT_S))
    script = (f"busybox env | busybox grep '^{NAME}=' | busybox sed 's/^/env: /'; "
              "echo unanswered: $(cat /smr/main/unanswered)")
    bundle = busybox_bundle(top, ["/bin/sh", "-c", script],
                            {"SMR_CONTAINER": "main", "SMR_INIT_TIMEOUT": str(INIT_TIMEOUT_S)})
    spec = json.loads((bundle / "config.json").read_text())
    env = spec["process"]["env"]
    # Before and after the webhook's entries, as a manifest and an image give them.
    spec["process"]["env"] = own[:1] + env + own[1:]
    (bundle / "config.json").write_text(json.dumps(spec))
    cid = f"envatk-{uuid.uuid4().hex[:8]}"
    try:
        out = subprocess.run([str(runtime), "--root", str(top / "runc-root"), "run",
                              "--bundle", str(bundle), cid], capture_output=True, text=True,
                             timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired as e:
        subprocess.run(["runc", "--root", str(top / "runc-root"), "delete", "--force", cid],
                       check=False, capture_output=True)
        raise AssertionError(f"smr-init never started the workload: it waits for ever "
                             f"(environment {own})") from e
    handed = json.loads((bundle / "config.json").read_text())["process"]["env"]
    assert out.returncode == 0, (out.stdout, out.stderr)
    return out.stdout, handed


@pytest.fixture
def top(tmp_path: Path) -> Path:
    if not shutil.which("runc"):
        pytest.skip("runc is installed by `make setup`")
    return tmp_path


@pytest.mark.parametrize("own", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_pods_own_agent_wait_never_reaches_smr_init(smr_runtime: Path, top: Path,
                                                      own: list[str]) -> None:
    """An agent ran a moment ago: smr-init gets the node's wait, once, and no
    entry of the pod's; with no agent coming it starts the workload after
    that wait and says so in ``unanswered``."""
    out, handed = run_container(smr_runtime, top, own, mark_age=0)
    mine = [e for e in handed if e.startswith(f"{NAME}=")]
    assert len(mine) == 1, f"smr-runtime handed on {mine}"
    assert 0 < int(mine[0].split("=", 1)[1]) <= NODE_WAIT_S, mine
    seen = [line for line in out.splitlines() if line.startswith("env: ")]
    assert seen == [f"env: {mine[0]}"], f"the workload's environment holds {seen}: {out!r}"
    assert "unanswered: no answer from the smr node agent within" in out, out


@pytest.mark.parametrize("own", HOSTILE.values(), ids=HOSTILE.keys())
def test_with_no_agent_coming_a_pods_agent_wait_is_dropped(smr_runtime: Path, top: Path,
                                                          own: list[str]) -> None:
    """No agent ran here lately: no SMR_INIT_AGENT_WAIT at all, whatever the
    pod set, and smr-init's own timeout starts the workload."""
    out, handed = run_container(smr_runtime, top, own, mark_age=None)
    assert [e for e in handed if e.startswith(f"{NAME}=")] == []
    assert "env: " not in out, out
    assert "unanswered: no answer from the smr node agent within" in out, out
