"""Is the webhook reachable from the API server? Asked the API server's way.

The webhook's failurePolicy is Ignore: when the API server cannot reach it
(no firewall rule to port 8443 on a private GKE cluster, no endpoints behind
the Service, a caBundle the certificate does not match), pods are created
unmutated and run unprotected, and nothing says so. Probing the webhook's
Service from a pod proves nothing: the API server's path is another one. So
the probe asks the API server itself: a server-side dry-run create
(``dryRun=All``) of an opted-in pod in the watcher's own namespace, which the
API server admits exactly as a real creation, calling the webhook (the
configuration declares ``sideEffects: None``, which a dry run requires), and
stores nothing. The pod comes back carrying ``<prefix>/injected``: reachable.
It comes back without: the call failed and was ignored.

Each watcher replica probes at start and every ``interval`` seconds; the
result goes to the metrics (``smr_webhook_reachable``, alert
SmrWebhookUnreachable) and to the KV bucket smr-health (key ``webhook``),
which `smr status` prints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from nats.js.kv import KeyValue

from smr import metrics
from smr.aio import wait_event
from smr.config import Settings

log = logging.getLogger("smr.watcher.webhook_probe")

PROBE_INTERVAL_S = 60.0
HEALTH_KEY = "webhook"  # its key in the KV bucket smr-health
PROBE_LABEL = "webhook-probe"  # <prefix>/webhook-probe: the webhook entry that admits the probe
# The API server's own request timeout: above the webhook's timeoutSeconds (3),
# so an unreachable webhook shows as an unmutated pod, not as a failed probe.
REQUEST_TIMEOUT_S = 30.0

UNREACHABLE_HINT = (
    "the API server could not call the webhook, so opted-in pods start unprotected "
    "(failurePolicy Ignore). Check, in this order: the API server reaches the webhook's "
    "pods on port 8443 (on a private GKE cluster add a firewall rule from the control "
    "plane's range to the nodes on TCP 8443; where a NetworkPolicy narrows port 8443, "
    "its ipBlock must hold the API server's address); the Service smr-webhook in "
    "smr-system has ready endpoints (`kubectl -n smr-system get endpoints smr-webhook`); "
    "the caBundle of the MutatingWebhookConfiguration smr-webhook matches the "
    "certificate in the Secret smr-webhook-tls (the webhook's log says when it updates it); "
    "that configuration exists, with its entry probe.pods.smr.dev (deploy/kustomize/base/"
    "webhook.yaml) (docs/kubernetes.md, \"Check the webhook\")")


@dataclass(frozen=True)
class ProbeResult:
    reachable: bool
    message: str
    at: float  # Unix time the probe finished
    seconds: float  # how long the dry run took
    by: str = ""  # the watcher replica that probed


def probe_pod(s: Settings) -> dict[str, Any]:
    """An opted-in pod that only the webhook's probe entry selects (its
    namespace, smr's own, is left out of every other entry). Never created:
    the dry run stores nothing, and no kubelet ever sees it."""
    p = s.label_prefix
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "smr-webhook-probe-",
                     "labels": {f"{p}/{PROBE_LABEL}": "true", f"{p}/node-restore": "true"}},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "probe", "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": "1m", "memory": "1Mi"},
                              "limits": {"cpu": "1m", "memory": "8Mi"}},
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}}],
        },
    }


async def probe(core: client.CoreV1Api, s: Settings, *, namespace: str,
                by: str = "") -> ProbeResult:
    """One dry-run create of the probe pod in ``namespace``: what it says
    about the webhook, with what to do when it is not reachable."""
    start = time.monotonic()
    try:
        created = await core.create_namespaced_pod(
            namespace, probe_pod(s), dry_run="All", _request_timeout=REQUEST_TIMEOUT_S)
    except ApiException as e:
        body = _message(e)
        reachable, message = False, (
            f"the dry-run create of the probe pod in {namespace} failed "
            f"({e.status} {e.reason}: {body}), so the webhook's reachability is unknown: "
            + ("the watcher's ClusterRole must grant pods create (deploy/kustomize/base/"
               "watcher.yaml)" if e.status == 403 else
               "a webhook with side effects refuses dry runs; the API server's answer says "
               "which" if "dry run" in body else "see the API server's answer"))
    except (TimeoutError, OSError, aiohttp.ClientError) as e:
        reachable, message = False, (f"the API server did not answer the probe's dry run: "
                                     f"{type(e).__name__}: {e}")
    else:
        injected = (created.metadata.annotations or {}).get(f"{s.label_prefix}/injected")
        if injected is None:
            reachable, message = False, f"the probe pod came back unmutated: {UNREACHABLE_HINT}"
        else:
            reachable, message = True, (f"the API server called the webhook: the probe pod "
                                        f"came back mutated ({s.label_prefix}/injected: "
                                        f"{injected})")
    seconds = time.monotonic() - start
    metrics.WEBHOOK_REACHABLE.labels(s.webhook_config).set(1 if reachable else 0)
    metrics.WEBHOOK_PROBE_SECONDS.labels(s.webhook_config).observe(seconds)
    metrics.WEBHOOK_PROBED_AT.labels(s.webhook_config).set(time.time())
    return ProbeResult(reachable, message, time.time(), seconds, by)


def _message(e: ApiException) -> str:
    try:
        return str(orjson.loads(e.body or b"{}").get("message") or e.body)
    except (orjson.JSONDecodeError, AttributeError):
        return str(e.body)


async def record(kv: KeyValue, result: ProbeResult) -> None:
    await kv.put(HEALTH_KEY, orjson.dumps(asdict(result)))


class WebhookProbe:
    """Probes at start and every ``interval`` seconds until ``stop`` is set."""

    def __init__(self, core: client.CoreV1Api, kv: KeyValue, s: Settings, *, namespace: str,
                 identity: str, interval: float = PROBE_INTERVAL_S) -> None:
        self.core, self.kv, self.s = core, kv, s
        self.namespace, self.identity, self.interval = namespace, identity, interval
        self.last: ProbeResult | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            # Neither a failed probe nor a failed record ends the watcher: next round.
            try:
                self.last = await probe(self.core, self.s, namespace=self.namespace,
                                        by=self.identity)
            except Exception as e:
                # probe() answers the API's own failures; this is anything else.
                log.warning("webhook probe: the probe failed unexpectedly (%r); tried again "
                            "in %.0fs", e, self.interval, exc_info=True)
                await wait_event(stop, self.interval)
                continue
            if not self.last.reachable:
                log.warning("webhook probe: %s", self.last.message)
            try:
                await record(self.kv, self.last)
            except Exception as e:
                log.warning("webhook probe: could not record its result in NATS (%s); "
                            "`smr status` shows the last one recorded", e)
            await wait_event(stop, self.interval)
