"""Prometheus config and rules, Grafana dashboards and provisioning.

promtool runs the rule unit tests (deploy/prometheus/tests) and parses every dashboard and
alert query; the dashboards are held to the rules of Grafana's dashboard-linter here, in
Python: the Go linter cannot be installed (the Go module proxy refuses the module), so no
test depends on it (`make lint` runs it where it can be had, deploy/lint-dashboards.sh,
and these checks where not); docker-compose.yml has its
own tests in test_compose.py. Without promtool the tests skip, except under CI=true, where a
missing tool is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

from services.common import metrics
from services.common.config import MetricsSettings
from tests import panel_queries as pq

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
PROM_CONFIGS = ["prometheus.yml", "prometheus.compose.yml"]
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
COMPOSE_FILE = ROOT / "docker-compose.yml"
GRAFANA = ROOT / "grafana"

IN_CI = os.environ.get("CI", "").lower() == "true"

STAGE_PORTS = {
    "inference": MetricsSettings().inference_port,
    "reconstruct": MetricsSettings().reconstruct_port,
    "audit": MetricsSettings().audit_port,
    "budget": MetricsSettings().budget_port,
    "sink": MetricsSettings().sink_port,
    "simulator": MetricsSettings().simulator_port,
    "continuation": MetricsSettings().continuation_port,
}


def _missing(what: str) -> None:
    """Skip, or fail under CI=true, because a tool the test needs is absent."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing tool is a failure)")
    pytest.skip(what)


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        _missing("promtool is not installed (Debian package `prometheus`; `make system-deps`)")
    assert path is not None
    return path


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# ------------------------------------------------------------------------ Prometheus


