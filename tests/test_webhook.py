"""The webhook on its own: what it does to each kind of AdmissionReview, over
its real HTTPS server, and its certificate kept in a Secret against the FAKE
API server (tests/fake_apiserver.py) through the real kubernetes-asyncio client."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from services.kubeapi import api_client
from services.webhook.admission import review
from services.webhook.certs import CertKeeper, issue, service_names
from services.webhook.service import MAX_BODY, Webhook
from smr import config
from smr.contract.errors import PermanentError
from tests.agent.cluster import webhook_configuration
from tests.fake_apiserver import FakeApiServer, json_patch, pod

S = config.load({})


def admission(obj: Any, *, kind: str = "Pod", operation: str = "CREATE",
              uid: str = "u-1") -> bytes:
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                         "request": {"uid": uid, "kind": {"kind": kind},
                                     "operation": operation, "namespace": "default",
                                     "object": obj}})


def patched(p: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    r = answer["response"]
    assert r["allowed"] is True
    if "patch" not in r:
        return p
    assert r["patchType"] == "JSONPatch"
    return json_patch(p, orjson.loads(base64.b64decode(r["patch"])))  # type: ignore[no-any-return]


def opted(**kw: Any) -> dict[str, Any]:
    return pod("p", None, labels={"smr.dev/node-restore": "true"}, **kw)


def test_opted_in_pod_gets_the_runtime_class_and_its_container_name() -> None:
    p = opted(containers=("app", "sidecar"))
    out = patched(p, review(admission(p), S))
    assert out["spec"]["runtimeClassName"] == "smr"
    for c in out["spec"]["containers"]:
        assert {"name": "SMR_CONTAINER", "value": c["name"]} in c["env"]
    assert out["metadata"]["annotations"]["smr.dev/injected"] == "smr"


def test_env_opt_in_marks_only_that_container() -> None:
    p = pod("j", None, env={"CEDANA_CHECKPOINT": "run-1"}, containers=("train", "logger"))
    out = patched(p, review(admission(p), S))
    train, logger = out["spec"]["containers"]
    assert {"name": "SMR_CONTAINER", "value": "train"} in train["env"]
    assert not any(e["name"] == "SMR_CONTAINER" for e in logger["env"])


def test_a_fail_policy_reaches_smr_init() -> None:
    """smr-init cannot read labels: without the env it would start fresh on
    its own timeout, whatever restore-failure says."""
    p = pod("p", None, labels={"smr.dev/node-restore": "true",
                               "smr.dev/restore-failure": "fail"},
            containers=("app", "sidecar"), env={"A": "1"})  # env: the first one's only
    app, sidecar = patched(p, review(admission(p), S))["spec"]["containers"]
    for c in (app, sidecar):
        assert {"name": "SMR_RESTORE_FAILURE", "value": "fail"} in c["env"]
    assert {"name": "A", "value": "1"} in app["env"]
    p = opted()
    out = patched(p, review(admission(p), S))
    assert not any(e["name"] == "SMR_RESTORE_FAILURE" for e in out["spec"]["containers"][0]["env"])


def test_a_gpu_container_gets_one_compile_thread_unless_it_sets_its_own() -> None:
    """A container asking for nvidia.com/gpu gets TORCHINDUCTOR_COMPILE_THREADS=1
    (Inductor's compile workers map the GPU without a CUDA context, which
    cannot be saved); one that sets its own keeps it; a CPU container gets none."""
    p = opted(containers=("train", "own", "cpu"))
    train, own, cpu = p["spec"]["containers"]
    for c in (train, own):
        c["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    own["env"] = [{"name": "TORCHINDUCTOR_COMPILE_THREADS", "value": "8"}]
    train, own, cpu = patched(p, review(admission(p), S))["spec"]["containers"]
    assert {"name": "TORCHINDUCTOR_COMPILE_THREADS", "value": "1"} in train["env"]
    assert [e for e in own["env"] if e["name"] == "TORCHINDUCTOR_COMPILE_THREADS"] == [
        {"name": "TORCHINDUCTOR_COMPILE_THREADS", "value": "8"}]
    assert not any(e["name"] == "TORCHINDUCTOR_COMPILE_THREADS" for e in cpu["env"])


def test_warm_start_labels_alone_opt_a_pod_in() -> None:
    """A template's pod and a replica (docs/warm-start.md) need smr-init in front
    of their containers, even without node-restore: the template is a
    checkpoint of it, the replica a restore into it. No preStop hook: neither
    gets a final checkpoint."""
    for label in ("smr.dev/snapshot-when-ready", "smr.dev/start-from"):
        p = pod("p", None, labels={label: "llm"}, containers=("app", "sidecar"))
        out = patched(p, review(admission(p), S))
        assert out["spec"]["runtimeClassName"] == "smr", label
        for c in out["spec"]["containers"]:
            assert {"name": "SMR_CONTAINER", "value": c["name"]} in c["env"]
            assert "lifecycle" not in c


def test_pods_left_alone() -> None:
    plain = pod("p", None)
    assert "patch" not in review(admission(plain), S)["response"]
    by_hand = opted()
    by_hand["spec"]["containers"][0]["command"] = ["/smr/smr-init", "--", "python"]
    assert "patch" not in review(admission(by_hand), S)["response"]


def test_runtime_classes_are_chained_or_the_user_is_told() -> None:
    gpu = opted()
    gpu["spec"]["runtimeClassName"] = "nvidia"
    assert patched(gpu, review(admission(gpu), S))["spec"]["runtimeClassName"] == "smr-nvidia"
    kata = opted()
    kata["spec"]["runtimeClassName"] = "kata"
    answer = review(admission(kata), S)
    out = patched(kata, answer)
    assert out["spec"]["runtimeClassName"] == "kata"
    assert "kata" in answer["response"]["warnings"][0]
    assert out["metadata"]["annotations"]["smr.dev/injected"].startswith("skipped:")


@pytest.mark.parametrize("body", [
    b"", b"{", b"[]", b"null", b'{"request": 5}', b'{"request": {"uid": "u-7"}}',
    b'{"request": {"uid": "u-7", "kind": {"kind": "Pod"}, "operation": "CREATE", '
    b'"object": "not a pod"}}',
    b'{"request": {"uid": "u-7", "kind": {"kind": "Pod"}, "operation": "CREATE", '
    b'"object": {"spec": {"containers": "nope"}, "metadata": {"labels": '
    b'{"smr.dev/node-restore": "true"}}}}}',
    "\ufffd\x00{".encode(),
])
def test_bad_input_is_allowed_without_a_patch(body: bytes) -> None:
    r = review(body, S)["response"]
    assert r["allowed"] is True and "patch" not in r
    if b'"u-7"' in body:
        assert r["uid"] == "u-7"


def test_other_kinds_and_operations_are_allowed_unchanged() -> None:
    p = opted()
    for raw in (admission(p, kind="Deployment"), admission(p, operation="UPDATE")):
        r = review(raw, S)["response"]
        assert r["allowed"] is True and "patch" not in r


def ephemeral_update(p: dict[str, Any], debug: dict[str, Any]) -> bytes:
    """What kube-apiserver sends for the pods/ephemeralcontainers subresource
    (kubectl debug): kind Pod, operation UPDATE, the whole pod before and after."""
    after = {**p, "spec": {**p["spec"], "ephemeralContainers": [
        *(p["spec"].get("ephemeralContainers") or []), debug]}}
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                         "request": {
        "uid": "u-e", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "subResource": "ephemeralcontainers", "operation": "UPDATE", "namespace": "default",
        "object": after, "oldObject": p}})


def debugger(target: str | None = "app", **sc: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "debugger-x1", "image": "busybox", "securityContext": sc}
    if target:
        c["targetContainerName"] = target
    return c


@pytest.mark.parametrize("sc", [{"privileged": True},
                                {"capabilities": {"add": ["SYS_PTRACE"]}},
                                {"capabilities": {"add": ["ALL"]}}],
                         ids=["sysadmin-profile", "SYS_PTRACE", "ALL"])
def test_a_debug_container_that_could_ptrace_smrs_criu_is_refused(sc: dict[str, Any]) -> None:
    """kubectl debug --target=app --profile=sysadmin on an opted-in pod: the
    debug container would share the PID namespace where the agent's CRIU
    runs, with CAP_SYS_PTRACE; it could come while CRIU runs, after the
    agent's own check. Refused, saying why and what to do instead."""
    p = patched(opted(containers=("app",)), review(admission(opted(containers=("app",))), S))
    r = review(ephemeral_update(p, debugger(**sc)), S)["response"]
    assert r["uid"] == "u-e" and r["allowed"] is False, r
    assert "debugger-x1" in r["status"]["message"] and "--profile=general" in r["status"]["message"]
    assert r["status"]["code"] == 403


