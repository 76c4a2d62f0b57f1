"""Storage layout; every key is built here.

    <namespace>/<checkpoint_id>/latest                   {"generation": N}
    <namespace>/<checkpoint_id>/<generation>/claim       who is writing it
    <namespace>/<checkpoint_id>/<generation>/files/...   the images
    <namespace>/<checkpoint_id>/<generation>/manifest.json

A generation exists for readers only once its manifest is committed.
``namespace`` is the pod's namespace, or ``local`` for jobs of the embedded mode.

A warm-start template (docs/warm-start.md) is a checkpoint like any other,
under an id of its own in the pod's namespace: ``template_<name>.<container>``
(``template_id``). Pod names and container names are DNS names, which never
hold ``_``: no pod's default checkpoint id (``<pod>.<container>``) is a
template's, so a replica's heartbeats and drains never write to it.
"""

from __future__ import annotations

import hashlib

from smr.contract.messages import LOCAL_NAMESPACE, Target

__all__ = ["LOCAL_NAMESPACE"]
GEN_WIDTH = 8  # zero-padded so lexical order is numeric order
TEMPLATE_PREFIX = "template_"
MAX_ID = 128


def template_id(name: str, container: str) -> str:
    """The checkpoint id of template ``name``'s ``container``; long names are
    shortened with a hash (stable), as pods' default ids are."""
    cid = f"{TEMPLATE_PREFIX}{name}.{container}"
    if len(cid) > MAX_ID:
        cid = cid[:MAX_ID - 17] + "-" + hashlib.sha256(cid.encode()).hexdigest()[:16]
    return cid


def is_template(checkpoint_id: str) -> bool:
    return checkpoint_id.startswith(TEMPLATE_PREFIX)


def namespace_of(target: Target) -> str:
    return target.namespace_name


def checkpoint_prefix(namespace: str, checkpoint_id: str) -> str:
    return f"{namespace}/{checkpoint_id}/"


def generation_prefix(namespace: str, checkpoint_id: str, generation: int) -> str:
    return f"{checkpoint_prefix(namespace, checkpoint_id)}{generation:0{GEN_WIDTH}d}/"


def file_key(namespace: str, checkpoint_id: str, generation: int, rel: str) -> str:
    return f"{generation_prefix(namespace, checkpoint_id, generation)}files/{rel}"


def manifest_key(namespace: str, checkpoint_id: str, generation: int) -> str:
    return f"{generation_prefix(namespace, checkpoint_id, generation)}manifest.json"


def claim_key(namespace: str, checkpoint_id: str, generation: int) -> str:
    return f"{generation_prefix(namespace, checkpoint_id, generation)}claim"


def latest_key(namespace: str, checkpoint_id: str) -> str:
    return f"{checkpoint_prefix(namespace, checkpoint_id)}latest"


def generation_of(key: str, namespace: str, checkpoint_id: str) -> int | None:
    """The generation number in a key under the checkpoint, if it has one."""
    rest = key[len(checkpoint_prefix(namespace, checkpoint_id)):]
    head = rest.split("/", 1)[0]
    return int(head) if head.isdigit() else None


def parse(key: str) -> tuple[str, str, int | None, str] | None:
    """(namespace, checkpoint_id, generation or None, rest) of a key."""
    parts = key.split("/", 3)
    if len(parts) < 3:
        return None
    ns, ckpt, head = parts[0], parts[1], parts[2]
    if head.isdigit():
        return ns, ckpt, int(head), parts[3] if len(parts) > 3 else ""
    return ns, ckpt, None, "/".join(parts[2:])
