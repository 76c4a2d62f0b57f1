"""Label-only protection: pods whose manifests know nothing of smr-init.

The pods are created through the (FAKE) API server's HTTP API, which calls
the REAL webhook over HTTPS as kube-apiserver does (an AdmissionReview v1,
the certificate verified against the CA the webhook put into the
MutatingWebhookConfiguration, the JSONPatch applied). The (FAKE) kubelets
run a pod whose RuntimeClass is `smr` through the REAL smr-runtime in front
of runc, as containerd does with the handler's BinaryName.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import (
    ENTRY_IMAGE,
    IMAGE,
    Cluster,
    assert_continues,
    steps,
    webhook_configuration,
)
from tests.agent.conftest import runtime_state
from tests.agent.runc_bundle import busybox_bundle
from tests.fake_apiserver import pod


def plain_pod(name: str, node: str | None, *, image: str = IMAGE,
              labels: dict[str, str] | None = None, env: dict[str, str] | None = None,
              command: list[str] | None = None, owner: str | None = None
              ) -> dict[str, Any]:
    """A pod as its author writes it: no smr-init, no volume, no runtime class."""
    p = pod(name, node, labels=labels, env=env, owner=owner)
    c = p["spec"]["containers"][0]
    c["image"] = image
    if command:
        c["command"] = command
    p.pop("status")
    return p


async def create(cluster: Cluster, body: dict[str, Any]) -> dict[str, Any]:
    """Through the API, so admission runs."""
    await cluster.core.create_namespaced_pod("default", body)
    stored = cluster.kube.get("pods", body["metadata"]["name"], "default")
    assert stored is not None
    stored["status"] = {"phase": "Pending"}
    return cluster.kube.put("pods", stored)


async def test_quickstart_pod_with_labels_only_resumes_on_another_node(cluster: Cluster
                                                                       ) -> None:
    a, b = list(cluster.kubelets)
    labels = {"cedana.ai/node-restore": "true", "cedana.ai/heartbeat-checkpoint": "120"}
    stored = await create(cluster, plain_pod("quick", a, labels=labels,
                                             command=["/bin/counter"]))
    assert stored["spec"]["runtimeClassName"] == "smr", cluster.kube.admission_log
    env = stored["spec"]["containers"][0]["env"]
    assert {"name": "SMR_CONTAINER", "value": "main"} in env
    assert "smr-init" not in str(stored["spec"]["containers"][0]["command"])
    await cluster.until_steps("quick", a, 5)

    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})  # kubectl cordon
    manifest = await cluster.latest("quick.main", reason="cordon")
    assert manifest["node"] == a
    before = steps(cluster.log("quick", a))
    # The drain evicts the pod; the watcher creates it again (through the webhook again);
    # the scheduler binds it to node b.
    cluster.kube.remove("pods", "quick", "default", disruption="EvictionByEvictionAPI")
    p = await cluster.recreated("quick")
    before = steps(cluster.log("quick", a)) or before
    assert p["spec"]["runtimeClassName"] == "smr"
    cluster.schedule("quick", b)
    after = await cluster.until_steps("quick", b, 5)
    assert_continues(before, after, before[-1][0])


async def test_entrypoint_image_without_command_resumes_on_another_node(cluster: Cluster
                                                                        ) -> None:
    """ENTRYPOINT ["/bin/sh"] + CMD ["/bin/counter"], no command in the manifest:
    smr-runtime sees the args as resolved from the image."""
    a, b = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "web-1"}  # one replica of a Deployment
    await create(cluster, plain_pod("web-7f9c-a", a, image=ENTRY_IMAGE, env=env,
                                    labels={"smr.dev/node-restore": "true"}, owner="web-7f9c"))
    await cluster.until_steps("web-7f9c-a", a, 5)
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await cluster.latest("web-1")
    # The cordon's checkpoint left it running; the drain takes its final state.
    await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="web-1", node=a, reason="drain",
        target=Target(kind="pod", namespace="default", pod="web-7f9c-a", container="main")),
        timeout=60)
    before = steps(cluster.log("web-7f9c-a", a))
    cluster.kube.remove("pods", "web-7f9c-a", "default")  # the drain evicts it
    # The ReplicaSet's replacement lands on node b.
    await create(cluster, plain_pod("web-7f9c-b", b, image=ENTRY_IMAGE, env=env,
                                    labels={"smr.dev/node-restore": "true"}, owner="web-7f9c"))
    after = await cluster.until_steps("web-7f9c-b", b, 5)
    assert_continues(before, after, before[-1][0])
    assert after[0][0] == before[-1][0] + 1, "a final checkpoint loses no step"


async def test_a_pod_without_opt_in_is_not_touched(cluster: Cluster) -> None:
    a, _ = list(cluster.kubelets)
    stored = await create(cluster, plain_pod("plain", a, command=["/bin/counter"]))
    assert "runtimeClassName" not in stored["spec"]
    assert "env" not in stored["spec"]["containers"][0] or not any(
        e["name"] == "SMR_CONTAINER" for e in stored["spec"]["containers"][0]["env"])
    assert (await cluster.until_steps("plain", a, 3))[0][0] == 1


async def test_pods_still_start_when_the_webhook_is_down(cluster: Cluster) -> None:
    """failurePolicy Ignore: the API server admits the pod unchanged."""
    a, _ = list(cluster.kubelets)
    cluster.webhook.stop()
    await cluster.webhook.stopped.wait()
    stored = await create(cluster, plain_pod("unguarded", a, command=["/bin/counter"],
                                             labels={"smr.dev/node-restore": "true"}))
    assert "runtimeClassName" not in stored["spec"]
    assert any("failed" in line for line in cluster.kube.admission_log)
    assert (await cluster.until_steps("unguarded", a, 3))[0][0] == 1


async def test_a_webhook_that_must_not_fail_refuses_when_down(cluster: Cluster) -> None:
    """The same call with failurePolicy Fail is refused: the test above shows
    Ignore, not an absent webhook."""
    cfg = webhook_configuration("Fail")
    ca = cluster.kube.get("mutatingwebhookconfigurations", "smr-webhook")["webhooks"][0][
        "clientConfig"]["caBundle"]
    for hook in cfg["webhooks"]:
        hook["clientConfig"]["caBundle"] = ca
    cluster.kube.put("mutatingwebhookconfigurations", cfg)
    cluster.kube.services[("smr-system", "smr-webhook")] = ("127.0.0.1", 1)
    try:
        await create(cluster, plain_pod("refused", None, labels={"smr.dev/node-restore": "true"}))
    except ApiException as e:
        assert e.status == 500
    else:
        raise AssertionError("a failing webhook with failurePolicy Fail admitted the pod")


def test_wrapper_changes_nothing_for_a_container_that_did_not_opt_in(
        containerd: Any, smr_runtime: Path, images: list[Path], tmp_path: Path) -> None:
    """The same container through plain runc and through smr-runtime: the same
    args, mounts and exit code."""
    ns = f"passthrough-{uuid.uuid4().hex[:6]}"
    asyncio.run(containerd.import_image(ns, images[0]))
    script = ("cat /proc/1/cmdline | tr '\\0' ' '; echo; "
              "cut -d' ' -f5 /proc/self/mountinfo | sort; exit 3")
    out = {}
    for how, extra in (("runc", []), ("smr", ["--runc-binary", str(smr_runtime)])):
        cid = f"{how}-{uuid.uuid4().hex[:6]}"
        log = tmp_path / f"{how}.log"
        cmd = [*containerd._ctr(ns, "run", "--rm", "--log-uri", f"file://{log}", *extra,
                                IMAGE, cid, "/bin/sh", "-c", script)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        out[how] = (r.returncode, log.read_text())
    assert out["runc"][0] == 3 == out["smr"][0], out
    assert out["runc"][1] == out["smr"][1] and "/bin/sh -c" in out["runc"][1]
    assert "/smr" not in out["smr"][1]


def test_wrapper_wraps_an_opted_in_container_and_cleans_up(
        containerd: Any, smr_runtime: Path, images: list[Path], tmp_path: Path) -> None:
    ns = f"wrapped-{uuid.uuid4().hex[:6]}"
    asyncio.run(containerd.import_image(ns, images[0]))
    cid = f"w-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "w.log"
    r = subprocess.run([*containerd._ctr(
        ns, "run", "--rm", "--log-uri", f"file://{log}", "--runc-binary", str(smr_runtime),
        "--env", "SMR_CONTAINER=main", "--env", "SMR_INIT_TIMEOUT=0.2", IMAGE, cid,
        "/bin/sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; exit 4")],
        capture_output=True, text=True, timeout=60)
    text = log.read_text()
    # No agent answers: smr-init starts the command fresh after its timeout,
    # as PID 1, and passes its exit code on.
    assert r.returncode == 4, (r, text)
    assert "/smr/smr-init -- /bin/sh -c" in text
    assert not (runtime_state(smr_runtime.parent) / cid).exists(), "its state stays after delete"


@pytest.mark.parametrize("userns", [False, True], ids=["uid-1000", "uid-1000-in-userns"])
def test_wrapped_container_of_a_non_root_user(smr_runtime: Path, tmp_path: Path, userns: bool,
                                              request: pytest.FixtureRequest) -> None:
    """runAsUser 1000 (ctr 1.6 cannot set a user: runc itself, through
    smr-runtime, with a bundle as containerd writes it): smr-init, as that
    user, writes its status in /smr and runs the command; the state directory
    belongs to the container's user, mapped to the host's id in a user
    namespace, and goes when the container does."""
    # Every directory on the way must be searchable by the mapped ids.
    top = Path(tempfile.mkdtemp(prefix="smr-userns-"))
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    os.chmod(top, 0o755)
    bundle = busybox_bundle(top, [
        "/bin/sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo; cat /smr/main/status; "
        "busybox stat -c 'owner %u %g' /smr; exit 4"],
        {"SMR_CONTAINER": "main", "SMR_INIT_TIMEOUT": "0.2"}, user=(1000, 1000))
    if userns:
        spec = json.loads((bundle / "config.json").read_text())
        spec["linux"]["namespaces"].append({"type": "user"})
        spec["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 200000, "size": 65536}]
        spec["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 200000, "size": 65536}]
        (bundle / "config.json").write_text(json.dumps(spec))
    cid = f"u-{uuid.uuid4().hex[:6]}"
    r = subprocess.run([str(smr_runtime), "--root", str(tmp_path / "runc"), "run",
                        "--bundle", str(bundle), cid], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 4, r
    assert "/smr/smr-init -- /bin/sh -c" in r.stdout and "running" in r.stdout, r
    # Seen from inside: in a user namespace, /smr's owner on the host is the
    # mapped id (201000), else it would show as the overflow id.
    assert "owner 1000 1000" in r.stdout, r
    assert not (runtime_state(smr_runtime.parent) / cid).exists(), "its /smr stays after run"
