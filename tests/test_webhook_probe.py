"""The webhook's reachability, probed the API server's way: the watcher's
server-side dry-run create of an opted-in pod, against the FAKE API server
(tests/fake_apiserver.py), which admits a dry run as kube-apiserver does
(mutating webhooks called, nothing stored, refused where a webhook may have
side effects), the real webhook over HTTPS, the real kubernetes-asyncio
client as the watcher's service account (held to the shipped RBAC), and a
real nats-server with the shipped users (the watcher records, `smr status`
reads as smr-admin)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.kubeapi import api_client
from services.storage.store import CheckpointStore
from services.watcher.service import Watcher
from services.watcher.webhook_probe import WebhookProbe, probe_pod
from services.webhook.service import Webhook
from smr import config, metrics
from smr.bus import KV_HEALTH, Bus
from smrctl import status
from tests.agent.cluster import webhook_configuration
from tests.fake_apiserver import FakeApiServer, pod
from tests.test_watcher import (  # noqa: F401 (fixtures)
    api,
    bus,
    storage,
    watch_settings,
    watcher_bus,
)

S = config.load({})
SERVICE = ("smr-system", "smr-webhook")


@pytest.fixture
async def kube() -> AsyncIterator[FakeApiServer]:
    srv = await FakeApiServer(bookmark_interval=0.5).start()
    srv.put("mutatingwebhookconfigurations", webhook_configuration())
    yield srv
    await srv.stop()


@pytest.fixture
async def webhook(kube: FakeApiServer) -> AsyncIterator[Webhook]:
    """The webhook as deployed: its own service account, reached as the Service."""
    hook_api = await api_client(kube.url, token=kube.token("smr-webhook"))
    hook = Webhook(hook_api, S.replace(webhook_port=0), host="127.0.0.1")
    task = asyncio.create_task(hook.run())
    await asyncio.wait_for(hook.ready.wait(), 10)
    kube.services[SERVICE] = ("127.0.0.1", hook.port)
    yield hook
    hook.stop()
    await task
    await hook_api.close()


@pytest.fixture
async def admin(kube: FakeApiServer) -> AsyncIterator[client.CoreV1Api]:
    a = await api_client(kube.url, token=kube.admin_token)
    yield client.CoreV1Api(a)
    await a.close()


def opted_in(name: str) -> dict[str, Any]:
    return pod(name, None, labels={"smr.dev/node-restore": "true"})


async def dry_run(core: client.CoreV1Api, body: dict[str, Any], ns: str = "default"
                  ) -> dict[str, Any]:
    """The API server's answer to a dry-run create (raw: the fake's pods carry
    a partial status that the client's models refuse)."""
    r = await core.create_namespaced_pod(ns, body, dry_run="All", _preload_content=False)
    answer: dict[str, Any] = orjson.loads(await r.read())
    if r.status != 201:
        raise ApiException(status=r.status, reason=answer.get("reason"))
    return answer


# -- the fake API server admits a dry run as a real one does ----------------------------


async def test_a_dry_run_create_is_admitted_by_the_webhook_and_stores_nothing(
        kube: FakeApiServer, webhook: Webhook, admin: client.CoreV1Api) -> None:
    rv = kube.rv
    out = await dry_run(admin, opted_in("trainer"))
    assert out["metadata"]["annotations"]["smr.dev/injected"] == "smr"
    assert out["spec"]["runtimeClassName"] == "smr"
    assert kube.get("pods", "trainer", "default") is None
    assert kube.rv == rv, "a dry run wrote something"
    assert any(line.startswith("node-restore.pods.smr.dev: ") and "patch bytes" in line
               for line in kube.admission_log), kube.admission_log
    refused = await admin.create_namespaced_pod("default", opted_in("x"), dry_run="Some",
                                                _preload_content=False)
    assert refused.status == 400, "dryRun takes All only"
    await admin.create_namespaced_pod("default", opted_in("trainer"),  # a real one stores
                                      _preload_content=False)
    assert kube.get("pods", "trainer", "default") is not None


@pytest.mark.parametrize("side_effects", ["Some", "Unknown"])
async def test_a_dry_run_is_refused_where_a_matching_webhook_may_have_side_effects(
        kube: FakeApiServer, webhook: Webhook, admin: client.CoreV1Api,
        side_effects: str) -> None:
    cfg = webhook_configuration()
    cfg["webhooks"][0]["sideEffects"] = side_effects  # node-restore's entry
    kube.put("mutatingwebhookconfigurations", cfg)
    r = await admin.create_namespaced_pod("default", opted_in("trainer"), dry_run="All",
                                          _preload_content=False)
    assert r.status == 400
    assert (await r.json())["message"] == (
        'admission webhook "node-restore.pods.smr.dev" does not support dry run')
    assert kube.get("pods", "trainer", "default") is None
    # A pod that entry does not select is not held to it.
    assert "smr.dev/injected" not in (await dry_run(admin, pod("plain", None)))[
        "metadata"].get("annotations", {})


# -- the probe --------------------------------------------------------------------------


