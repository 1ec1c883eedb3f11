"""Each audit check with a passing and a failing case, for kimi-k2 ids and real deepseek-r1."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import (
    Message,
    PromptPublished,
    ResponseReceived,
    SampleReconstructed,
    ToolCall,
    ToolFunction,
    Usage,
)
from services.audit import checks, core
from services.audit.core import audit, audit_batch, mismatch_fraction, parse_tool_tokens
from services.common.config import AuditThresholds
from tests.unit.test_audit_support import deepseek, kimi, replacement_id

PROFILES = {"kimi-k2": kimi, "deepseek-r1": deepseek}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
EXACT = AuditThresholds(usage_offset=0)


@pytest.fixture(params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest) -> Any:
    """Both profiles: kimi-k2 (stand-in tokenizer, real ids) and deepseek-r1 (real tokenizer)."""
    return PROFILES[request.param]()


def tool_ids(profile: Any, calls: int = 1) -> list[int]:
    """Well-formed native tool-call ids for ``calls`` calls, built from the profile's tool tokens."""
    roles = core.tool_token_roles(profile.tool_tokens)
    by_role = {role: i for i, role in roles.items()}
    ids: list[int] = [by_role["S("]]
    for _ in range(calls):
        ids += [by_role["C("], *profile.encode("add"), by_role["|"], *profile.encode('{"a":1}'), by_role["C)"]]
    return ids + [by_role["S)"]]


def make(
    profile: Any,
    *,
    reasoning: str = "Two plus two is four.",
    content: str = "hello",
    output_ids: list[int] | None = None,
    extra_ids: list[int] | None = None,
    finish: str | None = "stop",
    completion: int | None | str = "auto",
    tools: list[dict[str, Any]] | None = None,
    tool_calls: list[ToolCall] | None = None,
    native: list[int] | None = None,
    loss_mask: list[int] | None = None,
    prompt_ids: list[int] | None = None,
    prompt_text: str | None = None,
    prompt_tokens: int | None = None,
    native_prompt: list[int] | None = None,
) -> SampleReconstructed:
    """A sample; by default a good one: encode(reasoning) + THINK_END + encode(content) + EOT.

    Its prompt text ends by opening the think block (as R1's generation prompt does).
    """
    if output_ids is None:
        output_ids = [*profile.encode(reasoning), profile.think_end_id, *profile.encode(content),
                      *(extra_ids or []), profile.end_of_turn_id]
        if finish == "length":  # a cut answer has no end-of-turn
            output_ids = output_ids[:-1]
    prompt_ids = prompt_ids if prompt_ids is not None else profile.encode("2+2?")
    prompt = PromptPublished(dataset="math", sample_id="s1",
                             messages=[Message(role="user", content="2+2?")], tools=tools)
    response = ResponseReceived(
        dataset="math", sample_id="s1", prompt=prompt, provider="openrouter", model="m",
        reasoning=reasoning, content=content, tool_calls=tool_calls or [], finish_reason=finish,
        usage=Usage(completion_tokens=len(output_ids) if completion == "auto" else completion,  # type: ignore[arg-type]
                    prompt_tokens=prompt_tokens),
        native_output_ids=native,
        native_prompt_ids=native_prompt,
    )
    if prompt_text is None:
        prompt_text = f"<user>2+2?<assistant>{profile.think_start or ''}\n"
    return SampleReconstructed(
        dataset="math", sample_id="s1", profile=profile.name, response=response,
        prompt_ids=prompt_ids, output_ids=output_ids,
        loss_mask=loss_mask if loss_mask is not None else [0] * len(prompt_ids) + [1] * len(output_ids),
        method="reencode", prompt_text=prompt_text,
    )


def run(sample: SampleReconstructed, profile: Any, thresholds: AuditThresholds = EXACT) -> Any:
    return audit(sample, profile, thresholds)


def result(audited: Any, code: str) -> Any:
    found = [r for r in audited.results if r.code == code]
    assert found, f"{code} did not run: {[r.code for r in audited.results]}"
    return found[0]


