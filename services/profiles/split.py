"""A completions-mode raw output split into the assistant message, by the profile's own output format.

In completions mode the model's output is known exactly (the raw text, specials kept). A
multi-turn regeneration needs it as a history turn: reasoning, content and tool calls with
their arguments' exact text. This module is the inverse of what the model's chat template
renders for an assistant turn (``../shared/reference/chat-templates``), written from those
templates, never by asking a server's parser:

- the think block: the think-start the model wrote itself (a prompt that ends with it opened
  the block), the reasoning up to the first think-end. Where the template writes newlines as
  separators (Qwen3: ``'<think>\\n' + reasoning + '\\n</think>\\n\\n' + content``; DeepSeek-R1:
  the prompt's ``'<think>\\n'``, then ``reasoning + '\\n</think>\\n\\n' + content``) exactly those
  separators are taken off, so the template's render of the message gives the text back;
  DeepSeek-V3.1, V4 and Kimi write ``reasoning + '</think>' + content`` with none;
- the tool block, per native format: Qwen3's Hermes ``<tool_call>`` blocks (a ``'\\n'`` before
  the first when there is content, between calls), DeepSeek-R1's and V3.1's tool-call tokens,
  Kimi's sections (the call id ``functions.NAME:INDEX`` is the model's own and is kept), and
  DeepSeek-V4's DSML invokes (arguments rebuilt as JSON: DSML writes parameters, not JSON).

What cannot be split ends the conversation with a reason (:class:`SplitError`): a think block
that never closes, a malformed or unclosed tool block, text after the tool calls (a history turn
cannot hold it), a call to a function the prompt did not offer. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from schemas import ToolCall, ToolFunction

__all__ = [
    "SPLIT_REASONS",
    "THINK_UNCLOSED",
    "TOOL_BLOCK_MALFORMED",
    "TOOL_NOT_OFFERED",
    "OutputFormat",
    "SplitError",
    "SplitMessage",
    "offered_tool_names",
    "prompt_state",
    "split_output",
]

THINK_UNCLOSED: Final = "think_unclosed"
TOOL_BLOCK_MALFORMED: Final = "tool_block_malformed"
TOOL_NOT_OFFERED: Final = "tool_not_offered"
SPLIT_REASONS: Final = (THINK_UNCLOSED, TOOL_BLOCK_MALFORMED, TOOL_NOT_OFFERED)

# Formats whose template writes newline separators around the reasoning and after the think-end.
_NEWLINE_THINK: Final = frozenset({"qwen", "deepseek-r1"})


class SplitError(ValueError):
    """A raw output that is not a history turn of its format; ``reason`` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class OutputFormat:
    """The facts of a profile the split needs (a ProfileSpec or a loaded Profile gives them)."""

    end_of_turn: str
    think_start: str | None = None
    think_end: str | None = None
    tool_format: str = "none"

    @classmethod
    def of(cls, profile: Any) -> OutputFormat:
        """The output format of a ``ProfileSpec`` or a ``Profile`` (anything with these attributes)."""
        return cls(
            end_of_turn=profile.end_of_turn,
            think_start=profile.think_start,
            think_end=profile.think_end,
            tool_format=profile.tool_format,
        )


@dataclass(frozen=True)
class SplitMessage:
    """The assistant turn a raw output is: what the next turn's history carries."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def prompt_state(fmt: OutputFormat, prompt_text: str) -> str:
    """Whether a rendered prompt opened the think block (``open``), closed it (``closed``) or neither (``none``)."""
    if fmt.think_start is None or fmt.think_end is None:
        return "none"
    tail = prompt_text.rstrip()
    if tail.endswith(fmt.think_start):
        return "open"
    if tail.endswith(fmt.think_end):
        return "closed"
    return "none"


def offered_tool_names(tools: Iterable[Mapping[str, Any]] | None) -> frozenset[str]:
    """The function names a request's ``tools`` offer (OpenAI shape, or bare function objects)."""
    names = set()
    for tool in tools or ():
        fn = tool.get("function", tool)
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def _drop_prefix(text: str, prefix: str) -> str:
    return text[len(prefix) :] if prefix and text.startswith(prefix) else text


def _drop_suffix(text: str, suffix: str) -> str:
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text


