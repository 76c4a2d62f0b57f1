"""What the webhook does to a pod: AdmissionReview in, AdmissionReview out.

An opted-in pod (services/policy: the labels or the SMR_CHECKPOINT
env var; the warm-start labels too, docs/warm-start.md) gets:

- ``spec.runtimeClassName`` = SMR_RUNTIME_CLASS (``smr``), whose handler is
  smr-runtime (services/agent/init/smr-runtime.c). A pod that names another
  class is moved to that class's smr counterpart (SMR_RUNTIME_CLASS_MAP, e.g.
  ``nvidia=smr-nvidia``: smr-runtime in front of the NVIDIA runtime); one with
  no counterpart is left as it is, with a warning the client shows
  (``kubectl apply`` prints it) and an annotation saying why.
- env ``SMR_CONTAINER=<name>`` on each opted-in container: what smr-runtime
  looks for, and the name smr-init keeps its state under; and, for a pod
  labelled ``restore-failure: fail``, ``SMR_RESTORE_FAILURE=fail``: smr-init
  then never starts fresh on its own when no agent answers it.
- the annotations ``smr.dev/injected`` and, where the grace period was
  raised, ``smr.dev/added-grace-seconds`` (by how much).
- a preStop hook on each opted-in container that has none,
  ``/smr/smr-init --wait-final SECONDS``: the kubelet runs it before its
  SIGTERM, and it waits for the agent's final checkpoint (done or failed),
  so a drain or a graceful node shutdown stops the workload only after it
  is saved; and ``terminationGracePeriodSeconds`` raised to make room for
  it: by the time the agent last measured for a checkpoint of the pod's
  containers (from the freeze to stored; services/timings),
  doubled and 10 s added, or by SMR_FINAL_CHECKPOINT_SECONDS if that is
  more (the floor, and all there is before a first checkpoint), never
  above SMR_MAX_GRACE_SECONDS nor the pod's ``smr.dev/max-grace-seconds``. The
  hook waits for the added seconds only: the workload keeps the grace it
  had for its own shutdown after SIGTERM. (The kubelet counts the hook
  inside the grace period; a provider's hard cap, e.g. GKE Spot's 15 s,
  cuts both short: docs/kubernetes.md.)
- a startupProbe, ``/smr/smr-init --started``, on each opted-in container
  that has a livenessProbe and no startupProbe: liveness probes begin only
  once the workload runs, so a long restore is not killed by them (and
  restarted into another restore). It allows SMR_RESTORE_SECONDS.

One thing is refused: an ephemeral container added (the pods/ephemeralcontainers
subresource, ``kubectl debug``) to a pod smr may run CRIU in, which may hold
CAP_SYS_PTRACE in the PID namespace of one of its containers
(services/containers/ptracers): added while the agent's CRIU runs there, it
could take CRIU over, and the agent's look before CRIU cannot see what comes
after it. That entry's failurePolicy is Fail, so an unreachable webhook
refuses it too.

A pod whose manifest already starts smr-init (written by hand,
docs/node-agent.md) is left alone. Admission is idempotent: a pod this
webhook mutated before (the API server calls it again under
``reinvocationPolicy: IfNeeded``, or for each of its configuration's entries
that selects the pod; the watcher recreates a bare pod from its mutated
spec) is mutated from what it was before: the grace it had without the
added seconds, its hook's wait set afresh, nothing added twice. Admitted
twice, a pod is the same as admitted once. Nothing else here ever refuses a
pod: bad input, another kind or any error gives an allowed response without
a patch and a log line.
"""

from __future__ import annotations

import base64
import logging
import math
import re
from typing import Any

import orjson

from services.containers import ptracers
from services.policy import policy_for
from smr.config import Settings
from smr.gpu.gpugate import GPU_JOB_DEFAULTS

log = logging.getLogger("smr.webhook")

INJECTED = "injected"  # the annotation <prefix>/injected
ADDED_GRACE = "added-grace-seconds"  # the annotation: what the grace period was raised by
WAIT_FINAL = ["/smr/smr-init", "--wait-final"]  # the injected preStop hook, less its seconds
_UID = re.compile(rb'"uid"\s*:\s*"([0-9A-Za-z-]{1,64})"')


def response(uid: str, patch: list[dict[str, Any]] | None = None,
             warnings: list[str] | None = None) -> dict[str, Any]:
    resp: dict[str, Any] = {"uid": uid, "allowed": True}
    if patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(orjson.dumps(patch)).decode()
    if warnings:
        resp["warnings"] = warnings
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}


def denied(uid: str, message: str) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {
        "uid": uid, "allowed": False,
        "status": {"code": 403, "reason": "Forbidden", "message": message}}}


