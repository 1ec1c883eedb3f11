"""A row's tools reach the model exactly once, by a route the run names before paying.

The truth for "as the template writes them" is the OFFICIAL chat template in ``../shared/reference``
(rendered with Hugging Face semantics by ``tests/conformance/truth.py``), never our renderer: the
messages we send with the tools written into the system text must render, by the official
template and without tools, to the very text it renders from the row with its tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schemas import Message, PromptPublished
from services.common.config import ConfigError, DatasetSettings, Settings, load_settings
from services.inference.adapters.providers import make_provider
from services.inference.tool_route import (
    PARSED_ADVICE,
    can_write_in_text,
    dataset_route,
    prompt_route,
    route_line,
)
from services.profiles import load_profile, profile_spec
from services.profiles.tooltext import tools_in_system_text
from services.publish.core import NormaliseOptions, normalise
from tests.conformance import truth as T
from tests.conformance.truth_formats import _SPECS

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
ROWS = (
    [Message(role="user", content="Weather in Oslo, and the time?")],
    [Message(role="system", content="Answer in French."), Message(role="user", content="Weather in Oslo?")],
)


def official(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The official template of ``model`` over ``messages`` as a server renders them (the profile's kwargs)."""
    spec = _SPECS[model]
    return T.render_template(T.template_source(spec.template), T.server_messages(model, messages), tools=tools,
                             add_generation_prompt=True, bos_token=spec.bos, eos_token=spec.eos,
                             **profile_spec(model).render_kwargs())  # fmt: skip


def wire(messages: list[Message]) -> list[dict[str, Any]]:
    return PromptPublished(dataset="d", sample_id="s", messages=messages).wire


@pytest.mark.parametrize("model", ["qwen3", "qwen3-thinking-2507", "deepseek-v3.1", "deepseek-r1"])
@pytest.mark.parametrize("row", range(len(ROWS)))
def test_tools_written_in_system_text_render_as_the_official_template_renders_them(model: str, row: int) -> None:
    profile = load_profile(model)
    messages = ROWS[row]
    written = tools_in_system_text(lambda m, t: profile.render_prompt(m, t), messages, TOOLS)
    assert written is not None
    assert official(model, wire(written), None) == official(model, wire(messages), TOOLS)
    if "# Tools" in official(model, wire(messages), TOOLS):  # Qwen: the block is in the text, once
        assert official(model, wire(written), None).count("# Tools") == 1


def test_a_template_that_declares_tools_in_a_turn_of_their_own_cannot_write_them_in_system_text() -> None:
    """Kimi-K2 renders tools as a ``tool_declare`` turn: no system text says that (the official template)."""
    spec = _SPECS["kimi-k2-thinking"]

    def render(messages: Any, tools: Any) -> str:
        return T.render_template(T.template_source(spec.template), wire(list(messages)), tools=tools,
                                 add_generation_prompt=True, bos_token=spec.bos, eos_token=spec.eos)  # fmt: skip

    assert "tool_declare" in render(ROWS[0], TOOLS)
    assert tools_in_system_text(render, ROWS[0], TOOLS) is None
    assert not can_write_in_text(render)
    settings = Settings(datasets={"k": DatasetSettings(profile="kimi-k2-thinking")})
    line = route_line(settings, "k", in_text=False)
    assert "tools parameter" in line and 'use mode = "completions"' in line and "no raw tool text" in line
    assert PARSED_ADVICE not in line  # raw tool text is no way out for this template


@pytest.mark.parametrize(
    ("provider", "section", "route"),
    [
        ({}, {}, "prompt_text"),
        ({}, {"tool_route": "parameter"}, "parameter"),
        ({}, {"send_tools": True}, "parameter"),  # an old config keeps its meaning
        ({}, {"send_tools": True, "tool_route": "prompt"}, "prompt_text"),
        ({}, {"send_tools": False}, "prompt_text"),  # no longer leaves the tools out
        ({}, {"mode": "completions", "tool_route": "parameter"}, "rendered"),
        ({"mode": "completions"}, {}, "rendered"),
        ({"kind": "sglang"}, {"tool_route": "parameter"}, "rendered"),
    ],
)
def test_the_route_follows_mode_provider_and_setting(
    provider: dict[str, Any], section: dict[str, Any], route: str
) -> None:
    settings = load_settings(None, provider=provider, datasets={"t": section})
    dataset = settings.dataset("t")
    assert dataset_route(settings, dataset, in_text=True) == route
    line = route_line(settings, "t", in_text=True)
    assert (PARSED_ADVICE in line) == (route == "parameter"), line
    assert ("send_tools" in line) == ("send_tools" in section), line


def test_an_old_send_tools_true_is_shown_as_the_tools_parameter_with_its_origin(tmp_path: Path) -> None:
    config = tmp_path / "old.toml"
    config.write_text("[defaults]\nsend_tools = true\n[datasets.a]\n[datasets.b]\nsend_tools = false\n")
    settings = load_settings(config)
    assert settings.dataset("a").tool_route == "parameter"
    assert settings.dataset_origins("a")["tool_route"] == ("parameter", "defaults")
    assert settings.dataset("b").tool_route == "prompt"  # b's own false wins over [defaults]
    assert 'read as tool_route = "parameter"' in route_line(settings, "a", in_text=True)
    assert "no longer leaves a row's tools out" in route_line(settings, "b", in_text=True)
    config.write_text('[defaults]\ntool_route = "server"\n')
    with pytest.raises(ConfigError, match="tool_route"):
        load_settings(config)


