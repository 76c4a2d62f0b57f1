"""What a real kubelet does to an opted-in pod (tests/fake_kubelet.py copies it):
preStop hooks, SIGTERM, SIGKILL after the grace period, graceful node
shutdown, liveness probes; and PodDisruptionBudgets in the eviction API.
Each workload here exits at once on SIGTERM (the counter's shell has no trap)."""

from __future__ import annotations

import asyncio
import math
import os
import pwd
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from services.containers import gpus, host
from smr.bus import KV_TIMINGS
from smr.contract.messages import CkptRequested, Target, epoch
from tests.agent.cluster import (
    USR_IMAGE,
    Cluster,
    assert_continues,
    steps,
    store_puts_through,
    workload,
)
from tests.agent.test_injection import create, plain_pod
from tests.fake_kubelet import FakeGpu

NODE_RESTORE = {"smr.dev/node-restore": "true"}


async def evict(cluster: Cluster, name: str) -> None:
    await cluster.core.create_namespaced_pod_eviction(
        name, "default", {"metadata": {"name": name, "namespace": "default"}})


async def test_drain_resumes_every_pod_from_its_final_checkpoint(cluster: Cluster) -> None:
    """kubectl drain: the cordon, then an eviction of each pod at once. The
    kubelet runs each pod's preStop hook, which waits for the final
    checkpoint; only then SIGTERM. No step is lost."""
    a, b = list(cluster.kubelets)
    names = ["drained-1", "drained-2", "drained-3"]
    for n in names[:2]:  # hand-written manifests, their hook written in
        cluster.kube.put("pods", workload(n, a, labels=NODE_RESTORE, final_wait=25, grace=30))
    # Labels only: the webhook adds smr-init, the hook and the longer grace.
    stored = await create(cluster, plain_pod(names[2], a, labels=NODE_RESTORE,
                                             command=["/bin/counter"]))
    assert stored["spec"]["terminationGracePeriodSeconds"] == 90
    assert "--wait-final" in stored["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"][
        "command"]
    for n in names:
        await cluster.until_steps(n, a, 5)

    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await asyncio.gather(*(evict(cluster, n) for n in names))
    for n in names:
        await cluster.recreated(n, timeout=90)

    kubelet = cluster.kubelets[a]
    for n in names:  # a timing to read, not to assert
        print(f"\ndrain: {n}: preStop hook (eviction to final checkpoint stored) "
              f"{seconds_between(cluster, a, n, 'prestop', 'prestop-done'):.2f}s")
    for n in names:
        hook = [x[3] for x in kubelet.actions if x[1] == n and x[3].startswith("prestop-done")]
        assert hook and "final checkpoint done" in hook[0], f"{n}: the hook said {hook}"
        assert not kubelet.did(n, "KILL"), f"{n} outlived its grace period"
        manifest = (await cluster.store.latest("default", f"{n}.main")).manifest  # type: ignore[union-attr]
        assert manifest["reason"] == "drain" and manifest["leave_running"] is False
        before = steps(cluster.log(n, a))
        cluster.schedule(n, b)
        after = await cluster.until_steps(n, b, 5)
        assert_continues(before, after, before[-1][0])
        assert after[0][0] == before[-1][0] + 1, f"{n}: steps lost after a final checkpoint"


def hook_said(cluster: Cluster, node: str, name: str) -> str:
    done = [x[3] for x in cluster.kubelets[node].actions
            if x[1] == name and x[3].startswith("prestop-done")]
    assert done, f"the preStop hook of {name} did not end"
    return done[0]


def seconds_between(cluster: Cluster, node: str, name: str, first: str, then: str) -> float:
    acts = cluster.kubelets[node].actions
    t0 = next(x[0] for x in acts if x[1] == name and x[3].startswith(first))
    t1 = next(x[0] for x in acts if x[1] == name and x[3].startswith(then))
    return t1 - t0


