"""deploy/observability: the monitoring component renders into a valid
overlay whose PodMonitor finds every smr pod's metrics port; promtool checks
the alert rules and runs their unit tests; the dashboard and the rules name
only metrics smr exports. (tests/test_metrics.py evaluates every dashboard
query in a real Prometheus scraping a real checkpoint.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from smr import metrics
from smr.config import REPO_TOOLS
from tests import deploy_policy
from tests.test_deploy import K8S_VERSION, render

OBSERVABILITY = Path(__file__).resolve().parents[1] / "deploy" / "observability"
OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}  # CRDs: no offline schema to check


def dashboard_exprs() -> list[str]:
    board = json.loads((OBSERVABILITY / "dashboard.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def rule_file() -> dict[str, Any]:
    return yaml.safe_load((OBSERVABILITY / "prometheusrule.yaml").read_text())["spec"]


@pytest.fixture(scope="module")
def promtool() -> str:
    binary = REPO_TOOLS / "promtool"
    if not binary.exists():
        pytest.skip("promtool is not installed (make setup)")
    return str(binary)


def test_monitoring_overlay_scrapes_every_smr_pod(kustomize: str) -> None:
    docs = render(kustomize, "monitoring")
    for d in docs:
        if d["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert deploy_policy.violations(docs) == []
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    assert {w["metadata"]["name"] for w in workloads} >= {
        "smr-watcher", "smr-agent", "smr-storage", "smr-webhook"}
    for w in workloads:
        template = w["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), w["metadata"]["name"]
        ports = [p for c in template["spec"]["containers"] for p in c.get("ports", [])]
        metrics_port = next(p for p in ports if p["name"] == port)
        assert template["metadata"]["annotations"]["prometheus.io/port"] == \
            str(metrics_port["containerPort"])
    board = next(d for d in docs if d["kind"] == "ConfigMap"
                 and d["metadata"]["name"] == "smr-grafana-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["smr.json"])["uid"] == "smr-overview"
    assert any(d["kind"] == "PrometheusRule" for d in docs)


def test_promtool_checks_the_rules_and_passes_their_unit_tests(promtool: str,
                                                               tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file()))
    (tmp_path / "rules.test.yaml").write_text((OBSERVABILITY / "rules.test.yaml").read_text())
    check = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 6 rules found" in check.stdout
    test = subprocess.run([promtool, "test", "rules", "rules.test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    # Each alert has at least one unit test that expects it to fire.
    tested = yaml.safe_load((OBSERVABILITY / "rules.test.yaml").read_text())
    fired = {c["alertname"] for t in tested["tests"] for c in t["alert_rule_test"]
             if c["exp_alerts"]}
    assert fired == {r["alert"] for g in rule_file()["groups"] for r in g["rules"]}


def exported() -> set[str]:
    names = set()
    for family in metrics.REGISTRY.collect():
        names |= {family.name + s for s in ("", "_total", "_bucket", "_count", "_sum")}
    return names


def test_dashboard_and_rules_name_only_metrics_smr_exports() -> None:
    rules = [r["expr"] for g in rule_file()["groups"] for r in g["rules"]]
    used = {m for e in dashboard_exprs() + rules for m in re.findall(r"\bsmr_\w+", e)}
    assert used, "no smr metric in the dashboard"
    assert used <= exported(), used - exported()
    # Every metric smr exports is on the dashboard.
    families = {f.name for f in metrics.REGISTRY.collect()}
    shown = {f for f in families if any(u.startswith(f) for u in used)}
    assert shown == families, families - shown


def test_every_metric_smr_exports_is_on_the_dashboard_and_in_the_docs_table() -> None:
    """Each metric family of the registry is queried by a dashboard panel (an
    alert rule alone is not enough: the dashboard is where an operator looks)
    and has its row in docs/observability.md's metrics table."""
    on_board = {m for e in dashboard_exprs() for m in re.findall(r"\bsmr_\w+", e)}
    doc = (OBSERVABILITY.parents[1] / "docs" / "observability.md").read_text()
    in_table = set(re.findall(r"^\| `(smr_\w+)` \|", doc, re.M))
    off_board, undocumented = [], []
    for family in metrics.REGISTRY.collect():
        samples = {family.name + s for s in ("", "_total", "_bucket", "_count", "_sum")}
        if not samples & on_board:
            off_board.append(family.name)
        if not samples & in_table:
            undocumented.append(family.name)
    assert not off_board, f"metrics no dashboard panel shows: {off_board}"
    assert not undocumented, f"metrics with no row in docs/observability.md: {undocumented}"
