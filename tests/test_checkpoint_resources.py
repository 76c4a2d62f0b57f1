"""`kubectl get checkpoints`: the storage service keeps one Checkpoint
resource (deploy/kustomize/base/checkpoints.yaml) per stored checkpoint in
its pod's namespace, a mirror of what the bucket holds.

Real parts: nats-server with the shipped users (the storage service logs in
as smr-storage), moto's S3 server over HTTP, the real commit path
(CheckpointStore.commit), kubernetes-asyncio. The API server is the FAKE one
(tests/fake_apiserver.py): it serves the CRD's routes once the shipped CRD
is created, enforces the shipped RBAC, and answers kubectl's Table request
from the CRD's printer columns."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.kubeapi import api_client
from services.storage.codec import Codec
from services.storage.mirror import DELETE_DATA, GROUP, PLURAL, VERSION, Mirror
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from smr.bus import BusConfig
from smr.contract.messages import Target
from tests import nats_auth
from tests.fake_apiserver import FakeApiServer
from tests.fake_rbac import Rbac, shipped_docs

# What kubectl get sends (kubectl 1.30's Accept for a list).
KUBECTL_ACCEPT = ("application/json;as=Table;v=v1;g=meta.k8s.io,"
                  "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")
TENANT = "alice"


def tenant_binding() -> dict[str, Any]:
    """What a cluster's operator gives a team: the built-in view role in its namespace."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "alice-view", "namespace": "a"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "view"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": TENANT}]}


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = await FakeApiServer(rbac=Rbac.from_docs([*shipped_docs(), tenant_binding()])
                                 ).start()
    crd = next(d for d in shipped_docs() if d["kind"] == "CustomResourceDefinition")
    async with aiohttp.ClientSession() as http:  # kubectl apply, as the operator
        async with http.post(f"{server.url}/apis/apiextensions.k8s.io/v1/"
                             "customresourcedefinitions", json=crd,
                             headers={"Authorization": f"Bearer {server.admin_token}"}) as r:
            assert r.status == 201, await r.text()
    yield server
    await server.stop()


@pytest.fixture
async def store(s3_endpoint: str) -> AsyncIterator[CheckpointStore]:
    from services.storage.s3 import S3Backend

    bucket = f"smr-{uuid.uuid4().hex[:6]}"
    backend = S3Backend(bucket, prefix="ckpt", path_style=True, endpoint_url=s3_endpoint)
    async with backend._client() as c:
        await c.create_bucket(Bucket=bucket)
    s = CheckpointStore(backend, Codec(level=1))
    yield s
    await s.close()


class Storage:
    """The storage service with its mirror, as its Deployment runs it."""

    def __init__(self, users: nats_auth.SecuredNats, config: BusConfig, api: FakeApiServer,
                 store: CheckpointStore) -> None:
        self.users, self.config, self.api, self.store = users, config, api, store

    async def __aenter__(self) -> Storage:
        self.bus = await self.users.connect("smr-storage", self.config, buckets=())
        self.kube = await api_client(self.api.url, token=self.api.token("smr-storage"))
        self.svc = StorageService(self.bus, self.store, scan_interval_s=0.3,
                                  mirror=Mirror(self.kube, self.store))
        self.task = asyncio.create_task(self.svc.run())
        await asyncio.wait_for(self.svc.ready.wait(), 15)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.svc.stop()
        await asyncio.wait_for(self.task, 15)
        await self.bus.close()
        await self.kube.close()


async def commit(store: CheckpointStore, tmp_path: Path, ns: str, pod: str, n: int) -> str:
    """``n`` generations of ``pod``'s container, stored as the node agent stores them."""
    ckpt = f"{pod}.main"
    src = tmp_path / f"src-{ns}"
    (src / "images").mkdir(parents=True, exist_ok=True)
    (src / "images" / "pages-1.img").write_bytes(os.urandom(6 * 1024))
    for i in range(n):
        await store.commit(ns, ckpt, src, {
            "request_id": f"{ns}-{i}", "node": f"node-{ns}", "reason": "drain",
            "target": Target(kind="pod", namespace=ns, pod=pod, container="main").to_dict(),
            "versions": {"criu": "4.2"}})
    return ckpt


