"""A container smr-init started fresh because no agent answered in time.

smr-init waits for its node's agent: its own SMR_INIT_TIMEOUT, or longer
when an agent ran on the node just before (services/agent/alive.py). When
that runs out it starts the workload fresh and leaves the file
``unanswered``. The agent that comes later (or the one that was there but
could not claim the container) posts a Warning Event on the pod, once: a
container that should have resumed from a checkpoint and did not is then
seen in ``kubectl describe pod``, not only in its log. Only the file's
presence is read: its text is the tenant's to change, and the Event's words
are the agent's own.

The file is the workload's to write as well (its /smr is its own), so its
presence is a claim, not a fact: a start that an agent answered with a
restore (its step is recorded under the request id derived from the
container's ID, whichever agent ran it: the one a rollout replaced, too) is
never reported as started fresh. And the checkpoint an Event names as not
restored is the latest one only if it was stored before the container
started (storage's created_at against the kubelet's startedAt), never one the
container stored itself afterwards.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from services.containers.pods import runtime_id
from services.policy import policy_for
from smr.contract.errors import SmrError
from smr.contract.messages import derive_request_id, epoch

if TYPE_CHECKING:
    from services.agent.starts import StartRestores

log = logging.getLogger("smr.agent")

REASON = "StartedWithoutAgent"


async def report(starts: StartRestores, pod: dict[str, Any], status: dict[str, Any]) -> None:
    meta, name = pod["metadata"], status["name"]
    if await _restored(starts, pod, status):
        log.info("pod %s/%s container %s: 'unanswered' in its /smr, but an agent restored "
                 "this start; no Event", meta["namespace"], meta["name"], name)
        return
    mine = next((c for c in policy_for(pod, starts.s).restorable() if c.name == name), None)
    if mine is None:
        what = "it resumes from no checkpoint, so nothing was lost"
    else:
        try:
            gen = await _before_start(starts, mine.checkpoint_id, meta["namespace"], status)
        except SmrError:
            gen = {"generation": "?"}
        what = (f"checkpoint {mine.checkpoint_id} generation {gen.get('generation')} was NOT "
                "restored, and this container's own checkpoints become its latest"
                if gen is not None else f"checkpoint {mine.checkpoint_id} had no generation "
                "stored when it started that is still its latest, so none is named as lost")
    message = (f"container {name} started fresh: smr-init got no answer from the smr node "
               "agent in time (no agent ran on this node, or none came within "
               f"SMR_AGENT_WAIT, {starts.s.agent_wait} s, of the last one: see the smr-agent "
               f"pod of node {starts.node}); {what}. Label the pod "
               f"{starts.s.label_prefix}/restore-failure=fail to have it wait instead")
    log.warning("pod %s/%s: %s", meta["namespace"], meta["name"], message)
    # Keyed by the container ID: once per start of this container.
    await starts.lineage.event(pod, REASON, name, status.get("containerID") or "", message,
                               warning=True)


async def _restored(starts: StartRestores, pod: dict[str, Any], status: dict[str, Any]) -> bool:
    """Whether an agent answered this container start with a restore: the
    step of the request it sent (services/agent/starts.py) is recorded. If
    the step store cannot be read, the Event is left out: it only explains,
    and the container's log says what smr-init did."""
    rid = derive_request_id("restore", pod["metadata"].get("uid", ""), status["name"],
                            runtime_id(status.get("containerID") or ""))
    try:
        state, _ = await starts.bus.step_state(rid)
    except Exception as e:  # NATS's own errors too: the Event is only a note
        log.warning("cannot read the step store (%s): no StartedWithoutAgent Event for pod "
                    "%s/%s", e, pod["metadata"]["namespace"], pod["metadata"]["name"])
        return True
    return state is not None


async def _before_start(starts: StartRestores, ckpt: str, namespace: str,
                        status: dict[str, Any]) -> dict[str, Any] | None:
    """The latest generation of ``ckpt`` if it was stored before the container
    started (the one it would have resumed from); None if there was none, or
    the latest is newer than the start (the container's own, or another
    copy's: what it missed, if anything, is not known here; an agent may ask
    storage for the latest only)."""
    gen = await starts._latest(ckpt, namespace)
    if gen is not None and await _taken_of(starts, namespace, ckpt, gen) == \
            runtime_id(status.get("containerID") or ""):
        return None  # taken of this very container: stored after it started
    try:
        started = epoch(status["state"]["running"]["startedAt"])
        stored = epoch(gen["created_at"]) if gen is not None else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return gen  # no times to compare: the latest, as before
    # The kubelet's startedAt holds whole seconds: a generation stored in the
    # second the container started is taken as stored before it. The
    # container's own checkpoints are known by their container ID (above),
    # so only another copy's, stored within that second, could be named by
    # mistake (this Event's text only).
    return gen if stored is not None and stored < started + 1 else None


async def _taken_of(starts: StartRestores, namespace: str, ckpt: str,
                    gen: dict[str, Any]) -> str | None:
    """The container a pod generation was taken of, from its manifest (the
    agent's own record); None if it cannot be read (the times decide then)."""
    if not isinstance(gen.get("generation"), int):
        return None
    try:
        got = await starts.store.get(namespace, ckpt, gen["generation"])
    except SmrError as e:
        log.warning("cannot read the manifest of %s generation %s: %s", ckpt,
                    gen["generation"], e.message)
        return None
    container = got.manifest.get("container")
    found = container.get("container_id") if isinstance(container, dict) else None
    return found if isinstance(found, str) and found else None
