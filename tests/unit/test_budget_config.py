"""A cap that is not a positive number is refused at start with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.common.config import ConfigError, load_settings


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"datasets": {"math": {"cap_completion_tokens": 0}}}, "cap_completion_tokens"),
        ({"datasets": {"math": {"cap_usd": -5}}}, "cap_usd"),
        ({"budget": {"global_cap_completion_tokens": -1}}, "global_cap_completion_tokens"),
        ({"budget": {"global_cap_usd": 0}}, "global_cap_usd"),
    ],
)
def test_non_positive_cap_is_refused(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, **overrides)
    text = str(info.value)
    assert field in text
    assert "greater than 0" in text


def test_run_budget_refuses_a_zero_cap_in_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "draftstream.toml"
    config.write_text("[datasets.math]\ncap_completion_tokens = 0\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["run", "budget", "--config", str(config)])
    assert result.exit_code == 2
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "cap_completion_tokens" in output and "greater than 0" in output


def test_budget_table_renders_state_who_and_why() -> None:
    from rich.console import Console

    from schemas import GLOBAL_SCOPE, BudgetSnapshot, Halt
    from services.budget.cli import budget_table

    settings = load_settings(None, datasets={"math": {"cap_completion_tokens": 1000}, "code": {}})
    snaps = {
        "math": BudgetSnapshot(scope="math", completion_tokens=900, cost_usd=1.5, state="soft-limit"),
        "code": BudgetSnapshot(
            scope="code",
            completion_tokens=10,
            projected_completion_tokens=50,
            projected_usd=0.5,
            remaining_prompts=4,
        ),
        GLOBAL_SCOPE: BudgetSnapshot(scope=GLOBAL_SCOPE, completion_tokens=910),
    }
    control = {"code": Halt(scope="code", reason="bad outputs", by="ann@host")}
    console = Console(width=250, record=True)
    console.print(budget_table(snaps, control, settings, wide=True))
    text = console.export_text()
    math_row = next(line for line in text.splitlines() if "math" in line)
    assert "900" in math_row and "1,000 tok" in math_row and "100 tok" in math_row and "soft-limit" in math_row
    code_row = next(line for line in text.splitlines() if " code " in line)
    assert "halted by ann@host: bad outputs" in code_row and "4 prompts left" in code_row
    assert "global" in text