def reachable_gauge() -> float | None:
    return metrics.REGISTRY.get_sample_value("smr_webhook_reachable",
                                             {"configuration": "smr-webhook"})


async def recorded(reader: Bus, timeout: float = 20) -> dict[str, Any]:
    """The watcher's record of its probe, as `smr status` reads it."""
    for _ in range(int(timeout * 10)):
        if (got := await status.webhook_probe(reader)) is not None:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"no probe recorded in {timeout:.0f}s")


async def test_the_watcher_probes_a_reachable_webhook_and_smr_status_says_so(
        kube: FakeApiServer, webhook: Webhook, watcher_bus: Bus, bus: Bus,  # noqa: F811
        api: client.ApiClient, watch_settings: config.Settings,  # noqa: F811
        storage: CheckpointStore) -> None:  # noqa: F811
    """The watcher's own loop, as deployed: it probes at start, records for
    `smr status`, sets the gauge; the probe pod is never stored."""
    metrics.WEBHOOK_REACHABLE.labels("smr-webhook").set(0)
    w = Watcher(watcher_bus, api, watch_settings)
    task = asyncio.create_task(w.run())
    try:
        got = await recorded(bus)
    finally:
        w.stop()
        await asyncio.wait_for(task, 20)
    assert got["reachable"] is True, got
    assert got["by"] == w.identity
    assert reachable_gauge() == 1
    assert any(line.startswith("probe.pods.smr.dev: ") and "patch bytes" in line
               for line in kube.admission_log), kube.admission_log
    assert kube.list("pods") == [], "the probe created a pod"
    st = await status.gather(bus)
    assert st["webhook"]["reachable"] is True
    shown = status.render(st)
    assert "WEBHOOK reachable (last probe " in shown, shown
    assert not kube.denied


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that takes connections and never answers (a firewall that lets
    the handshake through and drops the rest looks the same to the caller)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)  # never accepted: the kernel completes the handshake, nothing answers
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("how", ["down", "silent"])
async def test_an_unreachable_webhook_is_reported_with_what_to_do(
        kube: FakeApiServer, watcher_bus: Bus, bus: Bus, api: client.ApiClient,  # noqa: F811
        storage: CheckpointStore, how: str) -> None:  # noqa: F811
    """The Service leads nowhere (the webhook's pods down), or to a port that
    never answers (the API server's packets dropped, as on a private GKE
    cluster without the firewall rule for 8443): the API server honours the
    webhook's timeout and failurePolicy Ignore and admits the pod unmutated;
    the probe says unreachable and what to check, the gauge is 0, `smr
    status` says so, and no pod is ever stored."""
    metrics.WEBHOOK_REACHABLE.labels("smr-webhook").set(1)
    with silent_port() as silent:
        kube.services[SERVICE] = ("127.0.0.1", silent if how == "silent" else closed_port())
        stop = asyncio.Event()
        p = WebhookProbe(client.CoreV1Api(api), watcher_bus.kv(KV_HEALTH), S,
                         namespace="smr-system", identity="watcher-1")
        task = asyncio.create_task(p.run(stop))
        try:
            got = await recorded(bus)
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
    assert got["reachable"] is False, got
    assert reachable_gauge() == 0
    for hint in ("unmutated", "firewall", "8443", "endpoints smr-webhook", "caBundle"):
        assert hint in got["message"], (hint, got["message"])
    assert any(line.startswith("probe.pods.smr.dev: failed") for line in kube.admission_log)
    assert kube.list("pods") == [], "the probe created a pod"
    shown = status.render(await status.gather(bus))
    assert "WEBHOOK UNREACHABLE (last probe " in shown and "firewall" in shown, shown
    assert not kube.denied


async def test_only_the_probe_entry_selects_the_probe_pod(
        kube: FakeApiServer, webhook: Webhook, admin: client.CoreV1Api) -> None:
    """The probe pod in smr-system is admitted by the probe's entry alone, and a
    pod of smr's own namespace without its label by none (smr's pods never
    wait on the webhook)."""
    out = await dry_run(admin, probe_pod(S), "smr-system")
    assert out["metadata"]["annotations"]["smr.dev/injected"] == "smr"
    assert [line.split(":")[0] for line in kube.admission_log] == ["probe.pods.smr.dev"]
    await dry_run(admin, pod("agent", None, namespace="smr-system",
                             labels={"smr.dev/node-restore": "true"}), "smr-system")
    assert len(kube.admission_log) == 1, kube.admission_log


def test_a_process_that_never_probed_exports_no_reachability() -> None:
    """Every smr process (agents, storage, webhook, `smr up`) serves the same
    registry: one that never probed must serve no smr_webhook_reachable series,
    or its 0 would fire SmrWebhookUnreachable on every healthy cluster."""
    served = subprocess.run(
        [sys.executable, "-c", "from prometheus_client import generate_latest; "
         "from smr import metrics; print(generate_latest(metrics.REGISTRY).decode())"],
        capture_output=True, text=True, check=True).stdout
    samples = [line for line in served.splitlines()
               if line.startswith("smr_webhook_") and not line.startswith("#")]
    assert "# TYPE smr_webhook_reachable gauge" in served
    assert samples == [], samples
