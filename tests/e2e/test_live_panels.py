"""The live panel check (issue 8): every dashboard panel and alert query has data on a real run.

A short real pipeline run (the provider simulator with a few 429s and content faults, and
inference, reconstruct, audit, budget and sink as their own processes, each serving metrics
on its own free port) is scraped by a real Prometheus on loopback (``/usr/bin/prometheus``,
Debian package ``prometheus``; scrape interval 1 s, the repository's alert rules loaded).
Every panel target and annotation of ``grafana/dashboards`` and every alert's measure is
then evaluated through Prometheus's HTTP API: a query that errors or returns no series is a
failure, all of them reported together. The alerts' full expressions may be empty on a
healthy run, so they are only checked to evaluate without error.

Prometheus starts before the prompts are published so that the rates cover the run itself.
Without the prometheus binary the test skips; under CI=true it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from services.common.config import Settings
from services.common.kafka import ensure_topics
from services.demo.run import DATA as DEMO_DATA
from tests import panel_queries as pq
from tests.e2e.brokers import free_port
from tests.e2e.harness import Processes, accepted_keys, cli, dead_letters, wait_http, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.prometheus]

IN_CI = os.environ.get("CI", "").strip().lower() == "true"
PROMETHEUS = "/usr/bin/prometheus"
RULES_FILE = pq.RULES_FILE
DATASETS = {"math": 40, "code": 40}  # prompts published per dataset (demo data, first N rows)
SERVICES = ("inference", "reconstruct", "audit", "budget", "sink")
RATE_INTERVAL = "1m"  # $__rate_interval: the whole run fits in it
RANGE = "1h"  # $__range
SIMULATOR_FAULTS = ("429=0.10", "5xx=0.03", "truncate=0.05", "bad_usage=0.05", "empty_reasoning=0.03")


# ------------------------------------------------------------------------ helpers


def prometheus_binary() -> str:
    """The prometheus binary; skip without it (fail under CI=true, where `make test` installs it)."""
    found = shutil.which("prometheus") or (PROMETHEUS if os.access(PROMETHEUS, os.X_OK) else None)
    if found is None:
        reason = "prometheus is not installed (Debian package `prometheus`; `make system-deps`)"
        if IN_CI:
            pytest.fail(f"{reason} (CI=true: a missing tool is a failure)")
        pytest.skip(reason)
    return found


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(data: Mapping[str, Any], table: tuple[str, ...] = ()) -> str:
    """A nested mapping of scalars and lists as TOML tables (``None`` values are left out)."""
    scalars = [f"{k} = {_toml_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, Mapping)]
    out = []
    if table and scalars:
        out.append(f"[{'.'.join(table)}]")
    out.extend(scalars)
    text = "\n".join(out) + ("\n\n" if out else "")
    for key, value in data.items():
        if isinstance(value, Mapping):
            text += to_toml(value, (*table, key))
    return text


def settings_toml(settings: Settings) -> str:
    """The non-default parts of ``settings`` as a TOML config file; secrets are never written."""
    data = settings.model_dump(
        mode="json",
        exclude_defaults=True,
        exclude={"kafka": {"sasl_password"}, "provider": {"api_key"}},
    )
    text = to_toml(data)
    assert "**********" not in text
    return text


def prometheus_config(targets: Mapping[str, int]) -> dict[str, Any]:
    """A Prometheus config scraping exactly ``targets`` (job -> loopback port) every second."""
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]} for job, port in targets.items()
        ],
    }


@dataclass
class Prometheus:
    """A real Prometheus on a free loopback port with its own storage, stopped by :meth:`stop`."""

    binary: str
    work_dir: Path
    targets: Mapping[str, int]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        """Where Prometheus writes its output."""
        return self.work_dir / "prometheus.log"

    def start(self) -> None:
        """Write the config and start the server."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(self.targets), sort_keys=False), encoding="utf-8")
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - a fixed binary with our own arguments
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.work_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
            )

    def check_alive(self) -> None:
        """Fail with Prometheus's own output when it exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def targets_up(http: httpx.AsyncClient, prom: Prometheus) -> bool:
    """True once every configured job has exactly one active target and it is up."""
    prom.check_alive()
    try:
        response = await http.get(f"{prom.url}/api/v1/targets", params={"state": "active"})
    except httpx.HTTPError:
        return False
    if response.status_code != 200:
        return False
    active = response.json()["data"]["activeTargets"]
    health = {t["labels"]["job"]: t["health"] for t in active}
    return len(active) == len(prom.targets) and health == {job: "up" for job in prom.targets}


async def scraped_since(http: httpx.AsyncClient, prom: Prometheus, since: float) -> bool:
    """True once every job's latest scrape is later than ``since`` (Unix time)."""
    prom.check_alive()
    result = await query(http, prom, f"timestamp(up) > {since:.3f}")
    return result.error is None and {s["metric"]["job"] for s in result.series} == set(prom.targets)