def test_debug_containers_that_cannot_reach_smrs_criu_are_allowed() -> None:
    p = patched(opted(containers=("app",)), review(admission(opted(containers=("app",))), S))
    for debug in (debugger(), debugger(capabilities={"add": ["NET_ADMIN"]}),
                  debugger(None, privileged=True)):  # its own PID namespace
        r = review(ephemeral_update(p, debug), S)["response"]
        assert r["allowed"] is True and "patch" not in r, (debug, r)
    # Not smr's pod: smr has no say.
    plain = pod("q", None)
    r = review(ephemeral_update(plain, debugger("main", privileged=True)), S)["response"]
    assert r["allowed"] is True, r
    # One already there (added before smr's webhook was): the agent refuses
    # that pod; another, harmless, is still allowed.
    there = {**p, "spec": {**p["spec"], "ephemeralContainers": [
        {**debugger(privileged=True), "name": "old"}]}}
    r = review(ephemeral_update(there, {**debugger(), "name": "new"}), S)["response"]
    assert r["allowed"] is True, r


def test_a_hand_written_smr_init_pod_is_guarded_too() -> None:
    p = pod("h", None)
    p["spec"]["containers"][0]["command"] = ["/smr/smr-init", "--", "sleep", "1"]
    r = review(ephemeral_update(p, debugger("main", privileged=True)), S)["response"]
    assert r["allowed"] is False, r


