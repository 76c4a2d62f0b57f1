"""Pod containers checkpointed on one simulated node and resumed on the other,
through the node agent (tests/agent/cluster.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from services.agent import starts
from services.storage.service import StorageService
from smr.contract.messages import CkptRequested, Target
from tests import oci_image
from tests.agent.cluster import (
    COUNTER,
    IMAGE,
    OTHER_IMAGE,
    Cluster,
    assert_continues,
    steps,
    workload,
)
from tests.fake_apiserver import pod

MIRRORED = "mirror.smr.test/counter:1"  # IMAGE's bytes under another repository


async def test_cordoned_pod_resumes_on_another_node(cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("counter", a, labels={"smr.dev/node-restore": "true"}))
    await cluster.until_steps("counter", a, 5)

    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})  # kubectl cordon
    manifest = await cluster.latest("counter.main")
    assert manifest["reason"] == "cordon" and manifest["node"] == a
    assert manifest["container"]["image_id"].endswith(
        await cluster.kubelets[a].ctd.digest(a, IMAGE))
    before = steps(cluster.log("counter", a))
    assert before[-1][0] > 5, "a cordon checkpoint leaves the pod running"

    await cluster.drained_to("counter", a, b, before)
    await cluster.event("Restored", "counter")  # the restore is an Event on the pod


async def test_job_pod_resumes_in_its_retry_on_another_node(cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "train-7"}
    cluster.kube.put("pods", workload("train-x1", a, env=env, owner="train", restart="Never"))
    await cluster.until_steps("train-x1", a, 5)
    # A checkpoint through the API (a published message): the final state.
    await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="train-7", node=a,
        target=Target(kind="pod", namespace="default", pod="train-x1", container="main")),
        timeout=60)
    before = steps(cluster.log("train-x1", a))
    manifest = await cluster.latest("train-7")
    assert manifest["leave_running"] is False
    # The Job's next pod runs on node b, with the same checkpoint id.
    cluster.kube.put("pods", workload("train-x2", b, env=env, owner="train", restart="Never"))
    after = await cluster.until_steps("train-x2", b, 5)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "a final checkpoint loses no step"


async def test_restore_into_the_same_image_under_another_name_resumes(
        cluster: Cluster, tmp_path: Path) -> None:
    """The same image pulled through a mirror: another repository in its
    imageID, the same digest. The restore goes on; another digest is refused
    (the test after this one)."""
    a, b = list(cluster.kubelets)
    mirrored = oci_image.build(tmp_path / "mirror.tar", MIRRORED,
                               files={"/bin/counter": COUNTER})
    await cluster.kubelets[b].ctd.import_image(b, mirrored)
    assert await cluster.kubelets[b].ctd.digest(b, MIRRORED) == \
        await cluster.kubelets[a].pull(IMAGE), "not one image: the test proves nothing"
    env = {"SMR_CHECKPOINT": "mirror-1"}
    cluster.kube.put("pods", workload("first", a, env=env, owner="j", restart="Never"))
    await cluster.until_steps("first", a, 3)
    await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="mirror-1", node=a,
        target=Target(kind="pod", namespace="default", pod="first", container="main")),
        timeout=60)
    before = steps(cluster.log("first", a))
    cluster.kube.put("pods", workload("second", b, env=env, owner="j", image=MIRRORED,
                                      restart="Never"))
    after = await cluster.until_steps("second", b, 3)
    assert after[0][0] != 1, (
        f"the checkpoint of {IMAGE} was not restored into the same image named {MIRRORED}: "
        f"{[e['message'] for e in cluster.events('RestoreFailed')]}")
    assert_continues(before, after, before[-1][0])


async def test_restore_into_another_image_is_refused(cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "img-1"}
    cluster.kube.put("pods", workload("first", a, env=env, owner="j"))
    await cluster.until_steps("first", a, 3)
    await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="img-1", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="first", container="main")),
        timeout=60)
    # Another image: refused with an Event; this pod's policy allows a fresh start.
    cluster.kube.put("pods", workload("second", b, env=env, owner="j", image=OTHER_IMAGE))
    after = await cluster.until_steps("second", b, 3)
    assert after[0][0] == 1, "a refused restore starts the container fresh"
    # The watcher posts the Event from the result, on its own time: waited for.
    event = await cluster.event("RestoreFailed", "second", timeout=60)
    assert "image-mismatch" in event["message"] or "image" in event["message"]
    assert OTHER_IMAGE in event["message"] and IMAGE in event["message"]
    # With restore-failure: fail the container does not start over.
    cluster.kube.put("pods", workload("third", b, env=env, owner="j", image=OTHER_IMAGE,
                                      labels={"smr.dev/restore-failure": "fail"},
                                      restart="Never"))
    deadline = time.monotonic() + 30
    while (p := cluster.kube.get("pods", "third", "default")) and \
            p["status"].get("phase") != "Failed":
        assert time.monotonic() < deadline, "the container did not fail"
        await asyncio.sleep(0.2)
    assert p is not None
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 70
    log = cluster.log("third", b)
    assert "forbids a fresh start" in log and steps(log) == []



async def test_storage_down_never_starts_a_fail_policy_pod_fresh(cluster: Cluster) -> None:
    """restore-failure: fail. While no storage service answers, the agent cannot
    know whether a checkpoint exists: smr-init keeps waiting (past its own
    start timeout, 1 s here) instead of starting over; once storage is back
    the container gets its answer (no checkpoint: it starts)."""
    a, _ = list(cluster.kubelets)
    cluster.storage.stop()
    await asyncio.sleep(0.5)  # its subscription is gone
    labels = {"smr.dev/node-restore": "true", "smr.dev/restore-failure": "fail"}
    cluster.kube.put("pods", workload("strict", a, labels=labels,
                                      env={"SMR_INIT_TIMEOUT": "1"}))
    decision = None
    deadline = time.monotonic() + 30
    while decision is None or not decision.startswith("restoring"):
        st = cluster.kubelets[a].state("default", "strict")
        path = st.volume / "main" / "decision" if st else None
        decision = path.read_text() if path and path.is_file() else None
        assert steps(cluster.log("strict", a)) == [], "it started fresh without an answer"
        assert time.monotonic() < deadline, f"no 'restoring' from the agent: {decision!r}"
        await asyncio.sleep(0.2)
    await asyncio.sleep(3)  # three times smr-init's start timeout
    assert steps(cluster.log("strict", a)) == [], "it started fresh while storage was down"
    back = StorageService(cluster.bus, cluster.store, durable=f"retention-{uuid.uuid4().hex}")
    task = asyncio.create_task(back.run())
    try:
        await cluster.until_steps("strict", a, 3)
    finally:
        back.stop()
        await asyncio.wait_for(task, 30)


async def test_a_fail_policy_container_no_pod_claims_fails_instead_of_starting_fresh(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """restore-failure: fail, and the agent never finds the container's pod
    (the kubelet never reports the container, or no agent runs): smr-init's
    own start timeout (2 s here) must not start it fresh. The pod goes
    through the webhook, which tells smr-init the policy."""
    a, _ = list(cluster.kubelets)
    monkeypatch.setattr(starts, "_claim", lambda pods, container_id: None)
    body = pod("orphan", a, labels={"smr.dev/node-restore": "true",
                                    "smr.dev/restore-failure": "fail"},
               env={"SMR_INIT_TIMEOUT": "2"})
    body["spec"]["containers"][0].update(image=IMAGE, command=["/bin/counter"])
    body["spec"]["restartPolicy"] = "Never"
    body.pop("status")
    await cluster.core.create_namespaced_pod("default", body)
    stored = cluster.kube.get("pods", "orphan", "default")
    assert stored is not None and stored["spec"].get("runtimeClassName") == "smr", \
        cluster.kube.admission_log
    cluster.kube.put("pods", {**stored, "status": {"phase": "Pending"}})
    deadline = time.monotonic() + 30
    while (p := cluster.kube.get("pods", "orphan", "default")) and \
            p["status"].get("phase") not in ("Failed", "Succeeded"):
        assert steps(cluster.log("orphan", a)) == [], "it started fresh"
        assert time.monotonic() < deadline, "the container neither failed nor started"
        await asyncio.sleep(0.2)
    assert p is not None
    log = cluster.log("orphan", a)
    assert steps(log) == [], f"it started fresh: {log[-300:]!r}"
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 70
    assert "forbids a fresh start" in log


async def test_a_container_claimed_late_is_still_restored(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet reports the container's ID only after the agent's first
    look (UNKNOWN_FOR_S, 0.5 s here, in place of 20): the agent keeps
    looking while smr-init waits, and restores it; it never leaves it to
    smr-init's timeout (8 s here), which would start it fresh over its
    checkpoint."""
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "late-1", "SMR_INIT_TIMEOUT": "8"}
    cluster.kube.put("pods", workload("late-x1", a, env=env, owner="late", restart="Never"))
    await cluster.until_steps("late-x1", a, 5)
    await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="late-1", node=a,
        target=Target(kind="pod", namespace="default", pod="late-x1", container="main")),
        timeout=60)
    before = steps(cluster.log("late-x1", a))
    monkeypatch.setattr(starts, "UNKNOWN_FOR_S", 0.5)
    reported_at = time.monotonic() + 3
    claim = starts._claim
    monkeypatch.setattr(starts, "_claim", lambda pods, cid: (
        claim(pods, cid) if time.monotonic() > reported_at else None))
    cluster.kube.put("pods", workload("late-x2", b, env=env, owner="late", restart="Never"))
    after = await cluster.until_steps("late-x2", b, 5)
    assert_continues(before, after, before[-1][0])