def test_good_sample_passes_every_check(profile: Any) -> None:
    audited = run(make(profile), profile)
    assert audited.passed, audited.results
    assert audited.reasons == []
    ran = {r.code for r in audited.results}
    assert {checks.ENDS_WITH_END_OF_TURN, checks.ONE_THINK_END, checks.THINK_END_BEFORE_END_OF_TURN,
            checks.ONE_END_OF_TURN, checks.NO_THINK_START, checks.ROUNDTRIP, checks.REASONING_NONEMPTY,
            checks.USAGE_MATCHES, checks.FINISH_STOP, checks.NO_REPLACEMENT_CHAR, checks.CONTENT_NONEMPTY,
            checks.IDS_IN_VOCAB, checks.LOSS_MASK} <= ran
    assert result(audited, checks.ROUNDTRIP).message == "exact"


def test_ends_with_end_of_turn_fails_on_wrong_id(profile: Any) -> None:
    sample = make(profile)
    # The real-run bug: Kimi's <|im_end|> written as 163533 instead of 163586.
    wrong = 163533 if profile.name == "kimi-k2" else 2
    sample.output_ids[-1] = wrong
    audited = run(sample, profile)
    assert not audited.passed
    assert audited.reasons[0] == checks.ENDS_WITH_END_OF_TURN
    assert checks.ONE_END_OF_TURN in audited.reasons


def test_one_end_of_turn_fails_on_two(profile: Any) -> None:
    eot = profile.end_of_turn_id
    audited = run(make(profile, extra_ids=[eot, *profile.encode("again")]), profile,
                  AuditThresholds(usage_offset=0, disabled_checks=("roundtrip",)))
    assert result(audited, checks.ENDS_WITH_END_OF_TURN).passed
    assert not result(audited, checks.ONE_END_OF_TURN).passed
    assert audited.reasons == [checks.ONE_END_OF_TURN]


def test_one_think_end_fails_on_two_and_on_none(profile: Any) -> None:
    two = run(make(profile, extra_ids=[profile.think_end_id]), profile)
    assert checks.ONE_THINK_END in two.reasons
    ids = [*profile.encode("hello"), profile.end_of_turn_id]
    none = run(make(profile, output_ids=ids), profile)
    assert checks.ONE_THINK_END in none.reasons


def test_no_think_end_when_the_prompt_closed_the_block(profile: Any) -> None:
    """Thinking off (V3.1 "</think>" / Qwen3 "<think>\n\n</think>\n\n" prompts): no think tokens."""
    ids = [*profile.encode("hello"), profile.end_of_turn_id]
    t = AuditThresholds(usage_offset=0, require_reasoning=False)
    closed = f"<assistant>{profile.think_end}"
    audited = run(make(profile, reasoning="", output_ids=ids, prompt_text=closed), profile, t)
    assert audited.passed, audited.results
    # The prompt opened the block: a finished answer must close it.
    opened = run(make(profile, reasoning="", output_ids=ids), profile, t)
    assert opened.reasons == [checks.ONE_THINK_END]
    stray = [profile.think_end_id, *ids]
    assert checks.ONE_THINK_END in run(make(profile, reasoning="", output_ids=stray, prompt_text=closed), profile,
                                     AuditThresholds(usage_offset=0, require_reasoning=False,
                                                     roundtrip_tolerance=1.0)).reasons


def test_think_end_before_end_of_turn(profile: Any) -> None:
    eot, te = profile.end_of_turn_id, profile.think_end_id
    ids = [*profile.encode("abc"), eot, *profile.encode("hello"), te, eot]
    audited = run(make(profile, output_ids=ids), profile)
    assert not result(audited, checks.THINK_END_BEFORE_END_OF_TURN).passed
    assert result(run(make(profile), profile), checks.THINK_END_BEFORE_END_OF_TURN).passed


def test_no_think_start_in_output_when_the_prompt_opened_it(profile: Any) -> None:
    good = make(profile)
    audited = run(make(profile, output_ids=[profile.think_start_id, *good.output_ids]), profile)
    assert audited.reasons == [checks.NO_THINK_START]


