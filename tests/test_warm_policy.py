"""The warm-start labels (docs/warm-start.md) as the watcher and the agent read them."""

from __future__ import annotations

from typing import Any

from services.policy import pod_policy
from services.watcher.templates import template_requests
from smr.contract import schemas as contract
from tests.fake_apiserver import pod

POLICY = {"prefix": "smr.dev", "heartbeat_min": 30, "heartbeat_max": 3600}


def ready(p: dict[str, Any], is_ready: bool) -> dict[str, Any]:
    p["metadata"]["uid"] = "u1"
    p["status"]["conditions"] = [{"type": "Ready", "status": str(is_ready)}]
    for st in p["status"]["containerStatuses"]:
        st["ready"] = is_ready
    return p


def test_the_labels_name_templates_and_a_bad_name_is_a_problem() -> None:
    p = pod("web-1", "n1", labels={"smr.dev/snapshot-when-ready": "llm-7b",
                                   "cedana.ai/start-from": "llm-7b"})
    policy = pod_policy(p, **POLICY)
    assert (policy.snapshot_when_ready, policy.start_from, policy.problems) == \
        ("llm-7b", "llm-7b", ())
    assert not policy.opted_in, "a template label alone opts no container into drains"
    bad = pod_policy(pod("w", "n1", labels={"smr.dev/start-from": "../x"}), **POLICY)
    assert bad.start_from is None and "not a template name" in bad.problems[0]


def test_a_template_is_asked_for_once_the_pod_is_ready() -> None:
    p = pod("web-1", "n1", labels={"smr.dev/snapshot-when-ready": "llm"},
            containers=("main", "side"))
    policy = pod_policy(p, **POLICY)
    deadline = "2030-01-01T00:00:00.000Z"
    assert template_requests(ready(p, False), policy, deadline) == []
    reqs = template_requests(ready(p, True), policy, deadline)
    assert [(r.checkpoint_id, r.target.container, r.reason, r.leave_running) for r in reqs] \
        == [("template_llm.main", "main", "template", True),
            ("template_llm.side", "side", "template", True)]
    for r in reqs:
        contract.decode("ckpt.requested", r.to_payload())  # valid against the schema
    # The same pod and restart: the same request ids (JetStream drops repeats).
    assert [r.request_id for r in template_requests(p, policy, deadline)] == \
        [r.request_id for r in reqs]
    p["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    assert template_requests(p, policy, deadline) == [], "not from a pod on its way out"
