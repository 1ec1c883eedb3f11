"""Every table a person reads fits the terminal it is printed in (issue 56).

``budget`` (compact and ``--wide``), the ``status`` screen and the demo's closing tables are
rendered at 80, 100 and 120 columns with long values in every cell a real run fills (a cap
halt's summary, a halt reason, per-upstream yields, dead-letter reasons): no line is longer
than the terminal.
"""

from __future__ import annotations

import io
from collections import Counter

import pytest
from rich.console import Console, RenderableType

from schemas import GLOBAL_SCOPE, BudgetSnapshot, ConversationProgressed, Halt, YieldFigures
from services.common.config import load_settings

WIDTHS = (80, 100, 120)
LONG_REASON = (
    "quality: dataset tools-with-a-long-name, upstream DeepInfra: 21 of its last 25 audit verdicts are dead "
    "letters; top reasons: usage_mismatch 12, think_end_missing 5, tool_block_malformed 4"
)


def rendered(renderable: RenderableType, width: int) -> list[str]:
    """The lines ``renderable`` prints when laid out for ``width`` columns.

    The console itself is wider, so a table that overflows its width shows as a long line
    instead of being cropped (silently losing its last columns) by a console of that width.
    """
    console = Console(width=4 * width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable, width=width)
    return [line.rstrip() for line in console.export_text().splitlines()]


def assert_fits(lines: list[str], width: int) -> None:
    """No line wider than the terminal (and something was printed)."""
    assert lines, "nothing rendered"
    too_long = [(len(line), line) for line in lines if len(line) > width]
    assert not too_long, f"{len(too_long)} line(s) over {width} columns, e.g. {too_long[0]}"


def snapshots() -> dict[str, BudgetSnapshot]:
    """A run with every figure the tables print set, including two upstreams and a projection."""
    figures = YieldFigures(verdicts=400, accepted=350, window_verdicts=200, window_accepted=170,
                           window_reasons={"usage_mismatch": 20, "think_end_missing": 10})
    math = BudgetSnapshot(
        scope="math-reasoning-olympiad", completion_tokens=12_345_678, prompt_tokens=98_765_432,
        reasoning_tokens=9_876_543, cost_usd=1234.5678, cap_completion_tokens=20_000_000, cap_usd=5000.0,
        inflight_tokens=262_144, rate_tokens_per_s=12_345.0, rate_usd_per_s=0.25, remaining_prompts=81_234,
        projected_completion_tokens=40_000_000, projected_usd=4321.0, quality=figures,
        upstreams={"DeepInfra": figures, "Together": figures, "Fireworks": figures},
        state="soft-limit", requests=100_000,
    )
    tools = BudgetSnapshot(scope="tools-with-a-long-name", completion_tokens=5_000_000, cost_usd=99.0,
                           cap_completion_tokens=5_000_000, state="halted", halted_by="budget",
                           halted_reason="reached the cap of 5,000,000 completion tokens", quality=figures)
    return {"math-reasoning-olympiad": math, "tools-with-a-long-name": tools,
            GLOBAL_SCOPE: BudgetSnapshot(scope=GLOBAL_SCOPE, completion_tokens=17_345_678, cost_usd=1333.5)}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("wide", [False, True], ids=["compact", "wide"])
def test_budget_table_fits_the_terminal(width: int, wide: bool) -> None:
    from services.budget.cli import budget_table

    settings = load_settings(None, datasets={"math-reasoning-olympiad": {"cap_completion_tokens": 20_000_000},
                                             "tools-with-a-long-name": {"cap_completion_tokens": 5_000_000}})
    control: dict[str, Halt | object] = {
        "tools-with-a-long-name": Halt(scope="tools-with-a-long-name", reason=LONG_REASON, by="budget-quality"),
    }
    table = budget_table(snapshots(), control, settings, wide=wide)  # type: ignore[arg-type]
    lines = rendered(table, width)
    assert_fits(lines, width)
    # Both views keep the columns that matter; only the wide one has the projection and tokens by kind.
    headers = [c.name for c in table.columns]
    assert {"scope", "cap", "remaining", "rate", "state"} <= set(headers)
    assert ("projection" in headers) is wide and ("reasoning tok" in headers) is wide
    assert len(headers) == (15 - 2 if wide else 7)


