"""Reconstruction: rebuilt ids decode to the text, specials land at the right ids, masks align."""

from __future__ import annotations

import unicodedata
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
    decode,
    encode,
)
from services.common.kafka import DeadLetter
from services.profiles import Profile, load_profile
from services.reconstruct.core import reconstruct, reconstruct_batch, reconstruct_lines
from tests.unit.test_profiles import deepseek, kimi, qwen


def response(
    *,
    messages: list[Message] | None = None,
    tools: list[dict[str, Any]] | None = None,
    reasoning: str = "Let me think.",
    content: str = "The answer is 4.",
    tool_calls: list[ToolCall] | None = None,
    finish: str | None = "stop",
    sample_id: str = "s1",
    **extra: Any,
) -> ResponseReceived:
    """A response to a one-turn prompt unless ``messages`` says otherwise."""
    prompt = PromptPublished(
        dataset="math",
        sample_id=sample_id,
        messages=messages or [Message(role="user", content="What is 2+2?")],
        tools=tools,
    )
    return ResponseReceived(
        dataset="math",
        sample_id=sample_id,
        prompt=prompt,
        provider="simulator",
        model="m",
        reasoning=reasoning,
        content=content,
        tool_calls=tool_calls or [],
        finish_reason=finish,
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


def tc(name: str, args: str) -> ToolCall:
    """A structured tool call."""
    return ToolCall(function=ToolFunction(name=name, arguments=args), id="call_1")


# -- property tests ---------------------------------------------------------------------

# Random text biased toward the pieces that could confuse a rebuild: partial specials,
# brackets, the fullwidth bar of DeepSeek's tokens, whitespace runs, CJK, emoji, combining marks.
FRAGMENTS = st.sampled_from(
    [
        "<",
        ">",
        "</",
        "think",
        "<think",
        "/think>",
        "｜",
        "▁",
        "<|",
        "|>",
        "im_end",
        "tool_call",
        "\n",
        "\n\n",
        " ",
        "  ",
        "\t",
        "```",
        "{",
        "}",
        '"',
        "漢字",
        "🚀",
        "é",
        "e\u0301",
        "\u0338",
        "123",
    ]
)
TEXT = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12), FRAGMENTS), max_size=12
).map("".join)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
TOOL_CALLS = st.lists(
    st.tuples(
        st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True),
        st.dictionaries(st.text(max_size=6), JSON_VALUE, max_size=3),
    ),
    max_size=2,
)


def _clean(profile: Profile, *texts: str) -> None:
    for text in texts:
        for special in profile.special_strings:
            assume(special not in text)


def _check_round_trip(
    profile: Profile, reasoning: str, content: str, calls_spec: list[tuple[str, Any]]
) -> None:
    import json

    calls = [tc(name, json.dumps(args, ensure_ascii=False)) for name, args in calls_spec]
    _clean(profile, reasoning, content, *(c.function.arguments for c in calls))
    assume(reasoning or content or calls)
    sample = ok(reconstruct(response(reasoning=reasoning, content=content, tool_calls=calls), profile))
    assert sample.method == "reencode"
    out = sample.output_ids
    expected_text = (
        reasoning + profile.think_end + content + profile.render_tool_calls(calls) + profile.end_of_turn
    )
    decoded = profile.decode(out)
    if profile.name == "qwen3":  # Qwen's tokenizer NFC-normalises the text between specials
        assert unicodedata.normalize("NFC", decoded) == unicodedata.normalize("NFC", expected_text)
    else:
        assert decoded == expected_text
    # Specials land at the right positions and nowhere else.
    n_reasoning = len(profile.encode(reasoning))
    assert out[n_reasoning] == profile.think_end_id
    assert out.count(profile.think_end_id) == 1
    assert out[-1] == profile.end_of_turn_id and out.count(profile.end_of_turn_id) == 1
    assert profile.think_start_id not in out
    special_ids = {profile.think_end_id, profile.end_of_turn_id, *profile.tool_tokens.values()}
    expected_specials = [i for i in profile.encode(profile.render_tool_calls(calls)) if i in special_ids]
    assert [i for i in out if i in special_ids] == [
        profile.think_end_id,
        *expected_specials,
        profile.end_of_turn_id,
    ]
    # Prompt and output line up with the mask.
    assert sample.loss_mask == [0] * len(sample.prompt_ids) + [1] * len(out)


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(reasoning=TEXT, content=TEXT, calls=TOOL_CALLS)
def test_property_deepseek_round_trip(reasoning: str, content: str, calls: list[tuple[str, Any]]) -> None:
    _check_round_trip(deepseek(), reasoning, content, calls)


@PROPERTY
@given(reasoning=TEXT, content=TEXT, calls=TOOL_CALLS)
def test_property_qwen3_round_trip(reasoning: str, content: str, calls: list[tuple[str, Any]]) -> None:
    _check_round_trip(qwen(), reasoning, content, calls)