def ephemeral_ptracers(req: dict[str, Any], s: Settings) -> str | None:
    """Why an update of a pod's ephemeral containers is refused, or None: one
    it adds may hold CAP_SYS_PTRACE in the PID namespace of a container of a
    pod smr may run CRIU in (the module's docstring).

    The pod judged is the stored one (``oldObject``) with the ephemeral
    containers asked for: the API server calls a mutating webhook with the pod
    as the client sent it (a PUT's body, or the stored pod with the client's
    patch applied), and only after the webhooks keeps the stored pod and takes
    the ephemeral containers alone from the request. Any other field of
    ``object`` (labels, annotations, commands, container names,
    shareProcessNamespace) is the client's to say for this one request."""
    sent, old = req.get("object"), req.get("oldObject")
    if not isinstance(sent, dict):
        return None
    old = old if isinstance(old, dict) else sent
    sent_spec = sent.get("spec") if isinstance(sent.get("spec"), dict) else {}
    old_spec = old.get("spec") if isinstance(old.get("spec"), dict) else {}
    pod = {**old, "spec": {**old_spec,
                           "ephemeralContainers": sent_spec.get("ephemeralContainers") or []}}
    if not _smr_pod(old, s):
        return None
    spec = pod["spec"]
    added = sorted({who for c in spec.get("containers") or [] if isinstance(c, dict)
                    for who in ptracers.ptracers(pod, str(c.get("name")))
                    if who.startswith("ephemeral container ")
                    and who not in ptracers.ptracers(old, str(c.get("name")))})
    if not added:
        return None
    meta = pod.get("metadata") or {}
    return (f"smr: {', '.join(added)} would hold CAP_SYS_PTRACE (privileged: true, or "
            f"capabilities.add SYS_PTRACE or ALL) in the PID namespace of a container of pod "
            f"{meta.get('namespace') or req.get('namespace')}/{meta.get('name')}, where smr's "
            "node agent runs CRIU as root; with it, it could take CRIU over. Add it without "
            "that capability (kubectl debug --profile=general), or without "
            "--target/shareProcessNamespace")


def _smr_pod(pod: dict[str, Any], s: Settings) -> bool:
    """May smr's agent run CRIU in this pod: opted in, admitted by this
    webhook, or starting smr-init? Labels and annotations are the tenant's to
    remove from a running pod; a container's SMR_CONTAINER (what smr-runtime
    starts smr-init for, given by this webhook or by hand) and its command
    cannot change."""
    policy = policy_for(pod, s)
    annotations = (pod.get("metadata") or {}).get("annotations")
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    return policy.opted_in or policy.warm or \
        (isinstance(annotations, dict) and f"{s.label_prefix}/{INJECTED}" in annotations) or \
        any(ptracers.shows_smr(c) for c in spec.get("containers") or [] if isinstance(c, dict))


def uid_of(body: bytes) -> str:
    """The request's uid from a body too large or broken to parse whole: the
    API server accepts only a response that names it."""
    m = _UID.search(body[:65536])
    return m.group(1).decode() if m else ""


def review(body: bytes, s: Settings, measured_s: float | None = None) -> dict[str, Any]:
    """The answer to one AdmissionReview; ``measured_s``: the last measured
    checkpoint time of the pod's containers, if known (``checkpoints``)."""
    try:
        doc = orjson.loads(body)
        req = doc["request"]
        uid = str(req["uid"])
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        log.warning("not an AdmissionReview (%s: %s); allowed unchanged", type(e).__name__, e)
        return response(uid_of(body))
    if req.get("subResource") == "ephemeralcontainers":
        try:
            why = ephemeral_ptracers(req, s)
        except Exception:
            log.exception("review %s: ephemeral containers not judged; refused", uid)
            why = "smr could not judge the ephemeral containers added; nothing was added"
        if why:
            log.info("review %s refused: %s", uid, why)
            return denied(uid, why)
        return response(uid)
    try:
        patch, warnings = mutate(req, s, measured_s)
    except Exception:
        log.exception("review %s failed; the pod is allowed unchanged", uid)
        return response(uid)
    return response(uid, patch, warnings)


def checkpoints(body: bytes, s: Settings) -> tuple[str, list[str]] | None:
    """The namespace and checkpoint ids of the opted-in pod under review, to
    look up their measured times; None for anything else (``review`` says why)."""
    try:
        req = orjson.loads(body)["request"]
        pod = req["object"]
        meta = pod.get("metadata") or {}
        namespace = req.get("namespace") or meta.get("namespace")
        # A pod created with generateName has no name yet: nor its default ids.
        ids = [c.checkpoint_id for c in policy_for(pod, s).containers
               if c.from_env or meta.get("name")]
    except Exception:
        return None
    return (namespace, ids) if isinstance(namespace, str) and namespace and ids else None


