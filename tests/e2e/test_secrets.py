"""Secrets: run the pipeline through the real CLI processes with a recognisable fake API key
(and a fake SASL password) in the environment, then search everything the system emitted
for them: service logs, every topic's keys, values and headers (dead letters included),
every metrics page, the simulator's stats, the training files, ``config show``, the output
of failing commands. Zero hits, and the key provably reached the provider (the simulator
records the SHA-256 of each Authorization header it saw), so the scan is not vacuous.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.common.config import load_settings
from services.common.kafka import make_admin
from tests.e2e.brokers import free_port
from tests.e2e.harness import (
    Processes,
    accepted_keys,
    budget_caught_up,
    cli,
    dead_letters,
    read_all,
    run_cli,
    run_side_by_side,
    wait_http,
    wait_until,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "services" / "demo" / "data"
SERVICES = ("inference", "reconstruct", "audit", "budget", "sink")
PER_DATASET = 15
MARKER = "DRAFTSTREAMFAKE"


def _config(run_dir: Path, bootstrap: str, prefix: str, sim_port: int, ports: dict[str, int]) -> str:
    return f"""
[kafka]
bootstrap_servers = "{bootstrap}"
topic_prefix = "{prefix}"

[provider]
kind = "openrouter"
# The simulator parses like vLLM; OpenRouter's own upstreams are treated as lossy by default.
convention = "vllm"
base_url = "http://127.0.0.1:{sim_port}/api/v1"
model = "qwen/qwen3-8b"
concurrency = 16
max_attempts = 2
backoff_initial_s = 0.05
backoff_max_s = 0.2
timeout_s = 10

[sink]
out_dir = "{run_dir / "out"}"

[stage]
batch_max = 16
batch_timeout_ms = 50

