"""The simulator's pure core: raw model output, true ids, the emulated server parse, faults.

Truth comes from outside the code under test: the format of each model's raw output is
spelled out here (and checked against the official chat templates in
``../shared/reference/chat-templates`` rendered by transformers), the special ids are the
ones the models' tokenizer files give (``../shared/reference/TOKENS.md``), and the parsed
fields are checked by putting the specials a server strips back by hand.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.simulator.core import BAD_USAGE_OFFSET, build_response_body, generate, usage_counts
from services.simulator.faults import (
    CONTENT_FAULTS,
    choose_content_faults,
    choose_transient_fault,
    parse_fault_header,
    prompt_digest,
)
from services.simulator.noncanonical import noncanonical_same_length, noncanonical_split
from services.simulator.request import ChatRequest, RequestError, parse_request
from tests.official import hf_render, official_template
from tests.unit.simulator_cases import (
    EOT,
    LEGACY,
    PARAMS,
    PROFILE,
    QWEN3_RAW,
    THINK_END,
    THINK_START,
    TOOL_CALL,
    WEATHER_TOOL,
    chat,
    qwen_call_text,
)

# -- the raw output and the true ids ----------------------------------------------------


def test_generation_is_deterministic_per_prompt_and_seed() -> None:
    a = generate(PROFILE, chat(), PARAMS)
    b = generate(PROFILE, chat(), PARAMS)
    other_prompt = generate(PROFILE, chat("Tell me about owls."), PARAMS)
    other_seed = generate(PROFILE, chat(), replace(PARAMS, seed=1))
    assert (a.reasoning, a.content, a.true_ids, a.raw_text) == (b.reasoning, b.content, b.true_ids, b.raw_text)
    assert a.true_ids != other_prompt.true_ids
    assert a.true_ids != other_seed.true_ids
    assert prompt_digest(chat()) == prompt_digest(chat())
    assert prompt_digest(chat()) != prompt_digest(chat(tools=[WEATHER_TOOL]))


@pytest.mark.parametrize("i", range(6))
def test_raw_text_is_qwen3s_format_and_encodes_to_the_true_ids(i: int) -> None:
    g = generate(PROFILE, chat(f"question number {i}"), PARAMS)
    m = QWEN3_RAW.fullmatch(g.raw_text)
    assert m is not None and m["r"] and m["c"] and m["tool"] is None, g.raw_text
    assert g.think_block == "model"  # Qwen3 hybrid: the model opens the think block itself
    assert g.true_ids == PROFILE.encode(g.raw_text) == g.canonical_ids
    assert PROFILE.decode(g.true_ids) == g.raw_text
    assert g.true_ids[0] == THINK_START and g.true_ids.count(THINK_END) == 1 and g.true_ids[-1] == EOT
    assert g.finish_reason == "stop"


@pytest.mark.parametrize("i", range(4))
def test_vllm_fields_put_back_together_are_the_raw_text(i: int) -> None:
    """vLLM drops the leading <think>, splits at </think>, strips nothing; the EOS is not decoded."""
    g = generate(PROFILE, chat(f"fields {i}"), PARAMS)
    assert "<think>" + g.reasoning + "</think>" + g.content + "<|im_end|>" == g.raw_text
    assert g.reasoning.startswith("\n") and g.reasoning.endswith("\n")  # newlines of the think block kept
    assert g.content.startswith("\n\n")


def test_raw_text_is_the_assistant_turn_of_the_official_qwen3_template() -> None:
    template = official_template("Qwen-Qwen3-0.6B.jinja")
    for tools in (None, [WEATHER_TOOL]):
        request = chat("Weather in Oslo?", tools=tools)
        g = generate(PROFILE, request, PARAMS)
        m = QWEN3_RAW.fullmatch(g.raw_text)
        assert m is not None
        turn: dict[str, Any] = {"role": "assistant", "content": m["c"], "reasoning_content": m["r"]}
        if tools:
            args = json.loads(m["tool"].split('"arguments": ', 1)[1].rsplit("}\n</tool_call>", 1)[0])
            turn["tool_calls"] = [{"type": "function", "function": {"name": "get_weather", "arguments": args}}]
        prompt = hf_render(template, request.messages, generation=True, tools=tools)
        history = hf_render(template, [*request.messages, turn], generation=False, tools=tools)
        assert history == prompt + g.raw_text + "\n"


def test_lengths_follow_the_configured_ranges() -> None:
    params = replace(PARAMS, reasoning_tokens=(50, 60), content_tokens=(10, 20))
    for i in range(8):
        g = generate(PROFILE, chat(f"len {i}"), params)
        m = QWEN3_RAW.fullmatch(g.raw_text)
        assert m is not None
        assert 45 <= len(PROFILE.encode(m["r"])) <= 60
        assert 8 <= len(PROFILE.encode(m["c"])) <= 20


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
    assert g.reasoning_tokens == g.true_ids.index(THINK_END)
    assert usage_counts(PROFILE, g.true_ids, params) == (g.completion_tokens, g.reasoning_tokens)


def test_usage_of_an_answer_without_a_think_block() -> None:
    ids = PROFILE.encode("Just an answer.<|im_end|>")
    assert usage_counts(PROFILE, ids, PARAMS, thinking=False) == (len(ids), 0)
    assert usage_counts(PROFILE, ids[:2], PARAMS, thinking=True) == (2, 2)  # cut inside the reasoning


def test_prompt_tokens_are_the_prompt_as_a_server_tokenizes_it() -> None:
    template = official_template("Qwen-Qwen3-0.6B.jinja")
    request = chat("Déjà vu: count Ω and Ω.")
    official = hf_render(template, request.messages, generation=True)
    g = generate(PROFILE, request, PARAMS, prompt_text=official)
    assert g.prompt_ids == PROFILE.encode_prompt(official) and g.prompt_tokens == len(g.prompt_ids)


# -- truncation ---------------------------------------------------------------------------


def test_max_tokens_truncates_to_length() -> None:
    full = generate(PROFILE, chat(), PARAMS)
    limit = len(full.true_ids) - 5
    g = generate(PROFILE, chat(max_tokens=limit), PARAMS)
    assert g.finish_reason == "length"
    assert g.true_ids == full.true_ids[:limit]
    assert g.completion_tokens == limit
    assert EOT not in g.true_ids
    assert "<think>" + g.reasoning + "</think>" + g.content == PROFILE.decode(g.true_ids)
    roomy = generate(PROFILE, chat(max_tokens=len(full.true_ids)), PARAMS)
    assert roomy.finish_reason == "stop" and roomy.true_ids == full.true_ids


def test_truncate_fault_cuts_inside_the_reasoning() -> None:
    full = generate(PROFILE, chat(), PARAMS)
    g = generate(PROFILE, chat(), PARAMS, content_faults=["truncate"])
    assert g.finish_reason == "length"
    assert THINK_END not in g.true_ids and EOT not in g.true_ids
    assert 2 <= len(g.true_ids) < full.true_ids.index(THINK_END)
    assert g.true_ids == full.true_ids[: len(g.true_ids)]
    # No think-end: everything after the model's <think> is reasoning, no content.
    assert g.content == "" and "<think>" + g.reasoning == PROFILE.decode(g.true_ids) and g.reasoning
    assert g.reasoning_tokens == len(g.true_ids)


# -- tools ----------------------------------------------------------------------------------


def test_structured_tool_calls_when_tools_are_sent() -> None:
    g = generate(PROFILE, chat("weather in Paris?", tools=[WEATHER_TOOL]), PARAMS)
    assert g.finish_reason == "tool_calls"
    assert len(g.tool_calls) == 1
    call = g.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and isinstance(args["days"], int)
    assert "<tool_call>" not in g.content and TOOL_CALL in g.true_ids
    # vLLM's hermes parser: content is the text before <tool_call>, arguments re-serialised.
    rebuilt = "<think>" + g.reasoning + "</think>" + g.content + qwen_call_text("get_weather", call.function.arguments)
    assert rebuilt + "<|im_end|>" == g.raw_text
    assert call.function.arguments == json.dumps(args, ensure_ascii=False)


def test_parallel_tool_calls_call_every_offered_tool_in_order() -> None:
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    params = replace(PARAMS, parallel_tool_calls=True)
    g = generate(PROFILE, chat("weather and time?", tools=[WEATHER_TOOL, time_tool]), params)
    assert [c.function.name for c in g.tool_calls] == ["get_weather", "get_time"]
    m = QWEN3_RAW.fullmatch(g.raw_text)
    assert m is not None and m["tool"] == "\n" + "\n".join(
        qwen_call_text(c.function.name, c.function.arguments) for c in g.tool_calls
    )  # "\n"-joined, as the template
    assert g.true_ids.count(TOOL_CALL) == 2
    one = generate(PROFILE, chat("weather and time?", tools=[WEATHER_TOOL, time_tool]), PARAMS)
    assert len(one.tool_calls) == 1  # by default one tool, drawn at random


def test_native_tool_call_text_in_content_without_tools_param() -> None:
    system = "You can call functions:\n" + json.dumps([WEATHER_TOOL["function"]])
    request = ChatRequest(
        model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": "Paris?"}]
    )
    g = generate(PROFILE, request, PARAMS)
    assert g.tool_calls == [] and g.finish_reason == "stop"
    assert "<tool_call>" in g.content and "get_weather" in g.content
    assert "<think>" + g.reasoning + "</think>" + g.content + "<|im_end|>" == g.raw_text


def test_tool_choice_none_gives_no_tool_call() -> None:
    g = generate(PROFILE, chat("weather?", tools=[WEATHER_TOOL], tool_choice="none"), PARAMS)
    assert g.tool_calls == [] and TOOL_CALL not in g.true_ids
    assert g.finish_reason == "stop"


# -- the sglang-legacy parse -------------------------------------------------------------


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_sglang_legacy_strips_reasoning_and_content(tools: Any) -> None:
    vllm = generate(PROFILE, chat("strip me", tools=tools), PARAMS)
    legacy = generate(PROFILE, chat("strip me", tools=tools), LEGACY)
    assert legacy.true_ids == vllm.true_ids and legacy.raw_text == vllm.raw_text  # same model, other server
    m = QWEN3_RAW.fullmatch(legacy.raw_text)
    assert m is not None
    assert legacy.reasoning == m["r"].strip() and legacy.content == m["c"].strip()
    assert legacy.reasoning != vllm.reasoning and legacy.content != vllm.content  # the newlines are gone
    assert [c.function.arguments for c in legacy.tool_calls] == [c.function.arguments for c in vllm.tool_calls]


# -- content faults -------------------------------------------------------------------------


def test_empty_reasoning_fault() -> None:
    g = generate(PROFILE, chat(), PARAMS, content_faults=["empty_reasoning"])
    # Qwen3 writes an empty think block as "<think>\n\n</think>\n\n"; vLLM keeps the newlines.
    assert g.raw_text.startswith("<think>\n\n</think>\n\n")
    assert g.reasoning == "\n\n" and g.content.startswith("\n\n")
    assert g.true_ids[:3] == [THINK_START, *PROFILE.encode("\n\n"), THINK_END]
    assert g.reasoning_tokens == 2
    legacy = generate(PROFILE, chat(), LEGACY, content_faults=["empty_reasoning"])
    assert legacy.reasoning == ""


def test_bad_usage_fault_is_far_off() -> None:
    g = generate(PROFILE, chat(), PARAMS, content_faults=["bad_usage"])
    assert g.completion_tokens - len(g.true_ids) >= BAD_USAGE_OFFSET
    assert g.true_ids == g.canonical_ids


def test_noncanonical_len_same_text_longer_ids() -> None:
    g = generate(PROFILE, chat(), PARAMS, content_faults=["noncanonical_len"])
    assert g.fallbacks == []
    assert PROFILE.decode(g.true_ids) == PROFILE.decode(g.canonical_ids) == g.raw_text
    assert len(g.true_ids) == len(g.canonical_ids) + 1
    assert PROFILE.encode(PROFILE.decode(g.true_ids)) == g.canonical_ids != g.true_ids
    assert g.completion_tokens == len(g.true_ids)


@pytest.mark.parametrize("i", range(5))
def test_noncanonical_same_same_text_same_length_other_ids(i: int) -> None:
    g = generate(PROFILE, chat(f"same {i}"), PARAMS, content_faults=["noncanonical_same"])
    assert g.fallbacks == []
    assert PROFILE.decode(g.true_ids) == PROFILE.decode(g.canonical_ids) == g.raw_text
    assert len(g.true_ids) == len(g.canonical_ids)
    assert g.true_ids != g.canonical_ids
    differing = [k for k, (a, b) in enumerate(zip(g.true_ids, g.canonical_ids, strict=True)) if a != b]
    # one adjacent pair (or, failing that, triple) re-split
    assert 2 <= len(differing) <= 3 and differing == list(range(differing[0], differing[0] + len(differing)))
    assert PROFILE.encode(PROFILE.decode(g.true_ids)) == g.canonical_ids


def test_noncanonical_same_on_a_short_word() -> None:
    # " abc"+"def" is the same text, at the same count, as " "+"abcdef".
    ids = PROFILE.encode("x abcdef")
    changed = noncanonical_same_length(PROFILE, ids, random.Random(0))
    assert changed is not None and len(changed) == len(ids) and changed != ids
    assert PROFILE.decode(changed) == PROFILE.decode(ids)


def test_noncanonical_same_reports_when_impossible() -> None:
    rng = random.Random(0)
    assert noncanonical_same_length(PROFILE, [THINK_END, EOT], rng) is None
    assert noncanonical_split(PROFILE, [THINK_START, THINK_END, EOT], rng) is None
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


# -- requests and bodies --------------------------------------------------------------------


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
        (b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}', "chat_template_kwargs"),
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
                "chat_template_kwargs": {"enable_thinking": False},
                "return_token_ids": True,
            }
        ).encode()
    )
    assert request.messages[0]["content"] == "ab"
    assert (request.model, request.max_tokens, request.logprobs, request.top_logprobs) == ("x/y", 12, True, 2)
    assert request.chat_template_kwargs == {"enable_thinking": False} and request.return_token_ids
    plain = parse_request(b'{"messages": [{"role": "user", "content": "x"}]}')
    assert plain.chat_template_kwargs is None and not plain.return_token_ids


def test_fault_header_parsing() -> None:
    assert parse_fault_header("429, truncate") == ["429", "truncate"]
    assert parse_fault_header(None) == []
    with pytest.raises(RequestError):
        parse_fault_header("429,nope")


def test_response_body_shape_logprobs_and_token_ids() -> None:
    template = official_template("Qwen-Qwen3-0.6B.jinja")
    request = chat(top_logprobs=1, return_token_ids=True)
    official = hf_render(template, request.messages, generation=True)
    g = generate(PROFILE, request, PARAMS, content_faults=["noncanonical_same"], prompt_text=official)
    body = build_response_body(
        PROFILE,
        g,
        request,
        PARAMS,
        provider="SimProvider",
        response_id="gen-1",
        created=1,
        logprobs=True,
    )
    choice = body["choices"][0]
    assert body["provider"] == "SimProvider" and body["model"] == "qwen/qwen3"
    assert choice["message"]["reasoning"] == g.reasoning and choice["message"]["content"] == g.content
    assert choice["finish_reason"] == choice["native_finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == len(g.true_ids)
    assert usage["prompt_tokens"] == len(PROFILE.encode_prompt(official))
    assert usage["cost"] == pytest.approx(len(g.true_ids) * PARAMS.price_per_token)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == g.reasoning_tokens
    assert choice["token_ids"] == g.true_ids  # vLLM's return_token_ids
    # An OpenRouter/vLLM body and nothing more: the truth is served apart (GET /_sim/truth).
    assert set(body) == {"id", "provider", "model", "object", "created", "choices", "usage", "prompt_token_ids"}
    assert body["prompt_token_ids"] == PROFILE.encode_prompt(official)
    tokens = choice["logprobs"]["content"]
    assert len(tokens) == len(g.true_ids)
    assert [bytes(t["bytes"]) for t in tokens] == [PROFILE.token_bytes(i) for i in g.true_ids]
    assert [PROFILE.id_of_bytes(bytes(t["bytes"])) for t in tokens] == g.true_ids  # logprobs reveal the split
    assert tokens[-1]["token"] == "<|im_end|>" and all(t["logprob"] <= 0 for t in tokens)
    assert len(tokens[0]["top_logprobs"]) == 1
    without = build_response_body(PROFILE, g, chat(), PARAMS, provider="P", response_id="r", created=1, logprobs=False)
    assert "token_ids" not in without["choices"][0] and "prompt_token_ids" not in without
    assert without["choices"][0]["logprobs"] is None


@settings(max_examples=25, deadline=None)
@given(
    text=st.text(min_size=1, max_size=80),
    seed=st.integers(min_value=0, max_value=2**31),
    tools=st.booleans(),
    fault=st.sampled_from(["", "noncanonical_len", "noncanonical_same"]),
)
def test_property_fields_and_raw_text_agree(text: str, seed: int, tools: bool, fault: str) -> None:
    request = chat(text, tools=[WEATHER_TOOL] if tools else None)
    g = generate(PROFILE, request, replace(PARAMS, seed=seed), content_faults=[fault] if fault else [])
    assert PROFILE.encode(g.raw_text) == g.canonical_ids
    assert PROFILE.decode(g.true_ids) == PROFILE.decode(g.canonical_ids) == g.raw_text
    assert (g.true_ids == g.canonical_ids) == (not fault or bool(g.fallbacks))
    calls = "".join(qwen_call_text(c.function.name, c.function.arguments) for c in g.tool_calls)
    assert "<think>" + g.reasoning + "</think>" + g.content + calls + "<|im_end|>" == g.raw_text
