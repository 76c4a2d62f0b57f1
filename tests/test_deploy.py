"""deploy/kustomize: every overlay renders with kustomize, validates offline
against the Kubernetes schemas, and passes smr's policy checks; each policy
check catches what it is for."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests import deploy_placement, deploy_policy
from tests.deploy_render import ROOT, render

OVERLAYS = ["dev", "gpu", "prod"]
K8S_VERSION = "1.31"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(kustomize: str, overlay: str) -> None:
    docs = render(kustomize, overlay)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for needed in [("Namespace", "smr-system"), ("Deployment", "smr-watcher"),
                   ("DaemonSet", "smr-agent"), ("Deployment", "smr-storage"),
                   ("ConfigMap", "smr-config"), ("PodDisruptionBudget", "smr-watcher")]:
        assert needed in kinds, f"{overlay} lacks {needed}"
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert deploy_policy.violations(docs) == []


def test_overlays_differ_where_they_should(kustomize: str) -> None:
    dev, gpu, prod = (render(kustomize, o) for o in OVERLAYS)

    def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
        return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name),
                    None)

    assert find(dev, "StatefulSet", "nats") and find(dev, "StatefulSet", "minio")
    assert find(prod, "StatefulSet", "nats") is None, "prod uses the user's NATS"
    # Every overlay ships smr's NATS users (components/nats-auth); dev's
    # servers run with them, and each service logs in as its own.
    for docs in (dev, gpu, prod):
        assert "accounts {" in (find(docs, "ConfigMap", "smr-nats-accounts") or {})["data"][
            "accounts.conf"]
        users = {}
        for d in docs:
            for _, c in deploy_policy.containers(d):
                env = {e["name"]: e for e in c.get("env", [])}
                if "SMR_NATS_USER" in env:
                    users[d["metadata"]["name"]] = env["SMR_NATS_USER"]["value"]
                    assert env["SMR_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] \
                        == "smr-nats-users"
        assert users == {"smr-watcher": "smr-watcher", "smr-storage": "smr-storage",
                         "smr-webhook": "smr-webhook", "smr-agent": "smr-agent",
                         **({"smr-agent-gpu": "smr-agent"} if docs is gpu else {})}
        # The watcher can read no checkpoint: neither the bucket's credentials
        # nor the encryption key reach its pod (its NATS user reads no images).
        text = str(find(docs, "Deployment", "smr-watcher"))
        assert "smr-s3" not in text and "smr-encryption-key" not in text
    for docs in (dev, gpu):
        nats = find(docs, "StatefulSet", "nats")
        assert nats and "--config=/etc/nats/accounts.conf" in \
            nats["spec"]["template"]["spec"]["containers"][0]["args"]
    # The shipped NATS is a 3-server cluster, and smr replicates onto all three.
    for docs in (dev, gpu):
        nats = find(docs, "StatefulSet", "nats")
        assert nats and nats["spec"]["replicas"] == 3
        args = nats["spec"]["template"]["spec"]["containers"][0]["args"]
        routes = next(a for a in args if a.startswith("--routes="))
        assert len(routes.split(",")) == 3
        assert find(docs, "PodDisruptionBudget", "nats")
        data = (find(docs, "ConfigMap", "smr-config") or {})["data"]
        assert data["SMR_NATS_REPLICAS"] == "3"
        assert len(data["SMR_NATS_URL"].split(",")) == 3
    agent = find(gpu, "DaemonSet", "smr-agent-gpu")
    assert agent is not None and find(gpu, "DaemonSet", "smr-agent") is not None
    assert find(dev, "DaemonSet", "smr-agent-gpu") is None
    spec = agent["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert "transparent_hugepage" in " ".join(spec["initContainers"][0]["command"])
    # Two DaemonSets with one selector would fight over each other's pods.
    assert agent["spec"]["selector"] != find(gpu, "DaemonSet", "smr-agent")["spec"]["selector"]
    for docs in (dev, gpu, prod):
        watcher = find(docs, "Deployment", "smr-watcher")
        assert watcher and watcher["spec"]["replicas"] == 2
        for d in docs:
            for _, c in deploy_policy.containers(d):
                if c["image"].startswith("ghcr.io/smr-dev/smr"):
                    assert c["image"] == "ghcr.io/smr-dev/smr:0.1.0"


def _base(kustomize: str) -> list[dict[str, Any]]:
    return render(kustomize, "dev")


def _mutate(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


BAD = {
    "latest": lambda d: _mutate(d, "Deployment", "smr-watcher")["spec"]["template"]["spec"][
        "containers"][0].update(image="ghcr.io/smr-dev/smr:latest"),
    "untagged": lambda d: _mutate(d, "Deployment", "smr-storage")["spec"]["template"]["spec"][
        "containers"][0].update(image="ghcr.io/smr-dev/smr"),
    "no-limits": lambda d: _mutate(d, "StatefulSet", "nats")["spec"]["template"]["spec"][
        "containers"][0]["resources"].pop("limits"),
    "wildcard-verbs": lambda d: _mutate(d, "ClusterRole", "smr-watcher")["rules"][0].update(
        verbs=["*"]),
    "wildcard-resources": lambda d: _mutate(d, "ClusterRole", "smr-agent")["rules"][0].update(
        resources=["*"]),
    "privileged-watcher": lambda d: _mutate(d, "Deployment", "smr-watcher")["spec"][
        "template"]["spec"]["containers"][0]["securityContext"].update(privileged=True),
    "host-pid-storage": lambda d: _mutate(d, "Deployment", "smr-storage")["spec"][
        "template"]["spec"].update(hostPID=True),
    "webhook-every-port": lambda d: _mutate(d, "NetworkPolicy", "smr-webhook-ingress")[
        "spec"]["ingress"][0].pop("ports"),
    "agent-port-opened": lambda d: d.append({
        "kind": "NetworkPolicy", "metadata": {"name": "x", "namespace": "smr-system"},
        "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "smr-agent"}},
                 "ingress": [{"ports": [{"port": 8080}]}]}}),
}


@pytest.mark.parametrize("case", list(BAD))
def test_policy_catches(kustomize: str, case: str) -> None:
    docs = copy.deepcopy(_base(kustomize))
    assert deploy_policy.violations(docs) == []
    BAD[case](docs)
    found = deploy_policy.violations(docs)
    assert len(found) == 1, found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_agent_is_reached_on_its_metrics_port_only_and_the_webhook_on_its_own(
        kustomize: str, overlay: str) -> None:
    """The rendered NetworkPolicies: the node agent (root, every capability,
    on the pod network) admits its metrics port and nothing else; the
    webhook its HTTPS port, from the control plane's addresses in prod (from
    any source elsewhere: the API server is no pod a selector could name)."""
    docs = render(kustomize, overlay)
    agents = [d for d in docs if d["kind"] == "DaemonSet"
              and d["metadata"]["name"].startswith("smr-agent")]
    assert agents
    for agent in agents:
        assert not agent["spec"]["template"]["spec"].get("hostNetwork"), \
            "on the host's network no NetworkPolicy applies to the agent"
        assert deploy_policy.admitted(docs, agent) == [(9464, deploy_policy.ANY)]
    webhook = _mutate(docs, "Deployment", "smr-webhook")
    got = dict(deploy_policy.admitted(docs, webhook))
    assert set(got) == {8443, 9464}
    if overlay == "prod":
        assert got[8443] == [{"ipBlock": {"cidr": "10.0.0.0/28"}}]
    else:
        assert got[8443] == deploy_policy.ANY


def test_cert_manager_component(kustomize: str, tmp_path: Path) -> None:
    """The option for clusters with cert-manager: the webhook reads the mounted
    certificate, cert-manager injects the CA; the policy checks still hold."""
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(ROOT / 'overlays' / 'dev', tmp_path)}]\n"
        f"components: [{os.path.relpath(ROOT / 'components' / 'cert-manager', tmp_path)}]\n")
    out = subprocess.run([kustomize, "build", "--load-restrictor", "LoadRestrictionsNone",
                          str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    hook = next(d for d in docs if d["kind"] == "Deployment" and
                d["metadata"]["name"] == "smr-webhook")
    env = hook["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "SMR_WEBHOOK_CERT_DIR", "value": "/etc/smr/webhook-tls"} in env
    mwc = next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        "smr-system/smr-webhook"
    assert any(d["kind"] == "Certificate" for d in docs)
    for check in deploy_policy.CHECKS:
        assert check(docs) == [], check.__name__


# -- placement on a mixed cluster ---------------------------------------------------------

def _agents(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]
            for d in deploy_placement.agent_daemonsets(docs)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_pod_given_an_smr_runtime_class_lands_only_where_its_handler_is(
        kustomize: str, overlay: str) -> None:
    """A mixed cluster (CPU and GPU nodes, the GPU operator's taint, a user's
    own taint, a cordoned node): every RuntimeClass the webhook can give a pod
    exists, allows only nodes where an agent installed its handler, and allows
    every such node."""
    nodes = deploy_placement.MIXED_CLUSTER
    p = deploy_placement.place(render(kustomize, overlay), nodes)
    assert deploy_placement.problems(p, nodes) == []
    assert p.allowed["smr"], "no node can take an opted-in pod"
    if overlay == "gpu":
        gpu_nodes = [n.name for n in nodes if n.gpus]
        assert sorted(p.allowed["smr-nvidia"]) == sorted(gpu_nodes)
        assert p.given == ["smr", "smr-nvidia"]


def test_gpu_nodes_run_the_gpu_agent_and_every_node_runs_one(kustomize: str) -> None:
    docs = render(kustomize, "gpu")
    agents = _agents(docs)
    p = deploy_placement.place(docs, deploy_placement.MIXED_CLUSTER)
    for n in deploy_placement.MIXED_CLUSTER:
        assert len(p.agents[n.name]) == 1, f"{n.name}: {p.agents[n.name]}"
        spec = agents[p.agents[n.name][0]]
        env = {e["name"]: e.get("value") for e in spec["containers"][0].get("env") or []}
        if n.gpus:  # the driver's checkpoint API reaches the agent only through it
            assert spec.get("runtimeClassName") == "nvidia" and env.get("SMR_GPU") == "auto"
        else:  # no NVIDIA runtime handler on a CPU node: that pod could not start
            assert "runtimeClassName" not in spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_upgrade_starts_each_nodes_new_agent_before_it_stops_the_old_one(
        kustomize: str, overlay: str) -> None:
    """Every agent DaemonSet rolls with maxSurge and no unavailability (a
    node is never without an agent: tests/agent/test_rollout_pods.py), and
    nothing in its pod keeps the new one from running beside the old: no
    hostPort, no hostNetwork; its step locks (and starts lock) are the
    node's, a hostPath the two share."""
    docs = render(kustomize, overlay)
    for ds in deploy_placement.agent_daemonsets(docs):
        name, spec = ds["metadata"]["name"], ds["spec"]["template"]["spec"]
        rolling = ds["spec"]["updateStrategy"]
        assert rolling["type"] == "RollingUpdate", name
        assert rolling["rollingUpdate"].get("maxUnavailable") in (0, "0%"), name
        assert rolling["rollingUpdate"].get("maxSurge") not in (None, 0, "0%"), name
        assert not spec.get("hostNetwork"), name
        for c in spec["containers"]:
            assert all("hostPort" not in p for p in c.get("ports") or []), name
        env = {e["name"]: e.get("value") for c in spec["containers"] for e in c.get("env") or []}
        mounts = {m["mountPath"]: m["name"] for c in spec["containers"]
                  for m in c.get("volumeMounts") or []}
        volume = {v["name"]: v for v in spec["volumes"]}[mounts[env["SMR_STEP_LOCK_DIR"]]]
        assert "hostPath" in volume, f"{name}: its step locks are not the node's"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_agent_is_placed_on_a_windows_node(kustomize: str, overlay: str) -> None:
    """The agent tolerates every taint, so only its node selector keeps it
    off a mixed cluster's Windows nodes, where it could not start."""
    docs = render(kustomize, overlay)
    p = deploy_placement.place(docs, [*deploy_placement.MIXED_CLUSTER, deploy_placement.WINDOWS])
    assert p.agents["win-1"] == [], f"an agent lands on a Windows node: {p.agents['win-1']}"
    assert all(len(p.agents[n.name]) == 1 for n in deploy_placement.MIXED_CLUSTER), p.agents


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_smrs_own_pods_have_a_priority_no_workload_preempts(kustomize: str,
                                                            overlay: str) -> None:
    """The agent is node-critical (it must outlive the pods it checkpoints);
    the watcher, webhook, storage and NATS have smr's own class, above every
    workload's (user classes go up to 1000000000), so the scheduler never
    preempts them for one, least of all in a reclaim wave."""
    docs = render(kustomize, overlay)
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PriorityClass"}
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        name = d["metadata"]["name"]
        got = d["spec"]["template"]["spec"].get("priorityClassName")
        if d["kind"] == "DaemonSet":
            assert got == "system-node-critical", f"{overlay}: {name} has {got}"
        elif name != "minio":  # the dev overlay's stand-in for your S3
            assert got in classes, f"{overlay}: {d['kind']} {name} has priority class {got}"
            assert classes[got]["value"] == 1000000000, classes[got]
            assert not classes[got].get("globalDefault")


