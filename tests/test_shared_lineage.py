"""A NonIndexed Job running more than one pod at a time, its pods opted in
with one ``SMR_CHECKPOINT``: their states share one lineage and cannot be
told apart, so the watcher says so on the Job, in a Warning Event that says
what to do. Against the FAKE API server (RBAC of the shipped manifests
enforced) with a real nats-server: the watcher as it runs in a cluster."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from smr.bus import Bus
from tests import test_watcher
from tests.fake_apiserver import FakeApiServer, pod
from tests.fake_apiserver import node as a_node
from tests.test_watcher import Watchers

kube, api, admin = test_watcher.kube, test_watcher.api, test_watcher.admin
watch_settings, watchers = test_watcher.watch_settings, test_watcher.watchers
bus, watcher_bus, storage = test_watcher.bus, test_watcher.watcher_bus, test_watcher.storage

INDEX = "batch.kubernetes.io/job-completion-index"
REASON = "SharedCheckpointLineage"


def job(name: str, *, parallelism: int, indexed: bool = False) -> dict[str, Any]:
    uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, name))  # as tests.fake_apiserver.pod's owner
    spec: dict[str, Any] = {"parallelism": parallelism, "completions": 4,
                            "template": {"spec": {"containers": [
                                {"name": "main", "image": "busybox",
                                 "env": [{"name": "SMR_CHECKPOINT", "value": name}]}]}}}
    spec["completionMode"] = "Indexed" if indexed else "NonIndexed"
    return {"metadata": {"name": name, "namespace": "default", "uid": uid}, "spec": spec}


def job_pods(kube: FakeApiServer, name: str, node: str, n: int, indexed: bool = False
             ) -> None:
    """The Job's running pods as its controller makes them."""
    for i in range(n):
        index = {INDEX: str(i)} if indexed else None
        kube.put("pods", pod(f"{name}-x{i}", node, env={"SMR_CHECKPOINT": name}, owner=name,
                             annotations=index, labels=index))


def warnings(kube: FakeApiServer) -> list[dict[str, Any]]:
    return [e for e in kube.list("events", "default") if e.get("reason") == REASON]


async def test_a_nonindexed_job_whose_pods_share_a_lineage_gets_a_warning_on_the_job(
        kube: FakeApiServer, bus: Bus, watchers: Watchers, node: str) -> None:
    """One Warning on the Job (not one per pod), naming the lineage and the
    fix; none for an Indexed Job or a NonIndexed Job of one pod at a time."""
    kube.put("nodes", a_node(node))
    for name, parallelism, indexed in (("indexed", 2, True), ("single", 1, False)):
        kube.put("jobs", job(name, parallelism=parallelism, indexed=indexed))
        job_pods(kube, name, node, parallelism, indexed)
    kube.put("jobs", job("shared", parallelism=3))
    job_pods(kube, "shared", node, 3)
    await watchers.start()
    deadline = time.monotonic() + 15
    while not warnings(kube):
        assert time.monotonic() < deadline, (
            f"no {REASON} Event: {[e.get('reason') for e in kube.list('events', 'default')]}")
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.5)  # the other pods and Jobs have been seen meanwhile
    got = warnings(kube)
    assert len(got) == 1, got
    e = got[0]
    assert e["type"] == "Warning"
    assert e["involvedObject"]["kind"] == "Job" and e["involvedObject"]["name"] == "shared"
    assert e["involvedObject"]["uid"] == str(uuid.uuid5(uuid.NAMESPACE_DNS, "shared"))
    assert "parallelism 3" in e["message"] and '"shared"' in e["message"], e["message"]
    assert "completionMode: Indexed" in e["message"], e["message"]
    assert not kube.denied
