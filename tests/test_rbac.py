"""Every Kubernetes API call smr's services make, next to the shipped RBAC
rule that grants it (deploy/kustomize, as tests/fake_rbac.py renders it),
and the fake API server holding each service to those rules as a real one
does. The services' own tests run against that fake as their service
accounts, so a call the table misses is refused there too."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.kubeapi import api_client
from tests.fake_apiserver import FakeApiServer, pod
from tests.fake_rbac import Request, shipped

SERVICES = Path(__file__).resolve().parent.parent / "services"
# Whose service account runs the code of each package.
ACCOUNT_OF = {"watcher": ("smr-watcher",), "agent": ("smr-agent",),
              "containers": ("smr-agent",), "webhook": ("smr-webhook",),
              "natsauth": ("smr-natsauth",), "storage": ("smr-storage",),
              # a Job's suspension, read by the watcher and by the agent's preStop
              "suspension.py": ("smr-watcher", "smr-agent")}
TENANT = "team-a"  # any namespace of the cluster's workloads
SYSTEM = "smr-system"


@dataclass(frozen=True)
class Call:
    account: str
    method: str  # the kubernetes-asyncio method
    verb: str
    group: str
    resource: str
    namespace: str | None  # None: cluster-scoped or across all namespaces
    granted_by: str
    name: str | None = None
    subresource: str | None = None

    def request(self) -> Request:
        return Request(self.verb, self.group, self.resource, self.subresource,
                       self.namespace, self.name)


CALLS = [
    # The watcher: node and pod informers, Events, bare-pod recreation, leader election.
    Call("smr-watcher", "list_node", "list", "", "nodes", None, "ClusterRole/smr-watcher"),
    Call("smr-watcher", "list_node", "watch", "", "nodes", None, "ClusterRole/smr-watcher"),
    Call("smr-watcher", "list_pod_for_all_namespaces", "list", "", "pods", None,
         "ClusterRole/smr-watcher"),
    Call("smr-watcher", "list_pod_for_all_namespaces", "watch", "", "pods", None,
         "ClusterRole/smr-watcher"),
    Call("smr-watcher", "create_namespaced_event", "create", "", "events", TENANT,
         "ClusterRole/smr-watcher"),
    Call("smr-watcher", "create_namespaced_pod", "create", "", "pods", TENANT,
         "ClusterRole/smr-watcher"),
    # Its probe of the webhook: a dry-run create (dryRun=All, which RBAC checks as a
    # create) of a pod in its own namespace; nothing is stored.
    Call("smr-watcher", "create_namespaced_pod", "create", "", "pods", SYSTEM,
         "ClusterRole/smr-watcher"),
    # A bare pod that graceful node shutdown left Failed is deleted, then created again.
    Call("smr-watcher", "delete_namespaced_pod", "delete", "", "pods", TENANT,
         "ClusterRole/smr-watcher", name="trainer"),
    Call("smr-watcher", "read_namespaced_lease", "get", "coordination.k8s.io", "leases",
         SYSTEM, "Role/smr-watcher-lease", name="smr-watcher"),
    Call("smr-watcher", "create_namespaced_lease", "create", "coordination.k8s.io", "leases",
         SYSTEM, "Role/smr-watcher-lease"),
    Call("smr-watcher", "replace_namespaced_lease", "update", "coordination.k8s.io",
         "leases", SYSTEM, "Role/smr-watcher-lease", name="smr-watcher"),
    # The node agent: its pods, its node's labels and prestop's look at the node.
    Call("smr-agent", "read_namespaced_pod", "get", "", "pods", TENANT,
         "ClusterRole/smr-agent", name="trainer"),
    Call("smr-agent", "list_pod_for_all_namespaces", "list", "", "pods", None,
         "ClusterRole/smr-agent"),
    # A container start waits for another pod of its checkpoint id still ending.
    Call("smr-agent", "list_namespaced_pod", "list", "", "pods", TENANT,
         "ClusterRole/smr-agent"),
    Call("smr-agent", "read_node", "get", "", "nodes", None, "ClusterRole/smr-agent",
         name="node-1"),
    Call("smr-agent", "patch_node", "patch", "", "nodes", None, "ClusterRole/smr-agent",
         name="node-1"),
    Call("smr-agent", "create_namespaced_event", "create", "", "events", "default",
         "ClusterRole/smr-agent"),
    # Both: is a Job's pod deleted by its suspension (services/suspension)?
    *(Call(a, "read_namespaced_job", "get", "batch", "jobs", TENANT, f"ClusterRole/{a}",
           name="train") for a in ("smr-watcher", "smr-agent")),
    *(Call(a, "list_namespaced_custom_object", "list", "kueue.x-k8s.io", "workloads", TENANT,
           f"ClusterRole/{a}") for a in ("smr-watcher", "smr-agent")),
    # The webhook: its serving certificate and its configuration's caBundle.
    Call("smr-webhook", "read_namespaced_secret", "get", "", "secrets", SYSTEM,
         "Role/smr-webhook-tls", name="smr-webhook-tls"),
    Call("smr-webhook", "create_namespaced_secret", "create", "", "secrets", SYSTEM,
         "Role/smr-webhook-tls"),
    Call("smr-webhook", "replace_namespaced_secret", "update", "", "secrets", SYSTEM,
         "Role/smr-webhook-tls", name="smr-webhook-tls"),
    Call("smr-webhook", "read_mutating_webhook_configuration", "get",
         "admissionregistration.k8s.io", "mutatingwebhookconfigurations", None,
         "ClusterRole/smr-webhook", name="smr-webhook"),
    Call("smr-webhook", "replace_mutating_webhook_configuration", "update",
         "admissionregistration.k8s.io", "mutatingwebhookconfigurations", None,
         "ClusterRole/smr-webhook", name="smr-webhook"),
    # The storage service: the Checkpoint resources, a mirror of the bucket.
    Call("smr-storage", "list_cluster_custom_object", "list", "smr.dev", "checkpoints", None,
         "ClusterRole/smr-storage-checkpoints"),
    Call("smr-storage", "create_namespaced_custom_object", "create", "smr.dev", "checkpoints",
         TENANT, "ClusterRole/smr-storage-checkpoints"),
    Call("smr-storage", "replace_namespaced_custom_object", "update", "smr.dev",
         "checkpoints", TENANT, "ClusterRole/smr-storage-checkpoints", name="web-0.main"),
    Call("smr-storage", "delete_namespaced_custom_object", "delete", "smr.dev", "checkpoints",
         TENANT, "ClusterRole/smr-storage-checkpoints", name="web-0.main"),
    # The NATS auth callout: agents' projected tokens.
    Call("smr-natsauth", "create_token_review", "create", "authentication.k8s.io",
         "tokenreviews", None, "ClusterRole/system:auth-delegator"),
]


def api_methods() -> set[str]:
    """Every method of kubernetes-asyncio's API classes (CoreV1Api, ...)."""
    return {m for name in dir(client) if name.endswith("Api") and name != "ApiClient"
            for m in dir(getattr(client, name)) if not m.startswith("_")
            and re.match(r"(list|read|create|replace|patch|delete|connect)_", m)}