@pytest.mark.parametrize("config", PROM_CONFIGS)
def test_promtool_check_config_passes(config: str) -> None:
    result = _run(_promtool(), "check", "config", str(PROM_DIR / config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
    # the rule files were found and checked, not silently matched by nothing
    assert "draftstream.yml" in result.stdout + result.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    assert RULE_TESTS, "no rule tests under deploy/prometheus/tests"
    result = _run(_promtool(), "test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_rule_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    """The rule tests are not vacuous: a rules file with a changed threshold fails them."""
    promtool = _promtool()
    rules = (PROM_DIR / "rules" / "draftstream.yml").read_text(encoding="utf-8")
    assert "> 0.05" in rules
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "draftstream.yml").write_text(rules.replace("> 0.05", "> 0.5"), encoding="utf-8")
    (tmp_path / "tests").mkdir()
    for test_file in RULE_TESTS:
        shutil.copy(test_file, tmp_path / "tests" / test_file.name)
    result = subprocess.run(
        [promtool, "test", "rules", *[str(tmp_path / "tests" / t.name) for t in RULE_TESTS]],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "DraftstreamDeadLetterRateHigh" in result.stdout + result.stderr


def _rule_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = []
    for path in RULE_TESTS:
        tests.extend(yaml.safe_load(path.read_text(encoding="utf-8"))["tests"])
    return tests


@pytest.mark.parametrize("alert", [name for name, _ in pq.alert_rule_exprs()])
def test_every_alert_has_a_firing_and_a_quiet_case(alert: str) -> None:
    cases = [c for t in _rule_tests() for c in t.get("alert_rule_test", []) if c["alertname"] == alert]
    assert any(c["exp_alerts"] for c in cases), f"{alert}: no case where it fires"
    assert any(not c["exp_alerts"] for c in cases), f"{alert}: no case where it stays quiet"


def test_rules_cover_the_five_issue_alerts() -> None:
    names = {name for name, _ in pq.alert_rule_exprs()}
    assert {
        "DraftstreamBudgetSoftThreshold",
        "DraftstreamHaltInForce",
        "DraftstreamDeadLetterRateHigh",
        "DraftstreamNoProgress",
        "DraftstreamProviderErrorRateHigh",
    } <= names
    for rule in pq.load_rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.parametrize("config", PROM_CONFIGS)
def test_prometheus_scrapes_every_service_on_its_metrics_port(config: str) -> None:
    data = yaml.safe_load((PROM_DIR / config).read_text(encoding="utf-8"))
    assert data["rule_files"] == ["rules/*.yml"]
    ports: dict[str, set[int]] = {}
    for job in data["scrape_configs"]:
        targets = [t for s in job.get("static_configs", []) for t in s["targets"]]
        found = {int(t.rsplit(":", 1)[1]) for t in targets}
        found |= {int(d["port"]) for d in job.get("dns_sd_configs", [])}
        ports[job["job_name"]] = found
    assert ports == {job: {port} for job, port in STAGE_PORTS.items()}


def test_local_config_scrapes_loopback_and_compose_config_service_names() -> None:
    local = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    compose = yaml.safe_load((PROM_DIR / "prometheus.compose.yml").read_text(encoding="utf-8"))
    for job in local["scrape_configs"]:
        assert all(t.startswith("127.0.0.1:") for s in job["static_configs"] for t in s["targets"])
    for job in compose["scrape_configs"]:
        assert job["job_name"] in {n for d in job["dns_sd_configs"] for n in d["names"]}


# ------------------------------------------------------------------------ queries


def _metric_names() -> set[str]:
    """Every series name the services expose (counters with _total, histogram parts)."""
    names = {"up"}
    for value in vars(metrics).values():
        if isinstance(value, Counter):
            names.add(f"{value._name}_total")
        elif isinstance(value, Histogram):
            names |= {f"{value._name}_{part}" for part in ("bucket", "sum", "count")}
        elif isinstance(value, Gauge):
            names.add(value._name)
    return names


def _all_exprs() -> list[tuple[str, str]]:
    return pq.panel_queries() + pq.alert_queries() + pq.alert_rule_exprs()


def test_every_query_names_only_metrics_the_services_define() -> None:
    known = _metric_names()
    assert "draftstream_dead_letters_total" in known
    assert "draftstream_provider_request_duration_seconds_bucket" in known
    for name, expr in _all_exprs():
        used = set(re.findall(r"\b(draftstream_[a-z_]+|up)\b(?=\s*[{\[)])", expr))
        assert used, f"{name}: no metric found in {expr}"
        assert used <= known, f"{name}: unknown metric(s) {sorted(used - known)}"


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each rendered panel query, alert measure and alert expression."""
    promtool = _promtool()
    exprs = _all_exprs()
    rules = {
        "groups": [
            {"name": "parse", "rules": [{"record": f"draftstream:query_{i}", "expr": e} for i, (_, e) in
                                        enumerate(exprs)]}
        ]
    }
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_panel_queries_cover_every_target_and_render_every_variable() -> None:
    dashboards = pq.load_dashboards()
    assert set(dashboards) == {"budget", "errors", "pipeline"}
    targets = sum(len(p.get("targets", [])) for d in dashboards.values() for p in d["panels"])
    annotations = sum(1 for d in dashboards.values() for a in d["annotations"]["list"] if a.get("expr"))
    queries = pq.panel_queries()
    assert len(queries) == targets + annotations
    assert len({name for name, _ in queries}) == len(queries), "panel query names must be unique"
    for name, expr in queries:
        assert "$" not in expr, f"{name}: unrendered variable in {expr}"
    rendered = pq.render(
        'rate(x{job=~"$job", d=~"${dataset}"}[$__rate_interval]) [$__range]', rate_interval="2m"
    )
    assert rendered == 'rate(x{job=~".+", d=~".+"}[2m]) [1h]'


def test_alert_measures_are_what_each_alert_compares() -> None:
    exprs = dict(pq.alert_rule_exprs())
    assert set(pq.ALERT_MEASURES) == set(exprs)
    squash = "".join
    for name, measures in pq.ALERT_MEASURES.items():
        full = squash(exprs[name].split())
        for measure in measures:
            assert squash(measure.split()) in full, f"{name}: measure {measure!r} is not in its expression"
        if len(measures) == 1:
            assert full.startswith(squash(measures[0].split()))


# ------------------------------------------------------------------------ dashboards

# Units Grafana knows (a subset of dashboard-linter's list: the ones these dashboards may use).
_UNITS = {"none", "short", "percent", "percentunit", "currencyUSD", "bytes", "decbytes", "Bps", "binBps",
          "s", "ms", "ops", "reqps", "rps", "wps", "cps"}
_SELECTOR = re.compile(r"\b(draftstream_[a-z_]+|up)\b\s*(\{[^}]*\})?")  # "up", not "upstream"


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]


@pytest.fixture(params=["budget", "errors", "pipeline"])
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return pq.load_dashboards()[request.param]


def test_dashboard_templating_follows_the_linter(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"], ds["label"]) == ("datasource", "prometheus", "Data source")
    for name in ("job", "instance", "dataset"):
        v = variables[name]
        assert v["type"] == "query"
        assert v["datasource"]["uid"] == "${datasource}"
        assert v["label"] == name.title()
        assert v["multi"] is True and v["includeAll"] is True and v["allValue"] == ".+"
        assert v["refresh"] == 2, "query variables reload on time-range change"
        assert re.fullmatch(r"label_values\(.+, " + name + r"\)", v["query"]), v["query"]
    # the dataset variable is read from a metric that has a dataset label
    metric = re.match(r"label_values\((draftstream_[a-z_]+)", variables["dataset"]["query"])
    assert metric is not None and metric.group(1) in _metric_names()
    assert dashboard["editable"] is False
    assert dashboard["uid"].startswith("draftstream-")


def test_dashboard_panels_follow_the_linter(dashboard: dict[str, Any]) -> None:
    uses_dataset = False
    for panel in _panels(dashboard):
        where = f"{dashboard['title']} / {panel['title']}"
        assert panel["title"] and panel["description"], where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["fieldConfig"]["defaults"]["unit"] in _UNITS, where
        assert panel["targets"], where
        for target in panel["targets"]:
            expr = target["expr"]
            uses_dataset |= "$dataset" in expr
            assert target["datasource"]["uid"] == "${datasource}", where
            # every selector is scoped by the job and instance variables
            for metric, labels in _SELECTOR.findall(expr):
                assert labels and 'job=~"$job"' in labels and 'instance=~"$instance"' in labels, (
                    f"{where}: {metric} lacks job/instance matchers"
                )
            # rate() always over $__rate_interval
            for window in re.findall(r"\brate\([^\[]*\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", f"{where}: rate over {window}"
            # counters only through rate()/increase(); histogram buckets only in histogram_quantile
            for counter in re.finditer(r"(draftstream_[a-z_]+_total)\{[^}]*\}", expr):
                before = expr[: counter.start()]
                assert re.search(r"\b(rate|increase)\($", before), f"{where}: bare counter {counter.group(1)}"
                assert expr[counter.end()] == "[", where
            if "_bucket" in expr:
                assert expr.startswith("histogram_quantile("), where
    assert uses_dataset, f"{dashboard['title']}: the dataset variable filters no panel"


def test_dashboards_have_unique_uids_and_panel_ids() -> None:
    dashboards = pq.load_dashboards().values()
    assert len({d["uid"] for d in dashboards}) == 3
    for d in dashboards:
        ids = [p["id"] for p in _panels(d)]
        assert len(ids) == len(set(ids))


def test_budget_dashboard_shows_spend_cap_burn_projection_and_halts() -> None:
    budget = pq.load_dashboards()["budget"]
    exprs = " ".join(t["expr"] for p in budget["panels"] for t in p["targets"])
    for metric in ("draftstream_budget_spent", "draftstream_budget_cap",
                   "draftstream_budget_projected_dollars",
                   "draftstream_budget_burn_rate_dollars_per_second", "draftstream_tokens_total"):
        assert metric in exprs
    annotations = [a for a in budget["annotations"]["list"] if a.get("expr")]
    assert any("draftstream_budget_state" in a["expr"] for a in annotations)
    # Issue 23: what a sample costs, one panel each.
    titles = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in budget["panels"]}
    assert "draftstream_quality_yield_ratio" in titles["Yield per dataset and upstream"]
    assert "by (dataset, upstream)" in titles["Yield per dataset and upstream"]
    assert "by (dataset, reason)" in titles["Dead letters of paid answers by reason"]
    assert "draftstream_dollars_per_accepted_sample" in titles["Dollars per accepted sample"]
    paid_kept = titles["Tokens paid vs kept"]
    assert 'kind="completion"' in paid_kept and "draftstream_tokens_kept_total" in paid_kept
    assert any("draftstream_inference_halted" in a["expr"] for a in annotations)


def test_errors_and_pipeline_dashboards_cover_the_issue_panels() -> None:
    dashboards = pq.load_dashboards()
    errors = " ".join(t["expr"] for p in dashboards["errors"]["panels"] for t in p["targets"])
    for needle in ("draftstream_dead_letters_total", "by (stage, reason)",
                   "draftstream_provider_retries_total", 'outcome!="ok"', 'result="fail"', "by (check)"):
        assert needle in errors
    pipeline = " ".join(t["expr"] for p in dashboards["pipeline"]["panels"] for t in p["targets"])
    for needle in ("by (stage)", "draftstream_consumer_lag_records", "histogram_quantile(0.5,",
                   "histogram_quantile(0.95,", "histogram_quantile(0.99,"):
        assert needle in pipeline


def test_pipeline_dashboard_shows_the_rate_limit_window_429s_and_retry_after_pauses() -> None:
    pipeline = pq.load_dashboards()["pipeline"]
    (panel,) = [p for p in _panels(pipeline) if p["title"] == "Rate limits"]
    exprs = [t["expr"] for t in panel["targets"]]
    assert any(e.startswith("sum by (provider, upstream) (draftstream_provider_window_requests{") for e in exprs)
    assert any("rate(draftstream_provider_rate_limited_total{" in e and "by (provider, upstream)" in e for e in exprs)
    assert any("rate(draftstream_provider_rate_limit_paused_seconds_total{" in e for e in exprs)
    # The live panel check queries every target; the rendered queries include these three.
    names = {name for name, _ in pq.panel_queries() if "/ Rate limits [" in name}
    assert len(names) == 3


def test_dashboard_linter_script_is_valid_bash() -> None:
    script = ROOT / "deploy" / "lint-dashboards.sh"
    assert os.access(script, os.X_OK)
    result = _run("bash", "-n", str(script))
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------ Grafana provisioning


def test_grafana_provisions_the_prometheus_datasource_and_dashboards() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert (source["uid"], source["type"], source["access"]) == ("prometheus", "prometheus", "proxy")
    assert source["url"] == "${PROMETHEUS_URL}"
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "draftstream.yml").read_text())
    (provider,) = dash["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "${GRAFANA_DASHBOARDS_DIR}"
    # docker-compose mounts both and sets the variables the provisioning reads
    grafana = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["grafana"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    mount = next(v for v in grafana["volumes"] if v.startswith("./grafana/dashboards:"))
    assert mount.split(":")[1] == grafana["environment"]["GRAFANA_DASHBOARDS_DIR"]
    assert grafana["environment"]["PROMETHEUS_URL"] == "http://prometheus:9090"


# ------------------------------------------------------------------------ every query has data

# The series a healthy run leaves behind (no dead letter, no retry, no halt, no audit
# failure), one scrape a minute for 40 minutes: the shape the live panel check expects of
# a real pipeline run. Each panel query and alert measure must return a series over these.
_I = 'job="inference", instance="i:9401"'
_R = 'job="reconstruct", instance="r:9402"'
_A = 'job="audit", instance="a:9403"'
_B = 'job="budget", instance="b:9404"'
_S = 'job="sink", instance="s:9405"'
_LATENCY = "draftstream_provider_request_duration_seconds_bucket"
HEALTHY_RUN = [
    (f'up{{{_I}}}', "1x40"),
    (f'draftstream_budget_spent{{{_B}, dataset="code", unit="completion_tokens"}}', "0+100x40"),
    (f'draftstream_budget_spent{{{_B}, dataset="code", unit="dollars"}}', "0+0.01x40"),
    (f'draftstream_budget_cap{{{_B}, dataset="code", unit="completion_tokens"}}', "10000000x40"),
    (f'draftstream_budget_remaining{{{_B}, dataset="code", unit="completion_tokens"}}', "10000000-100x40"),
    (f'draftstream_budget_state{{{_B}, dataset="code"}}', "0x40"),
    (f'draftstream_budget_soft_limit_reached{{{_B}, dataset="code"}}', "0x40"),
    (f'draftstream_budget_projected_dollars{{{_B}, dataset="code"}}', "5x40"),
    (f'draftstream_budget_burn_rate_dollars_per_second{{{_B}, dataset="code"}}', "0.001x40"),
    (f'draftstream_spend_dollars_total{{{_B}, dataset="code"}}', "0+0.01x40"),
    (f'draftstream_tokens_total{{{_B}, dataset="code", kind="completion"}}', "0+100x40"),
    (f'draftstream_tokens_total{{{_B}, dataset="code", kind="prompt"}}', "0+50x40"),
    (f'draftstream_stage_records_total{{{_B}, stage="budget"}}', "0+10x40"),
    (f'draftstream_quality_verdicts_total{{{_B}, dataset="code", upstream="unknown", outcome="accepted"}}',
     "0+10x40"),
    (f'draftstream_quality_yield_ratio{{{_B}, dataset="code", upstream="all"}}', "1x40"),
    (f'draftstream_quality_halted{{{_B}, dataset="code"}}', "0x40"),
    (f'draftstream_dollars_per_accepted_sample{{{_B}, dataset="code"}}', "0.001x40"),
    (f'draftstream_tokens_kept_total{{{_B}, dataset="code"}}', "0+90x40"),
    (f'draftstream_inference_halted{{{_I}, scope="global"}}', "0x40"),
    (f'draftstream_provider_requests_total{{{_I}, provider="simulator", outcome="ok"}}', "0+10x40"),
    (f'{_LATENCY}{{{_I}, provider="simulator", le="0.1"}}', "0+5x40"),
    (f'{_LATENCY}{{{_I}, provider="simulator", le="1"}}', "0+10x40"),
    (f'{_LATENCY}{{{_I}, provider="simulator", le="+Inf"}}', "0+10x40"),
    (f'draftstream_inflight_requests{{{_I}, dataset="code"}}', "3x40"),
    (f'draftstream_provider_window_requests{{{_I}, provider="simulator", upstream="key"}}', "256x40"),
    (f'draftstream_provider_rate_limited_total{{{_I}, provider="simulator", upstream="key"}}', "0x40"),
    (f'draftstream_provider_rate_limit_paused_seconds_total{{{_I}, provider="simulator"}}', "0x40"),
    (f'draftstream_responses_total{{{_I}, dataset="code"}}', "0+10x40"),
    (f'draftstream_consumer_lag_records{{{_I}, group="draftstream-inference", topic="prompts.code"}}',
     "5x40"),
    (f'draftstream_stage_records_total{{{_R}, stage="reconstruct"}}', "0+10x40"),
    (f'draftstream_reconstructed_total{{{_R}, dataset="code", method="native"}}', "0+10x40"),
    (f'draftstream_consumer_lag_records{{{_R}, group="draftstream-reconstruct", topic="responses"}}', "0x40"),
    (f'draftstream_stage_records_total{{{_A}, stage="audit"}}', "0+10x40"),
    (f'draftstream_audit_checks_total{{{_A}, dataset="code", check="ends_with_eot", result="pass"}}',
     "0+10x40"),
    (f'draftstream_accepted_samples_total{{{_A}, dataset="code"}}', "0+10x40"),
    (f'draftstream_stage_records_total{{{_S}, stage="sink"}}', "0+10x40"),
    (f'draftstream_sink_rows_total{{{_S}, dataset="code"}}', "0+10x40"),
    (f'draftstream_sink_bytes_total{{{_S}, dataset="code"}}', "0+40000x40"),
    (f'draftstream_sink_files_total{{{_S}, dataset="code"}}', "1x40"),
]


def test_every_panel_query_and_alert_measure_has_data_after_a_healthy_run(tmp_path: Path) -> None:
    """promtool evaluates each query over a healthy run's series: none errors, none is empty."""
    promtool = _promtool()
    queries = pq.panel_queries(rate_interval="2m", range_="1h") + pq.alert_queries()
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in HEALTHY_RUN],
                "promql_expr_test": [
                    {"expr": f"count({expr}) > bool 0", "eval_time": "30m",
                     "exp_samples": [{"labels": "{}", "value": 1}]}
                    for _, expr in queries
                ],
            }
        ],
    }
    path = tmp_path / "queries_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    report = result.stdout + result.stderr
    # promtool quotes each failing expression Go-style: match on the metric-free skeleton too
    failing = [name for name, expr in queries if f"count({expr})" in report
               or json.dumps(f"count({expr}) > bool 0") in report]
    assert result.returncode == 0, f"queries without data or failing: {failing}\n{report[-3000:]}"
    assert "SUCCESS" in result.stdout
