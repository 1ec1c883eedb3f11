"""The quality halt's pure core: verdicts from wire records, windows, the halt rule, resume."""

from __future__ import annotations

import pytest

from schemas import (
    BudgetSnapshot,
    Message,
    PromptPublished,
    ResponseReceived,
    SampleAudited,
    SampleReconstructed,
    Usage,
    decode,
    encode,
)
from services.budget.quality import (
    QualityGate,
    Verdict,
    accepted_verdict,
    dead_letter_verdict,
    must_halt,
)


def response(dataset: str = "math", upstream: str | None = "Lossless", received_at: float = 5.0) -> ResponseReceived:
    """A paid answer as the inference worker publishes it."""
    return ResponseReceived(
        dataset=dataset,
        sample_id="s1",
        prompt=PromptPublished(dataset=dataset, sample_id="s1", messages=[Message(role="user", content="2+2?")]),
        provider="openrouter",
        model="m",
        upstream_provider=upstream,
        content="4",
        usage=Usage(prompt_tokens=5, completion_tokens=7),
        received_at=received_at,
    )


def sample(dataset: str = "math", upstream: str | None = "Lossless") -> SampleReconstructed:
    """The reconstructed sample of :func:`response`."""
    return SampleReconstructed(
        dataset=dataset,
        sample_id="s1",
        profile="qwen3",
        response=response(dataset, upstream),
        prompt_ids=[1, 2],
        output_ids=[3, 4, 5],
        loss_mask=[0, 0, 1, 1, 1],
        method="reencode",
    )


def v(accepted: bool, reason: str = "usage_matches", upstream: str = "", at: float = 0.0) -> Verdict:
    """A verdict of dataset ``math``."""
    return Verdict("math", accepted, upstream=upstream, reason="" if accepted else reason, received_at=at)


# ------------------------------------------------------------------ from the wire


def test_accepted_record_is_an_accepted_verdict_naming_its_upstream() -> None:
    value = encode(SampleAudited(dataset="math", sample_id="s1", sample=sample(), passed=True))
    got = accepted_verdict(value)
    assert got == Verdict("math", True, upstream="Lossless", received_at=5.0, completion_tokens=7,
                          provider="openrouter")  # the answer's provider (no configured name: its kind)


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        b"{not json",
        b'{"dataset": "math"}',
        b'{"dataset": "\xff", "passed": true}',
        encode(SampleAudited(dataset="math", sample_id="s1", sample=sample(), passed=False, reasons=["x"])),
    ],
    ids=["tombstone", "empty", "invalid-json", "no-sample", "not-utf8", "not-passed"],
)
def test_a_record_on_accepted_that_is_no_passed_sample_is_no_verdict(value: bytes | None) -> None:
    assert accepted_verdict(value) is None


def test_dead_letters_of_the_judging_stages_are_rejections_with_their_reason() -> None:
    audit = dead_letter_verdict("audit", "usage_matches", encode(sample(upstream="Stripper")))
    assert audit == Verdict("math", False, upstream="Stripper", reason="usage_matches", received_at=5.0,
                            completion_tokens=7, provider="openrouter")
    rebuilt = dead_letter_verdict("reconstruct", "whitespace_lost", encode(response(upstream=None)))
    assert rebuilt == Verdict("math", False, reason="whitespace_lost", received_at=5.0, completion_tokens=7,
                              provider="openrouter")


@pytest.mark.parametrize(
    ("stage", "value"),
    [
        ("inference", encode(response())),  # an unpaid failure (429, 5xx...)
        ("sink", encode(sample())),
        (None, encode(sample())),
        ("audit", b"\xff\xfe garbage"),  # poison fed to the stage: judges no provider
        ("reconstruct", b'{"dataset": 3}'),
        ("reconstruct", b'{"dataset": "\xfe\xff"}'),
    ],
)
def test_other_dead_letters_are_no_verdict(stage: str | None, value: bytes) -> None:
    assert dead_letter_verdict(stage, "x", value) is None


# ------------------------------------------------------------------ the rule


def test_halt_rule_boundary_with_the_defaults() -> None:
    # 200 verdicts, floor 0.9: 20 dead letters can still end at exactly 90%, 21 cannot.
    assert not must_halt(20, 200, 0.9)
    assert must_halt(21, 200, 0.9)
    assert not must_halt(0, 1, 1.0) and must_halt(1, 1, 1.0)
    assert not must_halt(200, 200, 0.0)  # 0 turns it off


def test_young_window_halts_as_soon_as_the_floor_cannot_be_reached() -> None:
    gate = QualityGate(window=200, min_yield=0.9)
    for _ in range(4):
        assert gate.observe(v(True)) is None
    reasons = ["usage_matches"] * 19 + ["finish_stop"] * 2
    decisions = [gate.observe(v(False, reason=r)) for r in reasons]
    assert decisions[:-1] == [None] * 20
    reason = decisions[-1]
    assert reason is not None
    assert "dataset math:" in reason and "21 of its last 25" in reason
    assert reason.endswith("top reasons: usage_matches 19, finish_stop 2")


def test_a_sliding_window_at_the_floor_never_halts_and_just_below_does() -> None:
    at_floor = QualityGate(window=200, min_yield=0.9)
    assert all(at_floor.observe(v(i % 10 != 9)) is None for i in range(2000))  # exactly 10% lost
    below = QualityGate(window=200, min_yield=0.9)
    outcomes = [below.observe(v(i % 9 != 8)) for i in range(2000)]  # 11.1% lost
    first = next(i for i, r in enumerate(outcomes) if r is not None)
    assert 180 <= first < 200 + 9  # the 21st dead letter of a window: verdict 189


