"""The completions-mode splitter against the official templates and real tokenizers.

Truth from outside the code under test: the raw outputs of ``tests/conformance/truth.py`` are
written from each OFFICIAL chat template's assistant turn (``../shared/reference``), with the
reasoning, content and tool calls (exact argument text, Kimi's own ids) they were built from, and
the real tokenizers. Checked per family (Qwen3 hybrid, Qwen3-2507, DeepSeek-R1, DeepSeek-V3.1,
Kimi-K2-Thinking):

- every answer that stopped by itself splits into exactly the parts it was written from;
- an answer cut inside its think block, or with text after its tool block, does not split;
- where the official template is append-only (a Qwen3 thinking / Kimi turn with tool calls,
  followed by its tool results), the template's render of the split message reproduces the model's raw text: the
  next prompt's ids begin with the previous prompt's ids and the output's;
- malformed blocks, calls to functions not offered, and DSML (DeepSeek-V4's encoding_dsv4 format).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.profiles import BUILTIN_SPECS
from services.profiles.split import (
    THINK_UNCLOSED,
    TOOL_BLOCK_MALFORMED,
    TOOL_NOT_OFFERED,
    OutputFormat,
    SplitError,
    offered_tool_names,
    prompt_state,
    split_output,
)
from tests.conformance import truth as T

MODELS = ("qwen3", "qwen3-thinking-2507", "deepseek-r1", "deepseek-v3.1", "kimi-k2-thinking")
N_CASES = 48


def fmt_of(model: str) -> OutputFormat:
    """Our built-in profile's output format for a truth model (the profiles share the truth's names)."""
    return OutputFormat.of(BUILTIN_SPECS[model])


def split_case(case: T.Case) -> Any:
    conv = case.conversation
    offered = offered_tool_names(conv.tools) if conv.tools_sent else frozenset()
    fmt = fmt_of(case.model)
    return split_output(case.raw_output, fmt, state=prompt_state(fmt, case.prompt_text), offered=offered)


def written_parts(case: T.Case) -> tuple[str, str, list[tuple[str, str, str]]]:
    """(reasoning, content, calls) the raw output was written from, without the format's separators."""
    spec, gen = T._SPECS[case.model], case.conversation.generation
    reasoning = ""
    content = gen.content
    if gen.reasoning is not None:
        reasoning = gen.reasoning.removeprefix(spec.r_wrap[0]).removesuffix(spec.r_wrap[1])
        content = content.removeprefix(spec.c_pre)
    if gen.calls and spec.tools == "hermes" and content:
        content = content.removesuffix("\n")  # the template's separator before the first <tool_call>
    return reasoning, content, [(c.name, c.arguments, c.id) for c in gen.calls]


@pytest.mark.parametrize("model", MODELS)
def test_every_stopped_answer_splits_into_the_parts_it_was_written_from(model: str) -> None:
    cases = [c for c in T.build_cases(model, N_CASES) if c.finished and not c.conversation.generation.tail]
    with_calls = parallel = 0
    for case in cases:
        got = split_case(case)
        reasoning, content, calls = written_parts(case)
        assert (got.reasoning, got.content) == (reasoning, content), case.conversation.name
        assert [(c.function.name, c.function.arguments) for c in got.tool_calls] == [(n, a) for n, a, _ in calls]
        if model == "kimi-k2-thinking":  # the model writes its own call ids
            assert [c.id for c in got.tool_calls] == [i for _, _, i in calls]
        with_calls += bool(calls)
        parallel += len(calls) > 1
    assert len(cases) >= N_CASES // 2
    if model != "deepseek-r1":  # the R1 truth sends no tools in its shapes that answer with calls
        assert with_calls and parallel, (model, with_calls, parallel)


@pytest.mark.parametrize("model", MODELS)
def test_an_answer_cut_in_its_reasoning_or_with_text_after_its_tools_does_not_split(model: str) -> None:
    refused = 0
    for case in T.build_cases(model, N_CASES):
        feats, gen = case.conversation.features, case.conversation.generation
        if "truncated_in_reasoning" in feats:
            expected = THINK_UNCLOSED
        elif gen.tail and case.finished:
            expected = TOOL_BLOCK_MALFORMED
        else:
            continue
        with pytest.raises(SplitError) as err:
            split_case(case)
        assert err.value.reason == expected, case.conversation.name
        refused += 1
    assert refused, model