async def test_graceful_node_shutdown_takes_the_final_checkpoint(cluster: Cluster) -> None:
    """GKE Spot: the kubelet stops the pods itself within 15 s, with no
    deletion; the bare pod ends Failed and the watcher recreates it."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("spot", a, labels=NODE_RESTORE, final_wait=13, grace=43))
    await cluster.until_steps("spot", a, 5)

    await cluster.kubelets[a].shutdown(grace=15)
    print(f"\ngraceful shutdown: preStop hook ended after "
          f"{seconds_between(cluster, a, 'spot', 'prestop', 'prestop-done'):.2f}s")
    assert "final checkpoint done" in hook_said(cluster, a, "spot")
    assert not cluster.kubelets[a].did("spot", "KILL")
    await cluster.recreated("spot", timeout=60)
    manifest = (await cluster.store.latest("default", "spot.main")).manifest  # type: ignore[union-attr]
    assert manifest["reason"] == "preemption" and manifest["leave_running"] is False
    before = steps(cluster.log("spot", a))
    cluster.schedule("spot", b)
    after = await cluster.until_steps("spot", b, 5)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "steps lost after a final checkpoint"


async def test_a_budget_that_blocks_the_eviction_leaves_the_workload_running(
        cluster: Cluster) -> None:
    """Karpenter taints the node and evicts; the PodDisruptionBudget refuses
    (429). smr checkpoints but stops nothing: the workload runs on."""
    a, _ = list(cluster.kubelets)
    labels = {**NODE_RESTORE, "app": "guarded"}
    cluster.kube.put("pods", workload("guarded", a, labels=labels, final_wait=25, grace=30))
    cluster.kube.put("poddisruptionbudgets", {
        "metadata": {"name": "guarded", "namespace": "default"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}})
    await cluster.until_steps("guarded", a, 5)

    await cluster.core.patch_node(a, {"spec": {"taints": [
        {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}})
    try:
        await evict(cluster, "guarded")
        raise AssertionError("the eviction was allowed despite the budget")
    except ApiException as e:
        assert e.status == 429
    manifest = await cluster.latest("guarded.main")
    assert manifest["reason"] == "preemption" and manifest["leave_running"] is True
    ran = len(steps(cluster.log("guarded", a)))
    await cluster.until_steps("guarded", a, ran + 10)
    p = cluster.kube.get("pods", "guarded", "default")
    assert p is not None and not p["metadata"].get("deletionTimestamp")
    assert p["status"]["phase"] == "Running"
    assert not cluster.kubelets[a].did("guarded", "TERM"), "the kubelet stopped it"
    assert "exited" not in [x[3] for x in cluster.kubelets[a].actions if x[1] == "guarded"]


async def test_a_stale_request_for_a_recreated_pod_is_refused(cluster: Cluster) -> None:
    """A request queued for a pod acts on no later pod of the same name, nor
    after its deadline."""
    a, _ = list(cluster.kubelets)
    cluster.kube.put("pods", workload("reused", a, labels=NODE_RESTORE))
    await cluster.until_steps("reused", a, 3)
    old = cluster.kube.get("pods", "reused", "default")
    assert old is not None
    cluster.kube.remove("pods", "reused", "default")  # gone; a new pod takes the name
    cluster.kube.put("pods", workload("reused", a, labels=NODE_RESTORE))
    new = cluster.kube.get("pods", "reused", "default")
    assert new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]
    await cluster.until_steps("reused", a, 3)

    def request(uid: str, deadline: str | None = None) -> CkptRequested:
        return CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id="reused.main", node=a,
            leave_running=True, deadline=deadline,
            target=Target(kind="pod", namespace="default", pod="reused", container="main",
                          pod_uid=uid))

    done = await cluster.bus.request(request(old["metadata"]["uid"]), timeout=60)
    assert done.status == "failed" and done.error["code"] == "stale-request", done.error
    late = await cluster.bus.request(request(new["metadata"]["uid"],
                                             "2026-01-01T00:00:00Z"), timeout=60)
    assert late.status == "failed" and late.error["code"] == "request-expired", late.error
    assert await cluster.store.latest("default", "reused.main") is None, "nothing was saved"
    ok = await cluster.bus.request(request(new["metadata"]["uid"]), timeout=60)
    assert ok.status == "succeeded", ok.error  # the current pod's request is carried out


async def test_sigterm_during_a_cordon_dump_stops_only_the_original(cluster: Cluster) -> None:
    """The kubelet's SIGTERM lands while the cordon checkpoint is being
    taken: the original stops as asked, and a restore of that checkpoint
    keeps running (the signal was not saved in the image)."""
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "sigterm-1"}
    kubelet = cluster.kubelets[a]
    cluster.kube.put("pods", workload("first", a, env=env, owner="j", restart="Never"))
    await cluster.until_steps("first", a, 5)
    st = kubelet.state("default", "first")
    assert st is not None
    hold = st.volume / "main" / "hold"

    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    for _ in range(6000):  # the dump begins: the agent holds smr-init
        if hold.exists():
            break
        await asyncio.sleep(0.005)
    await kubelet.ctd.ctr(a, "tasks", "kill", "-s", "TERM", st.containers["main"].id)
    assert hold.exists(), "the SIGTERM did not land during the dump (it was too quick)"
    manifest = await cluster.latest("sigterm-1")
    assert manifest["reason"] == "cordon" and manifest["leave_running"] is True
    for _ in range(100):  # the original stops as asked, once the dump is over
        if kubelet.did("first", "exited"):
            break
        await asyncio.sleep(0.1)
    assert kubelet.did("first", "exited"), "the original did not stop on SIGTERM"
    before = steps(cluster.log("first", a))

    cluster.kube.put("pods", workload("second", b, env=env, owner="j", restart="Never"))
    after = await cluster.until_steps("second", b, 5)
    assert_continues(before, after, before[-1][0])
    ran = len(steps(cluster.log("second", b)))
    await cluster.until_steps("second", b, ran + 20)  # two more seconds, still running
    assert not cluster.kubelets[b].did("second", "exited"), "the restored copy stopped"


async def test_a_liveness_probe_does_not_kill_a_restore(cluster: Cluster) -> None:
    """A liveness probe that allows no startup time at all: the restore
    (download and CRIU) outlasts it. The startupProbe the webhook adds holds
    it back until the workload runs: no kill, no restore loop."""
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "live-1"}
    # The counter with some 100 MiB in its shell's memory: a restore that takes a while.
    command = ["/bin/sh", "-c", "x=$(busybox seq 1 6000000); . /bin/counter"]
    await create(cluster, plain_pod("live-a", a, env=env, owner="live", command=command))
    await cluster.until_steps("live-a", a, 5, timeout=60)
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await cluster.latest("live-1")
    before = steps(cluster.log("live-a", a))

    second = plain_pod("live-b", b, env=env, owner="live", command=command)
    second["spec"]["containers"][0]["livenessProbe"] = {
        # Is the workload there? A process running the counter, other than PID 1
        # (smr-init's arguments name it too; the bracket keeps the probe from
        # finding itself).
        "exec": {"command": ["/bin/sh", "-c",
                             "for f in /proc/[0-9]*/cmdline; do "
                             "[ $f = /proc/1/cmdline ] && continue; "
                             "busybox grep -qs 'bin/count[e]r' $f && exit 0; done; exit 1"]},
        "initialDelaySeconds": 0, "periodSeconds": 1, "failureThreshold": 1}
    stored = await create(cluster, second)
    assert stored["spec"]["containers"][0]["startupProbe"]["exec"]["command"] == [
        "/smr/smr-init", "--started"], cluster.kube.admission_log
    after = await cluster.until_steps("live-b", b, 5, timeout=120)
    assert_continues(before, after, before[-1][0])
    kubelet = cluster.kubelets[b]
    restored = await cluster.event("Restored", "live-b")
    print(f"\nliveness: {restored['message']}")  # the restore's time, to read
    for _ in range(50):  # the liveness probe runs once the workload does
        if kubelet.did("live-b", "liveness-ok") or kubelet.did("live-b", "liveness-failed"):
            break
        await asyncio.sleep(0.1)
    assert not kubelet.did("live-b", "liveness-failed"), "its liveness probe killed the restore"
    assert kubelet.did("live-b", "liveness-ok"), "the liveness probe never ran"
    await cluster.until_steps("live-b", b, len(steps(cluster.log("live-b", b))) + 10)
    assert not kubelet.did("live-b", "liveness-failed")
    assert not kubelet.did("live-b", "startup-failed")
    st = kubelet.state("default", "live-b")
    assert st is not None and st.containers["main"].restarts == 0, "restarted: a restore loop"


async def test_final_checkpoints_go_ahead_of_queued_leave_running_ones(
        cluster: Cluster) -> None:
    """A drain on a node whose checkpointer is busy: leave-running
    checkpoints (heartbeats) queued for every pod, then the cordon's, then
    the evictions. Each pod's final checkpoint must not wait behind the
    leave-running ones queued before it: it is stored within the pod's grace
    period, no pod is SIGKILLed, and each replacement resumes from it."""
    a, b = list(cluster.kubelets)
    names = ["busy-1", "busy-2", "busy-3"]
    for n in names:
        # A hook wait and grace a loaded 2-core VM keeps (8 s failed once
        # under a load average of 10); the order below fails the old code
        # whatever the grace.
        cluster.kube.put("pods", workload(n, a, labels=NODE_RESTORE, final_wait=20, grace=24))
    for n in names:
        await cluster.until_steps(n, a, 3)
    queued = []
    for _ in range(10):  # a backlog of some 30 dumps
        for n in names:
            p = cluster.kube.get("pods", n, "default")
            assert p is not None
            req = CkptRequested(
                request_id=uuid.uuid4().hex, checkpoint_id=f"{n}.main", node=a,
                reason="heartbeat", leave_running=True,
                target=Target(kind="pod", namespace="default", pod=n, container="main",
                              pod_uid=p["metadata"]["uid"]))
            await cluster.bus.publish(req)
            queued.append(req)

    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await asyncio.gather(*(evict(cluster, n) for n in names))
    for n in names:
        await cluster.recreated(n, timeout=120)

    kubelet = cluster.kubelets[a]
    for n in names:  # a timing to read, not to assert
        print(f"\nbusy drain: {n}: preStop hook (eviction to final checkpoint stored) "
              f"{seconds_between(cluster, a, n, 'prestop', 'prestop-done'):.2f}s")
    final_started = {}
    for n in names:
        said = hook_said(cluster, a, n)
        assert "final checkpoint done" in said, f"{n}: the hook said {said}"
        assert not kubelet.did(n, "KILL"), f"{n} outlived its grace period"
        gen = await cluster.store.latest("default", f"{n}.main")
        assert gen is not None
        m = gen.manifest
        assert m["reason"] == "drain" and m["leave_running"] is False
        # The final request's own step (a taken-over dump names it).
        final, _ = await cluster.bus.step_state(m.get("final_request_id") or m["request_id"])
        assert final is not None and final["result"]["started_at"], final
        final_started[n] = epoch(final["result"]["started_at"])
    # The order: the finals started while leave-running requests queued before
    # them still waited (in the order published, every one of those would
    # be answered first), and none of those dumped its pod once its final
    # had started (it gave way, or found the pod gone).
    later = 0
    for req in queued:
        done = await cluster.bus.wait_result(req.request_id, "ckpt.requested", timeout=120)
        state, _ = await cluster.bus.step_state(req.request_id)
        assert state is not None
        assert done.status in ("succeeded", "failed")
        began = final_started[req.target.pod or ""]
        later += state["finished"] > began
        if done.status == "succeeded":
            assert done.started_at and epoch(done.started_at) < began, \
                f"a leave-running dump of {req.target.pod} began after its final checkpoint did"
    print(f"busy drain: {later} of {len(queued)} leave-running requests queued before the "
          "drain were answered after their pod's final checkpoint had started")
    assert later > 0, "every queued leave-running request went ahead of the finals"
    for n in names:
        before = steps(cluster.log(n, a))
        cluster.schedule(n, b)
        after = await cluster.until_steps(n, b, 5)
        assert_continues(before, after, before[-1][0])
        assert after[0][0] == before[-1][0] + 1, f"{n}: steps lost after a final checkpoint"


async def test_a_recovered_final_checkpoint_still_releases_the_prestop_hook(
        cluster: Cluster) -> None:
    """The agent's step stops right after the manifest of a final checkpoint
    is stored, before it tells the preStop hook (as the agent stopping does,
    mid-step: the request is delivered again). Its recovery stores nothing
    twice, ends the workload held stopped, and must tell the hook as the step
    would have: else the hook waits its whole time and the pod's stop with it."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("recovered", a, labels=NODE_RESTORE, final_wait=25,
                                      grace=30))
    await cluster.until_steps("recovered", a, 5)
    stopped = []

    async def stop_after_final_manifest(real: Any, key: str, data: bytes, **kw: Any) -> str:
        out = str(await real(key, data, **kw))
        if key.endswith("manifest.json") and not orjson.loads(data)["leave_running"] \
                and not stopped:
            stopped.append(key)
            raise asyncio.CancelledError  # the step ends here, its manifest stored
        return out

    with store_puts_through(cluster, stop_after_final_manifest):
        await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
        await evict(cluster, "recovered")
        await cluster.recreated("recovered", timeout=60)
    assert stopped, "the fault never fired"
    said = hook_said(cluster, a, "recovered")
    print(f"\nrecovered final: preStop hook ended after "
          f"{seconds_between(cluster, a, 'recovered', 'prestop', 'prestop-done'):.2f}s: {said}")
    assert "final checkpoint done" in said, f"the hook said {said}"
    assert not cluster.kubelets[a].did("recovered", "KILL")
    gen = await cluster.store.latest("default", "recovered.main")
    assert gen is not None and gen.manifest["leave_running"] is False
    assert f"done {gen.number}" in said  # the very generation recovery stored
    before = steps(cluster.log("recovered", a))
    cluster.schedule("recovered", b)
    after = await cluster.until_steps("recovered", b, 5)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "steps lost after a final checkpoint"