def injected_sharing() -> dict[str, Any]:
    """An opted-in pod as the webhook admitted it, sharing its PID namespace."""
    p = patched(opted(containers=("app",)), review(admission(opted(containers=("app",))), S))
    p["spec"]["shareProcessNamespace"] = True
    return p


def test_a_debug_container_is_judged_on_the_pod_as_stored_not_as_sent() -> None:
    """The API server calls a mutating webhook for pods/ephemeralcontainers
    with the pod as the client sent it (a PUT's body, or the stored pod with
    the client's patch applied); only after the webhooks does its strategy
    keep the stored pod and take the ephemeral containers alone from the
    request. Everything else in ``object`` is the tenant's to say for that
    one request: no smr label or annotation, no smr-init, no
    shareProcessNamespace, other container names. The stored pod decides."""
    stored = injected_sharing()
    sent = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {k: stored["metadata"][k] for k in ("name", "namespace", "uid")
                         if k in stored["metadata"]},
            "spec": {"containers": [{"name": "other", "image": "busybox"}]}}
    for debug in (debugger(None, privileged=True), debugger("app", privileged=True),
                  debugger(None, capabilities={"add": ["SYS_PTRACE"]})):
        after = {**sent, "spec": {**sent["spec"], "ephemeralContainers": [debug]}}
        body = orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                             "request": {
            "uid": "u-s", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "ephemeralcontainers", "operation": "UPDATE",
            "namespace": "default", "object": after, "oldObject": stored}})
        r = review(body, S)["response"]
        assert r["allowed"] is False, (debug, r)


def test_an_injected_pod_stripped_of_its_labels_and_annotations_is_guarded_still() -> None:
    """Labels and annotations are the tenant's to change on a running pod
    (kubectl annotate pod p smr.dev/injected-): what marks a pod smr may run
    CRIU in must be what cannot change, the SMR_CONTAINER its containers
    were given (smr-runtime starts smr-init only there)."""
    p = injected_sharing()
    p["metadata"].pop("labels", None)
    p["metadata"].pop("annotations", None)
    for debug in (debugger(None, privileged=True), debugger("app", privileged=True)):
        r = review(ephemeral_update(p, debug), S)["response"]
        assert r["allowed"] is False, (debug, r)


@pytest.fixture
async def kube() -> AsyncIterator[FakeApiServer]:
    k = await FakeApiServer().start()
    k.put("mutatingwebhookconfigurations", webhook_configuration())
    yield k
    await k.stop()
    assert not k.denied, f"a call the shipped RBAC does not grant: {k.denied}"


