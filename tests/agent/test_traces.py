"""One trace from a cordon to the resumed process, exported over OTLP/HTTP:
the watcher's trigger, the agent's checkpoint and upload on node a, and the
restore on node b (which continues the trace its checkpoint's manifest names)."""

from __future__ import annotations

import asyncio

from tests.agent.cluster import Cluster, steps, workload
from tests.otlp import ReceivedSpan, Receiver


async def test_one_trace_runs_from_the_cordon_to_the_resumed_process(
        otlp: Receiver, cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", workload("traced", a, labels={"smr.dev/node-restore": "true"}))
    await cluster.until_steps("traced", a, 5)
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    manifest = await cluster.latest("traced.main")
    await cluster.drained_to("traced", a, b, steps(cluster.log("traced", a)))
    assert await asyncio.to_thread(otlp.flush)

    roots = [s for s in otlp.spans if s.name == "node going away"
             and s.attributes.get("k8s.node.name") == a]
    assert len(roots) == 1, [s.name for s in otlp.spans][:40]
    spans = otlp.trace(roots[0].trace_id)
    by_id = {s.span_id: s for s in spans}

    def path(s: ReceivedSpan) -> list[str]:
        names = [s.name]
        while s.parent_id:
            s = by_id[s.parent_id]  # a KeyError: a parent outside this trace
            names.append(s.name)
        return names

    ckpt = next(s for s in spans if s.name == "step ckpt.requested"
                and s.attributes.get("smr.generation") == manifest["generation"])
    assert ckpt.attributes["smr.outcome"] == "succeeded"
    assert {"phase dump"} <= set(ckpt.events)
    upload = next(s for s in spans if s.name == "upload" and s.parent_id == ckpt.span_id)
    assert upload.attributes["smr.size_bytes"] == manifest["size_bytes"]
    assert path(ckpt)[-1] == "node going away"

    restore = next(s for s in spans if s.name == "step restore.requested")
    assert restore.attributes["smr.outcome"] == "succeeded"
    assert restore.attributes["smr.generation"] == manifest["generation"]
    assert restore.attributes["smr.pid"] > 0
    assert any(s.name == "download" and s.parent_id == restore.span_id for s in spans)
    # From the resumed process back to the cordon, every link in one trace.
    assert path(restore) == [
        "step restore.requested", "consume restore.requested", "publish restore.requested",
        "resume from checkpoint", *path(by_id[manifest_span(spans, manifest)])]
    resume = next(s for s in spans if s.name == "resume from checkpoint")
    assert resume.attributes["k8s.pod.name"] == "traced" and resume.links  # the container start


def manifest_span(spans: list[ReceivedSpan], manifest: dict[str, object]) -> str:
    """The span the manifest's traceparent names (the one that wrote it)."""
    parent = str(manifest["traceparent"]).split("-")[2]
    assert any(s.span_id == parent for s in spans)
    return parent