@pytest.mark.parametrize("overlay", ["dev", "gpu"])
def test_nodes_without_an_agent_get_no_smr_pods(kustomize: str, overlay: str) -> None:
    """Where the agent does not run (a taint it does not tolerate, the user's
    nodeSelector), its node has no label, so opted-in pods wait in Pending
    rather than start where no handler is."""
    docs = render(kustomize, overlay)
    for spec in _agents(docs).values():  # no longer every taint: the GPU one only
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    nodes = deploy_placement.MIXED_CLUSTER
    p = deploy_placement.place(docs, nodes)
    assert p.agents["cpu-dedicated"] == [] and p.agents["gpu-1"] != []
    assert "cpu-dedicated" not in p.allowed["smr"]
    assert deploy_placement.problems(p, nodes) == []


def test_nats_callout_component(kustomize: str, tmp_path: Path) -> None:
    """Agents held to their node (components/nats-callout, on the gpu overlay:
    both agents): each logs in with its projected token, not the shared
    password; the servers run the callout; the policy checks still hold."""
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(ROOT / 'overlays' / 'gpu', tmp_path)}]\n"
        f"components: [{os.path.relpath(ROOT / 'components' / 'nats-callout', tmp_path)}]\n")
    out = subprocess.run([kustomize, "build", "--load-restrictor", "LoadRestrictionsNone",
                          str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    agents = [d for d in docs if d["kind"] == "DaemonSet"]
    assert sorted(a["metadata"]["name"] for a in agents) == ["smr-agent", "smr-agent-gpu"]
    for a in agents:
        spec = a["spec"]["template"]["spec"]
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert "SMR_NATS_USER" not in env and "SMR_NATS_PASSWORD" not in env
        token = env["SMR_NATS_TOKEN_FILE"]["value"]
        vol = next(v for v in spec["volumes"] if v["name"] == "nats-token")
        sa = vol["projected"]["sources"][0]["serviceAccountToken"]
        assert sa["audience"] == "nats" and token.endswith("/" + sa["path"])
    nats = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats")
    c = nats["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][0] == "--config=/etc/nats/auth-callout.conf"
    assert any(e["name"] == "SMR_NATS_CALLOUT_ISSUER" for e in c["env"])
    auth = next(d for d in docs if d["kind"] == "Deployment"
                and d["metadata"]["name"] == "smr-natsauth")
    assert auth["spec"]["template"]["spec"]["containers"][0]["args"] == ["natsauth"]
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert deploy_policy.violations(docs) == []


def test_the_webhook_is_called_for_opted_in_pods_by_their_labels_and_briefly(
        kustomize: str) -> None:
    """Each entry of the MutatingWebhookConfiguration selects pods by one
    opt-in label (services/policy), so a pod without one costs no call on its
    creation; one entry, for the env-var opt-in no selector can see, takes the
    pods with none of them. Each call is short, and never refuses a pod. The
    watcher's reachability probe has an entry of its own, for its label in
    smr's own namespace only; every entry allows a dry run (no side effects).
    One entry refuses: debug containers that could ptrace the agent's CRIU,
    added to smr's pods only, refused too while the webhook is unreachable."""
    from services.policy import HEARTBEAT, NODE_RESTORE, SNAPSHOT_WHEN_READY, START_FROM

    labels = {f"smr.dev/{name}" for name in (NODE_RESTORE, HEARTBEAT, SNAPSHOT_WHEN_READY,
                                               START_FROM)}
    for overlay in OVERLAYS:
        [cfg] = [d for d in render(kustomize, overlay)
                 if d["kind"] == "MutatingWebhookConfiguration"]
        [ephemeral] = [h for h in cfg["webhooks"]
                       if h["name"] == "ephemeral-ptrace.pods.smr.dev"]
        assert ephemeral["failurePolicy"] == "Fail" and ephemeral["timeoutSeconds"] <= 3
        assert ephemeral["rules"] == [{"operations": ["UPDATE"], "apiGroups": [""],
                                       "apiVersions": ["v1"],
                                       "resources": ["pods/ephemeralcontainers"]}]
        match = ephemeral["matchConditions"][0]["expression"]
        # The stored pod, by what a tenant cannot take off a running one too
        # (`object` is the pod as the client sent it: tests/test_webhook.py).
        assert "smr.dev/injected" in match and "SMR_CONTAINER" in match, match
        assert "oldObject." in match and "object." not in match.replace("oldObject.", ""), match
        hooks = [h for h in cfg["webhooks"] if h is not ephemeral]
        for h in [*hooks, ephemeral]:
            assert h["reinvocationPolicy"] == "IfNeeded", h["name"]
            assert h["sideEffects"] == "None", h["name"]
        for h in hooks:
            assert h["timeoutSeconds"] <= 3 and h["failurePolicy"] == "Ignore", h["name"]
            assert h["reinvocationPolicy"] == "IfNeeded", h["name"]
            assert h["sideEffects"] == "None", h["name"]
        [probe] = [h for h in hooks if h["name"] == "probe.pods.smr.dev"]
        assert probe["objectSelector"] == {"matchExpressions": [
            {"key": "smr.dev/webhook-probe", "operator": "Exists"}]}
        assert probe["namespaceSelector"] == {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In",
             "values": ["smr-system"]}]}
        hooks = [h for h in hooks if h is not probe]
        terms = [[(e["key"], e["operator"]) for e in h["objectSelector"]["matchExpressions"]]
                 for h in hooks]
        by_label = sorted(t[0][0] for t in terms if len(t) == 1 and t[0][1] == "Exists")
        assert by_label == sorted(labels), overlay
        rest = [t for t in terms if not (len(t) == 1 and t[0][1] == "Exists")]
        assert [sorted(t) for t in rest] == [sorted((k, "DoesNotExist") for k in labels)], \
            "the env-var entry must leave out the pods a label entry calls for"
