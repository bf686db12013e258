"""deploy/prometheus and deploy/grafana against the metric catalog: every metric a rule or a dashboard panel queries
is exported by some service (the catalog, which tests/integration/test_monitoring.py checks against every service's
live /metrics), and every recording rule a dashboard or alert uses is defined."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.telemetry import CATALOG

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))

EXPORTED = {name for spec in CATALOG.values() for name in spec.sample_names}
# Words of PromQL that look like identifiers but are not metrics.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
KEYWORDS |= {"inf", "nan", "Inf", "NaN"}


def metric_names(expr: str) -> set[str]:
    """The metric (or recording-rule) names an expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers, Grafana's ${var}
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery windows ([5m], [$__rate_interval])
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", expr):
        before = expr[match.start() - 1] if match.start() else " "
        after = expr[match.end() :].lstrip()[:1]
        if before.isalnum() or before in "_$.:" or after == "(" or match.group() in KEYWORDS:
            continue  # part of a number or variable, a function call, or a keyword
        names.add(match.group())
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (job, le) (rate(fairfl_x_bucket{run_id=~"$run_id"}[$__rate_interval]))', {"fairfl_x_bucket"}),
        ("a:b:c * 10000 > 20 and on (run_id) time() - fairfl_t > 600", {"a:b:c", "fairfl_t"}),
        ('histogram_quantile(0.95, sum(rate(m_bucket{le="+Inf"}[5m])) by (le)) offset 5m', {"m_bucket"}),
        ("-job:x:rate5m + 1e4 * topk(25, y)", {"job:x:rate5m", "y"}),
        ("fairfl_a == bool 1 unless ignoring(phase) fairfl_b", {"fairfl_a", "fairfl_b"}),
    ],
)
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def _rules() -> list[dict[str, Any]]:
    rules = []
    for path in sorted((PROMETHEUS / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules.extend(group["rules"])
    return rules


RULES = _rules()
RECORDED = {r["record"] for r in RULES if "record" in r}


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in board["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return panels


def _check(expr: str, where: str) -> list[str]:
    problems = []
    for name in metric_names(expr):
        if ":" in name:
            if name not in RECORDED:
                problems.append(f"{where}: recording rule {name} is not defined in deploy/prometheus/rules")
        elif name not in EXPORTED:
            problems.append(f"{where}: {name} is exported by no FairFL service")
    return problems


def test_rules_query_only_exported_metrics() -> None:
    assert len(RULES) >= 10
    problems = []
    for rule in RULES:
        problems += _check(rule["expr"], rule.get("alert") or rule.get("record"))
        assert metric_names(rule["expr"]), rule
    assert not problems, "\n".join(problems)


def test_required_alerts_exist() -> None:
    alerts = {r["alert"] for r in RULES if "alert" in r}
    assert alerts == {
        "FairFLFairnessRegression",
        "FairFLWorstClientsAccuracyLow",
        "FairFLPrivacyBudgetNearlyExhausted",
        "FairFLNoRoundCompleted",
        "FairFLClientDropoutHigh",
    }
    for rule in RULES:
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_alert_has_a_unit_test() -> None:
    tested = {
        case["alertname"]
        for path in (PROMETHEUS / "tests").glob("*.yml")
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert tested == {r["alert"] for r in RULES if "alert" in r}


def test_dashboards_exist_and_query_only_exported_metrics() -> None:
    assert {p.stem for p in DASHBOARDS} == {"fairness", "privacy", "system"}
    problems = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        panels = _panels(board)
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        assert board["uid"].startswith("fairfl-")
        for panel in panels:
            if panel["type"] == "row":
                continue
            where = f"{path.name} / {panel['title']}"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["targets"], where
            for target in panel["targets"]:
                assert metric_names(target["expr"]), where
                problems += _check(target["expr"], where)
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                problems += _check(variable["definition"].replace("label_values(", "").split(",")[0], path.name)
    assert not problems, "\n".join(problems)


def test_dashboards_cover_the_three_areas() -> None:
    used = {
        name
        for path in DASHBOARDS
        for panel in _panels(json.loads(path.read_text()))
        for target in panel.get("targets", [])
        for name in metric_names(target["expr"])
    }
    for required in (
        "fairfl_fairness_accuracy_variance",
        "fairfl_fairness_accuracy_tail_ratio",
        "fairfl_fairness_psi",
        "fairfl_fairness_client_disagreement",
        "fairfl_fairness_aggregation_weight_entropy",
        "fairfl_evaluation_client_accuracy_ratio_bucket",
        "fairfl_clustering_nmi",
        "fairfl_privacy_epsilon_spent",
        "fairfl_privacy_budget_used_ratio",
        "fairfl_privacy_principal_epsilon_spent",
        "fairfl_privacy_rounds_refused_total",
        "phase:fairfl_round_phase_duration_seconds:mean_5m",
        "fairfl_results_rejected_total",
        "method:fairfl_grpc_server_handling_seconds:p95_5m",
        "fairfl_connected_clients",
        "fairfl_checkpoint_duration_seconds_bucket",
    ):
        assert required in used, f"no dashboard shows {required}"


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "fairfl.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/fairfl"
