"""Which pods smr acts on, read from their labels and container env.

    <prefix>/node-restore: "true"            checkpoint on node events; the pod
                                             resumes from its latest checkpoint
    <prefix>/heartbeat-checkpoint: "<s>"     a checkpoint every <s> seconds
    env SMR_CHECKPOINT=<checkpoint id>       that container resumes from the id's
                                             latest checkpoint at every start (Jobs;
                                             in an Indexed Job, each completion index
                                             has its own: ``<id>-<index>``)
    <prefix>/restore-failure: fresh|fail     when a restore is refused or fails, the
                                             container starts over (default) or fails
    <prefix>/tcp-connections: auto|close     established TCP connections at a
                                             checkpoint (smr/process/sockets.py): kept where
                                             they can go on (default), or always closed
    <prefix>/snapshot-when-ready: "<name>"   once the pod is first Ready, one leave-
                                             running checkpoint of each container as
                                             template <name> (docs/warm-start.md)
    <prefix>/start-from: "<name>"            each new container starts from template
                                             <name> (its latest generation), unless
                                             it has a checkpoint of its own

``<prefix>`` is SMR_LABEL_PREFIX (``smr.dev``). The seed product's names
(``cedana.ai/...``, ``CEDANA_CHECKPOINT``) are read as aliases, so manifests
written for it work unchanged. A malformed value is reported as a problem
(the watcher turns it into a Kubernetes Event) and ignored.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from smr.config import Settings
from smr.process.sockets import POLICIES as TCP_POLICIES

ALIAS_PREFIX = "cedana.ai"
NODE_RESTORE = "node-restore"
HEARTBEAT = "heartbeat-checkpoint"
RESTORE_FAILURE = "restore-failure"
TCP_CONNECTIONS = "tcp-connections"
SNAPSHOT_WHEN_READY = "snapshot-when-ready"
START_FROM = "start-from"
# A label value (at most 63 characters): the template's name.
_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
CHECKPOINT_ENV = ("SMR_CHECKPOINT", "CEDANA_CHECKPOINT")
# Set by the Job controller on each pod of an Indexed Job (annotation, and a
# label since Kubernetes 1.28): the index whose work the pod does.
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_CHECKPOINT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class ContainerPolicy:
    name: str
    checkpoint_id: str
    from_env: bool  # named by the env var: resumes at every start


@dataclass(frozen=True)
class PodPolicy:
    node_restore: bool = False
    heartbeat_s: int | None = None
    containers: tuple[ContainerPolicy, ...] = ()
    problems: tuple[str, ...] = ()
    restore_failure: str = "fresh"  # or "fail"
    tcp: str = "auto"  # or "close" (smr.process.sockets.POLICIES)
    snapshot_when_ready: str | None = None  # a template's name (docs/warm-start.md)
    start_from: str | None = None  # a template's name

    @property
    def opted_in(self) -> bool:
        """Checkpointed when its node goes away."""
        return bool(self.containers)

    @property
    def warm(self) -> bool:
        """Labelled for warm starts: its containers need smr-init in front of
        them (a template is a checkpoint of one, a replica a restore into one),
        though nothing else opts them in."""
        return bool(self.snapshot_when_ready or self.start_from)

    def restorable(self) -> tuple[ContainerPolicy, ...]:
        """The containers that resume from their latest checkpoint when they start."""
        return tuple(c for c in self.containers if self.node_restore or c.from_env)


def default_checkpoint_id(pod: str, container: str) -> str:
    """``<pod>.<container>``; long names are shortened with a hash (stable)."""
    cid = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{pod}.{container}")
    if len(cid) > 128:
        cid = cid[:111] + "-" + hashlib.sha256(cid.encode()).hexdigest()[:16]
    return cid


def _label(labels: dict[str, str], prefix: str, name: str) -> tuple[str, str] | None:
    for p in (prefix, ALIAS_PREFIX):
        if f"{p}/{name}" in labels:
            return f"{p}/{name}", str(labels[f"{p}/{name}"])
    return None


def tcp_policy(pod: dict[str, Any], prefix: str) -> tuple[str, str | None]:
    """The pod's TCP connection policy, and a problem if its label is malformed."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if found := _label(labels, prefix, TCP_CONNECTIONS):
        key, value = found
        if value in TCP_POLICIES:
            return value, None
        return "auto", (f'label {key}="{value}" is not "auto" or "close"; TCP connections '
                        "are kept where they can go on and closed on a migration")
    return "auto", None


