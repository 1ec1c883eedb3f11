"""A convention is a claim the answers test: a stripping server declared lossless is caught.

The server here is SGLang before 2026 (``.strip()`` of the content) behind ``kind = "openai"``
with no convention set, so the default ``vllm`` convention says nothing is stripped. Every
expected id sequence is the model's raw text encoded by the real R1 tokenizer
(test_reconstruct.py's truth tokenizer), never by the code under test.
"""

from __future__ import annotations

from schemas import ResponseReceived, SampleReconstructed
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import COUNT_TRUSTED
from services.reconstruct.facts import STRIPS_PLACE, FactBook, fact_key
from services.reconstruct.verify import reconstruct_with_facts
from tests.unit.test_profiles import deepseek
from tests.unit.test_reconstruct import R1_EOS, r1_ids, response

VLLM = CONVENTIONS["vllm"]

# The model wrote "\n\n" + " trailing": the stripped content "trailing" re-encodes to as many ids.
COINCIDENT_REASONING, COINCIDENT_CONTENT = "Check the edge.\n", "\n\n trailing spaces are kept."
# Here the strip shows in the count: "Then" is one id, "\n\n" + " Then" two. The fact takes two such
# answers (verify.MIN_EVIDENCE) making up a quarter of the upstream's testable answers.
TELLING_REASONING, TELLING_CONTENT = "Plan it.\n", "\n\n Then we stop."
TELLING = (TELLING_CONTENT, "\n\n So it ends.", "\n\n We are done.")


def telling_answers(prefix: str = "t") -> list[ResponseReceived]:
    """Three answers of the stripping server whose counts show the strip (the fact needs two)."""
    return [_stripped(f"{prefix}{k}", TELLING_REASONING, content)[0] for k, content in enumerate(TELLING)]


def _stripped(sample_id: str, reasoning: str, content: str) -> tuple[ResponseReceived, list[int]]:
    """What the stripping server returns for the model's text, and the model's true ids."""
    truth = r1_ids(reasoning + "</think>" + content + R1_EOS)
    return response(sample_id=sample_id, reasoning=reasoning, content=content.strip(), completion=len(truth)), truth


def test_the_count_alone_accepts_the_wrong_ids_under_the_rule_that_trusted_it() -> None:
    """The failure this guards against, shown on the real tokenizer: same count, other ids."""
    coincident, truth = _stripped("a", COINCIDENT_REASONING, COINCIDENT_CONTENT)
    assert len(r1_ids(COINCIDENT_REASONING + "</think>trailing spaces are kept." + R1_EOS)) == len(truth)
    (verdict,), _ = reconstruct_with_facts([coincident], deepseek(), VLLM, FactBook(), rule=COUNT_TRUSTED)
    assert isinstance(verdict, SampleReconstructed)
    assert verdict.output_ids != truth


def test_answers_off_their_count_by_an_edge_strip_record_strips_at_edges() -> None:
    book = FactBook()
    first, *rest = telling_answers()
    (verdict,), changes = reconstruct_with_facts([first], deepseek(), VLLM, book, at=5.0)
    # Judged under the claim, it misses its count (the audit's usage_matches refuses it) ...
    assert isinstance(verdict, SampleReconstructed)
    assert len(verdict.output_ids) != first.usage.completion_tokens
    assert changes == [] and book.strips("openai/m") is None  # ... and one answer is not enough
    verdicts, changes = reconstruct_with_facts(rest, deepseek(), VLLM, book, at=5.0)
    assert not any(isinstance(v, SampleReconstructed) for v in verdicts)
    (fact,) = [c for c in changes if c.place == STRIPS_PLACE]
    assert fact_key(fact.upstream, fact.place) == "openai/m|strips_at_edges"
    assert fact.evidence == "math:t1"  # the second answer of evidence, among three testable ones
    assert "2 of 3 answers" in fact.reason and "content_start" in fact.reason
    assert book.strips("openai/m") is fact


def test_a_wrong_count_or_a_rare_miss_is_not_a_strip() -> None:
    """A count off by far more than edge whitespace costs, or misses among many that match, records nothing."""
    book = FactBook()
    wrong, truth = _stripped("w", TELLING_REASONING, TELLING_CONTENT)
    wrong.usage.completion_tokens = len(truth) + 1000
    lossless = []
    for k in range(8):
        text = f"\n\n Then step {k} ends."
        truth_k = r1_ids(TELLING_REASONING + "</think>" + text + R1_EOS)
        lossless.append(response(sample_id=f"l{k}", reasoning=TELLING_REASONING, content=text, completion=len(truth_k)))
    telling = telling_answers()
    _, changes = reconstruct_with_facts([wrong, wrong, wrong, *lossless, *telling[:2]], deepseek(), VLLM, book)
    assert changes == [] and book.strips("openai/m") is None
    assert len(book.tally("openai/m").evidence) == 2 and book.tally("openai/m").seen == 13