def _wants_gpu(container: dict[str, Any]) -> bool:
    """Does the container ask for an NVIDIA GPU (the device plugin's resource)?"""
    res = container.get("resources")
    if not isinstance(res, dict):
        return False
    return any(isinstance(r, dict) and "nvidia.com/gpu" in r
               for r in (res.get("limits"), res.get("requests")))


def _pointer(*parts: object) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _starts_smr_init(container: dict[str, Any]) -> bool:
    first = (container.get("command") or [""])[0]
    return isinstance(first, str) and first.rsplit("/", 1)[-1] == "smr-init"


def mutate(req: dict[str, Any], s: Settings, measured_s: float | None = None
           ) -> tuple[list[dict[str, Any]], list[str]]:
    """The JSONPatch for one admission request, and warnings for the user."""
    kind = (req.get("kind") or {}).get("kind")
    if kind != "Pod" or req.get("operation") != "CREATE" or req.get("subResource"):
        log.info("review %s: %s %s is not a pod creation; allowed unchanged",
                 req.get("uid"), req.get("operation"), kind)
        return [], []
    pod = req.get("object")
    if not isinstance(pod, dict) or not isinstance(pod.get("spec"), dict):
        log.warning("review %s: no pod in the request; allowed unchanged", req.get("uid"))
        return [], []
    policy = policy_for(pod, s)
    if not policy.opted_in and not policy.warm:
        return [], []
    spec = pod["spec"]
    containers = spec.get("containers") or []
    if any(_starts_smr_init(c) for c in containers if isinstance(c, dict)):
        return [], []  # written by hand: it already starts through smr-init
    meta = pod.get("metadata") or {}
    ops: list[dict[str, Any]] = []
    ours = {s.runtime_class, *s.runtime_class_map.values()}
    named = spec.get("runtimeClassName")
    if not named:
        ops.append({"op": "add", "path": "/spec/runtimeClassName", "value": s.runtime_class})
    elif named in s.runtime_class_map:
        ops.append({"op": "replace", "path": "/spec/runtimeClassName",
                    "value": s.runtime_class_map[named]})
    elif named not in ours:
        why = (f"runtime class {named!r} has no smr counterpart (SMR_RUNTIME_CLASS_MAP), so "
               "this pod is not protected by smr; map it, or start its command through "
               "smr-init (docs/node-agent.md)")
        return _annotate(meta, {f"{s.label_prefix}/{INJECTED}": f"skipped: {why}"}), \
            [f"smr: {why}"]
    opted = {c.name for c in policy.containers}
    # Warm-start labels (docs/warm-start.md) put smr-init in front of every container.
    wanted = opted | ({c.get("name") for c in containers if isinstance(c, dict)}
                      if policy.warm else set())
    for i, c in enumerate(containers):
        if not isinstance(c, dict) or c.get("name") not in wanted:
            continue
        entries = [{"name": "SMR_CONTAINER", "value": c["name"]}]
        if policy.restore_failure == "fail":
            entries.append({"name": "SMR_RESTORE_FAILURE", "value": "fail"})
        if _wants_gpu(c):
            # A GPU container's defaults (smr.jobs.GPU_JOB_DEFAULTS); its own
            # value of one, if it sets one, is kept: the opt-out.
            entries += [{"name": k, "value": v} for k, v in GPU_JOB_DEFAULTS.items()]
        env = c.get("env")
        if not isinstance(env, list):
            ops.append({"op": "add", "path": _pointer("spec", "containers", i, "env"),
                        "value": entries})
            continue
        for entry in entries:
            if not any(isinstance(e, dict) and e.get("name") == entry["name"] for e in env):
                ops.append({"op": "add", "path": _pointer("spec", "containers", i, "env", "-"),
                            "value": entry})
    # Only containers that get a final checkpoint wait for one.
    hooks, notes = _final_checkpoint_hooks(spec, meta, opted, s, measured_s)
    ops += hooks
    ops += _startup_probes(spec, wanted, s)
    runtime = next((o["value"] for o in ops if o["path"] == "/spec/runtimeClassName"), named)
    return ops + _annotate(meta, {f"{s.label_prefix}/{INJECTED}": str(runtime), **notes}), []


