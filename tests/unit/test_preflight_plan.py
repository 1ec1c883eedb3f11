"""Before the first paid request, each dataset's profile, mode, max_tokens, caps and min_yield are said."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.common.config import load_settings
from services.common.plan import OTHERS, plan_line
from services.inference.adapters.providers import make_provider
from services.inference.adapters.transport import make_http_client
from services.inference.guard import ProviderGuard
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.unit.test_completions_mode import _Halts

DEMO = Path(__file__).resolve().parents[2] / "services" / "demo" / "data"
CONFIG = """
[budget]
min_yield = 0.75

[defaults]
max_tokens = 64

[datasets.mt]
turns = "all"

[datasets.code]
profile = "qwen3"
max_tokens = 128
cap_usd = 3.5
"""


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import os

    for name in list(os.environ):
        if name.startswith("DRAFTSTREAM_"):
            monkeypatch.delenv(name)
    path = tmp_path / "draftstream.toml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


def test_the_plan_line_names_each_value_and_its_origin(config: Path) -> None:
    settings = load_settings(config)
    assert plan_line(settings, "mt") == (
        "dataset mt: profile qwen3 [built-in], mode chat [provider], max_tokens 64 [defaults], "
        "cap_completion_tokens 10,000,000 [built-in], cap_usd none [built-in], min_yield 0.75 [budget]"
    )
    assert plan_line(settings, "code") == (
        "dataset code: profile qwen3 [dataset], mode chat [provider], max_tokens 128 [dataset], "
        "cap_completion_tokens 10,000,000 [built-in], cap_usd 3.5 [dataset], min_yield 0.75 [budget]"
    )


async def test_the_worker_logs_the_plan_of_every_dataset_before_it_checks_anything(
    config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await start_simulator(SimulatorOptions())
    settings = load_settings(config, provider={"base_url": sim.url})
    client = make_http_client(settings)
    try:
        guard = ProviderGuard(settings, make_provider(settings, client), _Halts())  # type: ignore[arg-type]
        with caplog.at_level(logging.INFO, logger="services.inference.guard"):
            await guard.check_all()
    finally:
        await client.aclose()
        await sim.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "services.inference.guard"]
    plans = [line for line in lines if line.startswith("pre-flight: dataset ")]
    assert plans == [f"pre-flight: {plan_line(settings, name)}" for name in ("code", "mt")]
    others = f"pre-flight: {OTHERS}: profile qwen3 [built-in], mode chat [provider], max_tokens 64 [defaults], "
    assert any(line.startswith(others) for line in lines), lines
    assert lines.index(plans[-1]) < next(i for i, line in enumerate(lines) if "pre-flight: provider" in line)


def test_estimate_prints_the_same_plan(config: Path) -> None:
    files = [str(DEMO / "code.jsonl")]
    result = CliRunner().invoke(app, ["estimate", *files, "-d", "code", "-c", str(config)],
                                env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "COLUMNS": "300"})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"plan: {plan_line(load_settings(config), 'code')}" in result.stdout.splitlines()
