"""The model's raw output in each family's own format, and an inference server's parse of it.

:func:`write_raw_output` writes what the model generates (think block, native tool-call syntax,
end-of-turn), from the official chat templates, never from a profile's own rendering;
:func:`parse_raw_output` splits it into reasoning, content and tool calls as vLLM's or SGLang's
parsers do (after ``../shared/reference/PARSERS.md``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Final

from schemas import ToolCall, ToolFunction
from services.profiles import ProfileLike
from services.profiles.conventions import CONVENTIONS
from services.simulator.prompts import ThinkBlock

# Server parsers the simulator emulates: current vLLM (no whitespace stripped), and SGLang
# before PR #24251 (reasoning and content .strip()ped). PARSERS.md has the sources.
PARSERS: Final = ("vllm", "sglang-legacy")


# ---------------------------------------------------------------- the model's raw output
#
# Each family's raw answer, written here from its official chat template (the assistant
# turn of the history, which is what the model was trained to produce) and PARSERS.md,
# never from a profile's own rendering:
#
# - Qwen3 / Qwen3-2507 (Qwen-Qwen3-0.6B.jinja): '<think>\n' + reasoning + '\n</think>\n\n' +
#   content, then per call ('\n' first when content is not empty)
#   '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments + '}\n</tool_call>', then
#   '<|im_end|>'. Qwen3-2507's generation prompt ends '<think>\n': the model goes on from the
#   reasoning.
# - DeepSeek-R1 (R1-Distill template: generation prompt '<｜Assistant｜><think>\n'):
#   reasoning + '\n</think>\n\n' + content, then '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' +
#   type + '<｜tool▁sep｜>' + name + '\n```json\n' + arguments + '\n```<｜tool▁call▁end｜>' +
#   '<｜tool▁calls▁end｜>', then '<｜end▁of▁sentence｜>'. DeepSeek-V3 (no thinking): the same
#   without the think block.
# - DeepSeek-V3.1 (generation prompt '<｜Assistant｜><think>', history '</think>' + content):
#   reasoning + '</think>' + content, calls '<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' +
#   arguments + '<｜tool▁call▁end｜>' inside the calls section.
# - Kimi-K2-Thinking (moonshotai-Kimi-K2-Thinking.jinja): '<think>' + reasoning + '</think>' +
#   content + '<|tool_calls_section_begin|><|tool_call_begin|>functions.' + name + ':0' +
#   '<|tool_call_argument_begin|>' + arguments + '<|tool_call_end|><|tool_calls_section_end|>'
#   + '<|im_end|>'. Kimi-K2 (no thinking): the same without the think block.
# - DeepSeek-V4 (DSML) and profiles without a tool format: no native call is written (the
#   simulator answers in content instead).

# Tool formats whose think block has newlines around the reasoning and after the think-end.
_NEWLINE_THINK: Final = frozenset({"qwen", "deepseek-r1", "none"})


def native_tool_calls(tool_format: str, calls: Sequence[tuple[str, str]]) -> str | None:
    """The text tool calls (name, arguments text) are in the model's own syntax (None: no native syntax here).

    Several calls are one block, joined as each template joins them: Qwen's ``<tool_call>`` blocks and
    R1's calls by ``"\n"``, V3.1's and Kimi's adjacent (Kimi's ids counting from 0).
    """
    if tool_format == "qwen":
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls)
    if tool_format == "deepseek-r1":
        body = "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>" for n, a in calls
        )
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if tool_format == "deepseek-v3.1":
        body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>" for n, a in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if tool_format == "kimi":
        body = "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    return None


def write_raw_output(
    profile: ProfileLike,
    *,
    think_block: ThinkBlock,
    reasoning: str,
    content: str,
    tool_calls: Sequence[tuple[str, dict[str, Any]]] = (),
) -> str:
    """The full text the model generates after the prompt, end-of-turn included.

    ``tool_calls`` are (name, arguments object) pairs; the arguments are written as the model
    writes JSON, ``json.dumps(arguments, ensure_ascii=False)``.
    """
    fmt = profile.tool_format
    text = ""
    if think_block != "none" and profile.think_start is not None and profile.think_end is not None:
        if fmt in _NEWLINE_THINK:
            opening = f"{profile.think_start}\n" if think_block == "model" else ""
            text = f"{opening}{reasoning}\n{profile.think_end}\n\n"
        else:
            opening = profile.think_start if think_block == "model" else ""
            text = f"{opening}{reasoning}{profile.think_end}"
    text += content
    if tool_calls:
        native = native_tool_calls(fmt, [(n, json.dumps(a, ensure_ascii=False)) for n, a in tool_calls])
        if native is not None:
            text += ("\n" if fmt == "qwen" and content else "") + native
    return text + profile.end_of_turn


# ---------------------------------------------------------------- the server's parse

# Where each format's tool block starts, and one complete call inside it (the regexes of
# vLLM's hermes, deepseekv3, deepseekv31 and kimi_k2 tool parsers, PARSERS.md).
_TOOL_BLOCK_START: Final = {
    "qwen": "<tool_call>",
    "deepseek-r1": "<｜tool▁calls▁begin｜>",
    "deepseek-v3.1": "<｜tool▁calls▁begin｜>",
    "kimi": "<|tool_calls_section_begin|>",
}
_TOOL_CALL_PATTERN: Final = {
    "qwen": re.compile(r"<tool_call>(?P<body>.*?)</tool_call>", re.DOTALL),
    "deepseek-r1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
        re.DOTALL,
    ),
    "deepseek-v3.1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.DOTALL
    ),
    "kimi": re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>.*?)\s*"
        r"<\|tool_call_end\|>",
        re.DOTALL,
    ),
}
# Formats whose tool parser re-serialises the arguments (json.loads then json.dumps with
# ensure_ascii=False): vLLM's hermes; SGLang's Qwen25 and DeepSeek detectors.
_RESERIALIZED: Final = {
    "vllm": frozenset({"qwen"}),
    "sglang-legacy": frozenset({"qwen", "deepseek-r1", "deepseek-v3.1"}),
}


def _parse_tool_calls(tool_format: str, text: str, parser: str, call_id: str) -> tuple[str, list[ToolCall]]:
    """(content before the tool block, structured calls); the text unchanged when no call parses.

    Text after the block is dropped, as every tool parser does. A block with no complete,
    valid call (an answer cut inside it) stays in the content, with no calls.
    """
    start = _TOOL_BLOCK_START.get(tool_format)
    pattern = _TOOL_CALL_PATTERN.get(tool_format)
    if start is None or pattern is None or start not in text:
        return text, []
    block_at = text.index(start)
    reserialize = tool_format in _RESERIALIZED.get(parser, frozenset())
    calls: list[ToolCall] = []
    try:
        for index, match in enumerate(pattern.finditer(text, block_at)):
            id_ = call_id if index == 0 else f"{call_id}_{index}"
            if tool_format == "qwen":
                obj = json.loads(match["body"])
                name, arguments = obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)
            elif tool_format == "kimi":
                id_ = match["id"].strip()  # kimi_k2 returns the model's "functions.name:idx" as the id
                name, arguments = id_.split(":")[0].split(".")[-1], match["args"]
            else:
                name, arguments = match["name"], match["args"]
            if reserialize and tool_format != "qwen":
                arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
            calls.append(ToolCall(id=id_, function=ToolFunction(name=name, arguments=arguments)))
    except (ValueError, KeyError, TypeError):  # not JSON, or not a call object: the parser gives up
        return text, []
    if not calls:
        return text, []
    return text[:block_at], calls


def parse_raw_output(
    profile: ProfileLike,
    text: str,
    *,
    think_block: ThinkBlock,
    tools_sent: bool,
    parser: str = "vllm",
    call_id: str = "call_0",
) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, tool calls) a server returns for the decoded output ``text``.

    ``text`` is the detokenised output (end-of-turn dropped; think and tool tokens kept,
    being ``special=false``). ``vllm``: a leading think-start removed, the rest split at the
    first think-end with no strip (no think-end: all reasoning, a cut answer), bar the
    reasoning's end where vLLM 0.33's parser for the format ``.rstrip()``s it (``deepseek_v4``,
    ``kimi_k2``: the convention's ``strips_reasoning_end``); the tool
    parser runs on the content only when the request sent ``tools`` (else the native call
    text stays in the content). ``sglang-legacy``: the same split, then reasoning and
    content ``.strip()``ped (the 2025 detectors stripped the whole text and the content,
    and the streaming path rstripped the reasoning; OpenRouter-style streaming answers come
    out stripped on both sides, which is what is emulated).
    """
    if parser not in PARSERS:
        raise ValueError(f"unknown parser {parser!r}; known: {', '.join(PARSERS)}")
    reasoning, content = "", text
    if think_block != "none" and profile.think_end is not None:
        if profile.think_start and content.startswith(profile.think_start):
            content = content[len(profile.think_start) :]
        if profile.think_end in content:
            reasoning, _, content = content.partition(profile.think_end)
        else:
            reasoning, content = content, ""
        if parser == "vllm" and profile.tool_format in CONVENTIONS["vllm"].strips_reasoning_end:
            reasoning = reasoning.rstrip()
    calls: list[ToolCall] = []
    if tools_sent:
        content, calls = _parse_tool_calls(profile.tool_format, content, parser, call_id)
    if parser == "sglang-legacy":
        reasoning, content = reasoning.strip(), content.strip()
    return reasoning, content, calls
