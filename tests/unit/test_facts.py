"""Provider facts from evidence (services/reconstruct/facts.py), against the real R1 tokenizer.

Every expected id sequence is the raw model text encoded by the tokenizer library itself
(see test_reconstruct.py); the response fields are what an OpenRouter upstream returns from
that raw text: a lossless one (vLLM-like, every field as the model wrote it) or a stripping
one (SGLang before 2026, PARSERS.md), each named in ``provider`` (``upstream_provider``).
"""

from __future__ import annotations

from schemas import ProviderFactRecorded, ResponseReceived, decode, encode
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct_batch
from services.reconstruct.facts import FACT_CONTRADICTED, FactBook, upstream_of
from services.reconstruct.offline import reconstruct_lines
from services.reconstruct.verify import reconstruct_with_facts
from tests.unit.test_profiles import deepseek
from tests.unit.test_reconstruct import R1_EOS, TOOLS, dead, ok, r1_ids, response, tc

OPENROUTER = CONVENTIONS["openrouter"]

# The raw text R1 wrote (after the template's "<think>\n") and what a lossless upstream returns from it.
SHOWING_TEXT = "\nLet me think.\n</think>\n\nThe answer is 4.\n"
# "\n\n Consequently" and "Consequently" are two R1 tokens each (test_restore.py): alone, the count cannot
# tell whether a strip removed them; the upstream's facts can.
PLAIN_TEXT = "plan\n</think>Consequently it is 4."


def _routed(answer: ResponseReceived, upstream: str | None) -> ResponseReceived:
    """The answer as OpenRouter returns it, naming ``upstream`` in ``provider``."""
    answer.provider, answer.upstream_provider = "openrouter", upstream
    return answer


def _answer(sample_id: str, text: str, upstream: str | None) -> ResponseReceived:
    """A lossless upstream's fields of R1's raw ``text`` (split at </think>), with the true count."""
    reasoning, content = text.split("</think>")
    return _routed(response(sample_id=sample_id, reasoning=reasoning, content=content,
                            completion=len(r1_ids(text + R1_EOS))), upstream)


def test_the_upstream_is_the_named_provider_and_model_and_a_router_without_a_name_is_nobody() -> None:
    assert upstream_of(_answer("a", SHOWING_TEXT, "Lossless")) == "Lossless/m"
    assert upstream_of(_answer("a", SHOWING_TEXT, None)) is None  # OpenRouter routes: unattributable
    anonymous = response()
    anonymous.provider = "sglang"
    assert upstream_of(anonymous) == "sglang/m"  # one server behind one base URL


def test_one_answer_showing_its_whitespace_closes_the_gaps_of_the_upstreams_other_answers() -> None:
    plain = _answer("plain", PLAIN_TEXT, "Lossless")
    alone = dead(reconstruct_batch([plain], deepseek(), OPENROUTER)[0])
    assert alone.reason == "whitespace_ambiguous"  # the two-character strip stays possible on its own
    book = FactBook()
    # The plain answer comes first in the batch: facts are established from the whole batch before judging.
    verdicts, changes = reconstruct_with_facts([plain, _answer("showing", SHOWING_TEXT, "Lossless")],
                                               deepseek(), OPENROUTER, book)
    assert ok(verdicts[0]).output_ids == r1_ids(PLAIN_TEXT + R1_EOS)
    assert ok(verdicts[1]).output_ids == r1_ids(SHOWING_TEXT + R1_EOS)
    assert {(c.upstream, c.place, c.evidence) for c in changes} == {
        ("Lossless/m", "reasoning_end", "math:plain"),  # "plan\n" shows it first
        *(("Lossless/m", place, "math:showing") for place in ("reasoning_start", "content_start", "content_end")),
    }
    assert book.kept("Lossless/m") == {"reasoning_start", "reasoning_end", "content_start", "content_end"}
    # A later batch: the facts stand, nothing new is recorded.
    later, more = reconstruct_with_facts([_answer("plain2", PLAIN_TEXT, "Lossless")], deepseek(), OPENROUTER, book)
    assert ok(later[0]).output_ids == r1_ids(PLAIN_TEXT + R1_EOS) and more == []


def test_facts_of_one_upstream_never_close_the_gaps_of_another() -> None:
    book = FactBook()
    batch = [_answer("showing", SHOWING_TEXT, "Lossless"), _answer("plain", PLAIN_TEXT, "Other"),
             _answer("anon", PLAIN_TEXT, None)]
    verdicts, _ = reconstruct_with_facts(batch, deepseek(), OPENROUTER, book)
    assert dead(verdicts[1]).reason == "whitespace_ambiguous"
    assert dead(verdicts[2]).reason == "whitespace_ambiguous"
    # Other's own answer proves only its own reasoning end ("plan\n"); nobody's facts are the anonymous answer's.
    assert book.kept("Other/m") == {"reasoning_end"}
    assert {u for u, _ in book.facts} == {"Lossless/m", "Other/m"}