def test_a_coincident_answer_after_the_catch_is_refused() -> None:
    book = FactBook()
    reconstruct_with_facts(telling_answers(), deepseek(), VLLM, book)
    coincident, _ = _stripped("a", COINCIDENT_REASONING, COINCIDENT_CONTENT)
    (verdict,), changes = reconstruct_with_facts([coincident], deepseek(), VLLM, book)
    assert not isinstance(verdict, SampleReconstructed)
    assert verdict.reason == "whitespace_ambiguous"
    assert "never accepts alone" in verdict.message
    assert changes == [] or all(c.place != STRIPS_PLACE for c in changes)


def test_evidence_is_gathered_from_the_whole_batch_before_its_answers_stand() -> None:
    """The coincident answer comes first in the batch; the telling ones after it still decide."""
    coincident, _ = _stripped("a", COINCIDENT_REASONING, COINCIDENT_CONTENT)
    verdicts, changes = reconstruct_with_facts([coincident, *telling_answers()], deepseek(), VLLM, FactBook())
    assert not any(isinstance(v, SampleReconstructed) for v in verdicts)
    assert [c.place for c in changes if c.place == STRIPS_PLACE] == [STRIPS_PLACE]


def test_a_caught_upstream_still_yields_answers_whose_own_whitespace_proves_them() -> None:
    """After the catch, an answer showing whitespace at every edge a strip would touch is exact."""
    book = FactBook()
    reconstruct_with_facts(telling_answers(), deepseek(), VLLM, book)
    truth = r1_ids("\nLet me think.\n</think>\n\nThe answer is 4.\n" + R1_EOS)
    shown = response(sample_id="s", reasoning="\nLet me think.\n", content="\n\nThe answer is 4.\n",
                     completion=len(truth))  # fmt: skip
    (verdict,), _ = reconstruct_with_facts([shown], deepseek(), VLLM, book)
    assert isinstance(verdict, SampleReconstructed), verdict
    assert verdict.output_ids == truth


def test_a_lossless_server_is_never_caught() -> None:
    """The same answers from a server that keeps whitespace: counts match, no fact, all exact."""
    book = FactBook()
    answers = []
    for sample_id, reasoning, content in (("a", COINCIDENT_REASONING, COINCIDENT_CONTENT),
                                          ("t", TELLING_REASONING, TELLING_CONTENT)):  # fmt: skip
        truth = r1_ids(reasoning + "</think>" + content + R1_EOS)
        answers.append((response(sample_id=sample_id, reasoning=reasoning, content=content, completion=len(truth)),
                        truth))  # fmt: skip
    verdicts, changes = reconstruct_with_facts([r for r, _ in answers], deepseek(), VLLM, book)
    assert changes == []
    assert [v.output_ids for v in verdicts if isinstance(v, SampleReconstructed)] == [t for _, t in answers]


def test_the_probe_reports_an_upstream_caught_stripping_before_the_main_run() -> None:
    """``draftstream probe`` / ``probe_first`` judge their answers as one batch: the fact is in their book."""
    from services.common.config import load_settings
    from services.probe.app import judge

    coincident, _ = _stripped("a", COINCIDENT_REASONING, COINCIDENT_CONTENT)
    answers_in = [coincident, *telling_answers()]
    for answer in answers_in:
        answer.profile = "deepseek-r1"
    book = FactBook()
    answers = judge(load_settings(None), answers_in, book)
    assert [a.accepted for a in answers] == [False] * 4
    assert answers[0].reason == "whitespace_ambiguous"
    fact = book.strips("openai/m")
    assert fact is not None and fact.evidence == "math:t1"


def test_a_miss_at_a_place_the_convention_loses_is_no_evidence_of_strips() -> None:
    """vLLM's deepseek_v4 .rstrip()s the reasoning (the convention says so): V4 answers whose "\\n\\n" before
    </think> it took miss their count there, which says nothing about the upstream's other edges."""
    from services.profiles import load_profile
    from tests.unit.test_reconstruct import v4_truth

    book, answers = FactBook(), []
    for k, words in enumerate(("Plan it", "Then stop", "So it ends", "We are done")):
        truth = v4_truth().encode(f"{words}.\n \n</think>Done.<｜end▁of▁sentence｜>", add_special_tokens=False).ids
        rebuilt = v4_truth().encode(f"{words}.</think>Done.<｜end▁of▁sentence｜>", add_special_tokens=False).ids
        assert len(rebuilt) != len(truth)  # the miss a stripping upstream would show
        answers.append(response(sample_id=f"v{k}", reasoning=f"{words}.", content="Done.", completion=len(truth)))
    verdicts, changes = reconstruct_with_facts(answers, load_profile("deepseek-v4"), VLLM, book, at=5.0)
    assert all(v.reason == "whitespace_stripped" and "reasoning_end" in v.message for v in verdicts)  # type: ignore[union-attr]
    assert changes == [] and book.strips("openai/m") is None
