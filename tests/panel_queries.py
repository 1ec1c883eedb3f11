"""Every PromQL query the dashboards and alert rules run, ready to send to Prometheus.

The live panel check (issue 8) starts a real Prometheus scraping a short pipeline run and
evaluates each of these through the HTTP API; it fails on a query that errors or returns
no series. Grafana's template variables are rendered the way Grafana would with "All"
selected: ``$job``/``$instance``/``$dataset`` become ``.+`` (their ``allValue``),
``$__rate_interval`` and ``$__range`` become the durations passed in.

Alert rules are different: an alert expression ends in a threshold, so on a healthy run it
returns nothing by design. :func:`alert_queries` therefore returns each alert's *measure*
(what the threshold is applied to), which every run populates; :func:`alert_rule_exprs`
returns the rules' full expressions, to check that each one evaluates without error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS_DIR = ROOT / "grafana" / "dashboards"
RULES_FILE = ROOT / "deploy" / "prometheus" / "rules" / "draftstream.yml"

# The quantity each alert compares with its threshold. A healthy run populates every one
# (tests/unit/test_observability.py checks that each alert has one and that it is the
# left-hand side of the alert's expression).
ALERT_MEASURES: dict[str, tuple[str, ...]] = {
    "DraftstreamBudgetSoftThreshold": ("max by (dataset) (draftstream_budget_soft_limit_reached)",),
    "DraftstreamBudgetExhausted": ("max by (dataset) (draftstream_budget_state)",),
    "DraftstreamQualityHalt": ("max by (dataset) (draftstream_quality_halted)",),
    "DraftstreamHaltInForce": ("max by (scope) (draftstream_inference_halted)",),
    "DraftstreamDeadLetterRateHigh": (
        "(sum by (stage) (rate(draftstream_dead_letters_total[5m]))"
        " or on (stage) 0 * sum by (stage) (rate(draftstream_stage_records_total[5m])))"
        " / sum by (stage) (rate(draftstream_stage_records_total[5m]))",
    ),
    "DraftstreamNoProgress": (
        "max by (job, instance, group, topic) (draftstream_consumer_lag_records)",
        "sum by (job, instance) (increase(draftstream_stage_records_total[10m]))",
        "sum by (job, instance) (increase(draftstream_provider_requests_total[10m]))",
    ),
    "DraftstreamProviderErrorRateHigh": (
        "(sum by (provider) (rate(draftstream_provider_requests_total{outcome!=\"ok\"}[5m]))"
        " or on (provider) 0 * sum by (provider) (rate(draftstream_provider_requests_total[5m])))"
        " / sum by (provider) (rate(draftstream_provider_requests_total[5m]))",
    ),
}

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def render(expr: str, *, rate_interval: str = "1m", range_: str = "1h") -> str:
    """Substitute Grafana's variables the way Grafana does with every variable at "All"."""
    values = {"__rate_interval": rate_interval, "__range": range_, "__interval": rate_interval}

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, ".+")

    return _VARIABLE.sub(sub, expr)


def load_dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard JSON under grafana/dashboards, by file stem."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels collapsed inside a row
    return out


def raw_panel_queries() -> list[tuple[str, str]]:
    """(``<dashboard> / <panel>``, expr) for every panel target and annotation, unrendered."""
    out: list[tuple[str, str]] = []
    for dashboard in load_dashboards().values():
        title = dashboard["title"]
        for panel in _panels(dashboard):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((f"{title} / {panel['title']} [{target['refId']}]", target["expr"]))
        for annotation in dashboard.get("annotations", {}).get("list", []):
            if annotation.get("expr"):
                out.append((f"{title} / annotation {annotation['name']}", annotation["expr"]))
    return out


def panel_queries(*, rate_interval: str = "1m", range_: str = "1h") -> list[tuple[str, str]]:
    """(``<dashboard> / <panel>``, PromQL) for every panel target and annotation, rendered."""
    return [
        (name, render(expr, rate_interval=rate_interval, range_=range_))
        for name, expr in raw_panel_queries()
    ]


def load_rules() -> list[dict[str, Any]]:
    """Every alerting and recording rule of deploy/prometheus/rules/draftstream.yml."""
    data = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


def alert_rule_exprs() -> list[tuple[str, str]]:
    """(alert name, full expression) for every alert rule; empty results are normal here."""
    return [(rule["alert"], " ".join(rule["expr"].split())) for rule in load_rules() if "alert" in rule]


def alert_queries() -> list[tuple[str, str]]:
    """(alert name, measure) for every alert rule: what its threshold is applied to."""
    out: list[tuple[str, str]] = []
    for name, _expr in alert_rule_exprs():
        for measure in ALERT_MEASURES[name]:
            out.append((name, measure))
    return out