def test_old_verdicts_leave_the_window() -> None:
    gate = QualityGate(window=10, min_yield=0.9)
    assert gate.observe(v(False)) is None  # 1 of 10 may be lost
    for _ in range(9):
        assert gate.observe(v(True)) is None
    # The first dead letter slides out as this one comes in: still 1 of the last 10.
    assert gate.observe(v(False)) is None
    figures, _ = gate.figures("math")
    assert figures is not None
    assert (figures.window_verdicts, figures.window_accepted, figures.window_reasons) == (10, 9, {"usage_matches": 1})
    assert (figures.verdicts, figures.accepted) == (11, 9)


def test_one_bad_upstream_halts_the_dataset_while_its_share_of_the_dataset_stays_above_the_floor() -> None:
    gate = QualityGate(window=200, min_yield=0.9)
    reasons = []
    for i in range(400):
        bad = i % 10 == 9  # one answer in ten comes from the stripping upstream, all lost
        reasons.append(gate.observe(v(not bad, reason="whitespace_lost", upstream="Stripper" if bad else "Lossless")))
    first = next(i for i, r in enumerate(reasons) if r is not None)
    assert first == 209  # the Stripper's 21st answer; the dataset's window holds 20 of 200 then
    reason = reasons[first]
    assert reason is not None and "dataset math, upstream Stripper:" in reason and "whitespace_lost 21" in reason
    figures, ups = gate.figures("math")
    assert figures is not None and figures.window_reasons == {"whitespace_lost": 20}  # the dataset alone: 90%
    assert (ups["Stripper"].window_verdicts, ups["Stripper"].window_accepted) == (40, 0)
    assert ups["Lossless"].window_accepted == ups["Lossless"].window_verdicts == 200


def test_resume_starts_afresh_and_leaves_out_answers_paid_before_it() -> None:
    gate = QualityGate(window=10, min_yield=0.9)
    assert [gate.observe(v(False, at=1.0)) for _ in range(2)][-1] is not None
    gate.reset("math", since=10.0)
    # Answers still in flight at the halt, received before the resume: counted, not judged.
    assert all(gate.observe(v(False, at=9.0)) is None for _ in range(5))
    assert gate.observe(v(False, at=11.0)) is None  # the fix's first dead letter: 1 of 10 allowed
    assert gate.observe(v(False, at=12.0)) is not None
    figures, _ = gate.figures("math")
    assert figures is not None and figures.verdicts == 9 and figures.window_verdicts == 2


def test_totals_survive_a_restart_through_the_snapshot() -> None:
    gate = QualityGate(window=10, min_yield=0.5)
    for accepted in (True, True, False):
        gate.observe(Verdict("math", accepted, upstream="A", reason="" if accepted else "x", completion_tokens=4))
    figures, ups = gate.figures("math")
    snap = decode(encode(BudgetSnapshot(scope="math", quality=figures, upstreams=ups)), BudgetSnapshot)
    restored = QualityGate(window=10, min_yield=0.5)
    restored.restore([snap, BudgetSnapshot(scope="global")])
    again, again_ups = restored.figures("math")
    assert again is not None and (again.verdicts, again.accepted, again.kept_completion_tokens) == (3, 2, 8)
    assert again.window_verdicts == 0  # the window itself starts empty
    assert again_ups["A"].verdicts == 3
    assert restored.datasets == ["math"]


def test_an_old_snapshot_without_quality_figures_still_decodes() -> None:
    old = b'{"scope": "math", "completion_tokens": 10, "offsets": {"responses:0": 3}}'
    snap = decode(old, BudgetSnapshot)
    assert snap.quality is None and snap.upstreams == {}


# ------------------------------------------------------------------ the tables


def quality_snapshot() -> BudgetSnapshot:
    """A dataset halted for quality: 2 of 8 accepted in the window, one upstream all lost."""
    from schemas import YieldFigures

    return BudgetSnapshot(
        scope="math",
        completion_tokens=900,
        cost_usd=1.5,
        state="halted",
        quality=YieldFigures(verdicts=10, accepted=3, window_verdicts=8, window_accepted=2,
                             window_reasons={"whitespace_lost": 6}),
        upstreams={
            "Lossless": YieldFigures(verdicts=4, accepted=3, window_verdicts=2, window_accepted=2),
            "Stripper": YieldFigures(verdicts=6, accepted=0, window_verdicts=6, window_accepted=0),
        },
    )


def test_budget_and_status_tables_show_yield_per_dataset_and_upstream_and_cost_per_accepted_sample() -> None:
    from rich.console import Console

    from schemas import GLOBAL_SCOPE
    from services.budget.cli import budget_table
    from services.common.config import load_settings
    from services.status.core import StatusSnapshot, render

    snap = quality_snapshot()
    settings = load_settings(None, datasets={"math": {}})
    console = Console(width=320, record=True)
    snaps = {"math": snap, GLOBAL_SCOPE: BudgetSnapshot(scope=GLOBAL_SCOPE)}
    console.print(budget_table(snaps, {}, settings, wide=True))
    row = next(line for line in console.export_text().splitlines() if " math " in line)
    assert "25% of 8; Lossless 100% of 2; Stripper 0% of 6" in row
    assert "$0.5000" in row  # $1.50 over 3 accepted samples
    status = Console(width=250, record=True)
    status.print(render(StatusSnapshot(taken_at=1.0, budgets=[snap])))
    assert "25% of 8; Lossless 100% of 2; Stripper 0% of 6" in status.export_text()