def final_checkpoint_seconds(s: Settings, measured_s: float | None) -> int:
    """The seconds a final checkpoint is given: the setting, or more for a
    workload whose last checkpoint took longer. Twice its time: the node's
    other final checkpoints run beside it and share its link; 10 s more for
    the request to arrive and the hook to see the outcome."""
    floor = s.final_checkpoint_seconds
    if not floor or measured_s is None:
        return floor
    return max(floor, math.ceil(2 * measured_s + 10))


def _our_wait(c: dict[str, Any]) -> int | None:
    """The seconds of this webhook's preStop hook on the container, or None:
    not ours."""
    life = c.get("lifecycle")
    hook = life.get("preStop") if isinstance(life, dict) else None
    cmd = (hook.get("exec") or {}).get("command") if isinstance(hook, dict) else None
    if isinstance(cmd, list) and len(cmd) == 3 and cmd[:2] == WAIT_FINAL \
            and isinstance(cmd[2], str) and cmd[2].isdigit():
        return int(cmd[2])
    return None


def _added_before(spec: dict[str, Any], meta: dict[str, Any], s: Settings) -> int:
    """The seconds this webhook added to the pod's grace period when it
    admitted it before (its annotation; else, from before there was one,
    its hook's wait, which is what it added); 0: never admitted."""
    noted = (meta.get("annotations") or {}).get(f"{s.label_prefix}/{ADDED_GRACE}")
    if isinstance(noted, str) and noted.isdigit():
        return int(noted)
    return next((w for c in spec.get("containers") or [] if isinstance(c, dict)
                 and (w := _our_wait(c)) is not None), 0)


def _final_checkpoint_hooks(spec: dict[str, Any], meta: dict[str, Any], wanted: set[str],
                            s: Settings, measured_s: float | None = None
                            ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The preStop hooks and the longer grace period (the module's docstring),
    and the annotation saying by how much. A pod admitted before gets them
    from the grace it had before."""
    added = final_checkpoint_seconds(s, measured_s)
    if not added or not wanted:
        return [], {}
    own = spec.get("terminationGracePeriodSeconds")
    current = own if isinstance(own, int) and own >= 0 else 30  # the API's default
    current = max(0, current - _added_before(spec, meta, s))
    cap = s.max_grace_seconds
    allowed = (meta.get("annotations") or {}).get(f"{s.label_prefix}/max-grace-seconds")
    if isinstance(allowed, str) and allowed.isdigit():
        cap = min(cap, int(allowed))
    grace = max(current, min(current + added, cap))
    wait = grace - current
    if wait <= 0:
        return [], {}  # no room: the user's cap leaves the grace as it was
    ops: list[dict[str, Any]] = []
    if grace != own:
        ops.append({"op": "add", "path": "/spec/terminationGracePeriodSeconds", "value": grace})
    hook = {"exec": {"command": [*WAIT_FINAL, str(wait)]}}
    for i, c in enumerate(spec.get("containers") or []):
        if not isinstance(c, dict) or c.get("name") not in wanted:
            continue
        life = c.get("lifecycle")
        if not isinstance(life, dict):
            ops.append({"op": "add", "path": _pointer("spec", "containers", i, "lifecycle"),
                        "value": {"preStop": hook}})
        elif "preStop" not in life or _our_wait(c) not in (None, wait):
            # Ours again: its wait set afresh. The user's own hook stays; theirs runs instead.
            ops.append({"op": "add", "path": _pointer("spec", "containers", i, "lifecycle",
                                                      "preStop"), "value": hook})
    return ops, {f"{s.label_prefix}/{ADDED_GRACE}": str(wait)}


def _startup_probes(spec: dict[str, Any], wanted: set[str], s: Settings
                    ) -> list[dict[str, Any]]:
    """The startupProbe that holds liveness probes back during a restore."""
    period = 2
    probe = {"exec": {"command": ["/smr/smr-init", "--started"]}, "periodSeconds": period,
             "failureThreshold": max(1, -(-s.restore_seconds // period))}
    ops: list[dict[str, Any]] = []
    for i, c in enumerate(spec.get("containers") or []):
        if isinstance(c, dict) and c.get("name") in wanted and c.get("livenessProbe") \
                and not c.get("startupProbe"):
            ops.append({"op": "add", "path": _pointer("spec", "containers", i, "startupProbe"),
                        "value": probe})
    return ops


def _annotate(meta: dict[str, Any], values: dict[str, str]) -> list[dict[str, Any]]:
    """Set these annotations; none that has its value already."""
    annotations = meta.get("annotations")
    if not isinstance(annotations, dict):
        return [{"op": "add", "path": "/metadata/annotations", "value": dict(values)}]
    return [{"op": "add", "path": _pointer("metadata", "annotations", k), "value": v}
            for k, v in values.items() if annotations.get(k) != v]
