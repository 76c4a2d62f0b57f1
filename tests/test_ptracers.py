"""What the pod's spec lets ptrace in a container's PID namespace
(services/containers/ptracers): the agent's judgment before CRIU runs, a
pure function of the pod as the API server returns it."""

from __future__ import annotations

from typing import Any

import pytest

from services.containers import ptracers
from smr.contract.errors import PermanentError


def spec_pod(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"containers": [{"name": "main", "image": "app",
                                            "command": ["/smr/smr-init", "--", "app"]}]}
    return {"metadata": {"namespace": "default", "name": "p"}, "spec": {**base, **spec}}


def ctr(name: str, **sc: Any) -> dict[str, Any]:
    return {"name": name, "image": "x", "securityContext": sc}


@pytest.mark.parametrize("sc", [
    {"privileged": True},
    {"capabilities": {"add": ["SYS_PTRACE"]}},
    {"capabilities": {"add": ["CAP_SYS_PTRACE"]}},
    {"capabilities": {"add": ["sys_ptrace"]}},
    {"capabilities": {"add": ["ALL"]}},
    {"capabilities": {"add": ["all"]}},
    # A drop is not counted: runtimes differ on which wins.
    {"capabilities": {"add": ["SYS_PTRACE"], "drop": ["SYS_PTRACE"]}},
], ids=["privileged", "SYS_PTRACE", "CAP_SYS_PTRACE", "lower", "ALL", "all", "add-and-drop"])
def test_each_spelling_that_grants_ptrace_is_one(sc: dict[str, Any]) -> None:
    assert ptracers.grants_ptrace(ctr("c", **sc))


@pytest.mark.parametrize("sc", [
    {}, {"privileged": False}, {"capabilities": {"add": ["NET_ADMIN", "SYS_ADMIN"]}},
    {"capabilities": {"drop": ["ALL"]}}, {"capabilities": None}, {"privileged": "true"},
], ids=["none", "unprivileged", "others", "drop-all", "null", "string-true"])
def test_a_container_without_it_is_none(sc: dict[str, Any]) -> None:
    assert not ptracers.grants_ptrace(ctr("c", **sc))


def test_the_container_itself_always_counts() -> None:
    p = spec_pod(containers=[ctr("main", privileged=True)])
    assert ptracers.ptracers(p, "main") == ["container main"]


def test_a_sidecar_counts_only_where_the_pod_shares_its_pid_namespace() -> None:
    containers = [ctr("main"), ctr("tracer", capabilities={"add": ["SYS_PTRACE"]})]
    assert ptracers.ptracers(spec_pod(containers=containers), "main") == []
    shared = spec_pod(containers=containers, shareProcessNamespace=True)
    assert ptracers.ptracers(shared, "main") == ["container tracer"]


def test_only_a_sidecar_init_container_runs_beside_the_container() -> None:
    inits = [ctr("setup", privileged=True),
             {**ctr("proxy", privileged=True), "restartPolicy": "Always"}]
    p = spec_pod(initContainers=inits, shareProcessNamespace=True)
    assert ptracers.ptracers(p, "main") == ["sidecar init container proxy"]
    assert ptracers.ptracers(spec_pod(initContainers=inits), "main") == []


def test_an_ephemeral_container_counts_where_it_targets_the_container_or_all_share() -> None:
    debug = [{**ctr("dbg", privileged=True), "targetContainerName": "main"},
             {**ctr("other", privileged=True), "targetContainerName": "side"},
             ctr("loose", capabilities={"add": ["SYS_PTRACE"]})]
    p = spec_pod(containers=[ctr("main"), ctr("side")], ephemeralContainers=debug)
    assert ptracers.ptracers(p, "main") == ["ephemeral container dbg"]
    assert ptracers.ptracers(p, "side") == ["ephemeral container other"]
    p["spec"]["shareProcessNamespace"] = True
    assert ptracers.ptracers(p, "main") == ["ephemeral container dbg", "ephemeral container other",
                                            "ephemeral container loose"]


def test_a_host_pid_pod_shares_the_nodes_namespace() -> None:
    assert ptracers.ptracers(spec_pod(hostPID=True), "main") == [
        "the node's own processes (hostPID: true)"]


