"""The status screen's model: lag arithmetic, per-stage counts, rates and rendering."""

from __future__ import annotations

from collections import Counter

from rich.console import Console

from schemas import BudgetSnapshot, topology
from services.status.core import GroupLag, StatusSnapshot, render


def snapshot(taken_at: float, prompts: int, responses: int) -> StatusSnapshot:
    return StatusSnapshot(
        taken_at=taken_at,
        topic_prefix="p.",
        topic_records={"p.prompts.math": prompts - 10, "p.prompts.code": 10, "p.responses": responses},
        budgets=[
            BudgetSnapshot(
                scope="math",
                completion_tokens=9_876_543,
                cost_usd=86.25,
                state="halted",
                cap_completion_tokens=10_000_000,
            )
        ],
        lags=[
            GroupLag(
                group="draftstream-inference", topic="p.prompts.math", partition=0, end=50, committed=20
            ),
            GroupLag(
                group="draftstream-inference",
                topic="p.prompts.code",
                partition=0,
                end=10,
                committed=None,
                start=4,
            ),
        ],
        dead_letters=Counter({("audit", "usage_mismatch"): 3, ("inference", "http_429"): 1}),
    )


def test_lag_uses_committed_offset_or_the_log_start() -> None:
    snap = snapshot(100.0, 60, 0)
    assert [lag.lag for lag in snap.lags] == [30, 6]
    assert snap.stage_records(topology.PROMPTS) == 60 and snap.stage_records("responses") == 0


def test_render_shows_every_panel_and_rates() -> None:
    before, after = snapshot(100.0, 60, 10), snapshot(110.0, 80, 30)
    console = Console(width=160, record=True)
    console.print(render(after, before))
    text = console.export_text()
    assert "9,876,543" in text and "$86.25" in text and "halted" in text
    assert "2.0/s" in text  # 20 more prompts and 20 more responses in 10 s
    inference = next(line for line in text.splitlines() if "draftstream-inference" in line)
    assert "36 (not started)" not in inference and " 36 " in inference
    assert "usage_mismatch" in text and "dead letters: 4 prompts" in text


def test_standing_halts_show_scope_actor_and_reason_with_brackets_intact() -> None:
    from schemas import Halt

    snap = StatusSnapshot(taken_at=1_700_000_000.0)
    snap.halts = [
        Halt(scope="math", by="preflight", at=1_700_000_000.0,
             reason="pre-flight: dataset math: profile 'x' cannot be used (unknown_profile): see [profiles.x]"),
        Halt(scope="global", by="outage-probe", reason="base URL answers 404: 8 consecutive requests"),
    ]
    console = Console(record=True, width=300)
    console.print(render(snap))
    text = console.export_text()
    assert "halts: 2" in text
    assert "[profiles.x]" in text and "unknown_profile" in text and "preflight" in text
    assert "base URL answers 404" in text and "outage-probe" in text
    assert text.index("global") < text.index("math")  # global first


def test_no_halt_says_none() -> None:
    console = Console(record=True, width=200)
    console.print(render(StatusSnapshot(taken_at=0.0)))
    assert "halts: 0" in console.export_text()


def test_accepted_truncated_answers_are_counted_apart() -> None:
    snap = StatusSnapshot(taken_at=0.0)
    console = Console(record=True, width=200)
    console.print(render(snap))
    assert "accepted truncated" not in console.export_text()
    snap.accepted_truncated.update({"math": 3, "code": 1})
    console = Console(record=True, width=200)
    console.print(render(snap))
    assert "accepted truncated (finish_reason length, accept_truncated): 4 (code 1, math 3)" in console.export_text()


def test_conversations_show_in_progress_finished_and_ended_early_by_reason() -> None:
    from schemas import ConversationProgressed

    def state(cid: str, kind: str, reason: str = "") -> tuple[str, ConversationProgressed]:
        return f"chat:{cid}", ConversationProgressed(dataset="chat", conversation_id=cid, state=kind,  # type: ignore[arg-type]
                                                     turns_done=2, reason=reason)

    snap = snapshot(100.0, 60, 40)
    assert "conversations" not in _text(snap)  # no multi-turn dataset: no panel
    snap.conversations = dict([
        state("a", "in_progress"), state("b", "finished", "finished"), state("c", "finished", "finished"),
        state("d", "ended_early", "tool_name_mismatch"), state("e", "ended_early", "tool_name_mismatch"),
        state("f", "ended_early", "unexpected_tool_call"),
    ])
    text = _text(snap)
    assert "conversations: 6" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("│ chat"))
    assert [c.strip() for c in row.split("│")[2:5]] == ["1", "2", "3"]
    assert "tool_name_mismatch 2, unexpected_tool_call 1" in text


def _text(snap: StatusSnapshot) -> str:
    console = Console(width=200, record=True)
    console.print(render(snap))
    return console.export_text()


def test_upstreams_caught_stripping_are_shown_with_their_evidence() -> None:
    from schemas import ProviderFactRecorded

    snap = StatusSnapshot(taken_at=0.0)
    console = Console(record=True, width=200)
    console.print(render(snap))
    assert "caught stripping" not in console.export_text()
    snap.strips["openai/m"] = ProviderFactRecorded(upstream="openai/m", place="strips_at_edges", evidence="math:7",
                                                   reason="whitespace may be missing at content_start")
    console = Console(record=True, width=200)
    console.print(render(snap))
    text = console.export_text()
    assert "upstreams caught stripping (strips_at_edges): 1" in text
    assert "openai/m" in text and "math:7" in text and "content_start" in text