def test_offline_lines_accumulate_facts_over_the_file_as_the_stage_does() -> None:
    lines = [encode(_answer("showing", SHOWING_TEXT, "Lossless")), encode(_answer("plain", PLAIN_TEXT, "Lossless"))]
    profile = deepseek()
    with_facts = list(reconstruct_lines(lines, lambda _: (profile, OPENROUTER), batch_size=1, facts=FactBook()))
    assert ok(with_facts[1].verdict).output_ids == r1_ids(PLAIN_TEXT + R1_EOS)
    alone = list(reconstruct_lines(lines, lambda _: (profile, OPENROUTER), batch_size=1))
    assert dead(alone[1].verdict).reason == "whitespace_ambiguous"


def test_no_fact_is_recorded_under_a_convention_that_strips_nothing() -> None:
    book = FactBook()
    verdicts, changes = reconstruct_with_facts([_answer("showing", SHOWING_TEXT, "Lossless")], deepseek(),
                                               CONVENTIONS["vllm"], book)
    assert ok(verdicts[0]).output_ids == r1_ids(SHOWING_TEXT + R1_EOS)
    assert changes == [] and not book.facts


def test_a_count_showing_whitespace_missing_where_the_upstream_keeps_it_withdraws_the_fact() -> None:
    """The same name later serves a stripping engine: content "\\n\\nThe answer" comes back without "\\n\\n"."""
    book = FactBook()
    reconstruct_with_facts([_answer("showing", SHOWING_TEXT, "Mixed")], deepseek(), OPENROUTER, book)
    truth = r1_ids("plan\n</think>\n\nThe answer is 4." + R1_EOS)
    stripped = _routed(response(sample_id="stripped", reasoning="plan\n", content="The answer is 4.",
                                completion=len(truth)), "Mixed")
    verdicts, changes = reconstruct_with_facts([stripped, _answer("plain", PLAIN_TEXT, "Mixed")], deepseek(),
                                               OPENROUTER, book)
    refused = dead(verdicts[0])
    assert refused.reason == FACT_CONTRADICTED
    assert "Mixed/m|content_start" in refused.message
    assert "math:showing" in refused.message and "math:stripped" in refused.message
    withdrawn = {c.place for c in changes if c.withdrawn}
    assert "content_start" in withdrawn
    assert all(c.contradicted_by == "math:stripped" for c in changes if c.withdrawn)
    # The later answer of the same upstream that would have needed the fact is refused too.
    assert dead(verdicts[1]).reason == FACT_CONTRADICTED
    # ... and so are those of later batches; a new showing answer does not bring the fact back.
    again, _ = reconstruct_with_facts([_answer("showing2", SHOWING_TEXT, "Mixed"), _answer("plain2", PLAIN_TEXT,
                                       "Mixed")], deepseek(), OPENROUTER, book)  # fmt: skip
    assert ok(again[0]).output_ids == r1_ids(SHOWING_TEXT + R1_EOS)  # its own evidence still holds
    assert dead(again[1]).reason == FACT_CONTRADICTED
    assert book.facts[("Mixed/m", "content_start")].withdrawn


def _r1_tool(sample_id: str, written: str, upstream: str) -> tuple[list[int], ResponseReceived]:
    """R1's true ids when it wrote ``written`` as arguments, and a raw-arguments upstream's fields."""
    block = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n" + written
             + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    truth = r1_ids("\nplan\n</think>\n\n" + block + R1_EOS)
    answer = response(sample_id=sample_id, reasoning="\nplan\n", content="\n\n", tool_calls=[tc("calc", written)],
                      tools=TOOLS, completion=len(truth))
    return truth, _routed(answer, upstream)


def test_no_fact_speaks_for_the_inside_of_a_tool_block() -> None:
    """Arguments in a form json.dumps never writes once established the fact ``arguments``; the wrapper and
    what followed the block stay the parser's whatever the arguments show, so nothing is established, and an
    old ``arguments`` record read off the topic closes nothing."""
    book = FactBook()
    book.apply(ProviderFactRecorded(upstream="Raw/m", place="arguments", evidence="math:old"))
    _, compact = _r1_tool("compact", '{"expr":"6*7"}', "Raw")
    verdicts, changes = reconstruct_with_facts([compact], deepseek(), OPENROUTER, book)
    assert dead(verdicts[0]).reason == "tool_arguments_reserialized"
    assert "arguments" not in {c.place for c in changes}


def test_a_withdrawal_is_final_and_records_round_trip() -> None:
    book = FactBook()
    book.establish("U/m", "content_start", "ds:1")
    withdrawal = book.withdraw("U/m", "content_start", "ds:2", "count")
    book.apply(ProviderFactRecorded(upstream="U/m", place="content_start", evidence="ds:3"))
    assert book.kept("U/m") == frozenset() and book.contradicted("U/m") == withdrawal
    assert book.establish("U/m", "content_start", "ds:4") is None
    read_back = FactBook.of([decode(encode(withdrawal), ProviderFactRecorded)])
    assert read_back.facts == book.facts