def test_think_start_first_when_the_model_opens_the_block() -> None:
    """Qwen3-hybrid / Kimi-K2-Thinking: the prompt leaves the think block to the model."""
    p = kimi()
    good = make(p)
    opened = [p.think_start_id, *good.output_ids]
    assert run(make(p, output_ids=opened, prompt_text="<assistant>"), p).passed
    # Reasoning in the response but no <think> first: the output is laid out wrongly.
    missing = run(make(p, output_ids=list(good.output_ids), prompt_text="<assistant>"), p)
    assert not missing.passed
    twice = run(make(p, output_ids=[p.think_start_id, p.think_start_id, *good.output_ids],
                     prompt_text="<assistant>"), p, AuditThresholds(usage_offset=0, roundtrip_tolerance=1.0))
    assert checks.NO_THINK_START in twice.reasons


def test_roundtrip_catches_non_canonical_split_and_reports_exactness(profile: Any) -> None:
    split = [i for ch in "hello" for i in profile.encode(ch)]
    assert split != profile.encode("hello")  # a longer, non-canonical spelling of the same text
    ids = [*profile.encode("ok"), profile.think_end_id, *split, profile.end_of_turn_id]
    audited = run(make(profile, reasoning="ok", output_ids=ids), profile)
    rt = result(audited, checks.ROUNDTRIP)
    assert not rt.passed
    assert rt.message.startswith("not exact")
    assert rt.value is not None and rt.value > 0.05
    # A large tolerance lets it through, but still reports that it was not exact.
    loose = run(make(profile, reasoning="ok", output_ids=ids), profile,
                AuditThresholds(usage_offset=0, roundtrip_tolerance=1.0))
    assert result(loose, checks.ROUNDTRIP).passed
    assert result(loose, checks.ROUNDTRIP).message.startswith("not exact")


def test_reasoning_nonempty(profile: Any) -> None:
    audited = run(make(profile, reasoning=""), profile)
    assert audited.reasons == [checks.REASONING_NONEMPTY]
    off = run(make(profile, reasoning=""), profile, AuditThresholds(usage_offset=0, require_reasoning=False))
    assert off.passed


def test_content_nonempty(profile: Any) -> None:
    audited = run(make(profile, content=""), profile)
    assert audited.reasons == [checks.CONTENT_NONEMPTY]


def test_finish_stop(profile: Any) -> None:
    assert run(make(profile, finish="length"), profile).reasons == [checks.FINISH_STOP]
    assert run(make(profile, finish=None), profile).reasons == [checks.FINISH_STOP]
    relaxed = AuditThresholds(usage_offset=0, require_stop=False)
    assert run(make(profile, finish="length"), profile, relaxed).passed


def test_accept_truncated_passes_only_an_answer_cut_at_the_token_limit(profile: Any) -> None:
    accepting = AuditThresholds(usage_offset=0, accept_truncated=True)
    cut = run(make(profile, finish="length"), profile, accepting)
    assert cut.passed, cut.reasons
    stop = result(cut, checks.FINISH_STOP)
    assert stop.passed and stop.message == checks.TRUNCATED_ACCEPTED
    # Only "length": an answer that ended otherwise still fails, and the default still refuses a cut one.
    assert run(make(profile, finish=None), profile, accepting).reasons == [checks.FINISH_STOP]
    assert run(make(profile, finish="length"), profile).reasons == [checks.FINISH_STOP]
    assert AuditThresholds().accept_truncated is False


def test_no_replacement_char(profile: Any) -> None:
    bad = replacement_id(profile)
    audited = run(make(profile, extra_ids=[bad]), profile, AuditThresholds(usage_offset=0, roundtrip_tolerance=1))
    assert checks.NO_REPLACEMENT_CHAR in audited.reasons
    assert result(audited, checks.NO_REPLACEMENT_CHAR).value == 1.0


def test_ids_in_vocab_dead_letters_without_decoding(profile: Any) -> None:
    good = make(profile)
    audited = run(make(profile, output_ids=[profile.vocab_size + 5, *good.output_ids]), profile)
    assert audited.reasons[0] == checks.IDS_IN_VOCAB
    codes = {r.code for r in audited.results}
    assert checks.ROUNDTRIP not in codes and checks.NO_REPLACEMENT_CHAR not in codes