@PROPERTY
@given(texts=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=6))
def test_property_batch_equals_one_by_one(texts: list[tuple[str, str]]) -> None:
    p = deepseek()
    responses = []
    for i, (reasoning, content) in enumerate(texts):
        _clean(p, reasoning, content)
        responses.append(response(reasoning=reasoning, content=content, sample_id=f"s{i}"))
    batch = reconstruct_batch(responses, p)
    assert [encode(x) if isinstance(x, SampleReconstructed) else x for x in batch] == [
        encode(x) if isinstance(x, SampleReconstructed) else x for x in (reconstruct(r, p) for r in responses)
    ]


# -- prompts: input ids and loss mask line up -------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "calculator",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]
PROMPTS: dict[str, tuple[list[Message], list[dict[str, Any]] | None]] = {
    "single-turn": ([Message(role="user", content="What is 2+2?")], None),
    "system": (
        [Message(role="system", content="You are terse."), Message(role="user", content="2+2?")],
        None,
    ),
    "multi-turn": (
        [
            Message(role="user", content="Hi"),
            Message(role="assistant", content="Hello! How can I help?", reasoning_content="greet back"),
            Message(role="user", content="What is 2+2?"),
        ],
        None,
    ),
    "tools": (
        [
            Message(role="system", content="Use tools."),
            Message(role="user", content="Compute 6*7"),
            Message(role="assistant", content="", tool_calls=[tc("calc", '{"expr": "6*7"}')]),
            Message(role="tool", content="42", tool_call_id="call_1"),
        ],
        TOOLS,
    ),
}


@pytest.mark.parametrize("kind", sorted(PROMPTS))
@pytest.mark.parametrize("profile_name", ["deepseek-v3", "qwen3", "kimi-k2"])
def test_input_ids_and_loss_mask_line_up(kind: str, profile_name: str) -> None:
    p = kimi() if profile_name == "kimi-k2" else load_profile(profile_name)
    messages, tools = PROMPTS[kind]
    sample = ok(reconstruct(response(messages=messages, tools=tools), p))
    prompt_text = p.render_prompt(messages, tools)
    assert sample.prompt_text == prompt_text
    assert sample.prompt_ids == p.encode(prompt_text)
    assert p.decode(sample.prompt_ids) == prompt_text
    # The generation prompt opens the reasoning: the prompt ends with think-start.
    assert sample.prompt_ids[-1] == p.think_start_id or p.decode(sample.prompt_ids[-2:]).startswith(
        p.think_start
    )
    input_ids = sample.prompt_ids + sample.output_ids
    assert len(sample.loss_mask) == len(input_ids)
    first_loss = sample.loss_mask.index(1)
    assert first_loss == len(sample.prompt_ids)
    assert all(m == 0 for m in sample.loss_mask[:first_loss]) and all(
        m == 1 for m in sample.loss_mask[first_loss:]
    )
    assert p.decode(input_ids[first_loss:]) == p.render_output(
        reasoning="Let me think.", content="The answer is 4."
    )
    if kind == "system":
        assert "You are terse." in p.decode(sample.prompt_ids)
    if kind == "tools":
        assert "calc" in prompt_text and "42" in prompt_text
        tool_ids = set(p.tool_tokens.values())
        assert tool_ids & set(sample.prompt_ids)  # the history's tool call is native
    if kind == "multi-turn":
        assert "greet back" not in prompt_text and "Hello! How can I help?" in prompt_text


def test_tool_call_answer_in_output() -> None:
    p = deepseek()
    calls = [tc("calc", '{"expr": "6*7"}')]
    sample = ok(reconstruct(response(content="", tool_calls=calls, tools=TOOLS), p))
    assert sample.output_ids[-1] == 1
    assert sample.output_ids[-2] == 128807  # <｜tool▁calls▁end｜> right before end of turn
    assert p.decode(sample.output_ids) == "Let me think.</think>" + p.render_tool_calls(calls) + p.end_of_turn


# -- methods ----------------------------------------------------------------------------


def test_native_ids_are_kept_as_they_are() -> None:
    p = deepseek()
    native = [5, 6, 128822, 7, 1]
    sample = ok(reconstruct(response(native_output_ids=native, content="ignored"), p))
    assert sample.method == "native" and sample.output_ids == native


def test_native_ids_out_of_vocab() -> None:
    verdict = dead(reconstruct(response(native_output_ids=[5, 200_000]), deepseek()))
    assert verdict.reason == "id_out_of_vocab" and "200000" in verdict.message


def test_logprobs_from_bytes_strings_and_ids() -> None:
    p = deepseek()
    truth = p.encode("Let me think.</think>Héllo 世界<｜end▁of▁sentence｜>")
    tokens = [LogprobToken(token="x", bytes=list(p.token_bytes(i))) for i in truth[:3]]
    tokens += [LogprobToken(token=p.token_bytes(i).decode("utf-8", "replace")) for i in truth[3:4]]
    tokens += [LogprobToken(token=f"token_id:{i}") for i in truth[4:6]]
    tokens += [LogprobToken(token="?", id=i) for i in truth[6:-1]]  # the final end-of-turn omitted
    assert p.token_bytes(truth[3]).decode("utf-8", "strict")  # the string form is exact here
    sample = ok(reconstruct(response(logprobs=tokens), p))
    assert sample.method == "logprobs"
    assert sample.output_ids == truth  # end of turn appended for a stopped answer