async def test_the_grace_period_comes_from_the_last_measured_checkpoint(
        cluster: Cluster) -> None:
    """The agent records how long a workload's checkpoint took, from the
    freeze to stored; a pod created later for the same checkpoint gets, from
    the webhook, a grace period sized from that time."""
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "timed-1"}
    await create(cluster, plain_pod("timed-a", a, env=env, owner="timed",
                                    command=["/bin/counter"]))
    await cluster.until_steps("timed-a", a, 3)
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="timed-1", node=a, leave_running=True,
        target=Target(kind="pod", namespace="default", pod="timed-a", container="main")),
        timeout=60)
    assert done.status == "succeeded", done.error
    entry = await cluster.bus.kv(KV_TIMINGS).get("default/timed-1")
    measured = orjson.loads(entry.value or b"{}")
    print(f"\nmeasured checkpoint: {measured['seconds']:.2f}s (the step: {done.durations})")
    assert measured["generation"] == done.generation
    assert 0 < measured["seconds"] <= done.durations["total"]

    # This workload is saved in well under a second: a floor below it, so
    # that the measured time is what decides.
    cluster.webhook.s = cluster.webhook.s.replace(final_checkpoint_seconds=1)
    stored = await create(cluster, plain_pod("timed-b", b, env=env, owner="timed",
                                             command=["/bin/counter"]))
    added = math.ceil(2 * measured["seconds"] + 10)
    assert stored["spec"]["terminationGracePeriodSeconds"] == 30 + added
    assert stored["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
        "/smr/smr-init", "--wait-final", str(added)]