def test_loss_mask_consistent(profile: Any) -> None:
    sample = make(profile)
    audited = run(make(profile, loss_mask=[1] * (len(sample.prompt_ids) + len(sample.output_ids))), profile)
    assert audited.reasons == [checks.LOSS_MASK]


def test_usage_exact_offset_390_vs_325_is_corrupt(profile: Any) -> None:
    tail = [profile.think_end_id, *profile.encode("hello"), profile.end_of_turn_id]
    ids = [profile.encode("a")[0]] * (390 - len(tail)) + tail
    audited = run(make(profile, output_ids=ids, completion=325), profile, AuditThresholds(usage_offset=0))
    usage = result(audited, checks.USAGE_MATCHES)
    assert not usage.passed
    assert usage.value == -65
    assert checks.USAGE_MATCHES in audited.reasons
    # A configured offset of +1 (the provider counts one more token, say) is matched exactly.
    n = len(make(profile).output_ids)
    one = make(profile, completion=n + 1)
    assert run(one, profile, AuditThresholds(usage_offset=1)).passed
    assert run(one, profile, AuditThresholds(usage_offset=0)).reasons == [checks.USAGE_MATCHES]
    assert run(one, profile, AuditThresholds(usage_offset=0, usage_tolerance=1)).passed


def test_a_one_token_error_on_every_sample_is_dead_lettered_not_learned(profile: Any) -> None:
    """A reconstruction that loses one token on every sample never becomes "the convention"."""
    lossy = [make(profile, completion=len(make(profile).output_ids) + 1) for _ in range(40)]
    verdicts = audit_batch(lossy, profile, AuditThresholds())
    assert [v.reasons for v in verdicts] == [[checks.USAGE_MATCHES]] * 40
    assert all("configured offset 0" in result(v, checks.USAGE_MATCHES).message for v in verdicts)
    # And the other way round: one token too many on every sample.
    extra = [make(profile, completion=len(make(profile).output_ids) - 1) for _ in range(40)]
    assert all(v.reasons == [checks.USAGE_MATCHES] for v in audit_batch(extra, profile, AuditThresholds()))


def test_prompt_count_mismatch_is_dead_lettered(profile: Any) -> None:
    n = len(make(profile).prompt_ids)
    assert result(run(make(profile, prompt_tokens=n), profile), checks.PROMPT_MATCHES).passed
    audited = run(make(profile, prompt_tokens=n + 70), profile)
    assert audited.reasons == [checks.PROMPT_MATCHES]
    assert "usage.prompt_tokens" in result(audited, checks.PROMPT_MATCHES).message
    assert run(make(profile, prompt_tokens=n + 1), profile, AuditThresholds(prompt_usage_offset=1)).passed


def test_server_prompt_ids_must_equal_the_rendered_ones(profile: Any) -> None:
    good = make(profile)
    assert run(make(profile, native_prompt=list(good.prompt_ids)), profile).passed
    other = [*good.prompt_ids[:-1], good.prompt_ids[-1] + 1]
    # Same length, different id: only the server's ids can catch it, not a count.
    audited = run(make(profile, native_prompt=other, prompt_tokens=len(other)), profile)
    assert audited.reasons == [checks.PROMPT_MATCHES]


def test_usage_absent_is_not_checked(profile: Any) -> None:
    audited = run(make(profile, completion=None), profile)
    assert audited.passed
    assert "not checked" in result(audited, checks.USAGE_MATCHES).message


def test_tool_calls_well_formed_pass(profile: Any) -> None:
    call = ToolCall(function=ToolFunction(name="add", arguments='{"a":1}'), id="c1")
    sample = make(profile, content="", extra_ids=tool_ids(profile), tools=TOOLS, tool_calls=[call],
                  finish="tool_calls")
    audited = run(sample, profile)
    assert audited.passed, audited.results
    assert result(audited, checks.TOOL_CALLS_WELL_FORMED).value == 1.0


def test_tool_tokens_without_offered_tools_fail(profile: Any) -> None:
    audited = run(make(profile, extra_ids=tool_ids(profile)), profile)
    assert audited.reasons == [checks.TOOL_CALLS_WELL_FORMED]
    assert "offered no tools" in result(audited, checks.TOOL_CALLS_WELL_FORMED).message


