"""Kubernetes Events on pods (checkpoint and restore outcomes, policy problems)
and on Jobs (a lineage their pods share).

Each Event's name is derived from what it reports (a request_id, a problem),
so a redelivered result or a second replica posts it once: the API server
answers the repeat with 409 AlreadyExists.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from smr.contract.messages import CkptDone, RestoreDone, derive_request_id

log = logging.getLogger("smr.watcher.events")

COMPONENT = "smr-watcher"


class EventRecorder:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.posted = 0

    async def pod_event(self, namespace: str, pod: str, *, reason: str, message: str,
                        key: str, warning: bool = False, uid: str | None = None) -> bool:
        """Post once per ``key``; False if it was already there."""
        return await self.event({"kind": "Pod", "apiVersion": "v1", "namespace": namespace,
                                 "name": pod}, reason=reason, message=message, key=key,
                                warning=warning, uid=uid)

    async def event(self, ref: dict[str, Any], *, reason: str, message: str, key: str,
                    warning: bool = False, uid: str | None = None) -> bool:
        """Post an Event on the object ``ref`` (kind, apiVersion, namespace,
        name) once per ``key``; False if it was already there."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = ref["namespace"]
        name = f"{ref['name'][:200]}.smr-{derive_request_id(reason, key)[:16]}"
        ref = {**ref, "uid": uid} if uid else dict(ref)
        body = {"metadata": {"name": name, "namespace": namespace}, "involvedObject": ref,
                "reason": reason, "message": message[:1024],
                "type": "Warning" if warning else "Normal",
                "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
                "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        try:
            await self.core.create_namespaced_event(namespace, body, _request_timeout=30)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        self.posted += 1
        return True

    async def outcome(self, done: CkptDone | RestoreDone) -> None:
        """The Event for a checkpoint or restore result of a pod's container."""
        t = done.target
        if t.kind != "pod" or not t.namespace or not t.pod:
            return
        ckpt = isinstance(done, CkptDone)
        ok = done.status == "succeeded"
        if ckpt and not ok and (done.error or {}).get("code") == "taken-over":
            return  # gave way to the pod's final checkpoint, whose own Event says what was saved
        reason = ("Checkpointed" if ok else "CheckpointFailed") if ckpt else \
            ("Restored" if ok else "RestoreFailed")
        took = done.durations.get("total")
        if ok:
            size = f", {done.size_bytes / 2**20:.0f} MiB" if done.size_bytes else ""
            message = (f"container {t.container}: {'checkpoint' if ckpt else 'restore'} "
                       f"{done.checkpoint_id} generation {done.generation} ({done.reason}"
                       f"{size}{f', {took:.1f}s' if took else ''}) on node {done.node}")
        else:
            err = done.error or {}
            message = (f"container {t.container}: {'checkpoint' if ckpt else 'restore'} of "
                       f"{done.checkpoint_id} failed on node {done.node}: "
                       f"{err.get('message', 'unknown error')}"
                       + (f" ({err['hint']})" if err.get("hint") else ""))
        # With the pod's uid (requests carry it) `kubectl describe pod` shows it.
        await self.pod_event(t.namespace, t.pod, reason=reason, message=message,
                             key=done.request_id, warning=not ok, uid=t.pod_uid)
