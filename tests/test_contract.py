"""The message contract: the schemas, the typed messages, and the README's
examples, which users paste as they are."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from smr.contract import schemas as contract
from smr.contract.errors import ContractError
from smr.contract.messages import (
    CkptDone,
    CkptRequested,
    DeadLetter,
    NodeDraining,
    RestoreDone,
    RestoreRequested,
    Target,
)

SCHEMAS = contract.schema_dir()


@pytest.mark.parametrize("path", sorted(SCHEMAS.glob("*.json")), ids=lambda p: p.name)
def test_every_schema_is_valid_2020_12(path: Path) -> None:
    Draft202012Validator.check_schema(json.loads(path.read_text()))


def readme_examples() -> list[tuple[str, dict[str, object]]]:
    text = (SCHEMAS / "README.md").read_text()
    found = re.findall(r"nats pub (\S+) '(\{.*?\})'", text)
    return [(subj, json.loads(body)) for subj, body in found]


def test_readme_has_an_example_of_each_request() -> None:
    kinds = {".".join(s.split(".")[:2]) for s, _ in readme_examples()}
    assert {"ckpt.requested", "restore.requested", "node.draining"} <= kinds


@pytest.mark.parametrize("subject,doc", readme_examples(), ids=lambda x: str(x)[:30])
def test_readme_examples_validate(subject: str, doc: dict[str, object]) -> None:
    contract.validate(".".join(subject.split(".")[:2]), doc)


def test_readme_dead_letter_example_validates() -> None:
    text = (SCHEMAS / "README.md").read_text()
    block = re.search(r"```json\n(.*?)\n```", text, re.S)
    assert block
    contract.validate("error", json.loads(block.group(1)))


def test_messages_round_trip() -> None:
    t = Target(kind="pod", namespace="ml", pod="ppo", container="main")
    req = CkptRequested(request_id="a-1", checkpoint_id="ppo", target=t, node="n.example",
                        reason="cordon", leave_running=True)
    assert CkptRequested.from_payload(req.to_payload()) == req
    done = CkptDone.for_request(req, status="succeeded", generation=3, size_bytes=10,
                                durations={"dump": 1.5}, location="s3://b/k")
    assert CkptDone.from_payload(done.to_payload()) == done
    rreq = RestoreRequested(request_id="b", checkpoint_id="ppo", target=t, node="n", generation=2)
    assert RestoreRequested.from_payload(rreq.to_payload()) == rreq
    rdone = RestoreDone.for_request(rreq, status="failed",
                                    error={"code": "x", "message": "y", "hint": "z"})
    assert RestoreDone.from_payload(rdone.to_payload()) == rdone
    nd = NodeDraining(request_id="c", node="n", reason="preemption")
    assert NodeDraining.from_payload(nd.to_payload()) == nd
    dl = DeadLetter(subject="ckpt.requested.n", error={"code": "c", "message": "m"},
                    payload="{", service="s")
    assert DeadLetter.from_payload(dl.to_payload()) == dl


@pytest.mark.parametrize("change,field", [
    ({"reason": "whim"}, "reason"),
    ({"request_id": "has space"}, "request_id"),
    ({"request_id": "ends-with-dot."}, "request_id"),
    ({"target": {"kind": "job"}}, "target"),
    ({"target": {"kind": "pod", "namespace": "a", "pod": "b"}}, "target"),
    ({"schema_version": 2}, "schema_version"),
    ({"leave_running": "yes"}, "leave_running"),
    ({"surprise": 1}, "surprise"),
    ({"requested_at": "yesterday"}, "requested_at"),
])
def test_invalid_requests_name_the_field(change: dict[str, object], field: str) -> None:
    doc = CkptRequested(request_id="r", checkpoint_id="c", target=Target.job("j"),
                        node="n").to_dict()
    doc.update(change)
    with pytest.raises(ContractError) as e:
        contract.validate("ckpt.requested", doc)
    assert field in str(e.value)


def test_outgoing_messages_are_validated_too() -> None:
    bad = CkptRequested(request_id="r", checkpoint_id="c", target=Target.job("j"), node="n",
                        reason="whim")  # type: ignore[arg-type]
    with pytest.raises(ContractError):
        bad.to_payload()


def test_not_json_is_a_contract_error() -> None:
    with pytest.raises(ContractError) as e:
        contract.decode("ckpt.requested", b"\xff{")
    assert e.value.code == "json-invalid"