def _split_think(text: str, fmt: OutputFormat, state: str) -> tuple[str, str]:
    """(reasoning, the text after the think block)."""
    if fmt.think_end is None or state == "closed":
        return "", text
    newline = fmt.tool_format in _NEWLINE_THINK
    opened = state == "open"
    if not opened and fmt.think_start and text.startswith(fmt.think_start):
        text, opened = text[len(fmt.think_start) :], True
        if newline:
            text = _drop_prefix(text, "\n")
    if not opened:
        return "", text
    if fmt.think_end not in text:
        raise SplitError(THINK_UNCLOSED, "the output ends inside its think block")
    reasoning, _, rest = text.partition(fmt.think_end)
    if newline:
        reasoning, rest = _drop_suffix(reasoning, "\n"), _drop_prefix(rest, "\n\n")
    return reasoning, rest


def _object_text(text: str, what: str) -> str:
    """``text`` when it is a JSON object (arguments must be), else a SplitError."""
    try:
        value = json.loads(text)
    except ValueError:
        raise SplitError(TOOL_BLOCK_MALFORMED, f"{what}: arguments are not JSON") from None
    if not isinstance(value, dict):
        raise SplitError(TOOL_BLOCK_MALFORMED, f"{what}: arguments are not a JSON object")
    return text


# The template writes a Hermes call's body as '{"name": "' + name + '", "arguments": ' + arguments + '}'.
_HERMES_BODY = re.compile(r'\{"name": "(?P<name>[^"\\]*)", "arguments": (?P<args>.*)\}', re.DOTALL)


def _hermes_call(body: str, index: int) -> tuple[str, str]:
    """(name, arguments text) of one ``<tool_call>`` body."""
    shaped = _HERMES_BODY.fullmatch(body)
    if shaped is not None:
        return shaped["name"], _object_text(shaped["args"], f"tool call {index}")
    try:  # valid JSON in another layout: the arguments as the template's tojson writes them
        obj = json.loads(body)
    except ValueError:
        raise SplitError(TOOL_BLOCK_MALFORMED, f"tool call {index} is not JSON") from None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
        raise SplitError(TOOL_BLOCK_MALFORMED, f"tool call {index} is not a name and an arguments object")
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)


def _after_block(rest: str) -> None:
    if rest.strip():
        raise SplitError(TOOL_BLOCK_MALFORMED, f"text after the tool calls: {rest[:40]!r}")