async def test_https_server_answers_every_review_and_survives_a_huge_one(
        kube: FakeApiServer) -> None:
    api = await api_client(kube.url, token=kube.token("smr-webhook"))
    hook = Webhook(api, S.replace(webhook_port=0), host="127.0.0.1")
    task = asyncio.create_task(hook.run())
    await asyncio.wait_for(hook.ready.wait(), 10)
    ca = base64.b64decode(kube.get("mutatingwebhookconfigurations", "smr-webhook")[
        "webhooks"][0]["clientConfig"]["caBundle"])
    ctx = ssl.create_default_context(cadata=ca.decode())
    url = f"https://127.0.0.1:{hook.port}/mutate"
    try:
        async with aiohttp.ClientSession() as http:
            huge = b'{"request": {"uid": "big-1", "object": "' + b"x" * (MAX_BODY + 10) + b'"}}'
            for body in (huge, b"not json", admission(opted())):
                async with http.post(url, data=body, ssl=ctx,
                                     server_hostname="smr-webhook.smr-system.svc") as resp:
                    assert resp.status == 200
                    r = (await resp.json())["response"]
                    assert r["allowed"] is True
            assert r["uid"] == "u-1" and "patch" in r, "it still works after bad input"
    finally:
        hook.stop()
        await task
        await api.close()


async def test_certificate_is_kept_in_a_secret_and_renewed_before_it_expires(
        kube: FakeApiServer) -> None:
    api = await api_client(kube.url, token=kube.token("smr-webhook"))
    try:
        keeper = CertKeeper(api, S)
        first = await keeper.ensure()
        assert set(service_names(S)) <= set(first.names())
        assert (await keeper.ensure()) == first, "a fresh certificate is reused"
        bundle = kube.get("mutatingwebhookconfigurations", "smr-webhook")[
            "webhooks"][0]["clientConfig"]["caBundle"]
        assert base64.b64decode(bundle) == first.ca
        # A certificate a week from expiry (issued 358 days ago) is renewed,
        # and the configuration trusts the new CA.
        old = issue(service_names(S), dt.datetime.now(dt.UTC) - dt.timedelta(days=358))
        secret = kube.get("secrets", S.webhook_secret, S.webhook_namespace)
        secret["data"] = {k: base64.b64encode(v).decode() for k, v in
                          (("ca.crt", old.ca), ("tls.crt", old.cert), ("tls.key", old.key))}
        kube.put("secrets", secret)
        renewed = await keeper.ensure()
        assert renewed not in (old, first)
        bundle = kube.get("mutatingwebhookconfigurations", "smr-webhook")[
            "webhooks"][0]["clientConfig"]["caBundle"]
        assert base64.b64decode(bundle) == renewed.ca
    finally:
        await api.close()


def test_a_pod_the_webhook_could_not_protect_gets_a_policy_problem() -> None:
    """The watcher posts each policy problem as a Warning Event on the pod."""
    from services.policy import policy_for

    kata = opted()
    kata["spec"]["runtimeClassName"] = "kata"
    out = patched(kata, review(admission(kata), S))
    problems = policy_for(out, S).problems
    assert any(p.startswith("not protected: runtime class 'kata'") for p in problems), problems


async def test_a_client_that_stalls_holds_no_slot_for_long(kube: FakeApiServer) -> None:
    """One review read at a time here (the default is MAX_IN_FLIGHT): a client
    that sends half a body and stops is cut off after the read limit, and the
    API server's next review is answered."""
    api = await api_client(kube.url, token=kube.token("smr-webhook"))
    hook = Webhook(api, S.replace(webhook_port=0), host="127.0.0.1", max_in_flight=1,
                   read_s=0.5)
    task = asyncio.create_task(hook.run())
    await asyncio.wait_for(hook.ready.wait(), 10)
    ca = base64.b64decode(kube.get("mutatingwebhookconfigurations", "smr-webhook")[
        "webhooks"][0]["clientConfig"]["caBundle"])
    ctx = ssl.create_default_context(cadata=ca.decode())
    name = "smr-webhook.smr-system.svc"
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", hook.port, ssl=ctx,
                                                       server_hostname=name)
        writer.write(b"POST /mutate HTTP/1.1\r\nHost: smr-webhook\r\nContent-Length: 100000\r\n"
                     b"Content-Type: application/json\r\n\r\n{\"request\":")
        await writer.drain()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"https://127.0.0.1:{hook.port}/mutate",
                                 data=admission(opted()), ssl=ctx, server_hostname=name,
                                 timeout=aiohttp.ClientTimeout(total=20)) as resp:
                assert resp.status == 200
                assert "patch" in (await resp.json())["response"]
        status = await asyncio.wait_for(reader.readline(), 20)
        assert b" 408 " in status, status
        writer.close()
    finally:
        hook.stop()
        await task
        await api.close()


