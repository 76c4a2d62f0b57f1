"""The FAKE workload controllers (tests/fake_controllers.py) replace pods when
the real ones do: the agent's tests depend on it (tests/agent/test_controllers.py).
No kubelet runs here: a deleted pod stays terminating for ``eviction_delay``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fake_apiserver import node as a_node
from tests.fake_controllers import INDEX, FakeControllers, job, replicaset, statefulset

TERMINATING_S = 3.0


@pytest.fixture
async def kube() -> AsyncIterator[FakeApiServer]:
    k = await FakeApiServer(eviction_delay=TERMINATING_S).start()
    k.put("nodes", a_node("node-a"))
    ctl = await FakeControllers(k).start()
    k.ctl = ctl  # type: ignore[attr-defined]
    yield k
    await ctl.stop()
    await k.stop()


TEMPLATE = {"metadata": {"labels": {"app": "w"}},
            "spec": {"containers": [{"name": "main", "image": "busybox",
                                     "env": [{"name": "SMR_CHECKPOINT", "value": "w-1"}]}],
                     "terminationGracePeriodSeconds": 60}}


def pods(kube: FakeApiServer) -> list[dict[str, Any]]:
    return sorted(kube.list("pods", "default"), key=lambda p: int(
        p["metadata"]["resourceVersion"]))


async def until(what: Callable[[], Any], timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "not reached"
        await asyncio.sleep(0.05)
    return got


def live(kube: FakeApiServer) -> list[dict[str, Any]]:
    return [p for p in pods(kube) if not p["metadata"].get("deletionTimestamp")]


def terminating(kube: FakeApiServer) -> list[dict[str, Any]]:
    return [p for p in pods(kube) if p["metadata"].get("deletionTimestamp")]


def evict(kube: FakeApiServer, p: dict[str, Any]) -> None:
    kube._evict(("pods", "default", p["metadata"]["name"]))


async def test_a_replicaset_replaces_a_pod_the_moment_it_is_terminating(
        kube: FakeApiServer) -> None:
    rs = kube.put("replicasets", replicaset("web", TEMPLATE, deployment="web"))
    [old] = await until(lambda: live(kube))
    m = old["metadata"]
    assert m["name"].startswith(rs["metadata"]["name"] + "-")
    assert m["ownerReferences"] == [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                     "name": rs["metadata"]["name"],
                                     "uid": rs["metadata"]["uid"], "controller": True,
                                     "blockOwnerDeletion": True}]
    assert m["labels"]["pod-template-hash"] and old["spec"]["nodeName"] == "node-a"
    assert {"name": "SMR_CHECKPOINT", "value": "w-1"} in old["spec"]["containers"][0]["env"]
    evict(kube, old)
    [new] = await until(lambda: live(kube))
    assert terminating(kube), "the replacement came only after the old pod was gone"
    assert new["metadata"]["name"] != m["name"]


@pytest.mark.parametrize("spec,early", [
    ({}, True),  # TerminatingOrFailed, the default
    ({"podReplacementPolicy": "Failed"}, False),
    ({"podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [
        {"type": "DisruptionTarget"}]}]}}, False),  # its default is Failed
], ids=["default", "failed", "pod-failure-policy"])
async def test_a_job_follows_its_pod_replacement_policy(
        kube: FakeApiServer, spec: dict[str, Any], early: bool) -> None:
    j = kube.put("jobs", job("train", TEMPLATE, **spec))
    [old] = await until(lambda: live(kube))
    assert old["metadata"]["labels"]["batch.kubernetes.io/job-name"] == "train"
    assert old["metadata"]["labels"]["batch.kubernetes.io/controller-uid"] == \
        j["metadata"]["uid"]
    assert old["spec"]["restartPolicy"] == "Never"
    evict(kube, old)
    await until(lambda: terminating(kube))
    await asyncio.sleep(1.0)  # the controller had its chance
    if early:
        assert live(kube) and terminating(kube), "not replaced while terminating"
    else:
        assert not live(kube), "replaced while the old pod was still terminating"
        await until(lambda: live(kube) and not terminating(kube))


async def test_a_suspended_job_deletes_its_pods_with_their_grace_and_resumes(
        kube: FakeApiServer) -> None:
    kube.put("jobs", job("train", TEMPLATE, parallelism=2, completions=2,
                         completionMode="Indexed"))
    first = await until(lambda: len(live(kube)) == 2 and live(kube))
    idx = sorted(p["metadata"]["annotations"][INDEX] for p in first)
    assert idx == ["0", "1"]
    for p in first:
        i = p["metadata"]["annotations"][INDEX]
        assert p["metadata"]["labels"][INDEX] == i
        assert p["metadata"]["name"].startswith(f"train-{i}-")
        assert {"name": "JOB_COMPLETION_INDEX", "value": i} in p["spec"]["containers"][0]["env"]
    j = kube.get("jobs", "train", "default")
    assert j is not None
    j["spec"]["suspend"] = True
    kube.put("jobs", j)
    gone = await until(lambda: len(terminating(kube)) == 2 and terminating(kube))
    assert all(p["metadata"]["deletionGracePeriodSeconds"] == 60 for p in gone)
    assert not live(kube)
    j = kube.get("jobs", "train", "default")
    assert j is not None
    j["spec"]["suspend"] = False
    kube.put("jobs", j)
    again = await until(lambda: len(live(kube)) == 2 and live(kube))
    assert sorted(p["metadata"]["annotations"][INDEX] for p in again) == ["0", "1"]


async def test_a_statefulset_recreates_pod_n_only_once_the_old_one_is_gone(
        kube: FakeApiServer) -> None:
    kube.put("statefulsets", statefulset("db", TEMPLATE))
    [old] = await until(lambda: live(kube))
    assert old["metadata"]["name"] == "db-0"
    assert old["metadata"]["labels"]["statefulset.kubernetes.io/pod-name"] == "db-0"
    evict(kube, old)
    await asyncio.sleep(TERMINATING_S / 2)
    assert [p["metadata"]["uid"] for p in pods(kube)] == [old["metadata"]["uid"]]
    [new] = await until(lambda: live(kube))
    assert new["metadata"]["name"] == "db-0" and new["metadata"]["uid"] != old["metadata"]["uid"]
