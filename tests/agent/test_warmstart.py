"""Warm starts (docs/warm-start.md) on the two simulated nodes of
tests/agent/cluster.py: a server with a slow start is templated once it is
Ready; new pods start from the template's warm memory instead of warming up."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from typing import Any

from services.containers import host
from services.containers.pods import runtime_id
from services.policy import policy_for
from services.storage import layout
from services.storage.layout import template_id
from services.watcher import templates
from services.watcher.heartbeats import Beat
from smr.config import Settings
from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import SLOW_IMAGE, Cluster, held_by_us, workload

ANSWER = re.compile(r"^answer (\d+) secret (\S+)$", re.M)
READY_PROBE = {"exec": {"command": ["/bin/sh", "-c", "test -f /ready"]}, "periodSeconds": 1}


def answers(log: str) -> list[tuple[int, str]]:
    return [(int(n), s) for n, s in ANSWER.findall(log)]


def server(name: str, node: str, labels: dict[str, str], *, slow_s: int = 10,
           restart: str = "Always") -> dict[str, Any]:
    p = workload(name, node, image=SLOW_IMAGE, labels=labels,
                 env={"SLOW_S": str(slow_s)}, restart=restart)
    c = p["spec"]["containers"][0]
    c["command"] = ["/smr/smr-init", "--", "/bin/slow"]
    c["readinessProbe"] = READY_PROBE
    return p


async def until_answers(cluster: Cluster, name: str, node: str, n: int = 3,
                        timeout: float = 60) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    while len(got := answers(cluster.log(name, node))) < n:
        assert time.monotonic() < deadline, \
            f"pod {name} on {node} did not answer: {cluster.log(name, node)[-1000:]!r}"
        await asyncio.sleep(0.1)
    return got


async def templated(cluster: Cluster, name: str, timeout: float = 60) -> dict[str, Any]:
    """The template's manifest, once the watcher had it taken."""
    return await cluster.latest(template_id(name, "main"), timeout=timeout)


def cache_stats(cluster: Cluster, node: str) -> dict[str, int]:
    cache = cluster.agents[node].cache
    assert cache is not None
    return dict(cache.stats)