def _next_prompt(case: T.Case, got: Any) -> tuple[str, list[int]]:
    """The official render of the history with the split answer and its tool results, and its ids."""
    conv = case.conversation
    calls = [{"id": c.id or f"call_{i}", "type": "function",
              "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for i, c in enumerate(got.tool_calls)]  # fmt: skip
    answer: dict[str, Any] = {"role": "assistant", "content": got.content, "tool_calls": calls}
    if got.reasoning:
        answer["reasoning_content"] = got.reasoning
    results = [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"ok": True})} for c in calls]
    spec = T._SPECS[case.model]
    text = T.render_template(
        T._template_text(case.model), T.server_messages(case.model, [*conv.messages, answer, *results]),
        tools=conv.tools if conv.tools_sent else None, add_generation_prompt=True,
        bos_token=spec.bos, eos_token=spec.eos, **conv.kwargs,
    )  # fmt: skip
    return text, T.truth_tokenizer(case.model).encode_prompt(text)


def _edges_plain(*texts: str) -> bool:
    # The Qwen3 template strips newlines at the edges of reasoning and content: where the model
    # wrote some, no message renders its text back.
    return all(t == t.strip("\n") for t in texts)


@pytest.mark.parametrize("model", ["qwen3", "kimi-k2-thinking"])
def test_where_the_template_appends_the_next_prompt_extends_the_answer(model: str) -> None:
    checked = same_ids = 0
    for case in T.build_cases(model, 8 * N_CASES):
        gen = case.conversation.generation
        if not (case.finished and gen.calls and not gen.tail):
            continue
        got = split_case(case)
        feats = case.conversation.features
        # Qwen3 with thinking off: the template writes no empty think block for a turn with tool
        # calls that is not the last, so the prompt's "<think>\n\n</think>\n\n" is not kept.
        if model == "qwen3" and not (case.conversation.thinking and _edges_plain(got.reasoning, got.content)):
            continue
        # A server hands the template the arguments as an object (re-serialised: compact or ASCII-escaped
        # JSON comes back canonical).
        if "args_noncanonical" in feats:
            continue
        text, ids = _next_prompt(case, got)
        assert text.startswith(case.prompt_text + case.raw_output), case.conversation.name
        checked += 1
        if "non_nfc_output" not in feats:  # Qwen's tokenizer NFC-normalises a prompt, not an output
            assert ids[: len(case.input_ids)] == case.input_ids, case.conversation.name
            same_ids += 1
    assert checked >= 5 and same_ids >= 1, (checked, same_ids)


@pytest.mark.parametrize("model", ["deepseek-r1", "deepseek-v3.1"])
def test_where_the_template_drops_reasoning_the_next_prompt_does_not_extend(model: str) -> None:
    checked = 0
    for case in T.build_cases(model, N_CASES):
        gen = case.conversation.generation
        if not (case.finished and gen.reasoning and gen.reasoning.strip() and not gen.calls):
            continue
        got = split_case(case)
        assert got.reasoning
        _, ids = _next_prompt(case, got)
        assert ids[: len(case.input_ids)] != case.input_ids, case.conversation.name
        checked += 1
    assert checked >= 3, checked


# ---- hand-written raw texts in each format ------------------------------------------------------------------------

QWEN = fmt_of("qwen3")
OFFERED = frozenset({"get_weather", "search"})


