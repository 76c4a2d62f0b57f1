"""Sequences around a final request taking over a leave-running dump in flight
(services/checkpointer/takeover) that must still leave the pod's lineage
with a durable final checkpoint, the replacement resuming from it. Real
containerd, runc, CRIU, nats-server and moto; the kubelet and API server are
the repo's fakes. ``in_order`` (tests/agent/test_drain_takeover.py) makes
the order certain: the leave-running dump's captures wait, its tree frozen,
until the final request's step has started."""

from __future__ import annotations

import uuid
from pathlib import Path

from services.storage.layout import template_id
from smr.messages import CkptRequested, Target
from tests.agent.cluster import Cluster
from tests.agent.test_drain_takeover import (
    drain_image,  # noqa: F401  (a fixture)
    in_order,
    records,
    resumes_intact,
    start,
    until_frozen,
)
from tests.agent.test_kubelet import evict, hook_said


async def test_a_final_during_a_template_dump_of_another_lineage_stores_the_pods_final(
        cluster: Cluster, drain_image: Path) -> None:  # noqa: F811
    """A snapshot-when-ready template dump (leave-running, its own checkpoint
    id) is frozen when the pod is evicted: the final checkpoint must land in
    the pod's own lineage, where its replacement restores from, not in the
    template's."""
    a, b = list(cluster.kubelets)
    await start(cluster, drain_image, "templated", a)
    p = cluster.kube.get("pods", "templated", "default")
    assert p is not None
    tmpl = template_id("warm", "main")
    req = CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=tmpl, node=a, reason="template",
        leave_running=True,
        target=Target(kind="pod", namespace="default", pod="templated", container="main",
                      pod_uid=p["metadata"]["uid"]))

    async with in_order(cluster, a, "templated"):
        await cluster.bus.publish(req)
        await until_frozen()
        await evict(cluster, "templated")
        await cluster.recreated("templated", timeout=120)

    assert "final checkpoint done" in hook_said(cluster, a, "templated")
    own = await cluster.store.generations("default", "templated.main")
    shared = await cluster.store.generations("default", tmpl)
    assert [(r, lr) for _, r, lr in records(own)] == [("drain", False)], \
        f"the pod's lineage holds {records(own)}; the template's {records(shared)}"
    await resumes_intact(cluster, "templated", a, b)