async def test_replicas_start_warm_from_a_template(cluster: Cluster, settings: Settings
                                                   ) -> None:
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", server("warm", a, {"smr.dev/snapshot-when-ready": "slow"}))
    manifest = await templated(cluster, "slow")
    assert manifest["reason"] == "template" and manifest["leave_running"] is True
    assert manifest["checkpoint_id"] == "template_slow.main"
    warm = answers(cluster.log("warm", a))
    assert warm, "the template was taken before the pod was Ready"
    secret = warm[0][1]

    # Three replicas: two on node b (the second from b's cache), one on node a.
    start_from = {"smr.dev/start-from": "slow", "smr.dev/node-restore": "true"}
    cluster.kube.put("pods", server("r1", b, start_from))
    first = await until_answers(cluster, "r1", b)
    after_first = cache_stats(cluster, b)
    # (A restore may read an image twice: hits can come from the first one too.)
    assert after_first.get("downloads", 0) > 0
    cluster.kube.put("pods", server("r2", b, start_from))
    second = await until_answers(cluster, "r2", b)
    after_second = cache_stats(cluster, b)
    assert after_second["downloads"] == after_first["downloads"], \
        f"the second replica on node b downloaded again: {after_first} → {after_second}"
    assert after_second["hits"] - after_first.get("hits", 0) >= after_first["downloads"], \
        f"the second replica did not read every object from the cache: {after_second}"
    assert (after_first.get("linked", 0), after_second.get("linked", 0)) == (1, 2), \
        "CRIU did not read each replica's images as the node's cached files"
    cluster.kube.put("pods", server("r3", a, start_from))
    third = await until_answers(cluster, "r3", a)
    # Node a has a cache of its own: it downloaded the template once, too.
    assert cache_stats(cluster, a)["downloads"] == after_first["downloads"]

    for name, node, got in (("r1", b, first), ("r2", b, second), ("r3", a, third)):
        log = cluster.log(name, node)
        # The warm process's memory: its secret, its count; no warm-up run again.
        assert "warming up" not in log, f"{name} started cold: {log[:300]!r}"
        assert {s for _, s in got} == {secret}, f"{name} answers another secret: {got[:3]}"
        assert got[0][0] > 1, f"{name} started counting over: {got[:3]}"
        assert [n for n, _ in got] == list(range(got[0][0], got[0][0] + len(got)))
        await cluster.event("Restored", name)
        # It can tell that it is a clone (and re-seed): the agent's note.
        note = json.loads(log.split("restored from ", 1)[1].splitlines()[0])
        assert note["checkpoint_id"] == "template_slow.main" and note["template"] is True
        assert note["pod"] == name
    assert "restored from" not in cluster.log("warm", a)

    # A replica is its own workload: its heartbeat is stored under its own id.
    template = template_id("slow", "main")
    r1 = cluster.kube.get("pods", "r1", "default")
    assert r1 is not None
    own = [[c.name, c.checkpoint_id] for c in policy_for(r1, settings).containers]
    assert own == [["main", "r1.main"]]
    beat = Beat(r1["metadata"]["uid"], "default", "r1", b, 60, time.time(), own)
    done = await cluster.bus.request(beat.requests(time.time())[0], timeout=60)
    assert done.status == "succeeded" and done.checkpoint_id == "r1.main", done.error
    gens = await cluster.store.generations("default", template)
    assert [g.number for g in gens] == [1], "the replica's heartbeat touched the template"
    assert (await cluster.latest("r1.main"))["reason"] == "heartbeat"

    # A later start of the template's pod (its container killed, started
    # again by the kubelet, Ready again) does not take the template again.
    run = cluster.kubelets[a].state("default", "warm").containers["main"]  # type: ignore[union-attr]
    await cluster.kubelets[a].ctd.ctr(a, "tasks", "kill", "-s", "KILL", run.id)
    deadline = time.monotonic() + 60
    while not ((p := cluster.kube.get("pods", "warm", "default"))
               and p["status"]["containerStatuses"][0]["restartCount"] == 1
               and templates.is_ready(p)):
        assert time.monotonic() < deadline, "the template's pod did not start again"
        await asyncio.sleep(0.2)
    await asyncio.sleep(3)  # the watcher has seen it Ready
    gens = await cluster.store.generations("default", template)
    assert [g.number for g in gens] == [1], "a restart took the template again"

    # Retention and GC keep a template: a second generation (an API call),
    # then retention at its tightest, and GC.
    again = await cluster.bus.request(CkptRequested(
        request_id=f"tpl-again-{time.time()}", checkpoint_id=template, node=a,
        leave_running=True, reason="template",
        target=Target(kind="pod", namespace="default", pod="warm", container="main")),
        timeout=60)
    assert again.status == "succeeded", again.error
    assert await cluster.store.prune("default", template, keep=1, max_age_s=1e-6) == []
    await cluster.store.gc(grace_s=0)
    assert [g.number for g in await cluster.store.generations("default", template)] == [1, 2]
    assert layout.is_template(template) and not layout.is_template("r1.main")


