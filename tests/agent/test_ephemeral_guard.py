"""The agent runs CRIU only in pods whose debug containers the webhook judges.

The agent's look before CRIU cannot see an ephemeral container added while
CRIU runs (services/containers/ptracers.py); only the webhook's entry
ephemeral-ptrace.pods.smr.dev can refuse one that could ptrace CRIU, and the
API server calls it only for pods its matchConditions select. The agent takes
a container whose PID 1 is named smr-init (host.is_shim), however it was
started: `sh -c 'exec /smr/smr-init ...'`, the image's ENTRYPOINT, an
SMR_CONTAINER from envFrom or the image's ENV under runtimeClassName smr.
Those pods are not selected: a privileged debug container targeting the
container, added once CRIU is seen running (or kept running: the workload
can stop it with SIGSTOP until criu_timeout), would be admitted unjudged. So
the agent runs CRIU only where the container's own spec shows smr
(services/containers/ptracers.guarded)."""

from __future__ import annotations

from typing import Any

import yaml

from tests.agent.cluster import REPO, Cluster, workload
from tests.agent.test_attacks import refused_before_criu


def selected(pod: dict[str, Any]) -> bool:
    """deploy/kustomize/base/webhook.yaml's matchConditions of
    ephemeral-ptrace.pods.smr.dev, in Python, on the stored pod."""
    docs = list(yaml.safe_load_all((REPO / "deploy/kustomize/base/webhook.yaml").read_text()))
    [cfg] = [d for d in docs if d and d.get("kind") == "MutatingWebhookConfiguration"]
    [entry] = [h for h in cfg["webhooks"] if h["name"] == "ephemeral-ptrace.pods.smr.dev"]
    expr = entry["matchConditions"][0]["expression"]
    assert "'smr.dev/injected' in oldObject.metadata.annotations" in expr
    assert "c.command[0].endsWith('smr-init')" in expr and "e.name == 'SMR_CONTAINER'" in expr
    ann = pod["metadata"].get("annotations") or {}
    return "smr.dev/injected" in ann or any(
        (c.get("command") or [""])[0].endswith("smr-init")
        or any(e.get("name") == "SMR_CONTAINER" for e in c.get("env") or [])
        for c in pod["spec"]["containers"])


async def test_criu_runs_only_in_pods_the_webhook_guards(
        cluster: Cluster, criu_runs: list[list[str]]) -> None:
    """A pod that starts smr-init through `sh -c exec`, with no SMR_CONTAINER
    in its spec, is not selected by the webhook's entry for debug
    containers: the agent refuses it before CRIU runs, and it runs on."""
    a, _ = list(cluster.kubelets)
    p = workload("shstart", a, labels={"smr.dev/node-restore": "true"})
    p["spec"]["containers"][0]["command"] = ["/bin/sh", "-c",
                                             "exec /smr/smr-init -- /bin/counter"]
    cluster.kube.put("pods", p)
    await cluster.until_steps("shstart", a, 3)
    stored = cluster.kube.get("pods", "shstart", "default")
    assert stored is not None and not selected(stored)
    done = await refused_before_criu(cluster, "shstart", a, criu_runs,
                                     code="container-not-guarded")
    assert "webhook" in done.error["message"], done.error
