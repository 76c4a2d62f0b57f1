"""The message contract: loads ``schemas/`` and validates payloads against it.

The JSON Schema files are the public API; this module is the only place that
reads them. Validation happens at the bus boundary in both directions.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import orjson
from jsonschema import Draft202012Validator, FormatChecker
from referencing import Registry, Resource

from smr.contract.errors import ContractError, clip

SCHEMA_NAMES = (
    "node.draining",
    "ckpt.requested",
    "ckpt.done",
    "restore.requested",
    "restore.done",
    "error",
    "manifest",
    "storage.query",
    "storage.reply",
)


def schema_dir() -> Path:
    """The schemas: beside the package in a checkout, inside it in a wheel."""
    here = Path(__file__).resolve().parent.parent  # the smr package
    for cand in (here.parent / "schemas", here / "_schemas"):
        if (cand / "common.json").is_file():
            return cand
    raise FileNotFoundError(f"smr's schemas/ not found near {here}; reinstall smr")


@cache
def _registry() -> Registry:
    reg = Registry()
    for p in schema_dir().glob("*.json"):
        doc = json.loads(p.read_text())
        reg = reg.with_resource(doc["$id"], Resource.from_contents(doc))
    return reg


@cache
def validator(name: str) -> Draft202012Validator:
    if name not in SCHEMA_NAMES:
        raise KeyError(f"no schema named {name!r}; known: {', '.join(SCHEMA_NAMES)}")
    doc = json.loads((schema_dir() / f"{name}.json").read_text())
    return Draft202012Validator(doc, registry=_registry(), format_checker=FormatChecker())


def validate(name: str, doc: Any) -> None:
    """Raise ContractError naming every field that breaks schema ``name``."""
    errors = sorted(validator(name).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if not errors:
        return
    parts = []
    for e in errors[:5]:
        where = "/".join(str(p) for p in e.absolute_path) or "(message)"
        parts.append(f"{clip(where, 120)}: {clip(_short(e), 300)}")
    raise ContractError(
        f"message does not match schema {name}: " + "; ".join(parts),
        hint=f"see schemas/{name}.json and schemas/README.md",
    )


def _short(e: Any) -> str:
    # oneOf failures explain each branch at length; the best branch says enough.
    if e.validator == "oneOf" and e.context:
        best = min(e.context, key=lambda c: len(list(c.absolute_schema_path)))
        return best.message
    return e.message


def decode(name: str, payload: bytes) -> dict[str, Any]:
    """Parse and validate a payload; ContractError on bad JSON or schema."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as e:
        raise ContractError(
            f"payload is not valid JSON ({e})", code="json-invalid",
            hint="publish one JSON object, see schemas/README.md",
        ) from None
    validate(name, doc)
    return doc


def encode(name: str, doc: dict[str, Any]) -> bytes:
    validate(name, doc)
    return orjson.dumps(doc)