async def test_a_plain_delete_does_not_wait_for_a_final_checkpoint(cluster: Cluster) -> None:
    """`kubectl delete pod` on a node that is not going away: no final
    checkpoint is asked for, so the preStop hook must not wait for one (it
    would hold the delete back for its whole time). A drain, on the same
    agent, still waits for its final checkpoint (the drain test)."""
    a, _ = list(cluster.kubelets)
    cluster.kube.put("pods", workload("deleted", a, labels=NODE_RESTORE, final_wait=25,
                                      grace=30))
    await cluster.until_steps("deleted", a, 3)
    await cluster.core.delete_namespaced_pod("deleted", "default")
    for _ in range(400):
        if cluster.kube.get("pods", "deleted", "default") is None:
            break
        await asyncio.sleep(0.1)
    said = hook_said(cluster, a, "deleted")
    print(f"\nplain delete: preStop hook ended after "
          f"{seconds_between(cluster, a, 'deleted', 'prestop', 'prestop-done'):.2f}s: {said}")
    assert "final checkpoint none" in said, f"the hook said {said}"
    assert not cluster.kubelets[a].did("deleted", "KILL")
    assert await cluster.store.latest("default", "deleted.main") is None, "nothing is saved"


@pytest.mark.parametrize("disruption", ["scheduler-preemption", "eviction-api"])
async def test_a_disruption_on_a_node_that_stays_resumes_from_its_final_checkpoint(
        cluster: Cluster, disruption: str) -> None:
    """The scheduler preempts an opted-in pod for a higher-priority one
    (DisruptionTarget PreemptionByScheduler), or the descheduler evicts it
    (EvictionByEvictionAPI); its node stays. The preStop hook waits for the
    final checkpoint, as in a drain; the bare pod comes back and resumes."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("victim", a, labels=NODE_RESTORE, final_wait=25,
                                      grace=30))
    await cluster.until_steps("victim", a, 5)
    if disruption == "scheduler-preemption":
        cluster.kube.preempt("victim")
    else:
        await evict(cluster, "victim")
    await cluster.recreated("victim", timeout=90)
    said = hook_said(cluster, a, "victim")
    assert "final checkpoint done" in said, f"the hook said {said}"
    assert not cluster.kubelets[a].did("victim", "KILL")
    manifest = (await cluster.store.latest("default", "victim.main")).manifest  # type: ignore[union-attr]
    assert manifest["leave_running"] is False
    assert manifest["reason"] == {"scheduler-preemption": "preemption",
                                  "eviction-api": "drain"}[disruption]
    before = steps(cluster.log("victim", a))
    cluster.schedule("victim", b)
    after = await cluster.until_steps("victim", b, 5)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "steps lost after a final checkpoint"


async def test_a_plain_delete_on_a_cordoned_node_is_not_undone(cluster: Cluster) -> None:
    """`kubectl delete pod` of a bare node-restore pod on a cordoned node:
    the user's own delete. No final checkpoint (the hook is released), and
    the pod is not created again."""
    a, _ = list(cluster.kubelets)
    cluster.kube.put("pods", workload("deleted", a, labels=NODE_RESTORE, final_wait=25,
                                      grace=30))
    await cluster.until_steps("deleted", a, 3)
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    cordon = await cluster.latest("deleted.main")
    assert cordon["reason"] == "cordon" and cordon["leave_running"] is True
    await cluster.core.delete_namespaced_pod("deleted", "default")
    for _ in range(400):
        if cluster.kube.get("pods", "deleted", "default") is None:
            break
        await asyncio.sleep(0.1)
    said = hook_said(cluster, a, "deleted")
    assert "final checkpoint none" in said, f"the hook said {said}"
    await asyncio.sleep(3)
    assert cluster.kube.get("pods", "deleted", "default") is None, "the delete was undone"
    latest = await cluster.store.latest("default", "deleted.main")
    assert latest is not None and latest.manifest["reason"] == "cordon", "a final was taken"


async def test_a_node_pressure_eviction_leaves_the_failed_pod(cluster: Cluster) -> None:
    """The kubelet evicts a pod past a hard memory threshold: grace 0, so no
    preStop hook and no final checkpoint; the pod stays Failed (Evicted), as
    Kubernetes leaves it, and is not deleted by smr."""
    a, _ = list(cluster.kubelets)
    cluster.kube.put("pods", workload("pressed", a, labels=NODE_RESTORE, final_wait=25,
                                      grace=30))
    await cluster.until_steps("pressed", a, 3)
    uid = cluster.kube.get("pods", "pressed", "default")["metadata"]["uid"]  # type: ignore[index]
    await cluster.kubelets[a].evict("pressed")
    assert not cluster.kubelets[a].did("pressed", "prestop"), "grace 0 runs no hook"
    await asyncio.sleep(3)
    p = cluster.kube.get("pods", "pressed", "default")
    assert p is not None and p["metadata"]["uid"] == uid, "smr deleted the evicted pod"
    assert (p["status"]["phase"], p["status"]["reason"]) == ("Failed", "Evicted")


def ids_of(status: str) -> dict[str, list[int]]:
    """Uid, Gid and Groups of a /proc/PID/status."""
    got = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            got[key] = [int(v) for v in value.split()]
    return got


async def test_the_pods_user_runs_smr_init_the_workload_and_execs(cluster: Cluster) -> None:
    """securityContext as the kubelet and CRI apply it: the container's fields
    over the pod's; runAsGroup, then fsGroup and supplementalGroups as groups.
    smr-init (PID 1, through the smr RuntimeClass), the command and an exec
    (a probe's, a hook's) all run as that user; so does a hand-written
    manifest's smr-init, from the pod's emptyDir. runAsNonRoot with root: the
    kubelet's CreateContainerConfigError, and nothing runs."""
    a, _ = list(cluster.kubelets)
    p = plain_pod("as-user", a, labels=NODE_RESTORE, command=[
        "/bin/sh", "-c", "cat /proc/1/status /proc/self/status; sleep 1000"])
    p["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000,
                                    "supplementalGroups": [4000], "runAsNonRoot": True}
    p["spec"]["containers"][0]["securityContext"] = {"runAsGroup": 3000}
    stored = await create(cluster, p)
    assert stored["spec"]["runtimeClassName"] == "smr"
    kubelet = cluster.kubelets[a]
    want = {"Uid": [1000] * 4, "Gid": [3000] * 4, "Groups": [2000, 3000, 4000]}
    deadline = asyncio.get_running_loop().time() + 30
    while (log := cluster.log("as-user", a)).count("Name:") < 2:
        assert asyncio.get_running_loop().time() < deadline, f"it never ran: {log!r}"
        await asyncio.sleep(0.2)
    pid1, workload_ = log.split("Name:")[1:3]
    assert pid1.startswith("\tsmr-init\n"), log
    assert ids_of(pid1) == want and ids_of(workload_) == want, log
    st = kubelet.state("default", "as-user")
    assert st is not None
    rc, out = await kubelet._exec(st.containers["main"], ["cat", "/proc/self/status"], 10)
    assert rc == 0 and ids_of(out) == want, out

    # The hand-written manifest (docs/node-agent.md): smr-init from the pod's
    # emptyDir, which the kubelet makes writable by any user.
    p = workload("manual-user", a, labels=NODE_RESTORE)
    p["spec"]["containers"][0]["command"] = [
        "/smr/smr-init", "--", "/bin/sh", "-c", "cat /proc/self/status; sleep 1000"]
    p["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000}
    cluster.kube.put("pods", p)
    deadline = asyncio.get_running_loop().time() + 30
    while "Name:" not in (log := cluster.log("manual-user", a)):
        assert asyncio.get_running_loop().time() < deadline, f"it never ran: {log!r}"
        await asyncio.sleep(0.2)
    assert ids_of(log) == {"Uid": [1000] * 4, "Gid": [1000] * 4, "Groups": [1000]}, log
    st = kubelet.state("default", "manual-user")
    assert st is not None and (st.volume / "main" / "status").stat().st_uid == 1000

    # Not opted in (runc itself), runAsUser alone: the group is the user's in
    # the image's /etc/passwd, as containerd resolves it.
    pg = pwd.getpwnam("postgres")  # in the image's /etc/passwd with the same ids
    p = plain_pod("as-postgres", a, image=USR_IMAGE, command=[
        "/bin/sh", "-c", "cat /proc/self/status; sleep 1000"])
    p["spec"]["containers"][0]["securityContext"] = {"runAsUser": pg.pw_uid}
    assert "runtimeClassName" not in (await create(cluster, p))["spec"]
    deadline = asyncio.get_running_loop().time() + 30
    while "Name:" not in (log := cluster.log("as-postgres", a)):
        assert asyncio.get_running_loop().time() < deadline, f"it never ran: {log!r}"
        await asyncio.sleep(0.2)
    assert ids_of(log) == {"Uid": [pg.pw_uid] * 4, "Gid": [pg.pw_gid] * 4,
                           "Groups": [pg.pw_gid]}, log

    for name, sc, why in (
            ("as-root", {"runAsNonRoot": True},
             "container has runAsNonRoot and image will run as root"),
            ("as-uid-0", {"runAsNonRoot": True, "runAsUser": 0},
             "container's runAsUser breaks non-root policy")):
        p = plain_pod(name, a, labels=NODE_RESTORE, command=["/bin/counter"])
        p["spec"]["securityContext"] = sc
        await create(cluster, p)
        deadline = asyncio.get_running_loop().time() + 30
        while not (got := (cluster.kube.get("pods", name, "default") or {}).get(
                "status", {}).get("containerStatuses")):
            assert asyncio.get_running_loop().time() < deadline, f"{name}: no status"
            await asyncio.sleep(0.2)
        waiting = got[0]["state"].get("waiting") or {}
        assert waiting.get("reason") == "CreateContainerConfigError", got
        assert waiting["message"].startswith(why) and "container: main)" in waiting["message"]
        st = kubelet.state("default", name)
        assert st is not None and not st.containers, "a container was created"


async def test_the_fake_device_plugin_gives_each_pod_its_own_gpus(
        cluster: Cluster, tmp_path: Path) -> None:
    """The FAKE NVIDIA device plugin (tests/fake_kubelet.py), without a GPU:
    two device nodes of the NVIDIA major stand for the node's GPUs. A pod
    asking for one gets one no other pod holds: its node (and nvidiactl)
    in its runtime's spec, NVIDIA_VISIBLE_DEVICES naming it; a third waits
    until one is freed. The agent reads the container's GPUs back from that
    spec as a restore does (services/containers/gpus)."""
    a = next(iter(cluster.kubelets))
    kubelet = cluster.kubelets[a]
    uuids = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-00000000000{i}" for i in range(2)]
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        os.mknod(tmp_path / name, 0o600 | stat.S_IFCHR, os.makedev(gpus.NVIDIA_MAJOR, minor))
    kubelet.gpus = [FakeGpu(uuids[i], tmp_path / f"nvidia{i}") for i in range(2)]
    kubelet.gpu_dev = tmp_path
    node = [{"index": i, "uuid": u, "model": "fake", "minor": i} for i, u in enumerate(uuids)]
    names = ["gpu-a", "gpu-b", "gpu-c"]
    for n in names[:2]:
        cluster.kube.put("pods", gpu_workload(n, a))
        await cluster.until_steps(n, a, 2)
    given = {n: container_spec(cluster, n) for n in names[:2]}
    for n, i in zip(names[:2], range(2), strict=True):
        spec = given[n]
        nodes = {(d["major"], d["minor"]) for d in spec["linux"]["devices"]
                 if d["major"] == gpus.NVIDIA_MAJOR}
        assert nodes == {(gpus.NVIDIA_MAJOR, i), (gpus.NVIDIA_MAJOR, 255)}, spec["linux"]
        assert f"NVIDIA_VISIBLE_DEVICES={uuids[i]}" in spec["process"]["env"]
        got = gpus.granted(spec, node)
        assert got is not None and [d["uuid"] for d in got] == [uuids[i]]
    # None left: the third waits, as the kubelet's admission says.
    cluster.kube.put("pods", gpu_workload(names[2], a))
    deadline = time.monotonic() + 15
    while "Available: 0" not in waiting_message(cluster, names[2]):
        assert time.monotonic() < deadline, cluster.kube.get("pods", names[2], "default")
        await asyncio.sleep(0.2)
    cluster.kube.remove("pods", names[0], "default")  # its GPU is freed once it stops
    await cluster.until_steps(names[2], a, 2)
    assert f"NVIDIA_VISIBLE_DEVICES={uuids[0]}" in container_spec(cluster, names[2])[
        "process"]["env"]


def gpu_workload(name: str, node: str) -> dict[str, Any]:
    p = workload(name, node)
    p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    # Behind smr-runtime, as the GPU pods of tests/agent/test_gpu_pods.py are.
    p["spec"]["runtimeClassName"] = "smr"
    return p


def container_spec(cluster: Cluster, name: str) -> dict[str, Any]:
    """The runtime's spec of the pod's container, found as the agent finds it."""
    p = cluster.kube.get("pods", name, "default")
    assert p is not None
    cid = p["status"]["containerStatuses"][0]["containerID"].split("://")[1]
    shim = host.find_shim(cid)
    assert shim is not None, f"{name}: no smr-init"
    spec = gpus.runtime_spec(shim.pid, cid)
    assert spec is not None, f"{name}: its runtime's spec was not found"
    return spec


def waiting_message(cluster: Cluster, name: str) -> str:
    p = cluster.kube.get("pods", name, "default") or {}
    return " ".join(((s.get("state") or {}).get("waiting") or {}).get("message", "")
                    for s in (p.get("status") or {}).get("containerStatuses") or [])


async def test_a_containers_last_stderr_line_reaches_its_log(cluster: Cluster) -> None:
    """What a container writes to stderr after its stdout has ended is in its
    log once the kubelet reports it terminated, as with CRI (smr-init's reason
    for a refused start is such a line: `kubectl logs` must show it)."""
    a, _ = list(cluster.kubelets)
    body = plain_pod("last-words", a, command=[
        "/bin/sh", "-c", "echo first; exec 1>&-; sleep 0.5; echo last-words >&2; exit 3"])
    body["spec"]["restartPolicy"] = "Never"
    await create(cluster, body)
    deadline = time.monotonic() + 30
    while (p := cluster.kube.get("pods", "last-words", "default")) and \
            p["status"].get("phase") != "Failed":
        assert time.monotonic() < deadline, "the container did not end"
        await asyncio.sleep(0.2)
    assert p is not None
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    log = cluster.log("last-words", a)
    assert "first" in log and "last-words" in log, log