def test_opted_in_containers_wait_for_their_final_checkpoint_before_sigterm() -> None:
    p = opted(containers=("app", "sidecar"))
    p["spec"]["containers"][1]["lifecycle"] = {"preStop": {"exec": {"command": ["drain"]}}}
    out = patched(p, review(admission(p), S))
    # 30 s (the default) for the workload's own shutdown, plus the final checkpoint's.
    assert out["spec"]["terminationGracePeriodSeconds"] == 30 + S.final_checkpoint_seconds
    app, sidecar = out["spec"]["containers"]
    assert app["lifecycle"]["preStop"]["exec"]["command"] == [
        "/smr/smr-init", "--wait-final", str(S.final_checkpoint_seconds)]
    assert sidecar["lifecycle"]["preStop"]["exec"]["command"] == ["drain"], "theirs stays"


def test_the_grace_period_never_exceeds_what_the_user_allows() -> None:
    p = opted(annotations={"smr.dev/max-grace-seconds": "45"})
    p["spec"]["terminationGracePeriodSeconds"] = 20
    out = patched(p, review(admission(p), S))
    assert out["spec"]["terminationGracePeriodSeconds"] == 45
    assert out["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == "25"
    # No room at all: neither the grace nor a hook that would eat the workload's.
    tight = opted(annotations={"smr.dev/max-grace-seconds": "10"})
    tight["spec"]["terminationGracePeriodSeconds"] = 10
    out = patched(tight, review(admission(tight), S))
    assert out["spec"]["terminationGracePeriodSeconds"] == 10
    assert "lifecycle" not in out["spec"]["containers"][0]


def test_the_grace_period_follows_the_last_measured_checkpoint_time() -> None:
    """A workload whose last checkpoint took 100 s gets twice that and 10 s
    for its final one; a quick one gets the setting (the floor); the user's
    cap still holds."""
    p = opted()
    slow = patched(p, review(admission(p), S, measured_s=100.0))
    assert slow["spec"]["terminationGracePeriodSeconds"] == 30 + 210
    assert slow["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == \
        "210"
    quick = patched(p, review(admission(p), S, measured_s=2.0))
    assert quick["spec"]["terminationGracePeriodSeconds"] == 30 + S.final_checkpoint_seconds
    capped = opted(annotations={"smr.dev/max-grace-seconds": "120"})
    out = patched(capped, review(admission(capped), S, measured_s=100.0))
    assert out["spec"]["terminationGracePeriodSeconds"] == 120
    off = patched(p, review(admission(p), S.replace(final_checkpoint_seconds=0),
                            measured_s=100.0))
    assert "lifecycle" not in off["spec"]["containers"][0], "0 still means no hook"


def test_a_liveness_probe_waits_for_the_workload_to_run() -> None:
    p = opted(containers=("app", "sidecar"))
    probe = {"exec": {"command": ["healthy"]}, "periodSeconds": 5}
    p["spec"]["containers"][0]["livenessProbe"] = probe
    p["spec"]["containers"][1]["livenessProbe"] = probe
    p["spec"]["containers"][1]["startupProbe"] = {"exec": {"command": ["mine"]}}
    app, sidecar = patched(p, review(admission(p), S))["spec"]["containers"]
    start = app["startupProbe"]
    assert start["exec"]["command"] == ["/smr/smr-init", "--started"]
    assert start["periodSeconds"] * start["failureThreshold"] >= S.restore_seconds
    assert sidecar["startupProbe"] == {"exec": {"command": ["mine"]}}, "theirs stays"


async def test_slow_clients_never_keep_the_api_servers_reviews_waiting(
        kube: FakeApiServer) -> None:
    """Clients that send headers and half a body, and connect again as soon
    as they are cut off: 8 from addresses of their own (pods) and 8 more from
    one address. The API server's reviews (from its own address, each body
    sent at once) are each answered within 1 s, well inside its timeout."""
    api = await api_client(kube.url, token=kube.token("smr-webhook"))
    hook = Webhook(api, S.replace(webhook_port=0), host="127.0.0.1")  # the defaults
    task = asyncio.create_task(hook.run())
    await asyncio.wait_for(hook.ready.wait(), 10)
    ca = base64.b64decode(kube.get("mutatingwebhookconfigurations", "smr-webhook")[
        "webhooks"][0]["clientConfig"]["caBundle"])
    ctx = ssl.create_default_context(cadata=ca.decode())
    name = "smr-webhook.smr-system.svc"
    stop = asyncio.Event()

    async def trickler(source: str) -> None:
        while not stop.is_set():
            try:
                r, w = await asyncio.open_connection("127.0.0.1", hook.port, ssl=ctx,
                                                     server_hostname=name,
                                                     local_addr=(source, 0))
                w.write(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
                        b"Content-Type: application/json\r\n\r\n{\"request\":")
                await w.drain()
                await r.readline()  # until cut off, then again at once
                w.close()
            except (OSError, ssl.SSLError):
                await asyncio.sleep(0.01)

    sources = [f"127.0.0.{i}" for i in range(2, 10)] + ["127.0.0.10"] * 8
    tricklers = [asyncio.create_task(trickler(a)) for a in sources]
    try:
        await asyncio.sleep(1.5)  # every trickler connected and holding what it can
        async with aiohttp.ClientSession() as http:
            async def one(uid: str) -> dict[str, Any]:
                async with http.post(f"https://127.0.0.1:{hook.port}/mutate",
                                     data=admission(opted(), uid=uid), ssl=ctx,
                                     server_hostname=name) as resp:
                    assert resp.status == 200
                    return await resp.json()  # type: ignore[no-any-return]

            for i in range(4):
                try:
                    answer = await asyncio.wait_for(one(f"api-{i}"), 1.0)
                except TimeoutError:
                    raise AssertionError(f"review {i} of the API server not answered within "
                                         "1 s while slow clients held the webhook") from None
                assert "patch" in answer["response"], answer
                await asyncio.sleep(0.3)
    finally:
        stop.set()
        for t in tricklers:
            t.cancel()
        await asyncio.gather(*tricklers, return_exceptions=True)
        hook.stop()
        await task
        await api.close()


@pytest.mark.parametrize("main", [
    {"command": ["/smr/smr-init", "--", "app"]},
    {"command": ["smr-init"]},
    {"command": ["evil/smr-init"]},
    {"command": ["/app/not-smr-init"]},
    {"command": ["xsmr-init"]},
    {"command": ["/x/smr-init-not"]},
    {"command": ["/bin/sh", "-c", "exec /smr/smr-init"]},
    {"env": [{"name": "SMR_CONTAINER", "value": "main"}]},
    {"env": [{"name": "SMR_CONTAINER", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]},
    {"envFrom": [{"configMapRef": {"name": "smr"}}]},
])
def test_every_pod_the_agent_runs_criu_in_is_one_the_webhook_judges(
        main: dict[str, Any]) -> None:
    """The agent runs CRIU only where ptracers.guarded says the webhook judges
    the pod's debug containers: for each such pod, a privileged one aimed at
    the container is refused (and the webhook's matchConditions, CEL's
    endsWith('smr-init') or an SMR_CONTAINER name, select it too)."""
    from services.containers import ptracers
    p = pod("g", None)
    p["spec"]["containers"][0] = {"name": "main", "image": "app", **main}
    if not ptracers.guarded(p, "main"):
        return
    c = p["spec"]["containers"][0]
    assert str((c.get("command") or [""])[0]).endswith("smr-init") or \
        any(e.get("name") == "SMR_CONTAINER" for e in c.get("env") or [])
    r = review(ephemeral_update(p, debugger("main", privileged=True)), S)["response"]
    assert r["allowed"] is False, (main, r)


def test_the_agent_runs_no_criu_in_a_namespace_the_webhook_leaves_out() -> None:
    """The webhook's entry for debug containers leaves some namespaces out
    (its namespaceSelector): a debug container added to a pod there is never
    judged, so the agent runs no CRIU in one, however its spec shows smr."""
    from services.containers import ptracers
    [entry] = [h for h in webhook_configuration()["webhooks"]
               if h["name"] == "ephemeral-ptrace.pods.smr.dev"]
    [term] = entry["namespaceSelector"]["matchExpressions"]
    assert (term["key"], term["operator"]) == ("kubernetes.io/metadata.name", "NotIn")
    assert set(term["values"]) == ptracers.UNJUDGED_NAMESPACES
    p = pod("g", None)
    p["spec"]["containers"][0]["env"] = [{"name": "SMR_CONTAINER", "value": "main"}]
    assert ptracers.guarded(p, "main")
    for namespace in term["values"]:
        p["metadata"]["namespace"] = namespace
        assert not ptracers.guarded(p, "main"), namespace
        with pytest.raises(PermanentError, match="namespace is one the webhook leaves out"):
            ptracers.refuse(p, "main")