def test_tool_tokens_unbalanced_fail(profile: Any) -> None:
    ids = tool_ids(profile)[:-2]  # drop the call end and the section end
    audited = run(make(profile, extra_ids=ids, tools=TOOLS), profile)
    assert audited.reasons == [checks.TOOL_CALLS_WELL_FORMED]


def test_tool_call_count_must_match_structured_calls(profile: Any) -> None:
    call = ToolCall(function=ToolFunction(name="add"), id="c1")
    audited = run(make(profile, extra_ids=tool_ids(profile, calls=2), tools=TOOLS, tool_calls=[call]), profile)
    assert audited.reasons == [checks.TOOL_CALLS_WELL_FORMED]


def test_native_ids_difference_is_reported_not_failed(profile: Any) -> None:
    good = make(profile)
    native = [*good.output_ids[:-2], *profile.encode("xyz"), good.output_ids[-1]]
    audited = run(make(profile, native=native), profile)
    assert audited.passed
    diff = result(audited, checks.NATIVE_IDS_DIFF)
    assert diff.passed and diff.value is not None and diff.value > 0
    same = run(make(profile, native=list(good.output_ids)), profile)
    assert result(same, checks.NATIVE_IDS_DIFF).value == 0.0


def test_disabled_checks_do_not_run(profile: Any) -> None:
    t = AuditThresholds(usage_offset=0, disabled_checks=("finish_stop",))
    audited = run(make(profile, finish="length"), profile, t)
    assert audited.passed
    assert checks.FINISH_STOP not in {r.code for r in audited.results}


def test_profile_without_think_tokens_skips_think_checks() -> None:
    from dataclasses import replace

    plain = replace(kimi(), think_start=None, think_start_id=None, think_end=None, think_end_id=None,
                    think_location=None)
    ids = [*plain.encode("hello"), plain.end_of_turn_id]
    audited = run(make(plain, reasoning="", output_ids=ids), plain)
    assert audited.passed, audited.results
    codes = {r.code for r in audited.results}
    assert not codes & {checks.ONE_THINK_END, checks.THINK_END_BEFORE_END_OF_TURN, checks.NO_THINK_START,
                        checks.REASONING_NONEMPTY}


def test_batch_equals_one_by_one(profile: Any) -> None:
    samples = [make(profile), make(profile, finish="length"), make(profile, content="")]
    batch = audit_batch(samples, profile, EXACT)
    single = [run(s, profile) for s in samples]
    assert [b.reasons for b in batch] == [s.reasons for s in single]
    assert [b.passed for b in batch] == [True, False, False]


def test_mismatch_fraction_and_tool_parser() -> None:
    assert mismatch_fraction([1, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert mismatch_fraction([1, 2, 3, 4], [1, 9, 3, 4]) == 0.25
    assert mismatch_fraction([], [1]) == 1.0
    roles = core.tool_token_roles(kimi().tool_tokens)
    assert parse_tool_tokens([163595, 163597, 5, 163598, 6, 163599, 163596], roles) == (1, "")
    calls, error = parse_tool_tokens([163595, 163597, 5, 6, 163599, 163596], roles)
    assert "separators" in error
    assert parse_tool_tokens([163597], roles)[1] != ""
    qwen = core.tool_token_roles({"<tool_call>": 151657, "</tool_call>": 151658})
    assert parse_tool_tokens([151657, 5, 151658, 151657, 6, 151658], qwen) == (2, "")
    assert parse_tool_tokens([151657, 151657, 151658], qwen)[1] != ""


def test_an_empty_think_block_the_model_opened_is_no_reasoning() -> None:
    """Qwen3 hybrid's "<think>\\n\\n</think>\\n\\n": vLLM returns reasoning "\\n\\n"; the opener is not reasoning."""
    p = kimi()
    ids = [p.think_start_id, *p.encode("\n\n"), p.think_end_id, *p.encode("hello"), p.end_of_turn_id]
    audited = run(make(p, reasoning="\n\n", output_ids=ids, prompt_text="<assistant>"), p)
    assert audited.reasons == [checks.REASONING_NONEMPTY]