@dataclass(frozen=True)
class QueryResult:
    """What Prometheus answered to one instant query."""

    series: list[dict[str, Any]]
    error: str | None


async def query(http: httpx.AsyncClient, prom: Prometheus, expr: str) -> QueryResult:
    """Evaluate one instant query through /api/v1/query."""
    try:
        response = await http.get(f"{prom.url}/api/v1/query", params={"query": expr})
        body = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        return QueryResult([], f"{type(exc).__name__}: {exc}")
    if body.get("status") != "success":
        return QueryResult([], f"{body.get('errorType')}: {body.get('error')}")
    data = body["data"]
    if data["resultType"] not in ("vector", "matrix"):
        return QueryResult([], f"unexpected result type {data['resultType']}")
    return QueryResult(list(data["result"]), None)


async def evaluate(
    http: httpx.AsyncClient, prom: Prometheus, queries: list[tuple[str, str]], *, need_series: bool
) -> list[str]:
    """Failures among ``queries``: an error, or (``need_series``) an empty result."""
    failures = []
    for name, expr in queries:
        result = await query(http, prom, expr)
        if result.error is not None:
            failures.append(f"{name}: error {result.error}\n    {expr}")
        elif need_series and not result.series:
            failures.append(f"{name}: no series\n    {expr}")
    return failures


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """Service processes, all stopped at the end even on failure."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    procs = Processes(log_dir)
    try:
        yield procs
    finally:
        procs.stop_all()


def _log_tails(log_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(log_dir.glob("*.log")))


# ------------------------------------------------------------------------ the test


@pytest.mark.long(30)
@pytest.mark.timeout(420)
async def test_every_panel_and_alert_query_has_data_on_a_live_run(
    tmp_path: Path,
    settings_factory: Callable[..., Settings],
    processes: Processes,
    report: Callable[..., str],
) -> None:
    """A real run scraped by a real Prometheus: no panel or alert query errors or comes back empty."""
    binary = prometheus_binary()
    sim_port = free_port()
    ports = {f"{name}_port": free_port() for name in SERVICES}
    dataset = {"max_tokens": 512, "audit": {"usage_offset": 0}}
    settings = settings_factory(
        provider={
            "kind": "simulator",
            "base_url": f"http://127.0.0.1:{sim_port}/api/v1",
            "concurrency": 16,
            "max_attempts": 3,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.3,
            "timeout_s": 10,
        },
        metrics={**ports, "simulator_port": free_port()},
        stage={"batch_max": 16, "batch_timeout_ms": 50},
        # expected_prompts on both datasets: the budget's projection gauges exist from the start
        datasets={name: {**dataset, "expected_prompts": n} for name, n in DATASETS.items()},
    )
    config = tmp_path / "draftstream.toml"
    config.write_text(settings_toml(settings), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "DRAFTSTREAM_", "OPENROUTER_"))}
    env["PYTHONUNBUFFERED"] = "1"
    targets = {name: getattr(settings.metrics, f"{name}_port") for name in SERVICES}
    targets["simulator"] = settings.metrics.simulator_port
    prom = Prometheus(binary, tmp_path / "prometheus", targets)
    out_dir = Path(settings.sink.out_dir)
    started = time.monotonic()

    try:
        await ensure_topics(settings.kafka, DATASETS)
        processes.start(
            "simulator",
            cli(
                "simulate-provider",
                "--port",
                str(sim_port),
                "--metrics-port",
                str(settings.metrics.simulator_port),
                "--reasoning-tokens",
                "8-40",
                "--content-tokens",
                "8-30",
                "--latency",
                "0.02",
                "--jitter",
                "0.1",
                *[arg for fault in SIMULATOR_FAULTS for arg in ("--fault-rate", fault)],
            ),
            env,
        )
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{sim_port}/health", 60)
        for name in SERVICES:
            processes.start(name, cli("run", name, "--config", str(config)), env)
        for port in targets.values():
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/metrics", 90)
        processes.check_alive()

        startup_seconds = time.monotonic() - started
        prom.start()
        async with httpx.AsyncClient(timeout=10) as http:
            await wait_until(
                lambda: targets_up(http, prom), timeout=60, interval=0.5, message="every Prometheus target up"
            )

            from services.publish.app import publish

            published = 0
            for name, n in DATASETS.items():
                result = await publish(settings, [DEMO_DATA / f"{name}.jsonl"], dataset=name, limit=n)
                assert result.published == n, f"{name}: published {result.published} of {n}"
                published += result.published

            async def accounted() -> bool:
                processes.check_alive()
                prom.check_alive()
                done = set(accepted_keys(out_dir)) | {d.key for d in await dead_letters(settings)}
                return len(done) >= published

            t0 = time.monotonic()
            await wait_until(accounted, timeout=240, interval=1.0, message=f"all {published} prompts accounted for")
            run_seconds = time.monotonic() - t0
            accepted = len(accepted_keys(out_dir))
            letters = await dead_letters(settings)

            # a few more scrapes after the run, so the last counter values are in the TSDB
            settled = time.time() + 3.0
            await wait_until(
                lambda: scraped_since(http, prom, settled),
                timeout=60,
                interval=0.5,
                message="every target scraped again after the run",
            )

            panels = pq.panel_queries(rate_interval=RATE_INTERVAL, range_=RANGE)
            measures = pq.alert_queries()
            rules = pq.alert_rule_exprs()
            must_have_data = panels + measures

            # Budget gauges follow checkpoints: give every query a short deadline to show data
            # rather than a fixed wait, and report what is still failing at the deadline.
            failures: list[str] = []

            async def all_have_data() -> bool:
                nonlocal failures
                prom.check_alive()
                failures = await evaluate(http, prom, must_have_data, need_series=True)
                return not failures

            with suppress(TimeoutError):
                await wait_until(all_have_data, timeout=30, interval=2.0, message="every query has data")
            failures += await evaluate(http, prom, rules, need_series=False)
            up = await query(http, prom, "up")
    except BaseException:
        print(_log_tails(processes.log_dir))  # shown by pytest on failure
        if prom.log.exists():
            print(f"--- prometheus\n{prom.log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        prom.stop()
        processes.stop_all()

    evaluated = len(must_have_data) + len(rules)
    line = report(
        queries_evaluated=evaluated,
        panel_queries=len(panels),
        alert_measures=len(measures),
        alert_expressions=len(rules),
        failed=len(failures),
        targets=len(targets),
        prompts=published,
        accepted=accepted,
        dead_letters=len(letters),
        dead_letter_reasons=",".join(sorted({f"{d.stage}/{d.reason}" for d in letters})),
        startup_seconds=round(startup_seconds, 1),
        run_seconds=round(run_seconds, 1),
        total_seconds=round(time.monotonic() - started, 1),
    )
    assert len(up.series) == len(targets), f"targets scraped: {up.series}"
    assert {s["metric"]["job"] for s in up.series} == set(targets)
    assert panels and measures and rules
    assert letters, f"the faults should have produced dead letters (error panels need data): {line}"
    assert accepted > published // 2, f"most prompts should be accepted: {line}"
    assert not failures, f"{len(failures)} of {evaluated} queries failed ({line}):\n" + "\n".join(failures)