GLAIVE_SYSTEM = "SYSTEM: You may use these functions -\n" + json.dumps(TOOLS[0]["function"], indent=4)


@pytest.mark.parametrize("section", [{}, {"tool_route": "parameter"}, {"send_tools": True}])
def test_a_row_whose_system_text_carries_its_functions_gets_them_once(section: dict[str, Any]) -> None:
    """Glaive style: the functions are in the row's own text; neither the tools parameter nor the text again."""
    glaive_row = {"messages": [{"role": "system", "content": GLAIVE_SYSTEM}, {"role": "user", "content": "Oslo?"}]}
    glaive = normalise(glaive_row, NormaliseOptions(dataset="t"))
    # Every function described: a server's request model renders no null field (tests/conformance/engines.py).
    fielded = normalise({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS[:1]},
                        NormaliseOptions(dataset="t"))  # fmt: skip
    assert glaive.tools and glaive.tools_in_text and fielded.tools and not fielded.tools_in_text
    settings = load_settings(None, provider={"kind": "simulator", "base_url": "http://sim.test/v1"},
                             datasets={"t": section})  # fmt: skip
    dataset = settings.dataset("t")
    provider = make_provider(settings, client=None)  # type: ignore[arg-type] - no request is sent
    assert prompt_route(settings, dataset, glaive) == "own_text"
    body = provider.request_identity(glaive, dataset, max_tokens=8)["body"]
    assert body["messages"] == glaive.wire and "tools" not in body
    assert provider.tools_sent(glaive, dataset) is False  # reconstruct renders no second block
    body = provider.request_identity(fielded, dataset, max_tokens=8)["body"]
    sent = official("qwen3", body["messages"], body.get("tools"))
    assert sent == official("qwen3", fielded.wire, TOOLS[:1]) and sent.count("# Tools") == 1
    assert ("tools" in body) == (dataset.tool_route == "parameter")


# A template that declares tools in a turn of their own (as Kimi's does), on the Qwen3 vocabulary.
OWN_TURN_TEMPLATE = (
    "{%- if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_cannot_write_its_tools_in_text_sends_the_parameter_and_says_so() -> None:
    """The tools still reach the model once (the parameter), and the route line says why it is not raw text."""
    settings = load_settings(None, provider={"kind": "simulator", "base_url": "http://sim.test/v1"},
                             profiles={"own-turn": {"base": "qwen3", "chat_template": OWN_TURN_TEMPLATE}},
                             datasets={"t": {"profile": "own-turn"}})  # fmt: skip
    profile = load_profile("own-turn", settings)
    assert not can_write_in_text(lambda m, t: profile.render_prompt(m, t))
    prompt = PromptPublished(dataset="t", sample_id="s", messages=list(ROWS[0]), tools=TOOLS)
    provider = make_provider(settings, client=None)  # type: ignore[arg-type] - no request is sent
    body = provider.request_identity(prompt, settings.dataset("t"), max_tokens=8)["body"]
    assert body["tools"] == TOOLS and body["messages"] == prompt.wire
    line = route_line(settings, "t", in_text=False, ahead=True)
    assert line.startswith("tools of dataset t, where a row offers them: the server's tools parameter")
    assert "profile own-turn cannot write its tool block in system text: no raw tool text" in line


@pytest.mark.parametrize(
    ("profile", "provider", "lost"),
    [
        ("deepseek-v4", {"kind": "openai"}, True),  # vLLM 0.33's deepseek_v4 pair drops the DSML block
        ("deepseek-v4", {"kind": "simulator"}, True),  # judged under the vllm convention too
        ("qwen3", {"kind": "openai"}, False),  # hermes leaves the block alone without a tools parameter
        ("deepseek-v4", {"kind": "openai", "convention": "sglang"}, False),  # a server declared otherwise
        ("deepseek-v4", {"kind": "openai", "mode": "completions"}, False),  # rendered by us: raw text back
    ],
)
def test_raw_tool_text_is_provable_only_where_the_server_keeps_the_block(
    profile: str, provider: dict[str, Any], lost: bool
) -> None:
    """The pre-flight, estimate and probe lines (route_line, rows_lines) promise "provable" for raw tool text only
    where the convention keeps the profile's block in the content (tests/conformance/test_raw_tool_text.py runs
    vLLM's deepseek_v4 pair over a DSML answer sent without tools: the block is gone)."""
    from services.inference.tool_route import provable, rows_lines

    settings = load_settings(None, provider={"base_url": "http://engine.test/v1", **provider},
                             datasets={"t": {"profile": profile}})  # fmt: skip
    dataset = settings.dataset("t")
    route = dataset_route(settings, dataset, in_text=True)
    lines = rows_lines(settings, "t", in_text=True, fielded=3, own_text=2)
    assert len(lines) == 2 and route == ("rendered" if "mode" in provider else "prompt_text")
    for line, sound in lines:
        assert sound is not lost, line
        assert ("provable" in line.replace("cannot be proven", "")) is not lost, line
        if lost:
            assert 'cannot be proven through this server' in line and 'use mode = "completions"' in line, line
            assert "profile deepseek-v4: vllm servers' parsers take a dsml tool block out" in line, line
    assert provable(settings, dataset, "own_text") is not lost
    assert route_line(settings, "t", in_text=True) in lines[0][0]
