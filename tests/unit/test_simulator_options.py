"""Simulator options and CLI argument parsing (no server, no tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from services.simulator.cli import _parse_range, _parse_rates
from services.simulator.faults import CONTENT_FAULTS, TRANSIENT_FAULTS
from services.simulator.formats import PARSERS
from services.simulator.options import SimulatorOptions


def test_defaults_match_the_documented_api() -> None:
    o = SimulatorOptions()
    assert (o.profile, o.seed, o.reasoning_tokens, o.content_tokens) == (
        "qwen3",
        0,
        (40, 200),
        (20, 120),
    )
    assert o.count_end_of_turn and o.count_think_end and not o.logprobs and not o.keep_truth
    assert o.price_per_token == 2e-6 and o.retry_after_s == 0.1 and o.timeout_sleep_s == 30.0
    assert (o.parser, o.chat_template_file) == ("vllm", None)
    assert set(o.fault_rates()) == set(TRANSIENT_FAULTS + CONTENT_FAULTS)
    assert not any(o.fault_rates().values())


def test_parser_option() -> None:
    assert PARSERS == ("vllm", "sglang-legacy")
    assert SimulatorOptions(parser="sglang-legacy").params().parser == "sglang-legacy"
    assert SimulatorOptions().params().parser == "vllm"
    with pytest.raises(ValueError, match="unknown parser"):
        SimulatorOptions(parser="tgi")


def test_with_fault_rates() -> None:
    o = SimulatorOptions(parser="sglang-legacy").with_fault_rates({"429": 0.2, "noncanonical_same": 1.0})
    assert o.rate_429 == 0.2 and o.rate_noncanonical_same == 1.0
    assert o.params().seed == 0 and o.parser == "sglang-legacy"
    with pytest.raises(ValueError, match="unknown fault"):
        SimulatorOptions().with_fault_rates({"gremlins": 0.1})
    with pytest.raises(ValueError, match="0..1"):
        SimulatorOptions().with_fault_rates({"429": 1.5})


def test_cli_parsers() -> None:
    assert _parse_range("40-200", "--x") == (40, 200)
    assert _parse_range("7", "--x") == (7, 7)
    assert _parse_rates(["429=0.1", "drop=0"]) == {"429": 0.1, "drop": 0.0}
    for bad in ("x", "9-3", "0-4"):
        with pytest.raises(typer.Exit):
            _parse_range(bad, "--x")
    with pytest.raises(typer.Exit):
        _parse_rates(["429"])


def test_cli_refuses_a_bad_parser_or_template_before_loading_anything(tmp_path: Path) -> None:
    from services.cli import app

    runner = CliRunner()
    bad_parser = runner.invoke(app, ["simulate-provider", "--parser", "tgi"])
    assert bad_parser.exit_code == 2 and "unknown parser" in bad_parser.output
    missing = runner.invoke(app, ["simulate-provider", "--chat-template-file", str(tmp_path / "none.jinja")])
    assert missing.exit_code == 2 and "--chat-template-file" in missing.output
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}", encoding="utf-8")
    syntax = runner.invoke(app, ["simulate-provider", "--chat-template-file", str(broken)])
    assert syntax.exit_code == 2 and "broken.jinja" in syntax.output


def test_rate_limit_options_make_a_limiter_and_bad_ones_are_refused() -> None:
    assert not SimulatorOptions().limiter().active  # unlimited by default
    limited = SimulatorOptions(rate_limit_rps=2.5, max_open=4, retry_after_s=1.0).limiter()
    assert (limited.rps, limited.burst, limited.max_open, limited.open_retry_after_s) == (2.5, 3.0, 4, 1.0)
    assert SimulatorOptions(rate_limit_rps=10, rate_limit_burst=0).limiter().burst == 0.0
    with pytest.raises(ValueError):
        SimulatorOptions(rate_limit_rps=-1)
    from services.cli import app

    refused = CliRunner().invoke(app, ["simulate-provider", "--rate-limit-rps", "0"])
    assert refused.exit_code == 2 and "rate limit" in refused.output