def test_qwen_parallel_calls_keep_their_exact_argument_text() -> None:
    raw = ('<think>\nplan\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
           '{"city":"Zürich" ,"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {}}\n'
           '</tool_call><|im_end|>')  # fmt: skip
    got = split_output(raw, QWEN, state="none", offered=OFFERED, call_id="c")
    assert (got.reasoning, got.content) == ("plan", "Let me check.")
    assert [(c.id, c.function.name, c.function.arguments) for c in got.tool_calls] == [
        ("c_0", "get_weather", '{"city":"Zürich" ,"unit": "c"}'), ("c_1", "search", "{}")]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ('<tool_call>\n{"name": "search", "arguments": {"q": 1}}\n', TOOL_BLOCK_MALFORMED),  # never closed
        ('<tool_call>\n{"name": "search", "arguments": {"q": }}\n</tool_call>', TOOL_BLOCK_MALFORMED),
        ('<tool_call>\n{"name": "search", "arguments": "q"}\n</tool_call>', TOOL_BLOCK_MALFORMED),
        ('<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>', TOOL_NOT_OFFERED),
        ('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\nAnd more.', TOOL_BLOCK_MALFORMED),
        ("<think>\nno end", THINK_UNCLOSED),
    ],
)
def test_what_cannot_be_split_names_its_reason(raw: str, reason: str) -> None:
    with pytest.raises(SplitError) as err:
        split_output(raw, QWEN, state="none", offered=OFFERED)
    assert err.value.reason == reason and err.value.message


def test_a_call_when_no_tools_were_offered_is_not_offered() -> None:
    raw = '<think>\nx\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    with pytest.raises(SplitError) as err:
        split_output(raw, QWEN, state="none", offered=frozenset())
    assert err.value.reason == TOOL_NOT_OFFERED


def test_thinking_off_and_prompt_opened_blocks() -> None:
    closed = split_output("Plain answer.", QWEN, state="closed", offered=OFFERED)
    assert (closed.reasoning, closed.content) == ("", "Plain answer.")
    r1 = fmt_of("deepseek-r1")
    assert prompt_state(r1, "<｜User｜>hi<｜Assistant｜><think>\n") == "open"
    opened = split_output("why\n</think>\n\nbecause", r1, state="open", offered=OFFERED)
    assert (opened.reasoning, opened.content) == ("why", "because")


def test_deepseek_and_kimi_sections() -> None:
    v31 = split_output(
        "r</think>ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"a\"}<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        fmt_of("deepseek-v3.1"), state="open", offered=OFFERED)  # fmt: skip
    assert (v31.reasoning, v31.content) == ("r", "ok")
    assert [(c.function.name, c.function.arguments) for c in v31.tool_calls] == [("search", '{"q": "a"}'),
                                                                                ("get_weather", "{}")]
    kimi = split_output(
        "<think>r</think><|tool_calls_section_begin|><|tool_call_begin|>functions.search:3"
        "<|tool_call_argument_begin|>{\"q\":1}<|tool_call_end|><|tool_calls_section_end|>",
        fmt_of("kimi-k2-thinking"), state="none", offered=OFFERED)  # fmt: skip
    assert [(c.id, c.function.name, c.function.arguments) for c in kimi.tool_calls] == [
        ("functions.search:3", "search", '{"q":1}')]
    with pytest.raises(SplitError) as err:
        split_output("<|tool_calls_section_begin|><|tool_call_begin|>search<|tool_call_argument_begin|>{}"
                     "<|tool_call_end|><|tool_calls_section_end|>", fmt_of("kimi-k2-thinking"), state="none",
                     offered=OFFERED)  # fmt: skip
    assert err.value.reason == TOOL_BLOCK_MALFORMED


def test_dsml_invokes_become_json_arguments() -> None:
    # DeepSeek-V4's encoding_dsv4: "\n\n<｜DSML｜tool_calls>\n" + invokes + "\n</｜DSML｜tool_calls>";
    # string parameters as they are, the others as JSON.
    d = "｜DSML｜"
    raw = (f'r</think>Checking.\n\n<{d}tool_calls>\n<{d}invoke name="get_weather">\n'
           f'<{d}parameter name="city" string="true">Oslo</{d}parameter>\n'
           f'<{d}parameter name="days" string="false">3</{d}parameter>\n</{d}invoke>\n'
           f'<{d}invoke name="search">\n<{d}parameter name="q" string="true">a "b"</{d}parameter>\n</{d}invoke>'
           f"\n</{d}tool_calls>")  # fmt: skip
    got = split_output(raw, fmt_of("deepseek-v4"), state="open", offered=OFFERED)
    assert (got.reasoning, got.content) == ("r", "Checking.")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 3}), ("search", {"q": 'a "b"'})]