@pytest.mark.parametrize("width", WIDTHS)
def test_status_screen_fits_the_terminal(width: int) -> None:
    from services.status.core import GroupLag, RateLimitRow, StatusSnapshot, render

    snap = StatusSnapshot(
        taken_at=1_790_000_000.0,
        budgets=list(snapshots().values()),
        topic_records={"responses": 123_456, "samples": 120_000, "dead-letter": 4_321},
        lags=[GroupLag(group="inference", topic="prompts.math-reasoning-olympiad", partition=0, end=90_000,
                       committed=10)],
        dead_letters=Counter({("reconstruct", "unknown_profile_with_a_very_long_reason_code_that_does_not_wrap"): 10,
                              ("audit", "usage_mismatch"): 3}),
        halts=[Halt(scope="tools-with-a-long-name", reason=LONG_REASON, by="budget-quality", at=1_790_000_000.0)],
        rate_limits=[RateLimitRow(provider="openrouter", upstream="DeepInfra-with-a-long-name", window=512,
                                  refused=12, paused_s=3.5)],
        accepted_truncated=Counter({"math-reasoning-olympiad": 4}),
        conversations={
            f"chat:c{i}": ConversationProgressed(dataset="chat", conversation_id=f"c{i}", state=state, turns_done=1,
                                                 reason="tool_name_diverged_from_the_original_conversation")
            for i, state in enumerate(("in_progress", "finished", "ended_early"))
        },
    )
    assert_fits(rendered(render(snap), width), width)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_demo_closing_tables_fit_the_terminal(width: int) -> None:
    from services.demo.run import conversation_table, subcommand_env, summary_tables

    published = {"math": 12, "code": 8, "tools": 6, "chat": 5}
    accepted = Counter({"math:s1": 1, "code:s2": 1, "chat:c1:0": 1, "chat:c1:1": 1})
    reasons = Counter({("reconstruct", "tool_block_whitespace_not_provable_from_the_evidence"): 3,
                       ("inference", "provider_http_error"): 2})
    ends = {"chat:c1": "finished", "chat:c2": "ended early: tool_name_diverged_from_the_original_conversation",
            "chat:c3": "stopped at a dead letter"}
    conversations = {f"chat:c{i}": 1 for i in range(1, 6)}
    for table in [*summary_tables(published, accepted, {"math:s3", "tools:s4"}, {"chat": 3}, reasons),
                  conversation_table(accepted, ends, conversations)]:
        assert_fits(rendered(table, width), width)
    # The budget table the demo shows comes from a subcommand: it is laid out at the demo's own width.
    assert subcommand_env({"COLUMNS": "160", "HOME": "/x"}, width) == {"COLUMNS": str(width), "HOME": "/x"}


def probe_run() -> object:
    """A probe of two datasets, one below the floor with three upstreams (one caught stripping), one not probed."""
    from services.probe.core import DatasetReport, Findings, Forecast, ProbeRun

    def findings(answers: int, accepted: int, white: str) -> Findings:
        return Findings(answers=answers, accepted=accepted, dollars=0.1234 * answers, tokens_paid=123_456 * answers,
                        tokens_kept=123_456 * accepted, logprobs="present" if white != "unproven" else "null",
                        whitespace={"reasoning_start": white, "reasoning_end": "mixed", "content_start": white,
                                    "content_end": "unproven"},
                        end_of_turn="not counted", usage_wrong=2, prompt_agrees=answers - 1, prompt_compared=answers,
                        reasons=Counter({"whitespace_stripped": answers - accepted, "usage_mismatch": 1,
                                         "tool_arguments_reserialized": 1}))  # fmt: skip

    upstreams = {"DeepInfra-with-a-long-name": findings(7, 2, "stripped"), "Together": findings(7, 6, "kept"),
                 "Fireworks": findings(6, 4, "unproven")}  # fmt: skip
    below = DatasetReport(
        "math-reasoning-olympiad", findings(20, 12, "mixed"), upstreams,
        Forecast(prompts=1_234_567, accepted=740_740, dollars=98_765.4321, tokens_paid=987_654_321,
                 tokens_kept=592_592_592), requests_sent=20,
        strips=("DeepInfra-with-a-long-name (evidence math-reasoning-olympiad:s17: content_start stripped)",),
    )  # fmt: skip
    fine = DatasetReport("chat", findings(20, 20, "kept"), {"unknown": findings(20, 20, "kept")},
                         Forecast(prompts=500, accepted=500, dollars=1.5, tokens_paid=900, tokens_kept=900),
                         requests_sent=0)  # fmt: skip
    return ProbeRun([below, fine], skipped={"tools-with-a-long-name": LONG_REASON})


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("wide", [False, True], ids=["compact", "wide"])
def test_probe_table_fits_the_terminal(width: int, wide: bool) -> None:
    from services.probe.core import render

    table = render(probe_run(), 0.9, wide=wide)  # type: ignore[arg-type]
    lines = rendered(table, width)
    assert_fits(lines, width)
    headers = [c.name for c in table.columns]
    shown = {"accepted (share)", "reasons of the rest", "forecast" if not wide else "$/accepted", "verdict"}
    assert shown <= set(headers)
    assert ("what the answers proved" in headers) is wide and ("answers" in headers) is wide
    assert ("dataset" in headers and "upstream" in headers) is wide
    # What each view says (laid out wide enough to read a cell whole): the verdicts, who was caught stripping.
    text = "\n".join(rendered(table, 1000))
    for said in ("below min_yield", "not probed", "strips_at_edges: DeepInfra-with-a-long-name"):
        assert said in text, said
    assert "ok" in text.split()
    assert ("(evidence math-reasoning-olympiad:s17" in text) is wide  # the evidence: --wide