def test_logprobs_keep_a_non_canonical_split() -> None:
    p = deepseek()
    (hello,) = p.encode("hello")
    split = [p.id_of_bytes(b"hel"), p.id_of_bytes(b"lo")]
    assert None not in split
    tokens = [LogprobToken(token="", bytes=list(b"hel")), LogprobToken(token="", bytes=list(b"lo"))]
    sample = ok(reconstruct(response(logprobs=tokens, finish="length"), p))
    assert sample.output_ids == split and hello not in sample.output_ids


def test_logprobs_unmappable() -> None:
    tokens = [LogprobToken(token="ok"), LogprobToken(token="", bytes=[0xFF, 0xFE, 0xFD, 0xFC, 0x00, 0x01])]
    verdict = dead(reconstruct(response(logprobs=tokens), deepseek()))
    assert verdict.reason == "logprobs_unmappable" and "token 1" in verdict.message


# -- truncation -------------------------------------------------------------------------


def test_length_finish_gets_no_end_of_turn() -> None:
    p = deepseek()
    sample = ok(reconstruct(response(finish="length"), p))
    assert p.decode(sample.output_ids) == "Let me think.</think>The answer is 4."
    assert p.end_of_turn_id not in sample.output_ids


def test_length_inside_reasoning_has_no_think_end() -> None:
    p = qwen()
    sample = ok(reconstruct(response(content="", reasoning="I was thinking and then", finish="length"), p))
    assert sample.output_ids == p.encode("I was thinking and then")
    assert p.think_end_id not in sample.output_ids and p.end_of_turn_id not in sample.output_ids


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
    verdict = dead(reconstruct(response(**kwargs), deepseek()))
    assert verdict.reason == reason, verdict


@pytest.mark.parametrize(
    ("profile_name", "text", "token_id"),
    [("deepseek-v3", "see <｜place▁holder▁no▁0｜> here", 128000), ("qwen3", "box <|quad_start|>", 151650)],
)
def test_any_added_token_in_text_is_refused(profile_name: str, text: str, token_id: int) -> None:
    """Undeclared added tokens (DeepSeek has 1283) still encode as specials: refuse them."""
    verdict = dead(reconstruct(response(content=text), load_profile(profile_name)))
    assert verdict.reason == "special_token_in_text" and f"id {token_id}" in verdict.message


def test_raw_tool_text_in_content_is_allowed_without_structured_calls() -> None:
    p = deepseek()
    raw = p.render_tool_calls([tc("f", "{}")])
    sample = ok(reconstruct(response(content=raw), p))
    assert 128806 in sample.output_ids and sample.output_ids[-2] == 128807


def test_only_tool_calls_is_not_empty() -> None:
    sample = ok(reconstruct(response(reasoning="", content="", tool_calls=[tc("f", "{}")]), deepseek()))
    assert sample.output_ids[0] == 128822  # empty reasoning, then think-end


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
    results = list(reconstruct_lines(lines, lambda r: p, batch_size=2))
    assert [r.line for r in results] == [1, 3, 4, 5]
    assert isinstance(results[0].verdict, SampleReconstructed) and results[0].key == "math:a"
    assert isinstance(results[1].verdict, DeadLetter) and results[1].verdict.reason == "invalid_json"
    assert isinstance(results[2].verdict, DeadLetter) and results[2].verdict.reason == "empty_response"
    assert isinstance(results[3].verdict, SampleReconstructed)
    # The sample survives the wire.
    assert decode(encode(results[3].verdict), SampleReconstructed) == results[3].verdict


def test_tool_calls_for_a_profile_without_tool_format(tmp_path: Any) -> None:
    import json as _json

    from services.common.config import load_settings
    from tests.unit.test_profiles import KIMI_SPECIALS, _hf_tokenizer_json

    path = tmp_path / "tokenizer.json"
    path.write_text(_json.dumps(_hf_tokenizer_json(KIMI_SPECIALS)), encoding="utf-8")
    settings = load_settings(
        None,
        profiles={
            "plain": {
                "tokenizer": str(path),
                "end_of_turn": "<|im_end|>",
                "end_of_turn_id": 163586,
                "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
            }
        },
    )
    p = load_profile("plain", settings)
    verdict = dead(reconstruct(response(tool_calls=[tc("f", "{}")]), p))
    assert verdict.reason == "tool_format_unsupported"
    sample = ok(reconstruct(response(reasoning="", content="hi"), p))  # no think tokens at all
    assert sample.output_ids == [ord("h"), ord("i"), 163586]


def test_tool_definitions_not_sent_to_the_provider_stay_out_of_the_prompt_ids() -> None:
    p = deepseek()
    messages, tools = PROMPTS["tools"]
    sent = ok(reconstruct(response(messages=messages, tools=tools), p))
    unsent = ok(reconstruct(response(messages=messages, tools=tools, tools_sent=False), p))
    assert sent.prompt_text == p.render_prompt(messages, tools)
    assert unsent.prompt_text == p.render_prompt(messages, None)
    assert len(unsent.prompt_ids) < len(sent.prompt_ids)