async def until(what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := await check():
            return got
        await asyncio.sleep(0.1)
    pytest.fail(f"{what} within {timeout}s")


async def test_kubectl_get_checkpoints_lists_its_namespaces_own_mirrored_from_the_bucket(
        nats_users: nats_auth.SecuredNats, bus_config: BusConfig, api: FakeApiServer,
        store: CheckpointStore, tmp_path: Path) -> None:
    web = await commit(store, tmp_path, "a", "web-0", 2)
    db = await commit(store, tmp_path, "b", "db-0", 1)
    admin = await api_client(api.url, token=api.admin_token)
    alice = await api_client(api.url, token=api.user_token(TENANT))
    try:
        as_admin, as_alice = client.CustomObjectsApi(admin), client.CustomObjectsApi(alice)

        async def listed(ns: str) -> list[dict[str, Any]]:
            return (await as_admin.list_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL))["items"]

        async with Storage(nats_users, bus_config, api, store):
            await until("a's checkpoint mirrored", lambda: listed("a"))
            await until("b's checkpoint mirrored", lambda: listed("b"))
            # The tenant, through kubernetes-asyncio: a's only, at its latest generation.
            mine = (await as_alice.list_namespaced_custom_object(
                GROUP, VERSION, "a", PLURAL))["items"]
            assert [(o["spec"]["checkpointId"], o["status"]["latestGeneration"])
                    for o in mine] == [(web, 2)]
            assert mine[0]["status"]["generations"] == [1, 2]
            assert mine[0]["status"]["node"] == "node-a"
            with pytest.raises(ApiException) as refused:
                await as_alice.list_namespaced_custom_object(GROUP, VERSION, "b", PLURAL)
            assert refused.value.status == 403
            assert f"{TENANT}: list smr.dev/checkpoints ns=b" in api.denied

            # kubectl get checkpoints -n a (and -o wide): the Table kubectl asks for.
            async with aiohttp.ClientSession() as http:
                async with http.get(
                        f"{api.url}/apis/{GROUP}/{VERSION}/namespaces/a/{PLURAL}",
                        headers={"Accept": KUBECTL_ACCEPT,
                                 "Authorization": f"Bearer {api.user_token(TENANT)}"}) as r:
                    assert r.status == 200, await r.text()
                    table = await r.json()
                async with http.get(
                        f"{api.url}/apis/{GROUP}/{VERSION}/namespaces/b/{PLURAL}",
                        headers={"Accept": KUBECTL_ACCEPT,
                                 "Authorization": f"Bearer {api.user_token(TENANT)}"}) as r:
                    assert r.status == 403
            assert table["kind"] == "Table"
            columns = [(c["name"], c["priority"]) for c in table["columnDefinitions"]]
            assert columns == [("Name", 0), ("ID", 0), ("Generation", 0), ("Size", 0),
                               ("Reason", 0), ("Age", 0), ("Node", 0), ("Phase", 0),
                               ("Stored", 1), ("Request", 1), ("Location", 1)]
            [row] = table["rows"]
            cells = dict(zip([c for c, _ in columns], row["cells"], strict=True))
            assert (cells["ID"], cells["Generation"], cells["Reason"], cells["Node"],
                    cells["Phase"]) == (web, 2, "drain", "node-a", "Stored")
            assert cells["Size"] == "6.0 KiB" and cells["Age"].endswith("s")
            assert cells["Request"] == "a-1" and cells["Location"].rstrip("/").endswith("/00000002")

            # Deleting a resource deletes no data: it is rebuilt from the bucket.
            [a_obj] = await listed("a")
            name = a_obj["metadata"]["name"]
            await as_admin.delete_namespaced_custom_object(GROUP, VERSION, "a", PLURAL, name)
            back = await until("the deleted resource rebuilt from the bucket",
                               lambda: listed("a"))
            assert back[0]["metadata"]["uid"] != a_obj["metadata"]["uid"]
            assert back[0]["status"]["latestGeneration"] == 2
            assert (await store.latest("a", web)) is not None

            # The annotation asks for the data to go: through the store, then the resource.
            [b_obj] = await listed("b")
            await as_admin.patch_namespaced_custom_object(
                GROUP, VERSION, "b", PLURAL, b_obj["metadata"]["name"],
                {"metadata": {"annotations": {DELETE_DATA: "true"}}},
                _content_type="application/merge-patch+json")  # kubectl annotate's

            async def b_gone() -> bool:
                return not await listed("b") and await store.generations("b", db) == []
            await until("b's checkpoint deleted as its annotation asked", b_gone)
            assert await listed("a"), "a's checkpoint was left alone"

        # Rebuilt at start: every resource removed while no storage service ran.
        for o in await listed("a"):
            await as_admin.delete_namespaced_custom_object(
                GROUP, VERSION, "a", PLURAL, o["metadata"]["name"])
        async with Storage(nats_users, bus_config, api, store):
            again = await until("a's resource rebuilt at start", lambda: listed("a"))
            assert again[0]["spec"]["checkpointId"] == web
    finally:
        await admin.close()
        await alice.close()
