"""The simulator's pure core: determinism, ground truth, usage conventions, content faults."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.profiles import load_profile
from services.simulator.core import (
    BAD_USAGE_OFFSET,
    CONTENT_FAULTS,
    ChatRequest,
    GenerationParams,
    RequestError,
    build_response_body,
    choose_content_faults,
    choose_transient_fault,
    generate,
    noncanonical_same_length,
    noncanonical_split,
    parse_fault_header,
    parse_request,
    prompt_digest,
    usage_counts,
)

PROFILE = load_profile("deepseek-v3")  # cached by services.profiles: loaded once per session
THINK_END = 128822
EOT = 1
TOOL_CALLS_BEGIN = 128806
PARAMS = GenerationParams()

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def chat(text: str = "What is 17 * 23?", **kw: Any) -> ChatRequest:
    """A one-turn request."""
    return ChatRequest(model="deepseek/deepseek-v3", messages=[{"role": "user", "content": text}], **kw)


def truth_of(reasoning: str, content: str, calls: Any = ()) -> list[int]:
    """What reconstruction encodes for a finished answer."""
    return PROFILE.encode(PROFILE.render_output(reasoning=reasoning, content=content, tool_calls=calls))


def test_generation_is_deterministic_per_prompt_and_seed() -> None:
    a = generate(PROFILE, chat(), PARAMS)
    b = generate(PROFILE, chat(), PARAMS)
    other_prompt = generate(PROFILE, chat("Tell me about owls."), PARAMS)
    other_seed = generate(PROFILE, chat(), replace(PARAMS, seed=1))
    assert (a.reasoning, a.content, a.true_ids) == (b.reasoning, b.content, b.true_ids)
    assert a.true_ids != other_prompt.true_ids
    assert a.true_ids != other_seed.true_ids
    assert prompt_digest(chat()) == prompt_digest(chat())
    assert prompt_digest(chat()) != prompt_digest(chat(tools=[WEATHER_TOOL]))


@pytest.mark.parametrize("i", range(6))
def test_true_ids_are_the_joint_encoding_of_the_response_fields(i: int) -> None:
    g = generate(PROFILE, chat(f"question number {i}"), PARAMS)
    assert g.finish_reason == "stop"
    assert g.reasoning and g.content
    assert THINK_END not in PROFILE.encode(g.reasoning + g.content)  # providers strip the specials
    assert g.true_ids == truth_of(g.reasoning, g.content)
    assert g.true_ids == g.canonical_ids
    assert g.true_ids.count(THINK_END) == 1 and g.true_ids[-1] == EOT


def test_lengths_follow_the_configured_ranges() -> None:
    params = replace(PARAMS, reasoning_tokens=(50, 60), content_tokens=(10, 20))
    for i in range(8):
        g = generate(PROFILE, chat(f"len {i}"), params)
        n_reasoning = g.true_ids.index(THINK_END)
        n_content = len(g.true_ids) - n_reasoning - 2
        assert 45 <= n_reasoning <= 66, n_reasoning
        assert 8 <= n_content <= 24, n_content


def test_text_mixes_numbers_code_and_multibyte_unicode() -> None:
    texts = "".join(generate(PROFILE, chat(f"mix {i}"), PARAMS).reasoning for i in range(10))
    assert any(ord(ch) > 0x7FF for ch in texts)  # 3- and 4-byte UTF-8
    assert any(ch.isdigit() for ch in texts)
    assert "`" in texts


@pytest.mark.parametrize(
    ("eot", "think", "offset"), [(True, True, 0), (False, True, -1), (True, False, -1), (False, False, -2)]
)
def test_usage_counting_conventions(eot: bool, think: bool, offset: int) -> None:
    params = replace(PARAMS, count_end_of_turn=eot, count_think_end=think)
    g = generate(PROFILE, chat(), params)
    assert g.completion_tokens == len(g.true_ids) + offset
    assert g.reasoning_tokens == g.true_ids.index(THINK_END) == len(PROFILE.encode(g.reasoning))
    assert usage_counts(PROFILE, g.true_ids, params) == (g.completion_tokens, g.reasoning_tokens)


def test_max_tokens_truncates_to_length() -> None:
    full = generate(PROFILE, chat(), PARAMS)
    limit = len(full.true_ids) - 5
    g = generate(PROFILE, chat(max_tokens=limit), PARAMS)
    assert g.finish_reason == "length"
    assert g.true_ids == full.true_ids[:limit]
    assert g.completion_tokens == limit
    assert EOT not in g.true_ids
    roomy = generate(PROFILE, chat(max_tokens=len(full.true_ids)), PARAMS)
    assert roomy.finish_reason == "stop" and roomy.true_ids == full.true_ids


def test_structured_tool_calls_when_tools_are_sent() -> None:
    g = generate(PROFILE, chat("weather in Paris?", tools=[WEATHER_TOOL]), PARAMS)
    assert g.finish_reason == "tool_calls"
    assert len(g.tool_calls) == 1
    call = g.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and isinstance(args["days"], int)
    assert TOOL_CALLS_BEGIN not in PROFILE.encode(g.content)  # the call is structured, not in content
    assert g.true_ids == truth_of(g.reasoning, g.content, g.tool_calls)
    assert TOOL_CALLS_BEGIN in g.true_ids


def test_native_tool_call_text_in_content_without_tools_param() -> None:
    system = "You can call functions:\n" + json.dumps([WEATHER_TOOL["function"]])
    request = ChatRequest(
        model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": "Paris?"}]
    )
    g = generate(PROFILE, request, PARAMS)
    assert g.tool_calls == []
    assert "<｜tool▁calls▁begin｜>" in g.content and "get_weather" in g.content
    assert g.true_ids == truth_of(g.reasoning, g.content)


def test_tool_choice_none_gives_no_tool_call() -> None:
    g = generate(PROFILE, chat("weather?", tools=[WEATHER_TOOL], tool_choice="none"), PARAMS)
    assert g.tool_calls == [] and TOOL_CALLS_BEGIN not in g.true_ids
    assert g.finish_reason == "stop"


def test_truncate_fault_cuts_inside_the_reasoning() -> None:
    full = generate(PROFILE, chat(), PARAMS)
    g = generate(PROFILE, chat(), PARAMS, content_faults=["truncate"])
    assert g.finish_reason == "length"
    assert THINK_END not in g.true_ids and EOT not in g.true_ids
    assert 1 <= len(g.true_ids) < full.true_ids.index(THINK_END)
    assert g.true_ids == full.true_ids[: len(g.true_ids)]
    assert g.content == "" and g.reasoning == PROFILE.decode(g.true_ids)


def test_empty_reasoning_fault() -> None:
    g = generate(PROFILE, chat(), PARAMS, content_faults=["empty_reasoning"])
    assert g.reasoning == "" and g.content
    assert g.true_ids[0] == THINK_END
    assert g.reasoning_tokens == 0


def test_bad_usage_fault_is_far_off() -> None:
    g = generate(PROFILE, chat(), PARAMS, content_faults=["bad_usage"])
    assert g.completion_tokens - len(g.true_ids) >= BAD_USAGE_OFFSET
    assert g.true_ids == g.canonical_ids


def test_noncanonical_len_same_text_longer_ids() -> None:
    g = generate(PROFILE, chat(), PARAMS, content_faults=["noncanonical_len"])
    assert g.fallbacks == []
    assert PROFILE.decode(g.true_ids) == PROFILE.decode(g.canonical_ids)
    assert len(g.true_ids) == len(g.canonical_ids) + 1
    assert PROFILE.encode(PROFILE.decode(g.true_ids)) == g.canonical_ids != g.true_ids
    assert g.completion_tokens == len(g.true_ids)


@pytest.mark.parametrize("i", range(5))
def test_noncanonical_same_same_text_same_length_other_ids(i: int) -> None:
    g = generate(PROFILE, chat(f"same {i}"), PARAMS, content_faults=["noncanonical_same"])
    assert g.fallbacks == []
    assert PROFILE.decode(g.true_ids) == PROFILE.decode(g.canonical_ids)
    assert len(g.true_ids) == len(g.canonical_ids)
    assert g.true_ids != g.canonical_ids
    differing = [k for k, (a, b) in enumerate(zip(g.true_ids, g.canonical_ids, strict=True)) if a != b]
    # one adjacent pair (or, failing that, triple) re-split
    assert 2 <= len(differing) <= 3 and differing == list(range(differing[0], differing[0] + len(differing)))
    assert PROFILE.encode(PROFILE.decode(g.true_ids)) == g.canonical_ids


def test_noncanonical_same_on_a_short_number() -> None:
    # "1234" encodes as "123"+"4"; "12"+"34" is the same text at the same count.
    ids = PROFILE.encode("x 1234")
    changed = noncanonical_same_length(PROFILE, ids, random.Random(0))
    assert changed is not None and len(changed) == len(ids) and changed != ids
    assert PROFILE.decode(changed) == PROFILE.decode(ids)


def test_noncanonical_same_reports_when_impossible() -> None:
    rng = random.Random(0)
    assert noncanonical_same_length(PROFILE, [THINK_END, EOT], rng) is None
    assert noncanonical_split(PROFILE, [THINK_END, EOT], rng) is None
    one_byte = PROFILE.encode("a")
    assert noncanonical_split(PROFILE, one_byte, rng) is None


def test_content_faults_are_decided_by_prompt_hash() -> None:
    digest = prompt_digest(chat())
    all_on = dict.fromkeys(CONTENT_FAULTS, 1.0)
    assert choose_content_faults(digest, 0, all_on) == list(CONTENT_FAULTS)
    assert choose_content_faults(digest, 0, dict.fromkeys(CONTENT_FAULTS, 0.0)) == []
    half = {"truncate": 0.5}
    hits = [choose_content_faults(prompt_digest(chat(f"p{i}")), 0, half) for i in range(200)]
    again = [choose_content_faults(prompt_digest(chat(f"p{i}")), 0, half) for i in range(200)]
    assert hits == again
    assert 60 < sum(1 for h in hits if h) < 140


def test_transient_faults_come_from_the_seeded_rng() -> None:
    rates = {"429": 0.3, "5xx": 0.3}
    rng = random.Random(7)
    drawn = [choose_transient_fault(rng, rates) for _ in range(200)]
    assert set(drawn) == {"429", "5xx", None}
    assert 30 < drawn.count("429") < 90  # about 30% of 200
    assert choose_transient_fault(random.Random(1), {}) is None
    assert choose_transient_fault(random.Random(1), {"drop": 1.0}) == "drop"
    assert choose_transient_fault(random.Random(1), {"drop": 1.0, "429": 1.0}) == "429"  # first in order


def test_transient_sequence_is_reproducible() -> None:
    rates = {"429": 0.2, "timeout": 0.2}
    rng1, rng2 = random.Random(3), random.Random(3)
    assert [choose_transient_fault(rng1, rates) for _ in range(100)] == [
        choose_transient_fault(rng2, rates) for _ in range(100)
    ]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "x"}]}', "role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": {}}', "tools"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "content"),
    ],
)
def test_parse_request_refuses_bad_bodies(body: bytes, needle: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(body)
    assert info.value.status == 400 and needle in info.value.message


def test_parse_request_accepts_content_parts_and_fields() -> None:
    request = parse_request(
        json.dumps(
            {
                "model": "x/y",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
                "max_tokens": 12,
                "logprobs": True,
                "top_logprobs": 2,
                "provider": {"order": ["A"]},
                "reasoning": {"effort": "high"},
            }
        ).encode()
    )
    assert request.messages[0]["content"] == "ab"
    assert (request.model, request.max_tokens, request.logprobs, request.top_logprobs) == ("x/y", 12, True, 2)


def test_fault_header_parsing() -> None:
    assert parse_fault_header("429, truncate") == ["429", "truncate"]
    assert parse_fault_header(None) == []
    with pytest.raises(RequestError):
        parse_fault_header("429,nope")


def test_response_body_shape_and_logprobs() -> None:
    request = chat(top_logprobs=1)
    g = generate(PROFILE, request, PARAMS, content_faults=["noncanonical_same"], prompt_tokens=9)
    body = build_response_body(
        PROFILE,
        g,
        request,
        PARAMS,
        provider="SimProvider",
        response_id="gen-1",
        created=1,
        logprobs=True,
        debug_true_ids=True,
    )
    choice = body["choices"][0]
    assert body["provider"] == "SimProvider" and body["model"] == "deepseek/deepseek-v3"
    assert choice["message"]["reasoning"] == g.reasoning and choice["message"]["content"] == g.content
    assert choice["finish_reason"] == choice["native_finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == len(g.true_ids) and usage["prompt_tokens"] == 9
    assert usage["cost"] == pytest.approx(len(g.true_ids) * PARAMS.price_per_token)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == g.reasoning_tokens
    assert body["debug_true_ids"] == g.true_ids
    tokens = choice["logprobs"]["content"]
    assert len(tokens) == len(g.true_ids)
    assert [bytes(t["bytes"]) for t in tokens] == [PROFILE.token_bytes(i) for i in g.true_ids]
    assert [PROFILE.id_of_bytes(bytes(t["bytes"])) for t in tokens] == g.true_ids  # logprobs reveal the split
    assert tokens[-1]["token"] == "<｜end▁of▁sentence｜>" and all(t["logprob"] <= 0 for t in tokens)
    assert len(tokens[0]["top_logprobs"]) == 1


@settings(max_examples=25, deadline=None)
@given(
    text=st.text(min_size=1, max_size=80),
    seed=st.integers(min_value=0, max_value=2**31),
    tools=st.booleans(),
    fault=st.sampled_from(["", "noncanonical_len", "noncanonical_same"]),
)
def test_property_text_fields_rebuild_the_canonical_ids(
    text: str, seed: int, tools: bool, fault: str
) -> None:
    request = chat(text, tools=[WEATHER_TOOL] if tools else None)
    g = generate(PROFILE, request, replace(PARAMS, seed=seed), content_faults=[fault] if fault else [])
    assert truth_of(g.reasoning, g.content, g.tool_calls) == g.canonical_ids
    assert PROFILE.decode(g.true_ids) == PROFILE.decode(g.canonical_ids)
    assert (g.true_ids == g.canonical_ids) == (not fault or bool(g.fallbacks))


def test_other_profiles_work_too() -> None:
    qwen = load_profile("qwen3")
    g = generate(qwen, chat("weather?", tools=[WEATHER_TOOL]), PARAMS, content_faults=["noncanonical_same"])
    rebuilt = qwen.encode(
        qwen.render_output(reasoning=g.reasoning, content=g.content, tool_calls=g.tool_calls)
    )
    assert rebuilt == g.canonical_ids != g.true_ids
    assert len(g.true_ids) == len(rebuilt) and qwen.decode(g.true_ids) == qwen.decode(rebuilt)
    assert g.true_ids[-1] == qwen.end_of_turn_id and g.tool_calls
