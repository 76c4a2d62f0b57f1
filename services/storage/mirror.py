"""The Checkpoint resources (``smr.dev/v1``, namespaced; the CRD is
deploy/kustomize/base/checkpoints.yaml): one per stored checkpoint, in its
pod's namespace, so that ``kubectl get checkpoints`` shows what storage
holds.

The bucket is the source of truth; the resources only mirror it. Each sync
makes them say what storage holds now: created, updated where they differ,
deleted where storage holds nothing. So a resource deleted by hand comes
back at the next sync, and deleting one never deletes data. Data goes only
when its resource carries the annotation ``DELETE_DATA: "true"``: the sync
deletes the checkpoint through the store (CheckpointStore.delete_checkpoint,
as `smr` does), then the resource. Every step is idempotent: a sync that
dies half way is finished by the next.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.storage.generation import Generation
from services.storage.layout import LOCAL_NAMESPACE
from services.storage.store import CheckpointStore

log = logging.getLogger("smr.storage.mirror")

GROUP, VERSION, PLURAL, KIND = "smr.dev", "v1", "checkpoints", "Checkpoint"
DELETE_DATA = "smr.dev/delete-data"
# Only resources the storage service made are its to update or delete.
MANAGED_BY = ("app.kubernetes.io/managed-by", "smr-storage")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def resource_name(checkpoint_id: str) -> str:
    """The resource's name: the checkpoint id where it is a valid object name,
    else a valid form of it with a hash of the id (``spec.checkpointId``
    always holds the id itself)."""
    if _NAME.match(checkpoint_id):
        return checkpoint_id
    base = re.sub(r"[^a-z0-9.-]+", "-", checkpoint_id.lower()).strip("-.")[:200]
    digest = hashlib.sha256(checkpoint_id.encode()).hexdigest()[:8]
    return f"{base}-{digest}" if base else f"checkpoint-{digest}"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def desired(namespace: str, checkpoint_id: str, gens: list[Generation]) -> dict[str, Any]:
    """The resource of one checkpoint (``gens``: its generations, oldest first)."""
    latest = gens[-1]
    m = latest.manifest
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": resource_name(checkpoint_id), "namespace": namespace,
                     "labels": dict([MANAGED_BY])},
        "spec": {"checkpointId": checkpoint_id},
        "status": {
            "phase": "Stored",
            "latestGeneration": latest.number,
            "generations": [g.number for g in gens],
            "sizeBytes": latest.size_bytes,
            "size": human_bytes(latest.size_bytes),
            "storedBytes": int(m.get("stored_bytes", latest.size_bytes)),
            "reason": m.get("reason") or "",
            "node": m.get("node") or "",
            "requestId": m.get("request_id") or "",
            "createdAt": m.get("created_at") or "",
            "location": latest.location,
        },
    }


class Mirror:
    """Keeps the Checkpoint resources equal to ``store``'s inventory."""

    def __init__(self, api: client.ApiClient, store: CheckpointStore) -> None:
        self.objects = client.CustomObjectsApi(api)
        self.store = store

    async def sync(self, inventory: dict[tuple[str, str], list[Generation]]) -> None:
        """One pass: delete the data a resource's annotation asks to delete,
        then create, update and delete resources until they say what
        ``inventory`` (read from storage just before) holds."""
        listed = await self.objects.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, label_selector="=".join(MANAGED_BY))
        have = {(o["metadata"]["namespace"], o["metadata"]["name"]): o
                for o in listed.get("items") or []}
        want = {(ns, resource_name(ckpt)): desired(ns, ckpt, gens)
                for (ns, ckpt), gens in inventory.items()
                # A local job's checkpoints (`smr up`) belong to no namespace.
                if ns != LOCAL_NAMESPACE}
        for key, obj in have.items():
            annotations = obj["metadata"].get("annotations") or {}
            if annotations.get(DELETE_DATA) == "true":
                ckpt = (obj.get("spec") or {}).get("checkpointId") or key[1]
                removed = await self.store.delete_checkpoint(key[0], ckpt)
                log.info("deleted checkpoint %s/%s (%d objects), as its resource's %s "
                         "annotation asked", key[0], ckpt, removed, DELETE_DATA)
                want.pop(key, None)
        for key, body in want.items():
            ns, name = key
            cur = have.get(key)
            try:
                if cur is None:
                    await self.objects.create_namespaced_custom_object(
                        GROUP, VERSION, ns, PLURAL, body)
                elif any(cur.get(k) != body[k] for k in ("spec", "status")):
                    # Replaced at the version read: a change made meanwhile
                    # (409) waits for the next sync. Annotations stay.
                    await self.objects.replace_namespaced_custom_object(
                        GROUP, VERSION, ns, PLURAL, name, {**body, "metadata": {
                            **cur["metadata"], "labels": {
                                **(cur["metadata"].get("labels") or {}),
                                **body["metadata"]["labels"]}}})
            except ApiException as e:
                if e.status == 404:  # its namespace is gone: nothing to show it in
                    continue
                if e.status != 409:  # 409: made meanwhile (a replica); the next sync
                    raise
        for ns, name in have.keys() - want.keys():
            try:
                await self.objects.delete_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, name)
            except ApiException as e:
                if e.status != 404:
                    raise