def test_a_plain_pod_passes_and_a_ptracing_one_is_refused_with_what_to_do() -> None:
    ptracers.refuse(spec_pod(), "main")
    p = spec_pod(ephemeralContainers=[{**ctr("dbg", privileged=True),
                                       "targetContainerName": "main"}])
    with pytest.raises(PermanentError) as e:
        ptracers.refuse(p, "main")
    assert e.value.code == "container-can-ptrace"
    assert "ephemeral container dbg" in e.value.message and "default/p" in e.value.message
    assert "CAP_SYS_PTRACE" in e.value.message and "SYS_PTRACE" in (e.value.hint or "")


@pytest.mark.parametrize("container", [
    {"name": "main", "image": "app", "command": ["/bin/sh", "-c", "exec /smr/smr-init -- app"]},
    {"name": "main", "image": "app-with-smr-init-as-entrypoint"},
    {"name": "main", "image": "app", "envFrom": [{"configMapRef": {"name": "smr"}}]},
    {"name": "main", "image": "app", "command": ["/smr/smr-init"],
     "env": [{"name": "SMR_CONTAINER", "value": "main"}], "x": "other container's"},
    {"name": "main", "image": "app", "command": ["/bin/not-smr-init", "--", "app"]},
], ids=["shell", "entrypoint", "env-from", "another-container", "lookalike"])
def test_a_container_starting_smr_init_unseen_in_its_spec_is_refused(
        container: dict[str, Any]) -> None:
    """The webhook judges debug containers only for pods whose spec shows smr
    (a container's SMR_CONTAINER env or smr-init command, which cannot change):
    CRIU never runs in a container that smr-init reached another way."""
    p = spec_pod()
    if "x" in container:  # the marks are on a sidecar, not on the target
        p["spec"]["containers"] = [{"name": "main", "image": "app"},
                                   {k: v for k, v in container.items() if k != "x"} | {
                                       "name": "side"}]
    else:
        p["spec"]["containers"] = [container]
    with pytest.raises(PermanentError) as e:
        ptracers.refuse(p, "main")
    assert e.value.code == "container-not-guarded", e.value
    with pytest.raises(PermanentError):
        ptracers.refuse({"metadata": {}, "spec": None}, "main")
    p["spec"]["containers"][0]["env"] = [{"name": "SMR_CONTAINER", "value": "main"}]
    ptracers.refuse(p, "main")  # what the webhook adds


class _Pods:
    """A stand-in for the agent's pod reader: answers what it is given."""

    def __init__(self, answer: dict[str, Any] | Exception | None) -> None:
        self.answer = answer

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class _Bundle:
    """A stand-in for CriuBundle: records the pod CRIU would be judged on."""

    judged: dict[str, Any] | None = None

    async def inside(self, *a: Any, pod: dict[str, Any], container: str, **kw: Any) -> str:
        self.judged = pod
        return "criu"


def _step(answer: dict[str, Any] | Exception | None) -> tuple[Any, _Bundle]:
    from services.containers.pods import PodStep

    step = PodStep.__new__(PodStep)  # only what criu_in reads
    step.pods, step.bundle, step.criu_timeout = _Pods(answer), _Bundle(), 1.0
    return step, step.bundle


async def test_criu_is_judged_on_the_pod_read_again_and_on_the_first_read_if_the_api_is_away(
        ) -> None:
    """A debug container added while the step waited is in the spec read just
    before CRIU; an API server out of reach does not hold a final checkpoint
    up (the spec the step read judges; additions go through the webhook); a
    pod replaced under the same name is refused."""
    from services.containers.pods import PodContainer
    from smr.contract.errors import TemporaryError

    first = spec_pod()
    first["metadata"]["uid"] = "u1"
    now = spec_pod(ephemeralContainers=[{**ctr("debug", privileged=True),
                                         "targetContainerName": "main"}])
    now["metadata"]["uid"] = "u1"
    c = PodContainer(first, "main", {})
    step, bundle = _step(now)
    await step.criu_in(c, None, None, -1)
    assert bundle.judged is now
    step, bundle = _step(TemporaryError("cannot read pod", code="kube-api"))
    await step.criu_in(c, None, None, -1)
    assert bundle.judged is first
    other = spec_pod()
    other["metadata"]["uid"] = "u2"
    for answer in (other, None):
        step, bundle = _step(answer)
        with pytest.raises(PermanentError, match="the pod is gone"):
            await step.criu_in(c, None, None, -1)
        assert bundle.judged is None
