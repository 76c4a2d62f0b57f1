"""A restored tree runs before the agent tells smr-init about it (its
``decision``): a workload that makes that impossible gets no tree running
behind smr-init's back. Real containerd, runc, CRIU and S3 (moto); the
harness is tests/agent/cluster.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from services.containers import host
from services.containers.host import Shim
from services.containers.pods import runtime_id
from smr.contract.messages import CkptDone, CkptRequested, Target
from tests import oci_image
from tests.agent.cluster import CMD, COUNTER, Cluster, workload

IMAGE = "smr.test/undecided:1"
# Once restored (the agent's note is there), the workload makes `decision`,
# where the agent tells smr-init it was restored, a directory.
UNDECIDED = b"""#!/bin/sh
(while true; do
   if test -f /smr/main/restored && ! test -d /smr/main/decision; then
     rm -f /smr/main/decision; mkdir /smr/main/decision
   fi
   sleep 0.01
 done) &
exec /bin/counter
"""


@pytest.fixture(scope="module")
def undecided_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("undecided")
    return oci_image.build(d / "undecided.tar", IMAGE,
                           files={"/bin/counter": COUNTER, "/bin/undecided": UNDECIDED})


@pytest.fixture
async def undecided(cluster: Cluster, undecided_image: Path) -> Cluster:
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, undecided_image)
    return cluster


async def test_a_restored_tree_whose_decision_cannot_be_written_is_ended(
        undecided: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = list(undecided.kubelets)
    real = Shim.decide

    def slow_decide(self: Shim, decision: str) -> None:
        if decision.startswith("restored"):
            time.sleep(1)  # the restored tree runs meanwhile, as while a GPU is resumed
        real(self, decision)

    monkeypatch.setattr(Shim, "decide", slow_decide)
    env = {"SMR_CHECKPOINT": "undecided"}

    def pod(name: str, node: str) -> dict[str, object]:
        p = workload(name, node, image=IMAGE, env=env, owner="undecided", restart="Never")
        p["spec"]["containers"][0]["command"] = [*CMD[:-1], "/bin/undecided"]  # type: ignore[index]
        return p

    undecided.kube.put("pods", pod("u-1", a))
    await undecided.until_steps("u-1", a, 10, timeout=60)
    done = await undecided.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="undecided", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="u-1", container="main")),
        timeout=120)
    assert isinstance(done, CkptDone) and done.status == "succeeded", done.error
    undecided.kube.put("pods", pod("u-2", b))
    event = await undecided.event("RestoreFailed", "u-2", timeout=90)
    # The restored tree must not run on beside smr-init, which never heard of
    # it. (No fresh start can follow here: `decision` is a directory, so
    # smr-init hears nothing and waits.)
    p = undecided.kube.get("pods", "u-2", "default")
    assert p is not None
    shim = host.find_shim(runtime_id(p["status"]["containerStatuses"][0]["containerID"]))
    assert shim is not None
    deadline = time.monotonic() + 5
    while running := [(q, cmdline(q)) for q in host.tree(shim.pid) if q != shim.pid]:
        assert time.monotonic() < deadline, (
            f"the restored tree runs on untracked after its restore failed: {running}")
        await asyncio.sleep(0.2)
    assert "the restored processes were ended" in event["message"], event["message"]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "(gone)"
