"""A node's drain, as the watcher follows it: the node's signal opens an
episode in KV (its id makes every request of it idempotent), each opted-in
pod on the node gets its checkpoint request, and the node's recovery closes
the episode."""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any

import orjson
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.triggers import FINAL, FINAL_DISRUPTIONS, MESSAGE_REASON, node_reasons, pod_reasons
from services.watcher.kube import rv_of
from services.watcher.recreation import deadline_of
from smr import tracing
from smr.bus import KV_EPISODES, node_token
from smr.contract.messages import CkptRequested, NodeDraining, Target, derive_request_id

log = logging.getLogger("smr.watcher")


def _newer(rv: str, than: str) -> bool:
    """resourceVersions of one object are etcd revisions: integers that grow."""
    try:
        return int(rv) > int(than)
    except ValueError:
        return True


class Drains:
    """The node side of the Watcher (service.py)."""

    async def _on_node(self, kind: str, node: dict[str, Any], old: dict[str, Any] | None
                       ) -> None:
        name = node["metadata"]["name"]
        if kind != "DELETED":
            self.consumers.seen(name)  # its agent waits for them
        await self.pods.synced.wait()  # the pods on it must be known
        if kind == "DELETED":
            now = self.nodes.cache.get(name)
            if now is not None and now["metadata"].get("uid") != node["metadata"].get("uid"):
                # Registered again under its name (a re-list hands on the old
                # one's deletion once the new one is known): the pods on that
                # name run on the new Node, which is not going away. The new
                # one's own change, next, closes any episode of the old.
                return
            self._gone.add(name)
            reasons = {"node-deleted": "the Node was deleted"}
        else:
            self._gone.discard(name)
            reasons = node_reasons(node, self.s.preemption_taints)
        if not reasons:
            if name in self._episodes or name not in self._clean:
                await self._close_episode(name, node)
            return
        with tracing.tracer.start_as_current_span(
                "node going away", attributes={"k8s.node.name": name,
                                               "smr.reasons": ",".join(reasons)}):
            episode = await self._open_episode(name, node)
            # Those already handled are skipped; later pods come through _on_pod.
            new = [r for r in reasons
                   if derive_request_id("draining", episode, r) not in self._published]
            if not new:
                return
            drains = [NodeDraining(request_id=derive_request_id("draining", episode, r),
                                   node=name, reason=MESSAGE_REASON.get(r, r),  # type: ignore[arg-type]
                                   detail=reasons[r])
                      for r in new]
            for d in drains:
                log.info("node %s: %s (%s); checkpointing its opted-in pods", name, d.reason,
                         d.detail)
            # A pod may have been seen terminating before its node (the two
            # watches have no order): it gets its final checkpoint here too.
            await self._publish_requests([
                r for p in self._pods_on(name)
                for reason in pod_reasons(p, new)
                for r in self._drain_requests(p, episode, reason)])
            await self._publish_all(drains)

    async def _open_episode(self, node: str, obj: dict[str, Any]) -> str:
        """The node's open drain episode, created once for all replicas."""
        key = f"node.{node_token(node)}"
        node_uid = obj["metadata"].get("uid", "")
        kv = self.bus.kv(KV_EPISODES)
        while True:
            try:
                e = await kv.get(key)
            except KeyNotFoundError:
                e = None
            doc = orjson.loads(e.value) if e and e.value else None
            if doc and doc.get("node_uid") == node_uid:
                break
            new = {"episode": uuid.uuid4().hex, "node_uid": node_uid,
                   "node_rv": rv_of(obj)}
            try:
                if e is None:
                    await kv.create(key, orjson.dumps(new))
                else:  # deleted, or a new Node of the same name
                    await kv.update(key, orjson.dumps(new), last=e.revision)
            except KeyWrongLastSequenceError:
                continue  # another replica opened it first: use theirs
            doc = new
            break
        self._episodes[node] = doc["episode"]
        self._clean.discard(node)
        return str(doc["episode"])

    async def _close_episode(self, node: str, obj: dict[str, Any]) -> None:
        """The node is back to normal (uncordoned): a later cordon is a new episode.

        Only a view of the Node newer than the one that opened the episode
        closes it: a replica whose list is a moment behind another's must not
        end the episode that one just opened (its requests would be sent
        again under new ids)."""
        self._episodes.pop(node, None)
        key = f"node.{node_token(node)}"
        kv = self.bus.kv(KV_EPISODES)
        with contextlib.suppress(KeyNotFoundError, KeyWrongLastSequenceError):
            e = await kv.get(key)
            doc = orjson.loads(e.value) if e.value else None
            if doc and _newer(rv_of(obj), doc.get("node_rv", "")):
                await kv.delete(key, last=e.revision)
        self._clean.add(node)

    def _pods_on(self, node: str) -> list[dict[str, Any]]:
        return [p for p in self.pods.cache.values()
                if (p.get("spec") or {}).get("nodeName") == node
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]

    def _drain_requests(self, pod: dict[str, Any], episode: str, reason: str
                        ) -> list[CkptRequested]:
        policy = self._policy(pod)
        meta, node = pod["metadata"], pod["spec"]["nodeName"]
        out = []
        # A pod's own disruption (an eviction, a preemption) is one per pod,
        # whatever its node does: the same request whichever event shows it.
        key = "pod" if reason in FINAL_DISRUPTIONS.values() else episode
        for c in policy.containers:
            rid = derive_request_id("ckpt", key, reason, meta["uid"], c.name)
            out.append(CkptRequested(
                request_id=rid, checkpoint_id=c.checkpoint_id, node=node,
                reason=MESSAGE_REASON.get(reason, reason),  # type: ignore[arg-type]
                # Only when the kubelet is stopping the pod (its preStop hook
                # waits for this): the others may be undone (triggers.py).
                leave_running=reason not in FINAL,
                deadline=deadline_of(pod),
                target=Target(kind="pod", namespace=meta["namespace"], pod=meta["name"],
                              container=c.name, pod_uid=meta["uid"])))
            requests = self._pod_requests.setdefault(meta["uid"], [])
            if rid not in requests:
                requests.append(rid)
        return out