def policy_for(pod: dict[str, Any], s: Settings) -> PodPolicy:
    """The pod's policy under this installation's settings (label prefix, heartbeat bounds)."""
    return pod_policy(pod, prefix=s.label_prefix, heartbeat_min=s.heartbeat_min,
                      heartbeat_max=s.heartbeat_max)


def pod_policy(pod: dict[str, Any], *, prefix: str, heartbeat_min: float,
               heartbeat_max: float) -> PodPolicy:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    problems: list[str] = []

    node_restore = False
    if found := _label(labels, prefix, NODE_RESTORE):
        key, value = found
        if value.lower() == "true":
            node_restore = True
        elif value.lower() != "false":
            problems.append(f'label {key}="{value}" is not "true" or "false"; ignored')

    heartbeat = None
    if found := _label(labels, prefix, HEARTBEAT):
        key, value = found
        try:
            seconds = int(value)
        except ValueError:
            problems.append(f'label {key}="{value}" is not a whole number of seconds; '
                            "no heartbeat checkpoints")
        else:
            if not heartbeat_min <= seconds <= heartbeat_max:
                problems.append(f'label {key}="{value}" is outside {heartbeat_min:g} to '
                                f"{heartbeat_max:g} seconds; no heartbeat checkpoints")
            else:
                heartbeat = seconds

    restore_failure = "fresh"
    if found := _label(labels, prefix, RESTORE_FAILURE):
        key, value = found
        if value in ("fresh", "fail"):
            restore_failure = value
        else:
            problems.append(f'label {key}="{value}" is not "fresh" or "fail"; a failed '
                            "restore starts the container fresh")

    tcp, problem = tcp_policy(pod, prefix)
    if problem:
        problems.append(problem)

    templates: dict[str, str | None] = {SNAPSHOT_WHEN_READY: None, START_FROM: None}
    for name in templates:
        if found := _label(labels, prefix, name):
            key, value = found
            if _TEMPLATE_NAME.match(value):
                templates[name] = value
            else:
                problems.append(f'label {key}="{value}" is not a template name (1-63 '
                                "letters, digits, '.', '_' or '-', starting and ending with "
                                "a letter or digit); ignored")

    # The webhook could not give the pod smr's runtime (services/webhook): say so
    # on the pod, where its owner looks.
    injected = str((meta.get("annotations") or {}).get(f"{prefix}/injected", ""))
    if injected.startswith("skipped:"):
        problems.append(f"not protected: {injected.removeprefix('skipped:').strip()}")

    # Index i of an Indexed Job resumes index i's state, whatever pod runs it.
    index = str((meta.get("annotations") or {}).get(COMPLETION_INDEX)
                or labels.get(COMPLETION_INDEX) or "")
    containers = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        env = {e.get("name"): e.get("value") for e in c.get("env") or []}
        named = next((env[k] for k in CHECKPOINT_ENV if env.get(k)), None)
        if named is not None and not _CHECKPOINT_ID.match(named):
            problems.append(f'container {c["name"]}: checkpoint id "{named}" must be 1-128 '
                            "letters, digits, '.', '_' or '-', starting with a letter or "
                            "digit; ignored")
            named = None
        if named is not None and index:
            if index.isdigit() and _CHECKPOINT_ID.match(f"{named}-{index}"):
                named = f"{named}-{index}"
            else:
                problems.append(f'container {c["name"]}: checkpoint id "{named}" with '
                                f'completion index "{index[:20]}" is not a valid id; ignored')
                named = None
        if named is not None:
            containers.append(ContainerPolicy(c["name"], named, from_env=True))
        elif node_restore or heartbeat:
            containers.append(ContainerPolicy(
                c["name"], default_checkpoint_id(meta.get("name", ""), c["name"]),
                from_env=False))
    return PodPolicy(node_restore, heartbeat, tuple(containers), tuple(problems),
                     restore_failure, tcp, templates[SNAPSHOT_WHEN_READY],
                     templates[START_FROM])
