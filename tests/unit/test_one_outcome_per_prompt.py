"""One prompt, one outcome (issue 56): a replay that fails again supersedes the dead letter before it.

Pure pieces: the dead-letter tally the budget and ``status`` keep, the quality gate's window and
totals, ``dlq list``'s latest per key, and ``dlq replay --to inference --fresh``'s repay mark.
"""

from __future__ import annotations

import dataclasses

import pytest

from schemas import DLQ_HEADERS, topology
from services.budget.quality import QualityGate, Verdict
from services.common import outcomes
from services.dlq.core import DeadLetterRecord, FilterError, latest_per_key, plan_replay


def test_a_replay_that_fails_again_counts_its_key_once_by_its_latest_reason() -> None:
    tally: outcomes.Tally = {}
    standing: outcomes.Standing = {}
    for i in range(10):
        assert not outcomes.record_dead_letter(tally, standing, f"math:s{i}", "reconstruct", "unknown_profile")
    for _ in range(2):  # replayed twice, failing again each time
        for i in range(10):
            assert outcomes.record_dead_letter(tally, standing, f"math:s{i}", "reconstruct", "unknown_profile")
    assert tally == {"reconstruct": {"unknown_profile": 10}}
    # A replay that fails for another reason moves the key; one that is accepted removes it.
    assert outcomes.record_dead_letter(tally, standing, "math:s0", "audit", "usage_mismatch")
    assert outcomes.record_accepted(tally, standing, "math:s1")
    assert not outcomes.record_accepted(tally, standing, "math:never-failed")
    assert tally == {"reconstruct": {"unknown_profile": 8}, "audit": {"usage_mismatch": 1}}
    assert len(standing) == 9
    # Records without a key cannot be superseded: each counts.
    outcomes.record_dead_letter(tally, standing, "", "inference", "bad_json")
    outcomes.record_dead_letter(tally, standing, "", "inference", "bad_json")
    assert tally["inference"] == {"bad_json": 2}


def verdict(i: int, *, accepted: bool, upstream: str = "") -> Verdict:
    return Verdict(dataset="math", accepted=accepted, reason="" if accepted else "unknown_profile",
                   key=f"math:s{i}", upstream=upstream, completion_tokens=10)


def test_the_quality_window_judges_each_prompt_once() -> None:
    gate = QualityGate(window=200, min_yield=0.0)
    for _ in range(3):  # the first pass and two replays failing again
        for i in range(10):
            gate.observe(verdict(i, accepted=False, upstream="Up"))
    figures, upstreams = gate.figures("math")
    assert figures is not None
    assert (figures.verdicts, figures.accepted, figures.window_verdicts, figures.window_accepted) == (10, 0, 10, 0)
    assert figures.window_reasons == {"unknown_profile": 10}
    assert upstreams["Up"].window_verdicts == 10
    gate.observe(verdict(3, accepted=True))  # a replay accepted at last
    figures, _ = gate.figures("math")
    assert figures is not None
    assert (figures.verdicts, figures.accepted, figures.window_verdicts, figures.window_accepted) == (10, 1, 10, 1)


def test_the_quality_halt_counts_prompts_not_replays() -> None:
    # A 10-verdict window at min_yield 0.7 halts at 4 dead-lettered prompts (at most 6 of 10
    # accepted); 3 prompts dead-lettered five times each are 3 prompts, not 15.
    gate = QualityGate(window=10, min_yield=0.7)
    halts = [gate.observe(verdict(i % 3, accepted=False)) for i in range(15)]
    assert halts == [None] * 15
    assert gate.observe(verdict(3, accepted=False)) is not None


def test_a_replay_after_a_budget_restart_is_still_the_same_prompt() -> None:
    from schemas import GLOBAL_SCOPE, BudgetSnapshot, YieldFigures

    gate = QualityGate(window=200, min_yield=0.0)
    gate.restore([
        BudgetSnapshot(scope="math", quality=YieldFigures(verdicts=10, accepted=0)),
        BudgetSnapshot(scope=GLOBAL_SCOPE, dead_letters={"reconstruct": {"unknown_profile": 10}},
                       dead_letter_keys={f"math:s{i}": ("reconstruct", "unknown_profile") for i in range(10)}),
    ])
    for i in range(10):
        gate.observe(verdict(i, accepted=False))
    figures, _ = gate.figures("math")
    assert figures is not None and figures.verdicts == 10