[metrics]
{chr(10).join(f"{name}_port = {port}" for name, port in ports.items())}
"""


def _scan(blob: bytes, secrets: list[bytes]) -> list[bytes]:
    return [s for s in secrets if s in blob]


@pytest.mark.long(30)
async def test_no_secret_leaves_the_system(
    tmp_path: Path, kafka_bootstrap: str, report: Callable[..., str]
) -> None:
    """A fake key and SASL password never appear in anything the system emitted."""
    api_key = f"sk-or-v1-{MARKER}{uuid.uuid4().hex}"
    sasl_password = f"{MARKER}-sasl-{uuid.uuid4().hex[:12]}"
    secrets = [api_key.encode(), sasl_password.encode(), MARKER.encode()]
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    sim_port = free_port()
    sim_metrics = free_port()
    ports = {name: free_port() for name in SERVICES}
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    config = run_dir / "draftstream.toml"
    config.write_text(_config(run_dir, kafka_bootstrap, prefix, sim_port, ports), encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OPENROUTER_API_KEY": api_key,
        "DRAFTSTREAM_KAFKA__SASL_PASSWORD": sasl_password,
        "DRAFTSTREAM_KAFKA__SASL_USERNAME": "draftstream-user",
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
    }
    settings = load_settings(config, kafka={"bootstrap_servers": kafka_bootstrap})
    datasets = {"math": DATA / "math.jsonl", "code": DATA / "code.jsonl", "tools": DATA / "tools.jsonl"}
    emitted: dict[str, bytes] = {}
    procs = Processes(run_dir / "logs")
    try:
        emitted["topics create"] = run_cli(
            cli("topics", "create", "--config", str(config), *sum((["-d", d] for d in datasets), [])), env, "topics"
        ).encode()
        procs.start(
            "simulator",
            cli(
                "simulate-provider", "--port", str(sim_port), "--metrics-port", str(sim_metrics),
                "--reasoning-tokens", "8-40", "--content-tokens", "8-40",
                "--fault-rate", "429=0.1", "--fault-rate", "5xx=0.05", "--fault-rate", "bad_usage=0.1",
            ),
            env,
        )
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{sim_port}/health", 60)
        for name in SERVICES:
            procs.start(name, cli("run", name, "--config", str(config)), env)
        published = await asyncio.to_thread(run_side_by_side, {
            f"publish {name}": cli(
                "publish", str(path), "--dataset", name, "--limit", str(PER_DATASET), "--config", str(config)
            )
            for name, path in datasets.items()
        }, env)
        for what, done in published.items():
            assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout!r}\n{done.stderr!r}"
            emitted[what] = done.stdout
        expected = PER_DATASET * len(datasets)
        out_dir = run_dir / "out"

        async def accounted() -> bool:
            procs.check_alive()
            dead = {d.key for d in await dead_letters(settings)}
            return len(set(accepted_keys(out_dir)) | dead) >= expected

        await wait_until(accounted, timeout=240, interval=1.0, message="every prompt accounted for")
        # The budget's checkpoint on budget-state holds the final totals before the commands read it.
        await wait_until(lambda: budget_caught_up(settings), timeout=60, message="the budget's final checkpoint")
        async with httpx.AsyncClient(timeout=10) as http:
            for name, port in {**ports, "simulator": sim_metrics}.items():
                emitted[f"metrics {name}"] = (await http.get(f"http://127.0.0.1:{port}/metrics")).content
            stats_response = await http.get(f"http://127.0.0.1:{sim_port}/_sim/stats")
        emitted["simulator stats"] = stats_response.content
        stats = stats_response.json()
        commands = {
            "budget": ["budget"],
            "status": ["status"],
            "dlq list": ["dlq", "list"],
            "config show": ["config", "show"],
        }
        shown = await asyncio.to_thread(
            run_side_by_side, {what: cli(*args, "--config", str(config)) for what, args in commands.items()}, env
        )
        for what, done in shown.items():
            emitted[f"cli {what}"] = done.stdout + done.stderr
        assert b"**********" in emitted["cli config show"], "config show did not mask the secrets"
    finally:
        procs.stop_all()

    # Failing commands: a secret written into the config file is refused without echoing it,
    # and a command that fails at run time prints one error line without it.
    bad_config = run_dir / "bad.toml"
    bad_config.write_text(f'[provider]\napi_key = "{api_key}"\n', encoding="utf-8")
    failures = {
        "secret in file": cli("config", "show", "--config", str(bad_config)),
        "missing input": cli("publish", str(run_dir / "missing.jsonl"), "-d", "x", "--config", str(config)),
        "bad option": cli("simulate-provider", "--fault-rate", "nonsense"),
    }
    for what, done in (await asyncio.to_thread(run_side_by_side, failures, env)).items():
        assert done.returncode != 0, f"{what}: expected a failure"
        emitted[f"failing {what}"] = done.stdout + done.stderr

    # Every topic of this run: keys, values and headers.
    admin = make_admin(settings.kafka)
    await admin.start()
    try:
        topics = sorted(t for t in await admin.list_topics() if t.startswith(prefix))
    finally:
        await admin.close()
    records = await read_all(settings, *topics)
    n_records = 0
    for topic, recs in records.items():
        parts: list[bytes] = []
        for r in recs:
            n_records += 1
            parts += [r.key or b"", r.value or b""]
            parts += [k.encode() + b"=" + (v or b"") for k, v in r.headers or ()]
        emitted[f"topic {topic}"] = b"\n".join(parts)
    # Every file the run wrote: logs, training files, config.
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file() and p.name != "bad.toml"):
        emitted[f"file {path.relative_to(run_dir)}"] = path.read_bytes()

    hits = {what: _scan(blob, secrets) for what, blob in emitted.items()}
    hits = {what: found for what, found in hits.items() if found}
    bearer = hashlib.sha256(f"Bearer {api_key}".encode()).hexdigest()
    keys = accepted_keys(run_dir / "out")
    letters = await dead_letters(settings)
    line = report(
        prompts=PER_DATASET * len(datasets),
        accepted=len(keys),
        dead_letters=len(letters),
        duplicates=sum(1 for n in keys.values() if n > 1),
        provider_requests=stats["total_requests"],
        topics_scanned=len(topics),
        records_scanned=n_records,
        sources_scanned=len(emitted),
        bytes_scanned=sum(len(b) for b in emitted.values()),
        secret_hits=sum(len(v) for v in hits.values()),
    )
    assert not hits, f"secrets leaked into: {sorted(hits)}\n{line}"
    # Not vacuous: the key did reach the provider on every request, and every source was read.
    assert stats["auth_sha256"].get(bearer) == stats["total_requests"] > 0, line
    assert len(keys) > 0 and len(letters) > 0, line
    assert any(t.endswith("dead-letter") for t in topics) and any(t.endswith("budget-state") for t in topics), line
    assert all(emitted[f"metrics {name}"].startswith(b"# HELP") for name in (*SERVICES, "simulator")), line
    assert sum(1 for w in emitted if w.startswith("file logs/")) == len(SERVICES) + 1, line

