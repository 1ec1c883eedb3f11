"""Simulator options and CLI argument parsing (no server, no tokenizer)."""

from __future__ import annotations

import pytest
import typer

from services.simulator.app import SimulatorOptions
from services.simulator.cli import _parse_range, _parse_rates
from services.simulator.core import CONTENT_FAULTS, TRANSIENT_FAULTS


def test_defaults_match_the_documented_api() -> None:
    o = SimulatorOptions()
    assert (o.profile, o.seed, o.reasoning_tokens, o.content_tokens) == (
        "deepseek-v3",
        0,
        (40, 200),
        (20, 120),
    )
    assert o.count_end_of_turn and o.count_think_end and not o.logprobs and not o.debug_true_ids
    assert o.price_per_token == 2e-6 and o.retry_after_s == 0.1 and o.timeout_sleep_s == 30.0
    assert set(o.fault_rates()) == set(TRANSIENT_FAULTS + CONTENT_FAULTS)
    assert not any(o.fault_rates().values())


def test_with_fault_rates() -> None:
    o = SimulatorOptions().with_fault_rates({"429": 0.2, "noncanonical_same": 1.0})
    assert o.rate_429 == 0.2 and o.rate_noncanonical_same == 1.0
    assert o.params().seed == 0
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
