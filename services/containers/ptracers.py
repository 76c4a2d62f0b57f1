"""Who may ptrace in a container's PID namespace, by what the pod's spec grants.

The agent's CRIU runs in a container's PID namespace as root, with the
agent's directories open (services/containers/incontainer.py). A process
there with CAP_SYS_PTRACE could take CRIU over or walk `..` from its
descriptors into the host's tree. Looking at the live processes
(``incontainer.refuse_ptracers``) cannot see one that starts after the look:
a container in the spec whose start is still coming (an ephemeral debug
container whose image is being pulled, a sidecar restarting). What the spec
grants does not change while CRIU runs: a pod's containers and their
securityContext are immutable, and the only thing that can be added, an
ephemeral container, is judged here too, by the agent just before CRIU
starts and by the webhook as it is added (services/webhook/admission.py).

Who shares the namespace of container C (the kubelet's CRI namespace modes):
C itself; with ``shareProcessNamespace`` every container, sidecar init
container (``restartPolicy: Always``) and ephemeral container of the pod; an
ephemeral container whose ``targetContainerName`` is C. An init container
that runs to completion has ended before any app container starts, and
never runs beside one. With ``hostPID`` the namespace is the node's, where
every node daemon holds CAP_SYS_PTRACE.

What grants CAP_SYS_PTRACE: ``privileged: true`` (every capability), and
``capabilities.add`` naming ``SYS_PTRACE`` or ``ALL``, in any case and with
or without ``CAP_`` (containerd prefixes ``CAP_`` to what the kubelet
passes and takes ``ALL`` in any case; CRI-O accepts either spelling). A
``drop`` is not counted: runtimes differ on whether an add or a drop of the
same name wins, and the live look still catches a runtime default.
"""

from __future__ import annotations

from typing import Any

from smr.contract.errors import PermanentError

HINT = ("remove SYS_PTRACE (and privileged: true) from the securityContext of every "
        "container of the pod that shares the container's PID namespace, ephemeral debug "
        "containers too (kubectl debug --profile=general, not sysadmin), to checkpoint it "
        "(docs/compatibility.md)")


def grants_ptrace(container: dict[str, Any]) -> bool:
    """Does this container's securityContext give it CAP_SYS_PTRACE?"""
    sc = container.get("securityContext")
    if not isinstance(sc, dict):
        return False
    if sc.get("privileged") is True:
        return True
    caps = sc.get("capabilities")
    added = caps.get("add") if isinstance(caps, dict) else None
    names = {n.strip().upper().removeprefix("CAP_") for n in added or []
             if isinstance(n, str)}
    return bool(names & {"SYS_PTRACE", "ALL"})


def sharers(pod: dict[str, Any], container: str) -> list[tuple[str, str]]:
    """(kind, name) of each container of ``pod`` in the PID namespace of its
    container ``container``, itself included; kind is ``containers``,
    ``initContainers`` or ``ephemeralContainers``, as the spec names them."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    shared = spec.get("shareProcessNamespace") is True
    found = []
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            if not isinstance(c, dict):
                continue
            name = str(c.get("name"))
            if kind == "containers":
                shares = shared or name == container
            elif kind == "initContainers":
                shares = shared and c.get("restartPolicy") == "Always"
            else:
                shares = shared or c.get("targetContainerName") == container
            if shares:
                found.append((kind, name))
    return found


def ptracers(pod: dict[str, Any], container: str) -> list[str]:
    """What may ptrace in the PID namespace of ``container`` by ``pod``'s spec,
    each said in words; empty: nothing."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    found = ["the node's own processes (hostPID: true)"] if spec.get("hostPID") is True else []
    by_name = {(kind, str(c.get("name"))): c for kind in
               ("containers", "initContainers", "ephemeralContainers")
               for c in spec.get(kind) or [] if isinstance(c, dict)}
    for kind, name in sharers(pod, container):
        if grants_ptrace(by_name[(kind, name)]):
            found.append(f"{_KIND[kind]} {name}")
    return found


_KIND = {"containers": "container", "initContainers": "sidecar init container",
         "ephemeralContainers": "ephemeral container"}


# The namespaces the webhook's entry for debug containers leaves out (its
# namespaceSelector): kube-system, so that an unreachable webhook never blocks
# debugging the cluster's own pods, and smr-system, so that it never blocks
# debugging itself. The agent runs no CRIU there.
UNJUDGED_NAMESPACES = frozenset({"kube-system", "smr-system"})


def guarded(pod: dict[str, Any], container: str) -> bool:
    """Does the webhook judge every ephemeral container added to ``pod``? Its
    entry for them (deploy/kustomize/base/webhook.yaml, ephemeral-ptrace)
    selects, among others, a pod with a container whose spec names
    SMR_CONTAINER in its env or starts smr-init as its command; a pod's
    containers cannot change, so this holds for the pod's life. A container
    smr-init reaches otherwise (the image's entrypoint, `sh -c 'exec
    smr-init'`, an env from envFrom) is not selected: a debug container added
    while CRIU runs there would go unjudged. Nor is a pod in a namespace the
    entry's namespaceSelector leaves out (UNJUDGED_NAMESPACES)."""
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), dict) else {}
    if meta.get("namespace", "default") in UNJUDGED_NAMESPACES:
        return False
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    return any(isinstance(c, dict) and c.get("name") == container and shows_smr(c)
               for c in spec.get("containers") or [])


def shows_smr(container: dict[str, Any]) -> bool:
    """Does this container's own spec start smr-init: as its command, or
    through smr-runtime for an ``SMR_CONTAINER`` in its env? The one test the
    agent and the webhook share (the webhook's matchConditions are wider)."""
    command = container.get("command")
    first = command[0] if isinstance(command, list) and command else ""
    return (isinstance(first, str) and first.rsplit("/", 1)[-1] == "smr-init") or \
        any(isinstance(e, dict) and e.get("name") == "SMR_CONTAINER"
            for e in container.get("env") or [])


def refuse(pod: dict[str, Any], container: str) -> None:
    """Refuse to run CRIU in ``container`` of ``pod`` where the pod's spec lets
    a process of its PID namespace hold CAP_SYS_PTRACE (the module says why),
    or where a debug container added while CRIU runs would not be judged."""
    meta = pod.get("metadata") or {}
    if not guarded(pod, container):
        raise PermanentError(
            f"pod {meta.get('namespace')}/{meta.get('name')}: the smr webhook cannot judge a "
            f"debug container added to it while CRIU runs in container {container} (the pod's "
            "namespace is one the webhook leaves out, or the container starts smr-init by a "
            "way its spec does not show: the image's entrypoint, a shell, an env from "
            "envFrom); CRIU was not started, nothing was frozen or restored",
            code="container-not-guarded",
            hint="run the workload outside kube-system and smr-system; label the pod for the "
                 "smr webhook (it adds SMR_CONTAINER), or name smr-init as the container's "
                 "command, or set SMR_CONTAINER in the container's env (docs/node-agent.md)")
    if found := ptracers(pod, container):
        raise PermanentError(
            f"pod {meta.get('namespace')}/{meta.get('name')}: {', '.join(found)} may hold "
            f"CAP_SYS_PTRACE in the PID namespace of container {container} (the pod's spec "
            "grants it: privileged: true, or capabilities.add SYS_PTRACE or ALL): with it, "
            "it could take over the node agent's CRIU, which runs in that namespace as "
            "root; CRIU was not started, nothing was frozen or restored",
            code="container-can-ptrace", hint=HINT)