def _split_hermes(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    start = text.find(open_tag)
    if start < 0:
        return text, []
    content = _drop_suffix(text[:start], "\n")
    calls: list[tuple[str, str, str]] = []
    pos = start
    while True:
        end = text.find(close_tag, pos)
        if end < 0:
            raise SplitError(TOOL_BLOCK_MALFORMED, f"tool call {len(calls)} is not closed")
        body = _drop_suffix(_drop_prefix(text[pos + len(open_tag) : end], "\n"), "\n")
        name, args = _hermes_call(body, len(calls))
        calls.append(("", name, args))
        pos = end + len(close_tag)
        nxt = _drop_prefix(text[pos:], "\n")
        if not nxt.startswith(open_tag):
            _after_block(text[pos:])
            return content, calls
        pos = len(text) - len(nxt)


@dataclass(frozen=True)
class _Section:
    """A format whose calls sit in one section between a begin and an end token."""

    begin: str
    end: str
    call: re.Pattern[str]
    separator: str = ""


_SECTIONS: Final = {
    "deepseek-r1": _Section(
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        re.compile(
            r"<｜tool▁call▁begin｜>(?P<type>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n<]*)\n```json\n(?P<args>.*?)\n```"
            r"<｜tool▁call▁end｜>",
            re.DOTALL,
        ),
        separator="\n",
    ),
    "deepseek-v3.1": _Section(
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        re.compile(r"<｜tool▁call▁begin｜>(?P<name>[^<]*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.DOTALL),
    ),
    "kimi": _Section(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        re.compile(
            r"<\|tool_call_begin\|>(?P<id>[^<]*?)<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>",
            re.DOTALL,
        ),
    ),
}


def _kimi_name(call_id: str, index: int) -> str:
    # The model writes "functions.NAME:INDEX" (Kimi-K2's template renders the call id there).
    name, colon, number = call_id.removeprefix("functions.").rpartition(":")
    if not (colon and name and number.isdigit()):
        raise SplitError(TOOL_BLOCK_MALFORMED, f"tool call {index}: id {call_id[:60]!r} is not functions.NAME:INDEX")
    return name


def _split_section(text: str, section: _Section, tool_format: str) -> tuple[str, list[tuple[str, str, str]]]:
    start = text.find(section.begin)
    if start < 0:
        return text, []
    end = text.find(section.end, start)
    if end < 0:
        raise SplitError(TOOL_BLOCK_MALFORMED, "the tool-call section is not closed")
    _after_block(text[end + len(section.end) :])
    inner, pos = text[start + len(section.begin) : end], 0
    calls: list[tuple[str, str, str]] = []
    while pos < len(inner):
        if calls and section.separator:
            pos += len(section.separator) if inner.startswith(section.separator, pos) else 0
        match = section.call.match(inner, pos)
        if match is None:
            raise SplitError(TOOL_BLOCK_MALFORMED, f"tool call {len(calls)} does not parse: {inner[pos:pos + 60]!r}")
        index = len(calls)
        if tool_format == "kimi":
            call_id = match["id"]
            calls.append((call_id, _kimi_name(call_id, index), _object_text(match["args"], f"tool call {index}")))
        else:
            calls.append(("", match["name"], _object_text(match["args"], f"tool call {index}")))
        pos = match.end()
    if not calls:
        raise SplitError(TOOL_BLOCK_MALFORMED, "an empty tool-call section")
    return text[:start], calls


DSML = "｜DSML｜"
_DSML_BLOCK = (f"<{DSML}tool_calls>\n", f"\n</{DSML}tool_calls>")
_DSML_INVOKE = re.compile(rf'<{DSML}invoke name="(?P<name>[^"]+)">\n(?P<params>.*?)\n</{DSML}invoke>', re.DOTALL)
_DSML_PARAM = re.compile(
    rf'<{DSML}parameter name="(?P<key>[^"]+)" string="(?P<string>true|false)">(?P<value>.*?)</{DSML}parameter>',
    re.DOTALL,
)


def _dsml_arguments(params: str, index: int) -> str:
    values: dict[str, Any] = {}
    pos = 0
    while pos < len(params):
        pos += 1 if values and params.startswith("\n", pos) else 0
        match = _DSML_PARAM.match(params, pos)
        if match is None:
            raise SplitError(TOOL_BLOCK_MALFORMED, f"tool call {index}: a DSML parameter does not parse")
        value: Any = match["value"]
        if match["string"] == "false":
            try:
                value = json.loads(value)
            except ValueError:
                message = f"tool call {index}: a non-string parameter is not JSON"
                raise SplitError(TOOL_BLOCK_MALFORMED, message) from None
        values[match["key"]] = value
        pos = match.end()
    return json.dumps(values, ensure_ascii=False)


def _split_dsml(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    begin, end_tag = _DSML_BLOCK
    start = text.find(begin)
    if start < 0:
        return text, []
    end = text.find(end_tag, start)
    if end < 0:
        raise SplitError(TOOL_BLOCK_MALFORMED, "the DSML tool-call block is not closed")
    _after_block(text[end + len(end_tag) :])
    inner, pos = text[start + len(begin) : end], 0
    calls: list[tuple[str, str, str]] = []
    while pos < len(inner):
        pos += 1 if calls and inner.startswith("\n", pos) else 0
        match = _DSML_INVOKE.match(inner, pos)
        if match is None:
            raise SplitError(TOOL_BLOCK_MALFORMED, f"DSML invoke {len(calls)} does not parse")
        calls.append(("", match["name"], _dsml_arguments(match["params"], len(calls))))
        pos = match.end()
    if not calls:
        raise SplitError(TOOL_BLOCK_MALFORMED, "an empty DSML tool-call block")
    return _drop_suffix(text[:start], "\n\n"), calls


def _split_tools(text: str, tool_format: str) -> tuple[str, list[tuple[str, str, str]]]:
    if tool_format == "qwen":
        return _split_hermes(text)
    if tool_format == "dsml":
        return _split_dsml(text)
    section = _SECTIONS.get(tool_format)
    return (text, []) if section is None else _split_section(text, section, tool_format)


def split_output(
    text: str,
    fmt: OutputFormat,
    *,
    state: str,
    offered: Collection[str],
    call_id: str = "call",
) -> SplitMessage:
    """The assistant message a raw output is, under a prompt in ``state`` (see :func:`prompt_state`).

    ``text`` is the raw output (a trailing end-of-turn, when a server kept the stop token's
    text, is dropped); ``offered`` the function names the prompt offered. Calls get the ids
    ``<call_id>_<i>`` unless the format writes its own (Kimi). Raises :class:`SplitError`.
    """
    text = _drop_suffix(text, fmt.end_of_turn)
    reasoning, body = _split_think(text, fmt, state)
    content, found = _split_tools(body, fmt.tool_format)
    calls = []
    for index, (own_id, name, arguments) in enumerate(found):
        if name not in offered:
            raise SplitError(TOOL_NOT_OFFERED, f"tool call {index} names {name[:80]!r}, which the prompt did not offer")
        calls.append(ToolCall(id=own_id or f"{call_id}_{index}", function=ToolFunction(name=name, arguments=arguments)))
    return SplitMessage(reasoning=reasoning, content=content, tool_calls=calls)