def test_every_api_call_is_granted_by_the_shipped_rbac() -> None:
    rbac = shipped()
    wrong = []
    for c in CALLS:
        got = rbac.grant_for(f"system:serviceaccount:{SYSTEM}:{c.account}", (), c.request())
        if got != c.granted_by:
            wrong.append(f"{c.account} {c.method}: {c.request()} is granted by {got}, "
                         f"not {c.granted_by}")
    assert not wrong, "deploy/kustomize's RBAC does not grant:\n" + "\n".join(wrong)


def test_the_table_lists_every_api_call_in_the_code() -> None:
    """A call added to a service without its row (and its rule) fails here."""
    known = api_methods()
    listed = {(c.account, c.method) for c in CALLS}
    missing = []
    for path in sorted(SERVICES.rglob("*.py")):
        text = path.read_text()
        found = {m for m in re.findall(r"\.(\w+)\b", text) if m in known}
        if "LeaseLock(" in text:  # kubernetes-asyncio's LeaseLock makes these
            found |= {"read_namespaced_lease", "create_namespaced_lease",
                      "replace_namespaced_lease"}
        if not found:
            continue
        package = path.relative_to(SERVICES).parts[0]
        accounts = ACCOUNT_OF.get(package)
        assert accounts, f"{path}: API calls from a package with no service account: {found}"
        missing += [f"{path.relative_to(SERVICES.parent)}: {m} ({account})"
                    for account in accounts for m in sorted(found)
                    if (account, m) not in listed]
    assert not missing, "API calls with no row in CALLS:\n" + "\n".join(missing)


@pytest.fixture
async def kube() -> AsyncIterator[FakeApiServer]:
    k = await FakeApiServer().start()
    yield k
    await k.stop()


async def test_the_fake_refuses_what_a_role_does_not_grant_as_a_real_server_does(
        kube: FakeApiServer) -> None:
    kube.put("pods", pod("trainer", "node-1", namespace=TENANT))
    agent = await api_client(kube.url, token=kube.token("smr-agent"))
    nobody = await api_client(kube.url)
    try:
        core = client.CoreV1Api(agent)
        await core.read_namespaced_pod("trainer", TENANT, _preload_content=False)  # granted
        with pytest.raises(ApiException) as e:
            await core.delete_namespaced_pod("trainer", TENANT)
        assert e.value.status == 403 and e.value.reason == "Forbidden"
        body = json.loads(e.value.body)
        assert (body["kind"], body["status"], body["reason"], body["code"]) == (
            "Status", "Failure", "Forbidden", 403)
        assert body["message"] == (
            'pods "trainer" is forbidden: User "system:serviceaccount:smr-system:smr-agent" '
            'cannot delete resource "pods" in API group "" in the namespace "team-a"')
        with pytest.raises(ApiException) as e:  # a Role's namespace only
            await client.CoordinationV1Api(agent).list_namespaced_lease(SYSTEM)
        assert e.value.status == 403
        with pytest.raises(ApiException) as e:
            await client.CoreV1Api(nobody).list_node()
        assert e.value.status == 401
        assert kube.denied == [
            "system:serviceaccount:smr-system:smr-agent: delete core/pods ns=team-a",
            "system:serviceaccount:smr-system:smr-agent: list coordination.k8s.io/leases "
            "ns=smr-system"]
        assert kube.get("pods", "trainer", TENANT) is not None
    finally:
        await agent.close()
        await nobody.close()
