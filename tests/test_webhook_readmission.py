"""The webhook admits a pod it mutated before as if it had not: the API
server calls it again (``reinvocationPolicy: IfNeeded``, or once per entry
of its configuration that selects the pod) and the watcher recreates bare
pods from their mutated spec. Admitted twice, a pod is byte-identical to
one admitted once."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.webhook.admission import review
from smr import config
from tests.fake_apiserver import pod
from tests.test_webhook import admission, patched

S = config.load({})
LABELS = {"smr.dev/node-restore": "true"}


def shapes() -> dict[str, dict[str, Any]]:
    """Pods of every kind the webhook mutates differently."""
    probed = pod("probed", None, labels=LABELS, containers=("app", "sidecar"))
    probed["spec"]["containers"][0]["livenessProbe"] = {"exec": {"command": ["true"]}}
    gpu = pod("gpu", None, labels={**LABELS, "smr.dev/restore-failure": "fail"})
    gpu["spec"]["runtimeClassName"] = "nvidia"
    own_grace = pod("own-grace", None, labels=LABELS)
    own_grace["spec"]["terminationGracePeriodSeconds"] = 120
    own_hook = pod("own-hook", None, labels=LABELS)
    own_hook["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {
        "command": ["/bin/flush"]}}}
    capped = pod("capped", None, labels=LABELS, annotations={"smr.dev/max-grace-seconds": "50"})
    no_annotations = pod("bare", None, labels=LABELS)
    del no_annotations["metadata"]["annotations"]
    return {"labels": pod("p", None, labels=LABELS), "probed": probed, "gpu": gpu,
            "env": pod("job", None, env={"SMR_CHECKPOINT": "run-1"}),
            "own-grace": own_grace, "own-hook": own_hook, "capped": capped,
            "no-annotations": no_annotations,
            "warm": pod("warm", None, labels={"smr.dev/start-from": "llm"})}


def admit(p: dict[str, Any], measured_s: float | None = None) -> dict[str, Any]:
    return patched(p, review(admission(p), S, measured_s))


@pytest.mark.parametrize("shape", list(shapes()))
def test_a_pod_admitted_twice_is_the_same_as_admitted_once(shape: str) -> None:
    once = admit(shapes()[shape])
    twice = admit(once)
    assert twice == once
    assert orjson.dumps(twice, option=orjson.OPT_SORT_KEYS) == \
        orjson.dumps(once, option=orjson.OPT_SORT_KEYS)
    assert "patch" not in review(admission(once), S)["response"], "nothing left to change"


def test_a_recreated_pod_gets_the_grace_and_wait_of_its_latest_measure() -> None:
    """The watcher recreates a bare pod from its mutated spec: the grace is
    raised from what the user gave, by the time measured now, and the hook
    waits that long (not the wait of its first admission)."""
    first = admit(pod("p", None, labels=LABELS))
    assert first["spec"]["terminationGracePeriodSeconds"] == 30 + S.final_checkpoint_seconds
    again = admit(first, measured_s=200.0)
    wait = 2 * 200 + 10
    assert again["spec"]["terminationGracePeriodSeconds"] == min(30 + wait, S.max_grace_seconds)
    added = again["spec"]["terminationGracePeriodSeconds"] - 30
    assert again["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
        "/smr/smr-init", "--wait-final", str(added)]
    assert again == admit(pod("p", None, labels=LABELS), measured_s=200.0)