async def test_a_missing_or_corrupt_template_follows_the_restore_failure_policy(
        cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    # Missing: a RestoreFailed Event, and the container starts cold (the default policy).
    cluster.kube.put("pods", server("lost", b, {"smr.dev/start-from": "nowhere"}, slow_s=1))
    event = await cluster.event("RestoreFailed", "lost", timeout=60)
    assert "template_nowhere.main" in event["message"], event["message"]
    # (The Event may come before the container's fresh start: its answers are waited for.)
    await until_answers(cluster, "lost", b)
    assert "warming up" in cluster.log("lost", b)

    # Corrupt: a template whose stored bytes were altered.
    cluster.kube.put("pods", server("warm2", a, {"smr.dev/snapshot-when-ready": "t2"},
                                    slow_s=1))
    manifest = await templated(cluster, "t2")
    # A file fetched before anything is restored (not a streamed image).
    f = max((f for f in manifest["files"] if not f["path"].startswith("images/")),
            key=lambda f: f["size"])
    key = layout.file_key("default", manifest["checkpoint_id"], manifest["generation"],
                          f["path"])
    data, _ = await cluster.store.backend.get_bytes(key)
    await cluster.store.backend.put_bytes(key, data[:-64] + bytes(64))
    cluster.kube.put("pods", server("bad", b, {"smr.dev/start-from": "t2"}, slow_s=1))
    event = await cluster.event("RestoreFailed", "bad", timeout=60)
    assert "corrupt" in event["message"], event["message"]
    await until_answers(cluster, "bad", b)
    assert "warming up" in cluster.log("bad", b), "a failed restore starts the container cold"

    # With restore-failure: fail, the container fails instead.
    cluster.kube.put("pods", server("strict", b, {"smr.dev/start-from": "t2",
                                                  "smr.dev/restore-failure": "fail"},
                                    slow_s=1, restart="Never"))
    deadline = time.monotonic() + 60
    while (p := cluster.kube.get("pods", "strict", "default")) and \
            p["status"].get("phase") != "Failed":
        assert time.monotonic() < deadline, "the container did not fail"
        await asyncio.sleep(0.2)
    assert p is not None
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 70
    assert "warming up" not in cluster.log("strict", b)
    await cluster.event("RestoreFailed", "strict", timeout=30)


async def test_a_replica_restores_when_its_nodes_cached_copy_was_altered(
        cluster: Cluster) -> None:
    """The node's cached copy of a template object altered on disk (same
    size): storage still holds good bytes, so the replica restores from them
    (and the cache is filled again), not a RestoreFailed."""
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", server("warm3", a, {"smr.dev/snapshot-when-ready": "t3"},
                                    slow_s=1))
    manifest = await templated(cluster, "t3")
    secret = answers(cluster.log("warm3", a))[0][1]
    start_from = {"smr.dev/start-from": "t3", "smr.dev/node-restore": "true"}
    cluster.kube.put("pods", server("c1", b, start_from, slow_s=1))
    await until_answers(cluster, "c1", b)
    cache = cluster.agents[b].cache
    assert cache is not None
    f = max(manifest["files"], key=lambda f: f["size"])
    key = layout.file_key("default", manifest["checkpoint_id"], manifest["generation"],
                          f["path"])
    entry = cache.root / cache.name_of(key, f)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0x40
    entry.write_bytes(bytes(data))
    cluster.kube.put("pods", server("c2", b, start_from, slow_s=1))
    got = await until_answers(cluster, "c2", b)
    assert "warming up" not in cluster.log("c2", b), "the replica started cold"
    assert {s for _, s in got} == {secret}
    await cluster.event("Restored", "c2")
    assert cache.stats["corrupt"] >= 1
    assert entry.read_bytes() != bytes(data), "the altered copy stayed in the cache"
    # The failed attempt's descriptors of the container's stdout and stderr
    # were closed: the agent keeps none (one kept holds the container's log
    # open after it ends, and the runtime waits on its logger at its delete).
    st = cluster.kube.get("pods", "c2", "default")
    assert st is not None
    shim = host.find_shim(runtime_id(st["status"]["containerStatuses"][0]["containerID"]))
    assert shim is not None
    pipes = {os.readlink(f"/proc/{shim.pid}/fd/{fd}") for fd in (1, 2)}
    held = held_by_us(pipes)
    assert not held, f"the agent holds the container's {pipes} as its descriptors {held}"

