"""Pods the watcher recreates: one deleted by a drain (after its last
checkpoint, or at its deadline), and one whose restore failed for good."""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio.client.exceptions import ApiException

from services.policy import PodPolicy
from services.triggers import FINAL_DISRUPTIONS, KUBELET, disruption, shut_down_by_kubelet
from services.watcher.limits import API_TIMEOUT_S, REQUEST_TTL_S, RESULT_WAIT_S
from smr.contract.messages import epoch

log = logging.getLogger("smr.watcher")


def deadline_of(pod: dict[str, Any]) -> str:
    """When a checkpoint request for ``pod`` stops making sense: a terminating
    pod's deletionTimestamp, the end of its grace period (the API server sets
    it to the request's time plus the grace: the kubelet kills it then), else
    REQUEST_TTL_S."""
    meta = pod["metadata"]
    if since := meta.get("deletionTimestamp"):
        end = epoch(since)
    else:
        end = time.time() + REQUEST_TTL_S
    return datetime.fromtimestamp(end, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


class Recreation:
    """The recreation side of the Watcher (service.py)."""

    def _recreate_later(self, pod: dict[str, Any], policy: PodPolicy) -> None:
        """A bare node-restore pod that a disruption ended comes back (a
        controller's pod is recreated by its controller): evicted or
        preempted anywhere; else gone from a node going away. A pod deleted
        with no disruption is the user's delete, never undone; one that a
        node-pressure eviction failed is left as Kubernetes leaves it."""
        meta = pod["metadata"]
        node = (pod.get("spec") or {}).get("nodeName")
        if not policy.node_restore or meta.get("ownerReferences") or not node:
            return
        by = disruption(pod)
        if by is None or (by == KUBELET and not shut_down_by_kubelet(pod)):
            return
        if by not in FINAL_DISRUPTIONS and node not in self._episodes \
                and node not in self._gone:
            return
        self._spawn(self._recreate(pod, self._pod_requests.get(meta["uid"], []), by))

    async def _replace_failed(self, pod: dict[str, Any], policy: PodPolicy) -> None:
        """Graceful node shutdown leaves a bare pod Failed, not deleted: once
        its final checkpoint is over, delete it; its deletion recreates it
        (``_recreate_later``), as for a drained pod."""
        meta = pod["metadata"]
        node = (pod.get("spec") or {}).get("nodeName")
        if not policy.node_restore or meta.get("ownerReferences") or not node:
            return
        if requests := self._pod_requests.get(meta["uid"]):
            with contextlib.suppress(TimeoutError):
                await self.bus.wait_result(requests[-1], "ckpt.requested",
                                           timeout=RESULT_WAIT_S)
        try:
            await self.core.delete_namespaced_pod(
                meta["name"], meta["namespace"], body={"preconditions": {"uid": meta["uid"]}},
                _request_timeout=API_TIMEOUT_S)
        except ApiException as e:
            if e.status != 404:  # 404: gone already (another replica, the pod GC)
                log.warning("Failed pod %s/%s could not be deleted to recreate it: %s %s; "
                            "it is not recreated. A 403 means the watcher's ClusterRole "
                            "lacks delete on pods (deploy/kustomize/base/watcher.yaml). "
                            "Delete it and apply its manifest again: it resumes from its "
                            "latest checkpoint",
                            meta["namespace"], meta["name"], e.status, e.reason)
        except (TimeoutError, aiohttp.ClientError) as e:
            log.warning("deleting Failed pod %s/%s failed (%r); it is not recreated. Check "
                        "that the watcher reaches the API server; delete the pod and apply "
                        "its manifest again: it resumes from its latest checkpoint",
                        meta["namespace"], meta["name"], e)

    async def _recreate(self, pod: dict[str, Any], requests: list[str], by: str) -> None:
        meta = pod["metadata"]
        if requests:  # the pod's last checkpoint must finish first
            try:
                await self.bus.wait_result(requests[-1], "ckpt.requested",
                                           timeout=RESULT_WAIT_S)
            except TimeoutError:
                log.warning("pod %s/%s: no checkpoint result within %.0fs; recreating it "
                            "anyway", meta["namespace"], meta["name"], RESULT_WAIT_S)
        ann = dict(meta.get("annotations") or {})
        ann[f"{self.s.label_prefix}/recreated-from-node"] = pod["spec"]["nodeName"]
        spec = {k: v for k, v in pod["spec"].items() if k != "nodeName"}
        body = {"apiVersion": "v1", "kind": "Pod", "spec": spec, "metadata": {
            "name": meta["name"], "namespace": meta["namespace"],
            "labels": meta.get("labels") or {}, "annotations": ann}}
        try:
            new = await self.core.create_namespaced_pod(meta["namespace"], body,
                                                        _preload_content=False,
                                                        _request_timeout=API_TIMEOUT_S)
            created = orjson.loads(await new.read())
        except ApiException as e:
            if e.status != 409:  # 409: another replica recreated it
                log.warning("pod %s/%s could not be recreated: %s %s. A 403 means the "
                            "watcher's ClusterRole lacks create on pods; otherwise the "
                            "API server refused the pod as it was (its admission, a quota): "
                            "apply its manifest again: it resumes from its latest checkpoint",
                            meta["namespace"], meta["name"], e.status, e.reason)
            return
        self.stats["recreated"] += 1
        node = pod["spec"]["nodeName"]
        log.info("pod %s/%s recreated away from node %s (%s)", meta["namespace"], meta["name"],
                 node, by)
        why = f"its {by} on node {node}" if by in FINAL_DISRUPTIONS \
            else f"node {node} went away ({by})"
        await self._post(created["metadata"], "Recreated",
                         f"recreated by smr after {why}; it resumes from its latest checkpoint",
                         key=created["metadata"]["uid"])