def letter(offset: int, key: str | None, replays: int) -> DeadLetterRecord:
    headers = ((DLQ_HEADERS.STAGE, b"reconstruct"), (DLQ_HEADERS.REASON, b"unknown_profile"),
               (DLQ_HEADERS.REPLAY_COUNT, str(replays).encode()), (DLQ_HEADERS.TOPIC, b"p.responses"))
    return DeadLetterRecord(partition=0, offset=offset, timestamp_ms=0, key=None if key is None else key.encode(),
                            value=b"{}", headers=headers)


def test_dlq_list_keeps_the_latest_dead_letter_per_key() -> None:
    history = [letter(n * 10 + i, f"math:s{i}", n) for n in range(3) for i in range(10)]
    history += [letter(100, None, 0), letter(101, None, 0)]
    latest = latest_per_key(history)
    assert len(latest) == 12
    assert {r.replay_count for r in latest if r.key is not None} == {2}


def test_a_fresh_replay_asks_inference_to_pay_again_and_only_inference() -> None:
    from schemas import Message, PromptPublished, encode

    prompt = PromptPublished(dataset="math", sample_id="s0", messages=[Message(role="user", content="2+2?")])
    records = [dataclasses.replace(letter(0, "math:s0", 0), value=encode(prompt))]
    common = {"topic_prefix": "p.", "existing_topics": ["p.prompts.math"], "replayed_ids": []}
    reused = plan_replay(records, to="inference", **common)  # type: ignore[arg-type]
    fresh = plan_replay(records, to="inference", fresh=True, **common)  # type: ignore[arg-type]
    assert topology.REPAY_HEADER not in dict(reused.send[0].headers)
    assert dict(fresh.send[0].headers)[topology.REPAY_HEADER] == b"1"
    with pytest.raises(FilterError, match="--to inference"):
        plan_replay(records, fresh=True, **common)  # type: ignore[arg-type]


def test_status_lists_every_conversation_once_with_how_it_ended() -> None:
    """Died at turn 0 (no state record): listed as stopped by a dead letter; so is one stopped at turn 1."""
    import io

    from rich.console import Console

    from schemas import ConversationProgressed
    from services.status.core import StatusSnapshot, conversation_endings, render, stopped_conversations

    def state(cid: str, kind: str, turns: int, next_turn: int | None = None) -> ConversationProgressed:
        return ConversationProgressed(dataset="chat", conversation_id=cid, state=kind,  # type: ignore[arg-type]
                                      turns_done=turns, next_turn=next_turn)

    conversations = {"chat:a": state("a", "finished", 3), "chat:b": state("b", "in_progress", 1, 1),
                     "chat:c": state("c", "in_progress", 2, 2)}
    standing = {"chat:z:0": ("inference", "http_500"), "chat:b:1": ("reconstruct", "unknown_profile"),
                "chat:c:1": ("audit", "usage_mismatch"),  # an earlier turn's letter, superseded by the state
                "math:s1": ("audit", "usage_mismatch")}  # not a multi-turn dataset
    stopped = stopped_conversations(conversations, standing, {"chat"})
    assert stopped == {"chat:z": "inference http_500", "chat:b": "reconstruct unknown_profile"}
    snap = StatusSnapshot(taken_at=1.0, conversations=conversations, stopped=stopped)
    assert conversation_endings(snap) == {
        "chat:a": ("finished", ""), "chat:b": ("dead_letter", "reconstruct unknown_profile"),
        "chat:c": ("in_progress", ""), "chat:z": ("dead_letter", "inference http_500"),
    }
    console = Console(width=120, file=io.StringIO(), record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "conversations: 4" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("chat") or "│ chat" in line)
    assert [c for c in row.replace("│", " ").split()][:5] == ["chat", "1", "1", "0", "2"]
