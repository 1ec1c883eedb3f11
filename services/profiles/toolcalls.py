"""The model-native text of structured tool calls, one writer per tool-call format.

The pieces are what a model wrote for the calls a server parsed out of its answer; the gaps
mark what the tool parser keeps nothing of (reconstruction proves them empty or refuses).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from schemas import ToolCall
from services.profiles.spec import ProfileError


def tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    """``tojson`` as Hugging Face templates get it: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)



def _call_text(call: ToolCall) -> tuple[str, str]:
    return call.function.name, call.function.arguments


# Native text of structured tool calls, as a list of pieces. None marks a gap: a place
# where the tool parser keeps nothing of what the model wrote (between calls, after the
# block; around the arguments where the parser's regex consumes whitespace). Reconstruction
# decides, from the provider's convention, whether a gap can be proven empty.
GAP_BETWEEN = "between_calls"
GAP_ARGUMENTS = "around_arguments"
Piece = str | tuple[str]


def _pieces_deepseek_r1(calls: Sequence[ToolCall]) -> list[Piece]:
    # R1 / V3-0324: "<｜tool▁call▁begin｜>{type}<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>",
    # joined by "\n" inside one section.
    out: list[Piece] = ["<｜tool▁calls▁begin｜>"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        if index:
            out += [(GAP_BETWEEN,), "\n"]
        out.append(f"<｜tool▁call▁begin｜>{call.type}<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>")
    out.append("<｜tool▁calls▁end｜>")
    return out


def _pieces_deepseek_v31(calls: Sequence[ToolCall]) -> list[Piece]:
    # V3.1: "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>", calls adjacent.
    out: list[Piece] = ["<｜tool▁calls▁begin｜>"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        if index:
            out.append((GAP_BETWEEN,))
        out.append(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>")
    out.append("<｜tool▁calls▁end｜>")
    return out


def _pieces_kimi(calls: Sequence[ToolCall]) -> list[Piece]:
    # Kimi-K2: the call id "functions.{name}:{index}" is what the model wrote (the parsers
    # return it as the call's id); calls adjacent inside one section.
    out: list[Piece] = ["<|tool_calls_section_begin|>"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        call_id = call.id if call.id.startswith("functions.") else f"functions.{name}:{index}"
        if index:
            out.append((GAP_BETWEEN,))
        out += [f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>", (GAP_ARGUMENTS,), args,
                (GAP_ARGUMENTS,), "<|tool_call_end|>"]
    out.append("<|tool_calls_section_end|>")
    return out


def _pieces_qwen(calls: Sequence[ToolCall]) -> list[Piece]:
    # Qwen3 (Hermes): one "<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>" per call,
    # joined by "\n" (the newline before the first is part of the content a parser returns).
    out: list[Piece] = []
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        if index:
            out += [(GAP_BETWEEN,), "\n"]
        out.append(f'<tool_call>\n{{"name": {tojson(name)}, "arguments": {args}}}\n</tool_call>')
    return out


DSML = "｜DSML｜"


def _dsml_parameter(key: str, value: Any) -> str:
    # encoding_dsv4.encode_arguments_to_dsml: strings as they are, every other value as JSON.
    text = value if isinstance(value, str) else tojson(value)
    flag = "true" if isinstance(value, str) else "false"
    return f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>'


def _pieces_dsml(calls: Sequence[ToolCall]) -> list[Piece]:
    # DeepSeek-V4 (encoding_dsv4.py): "\n\n" + "<｜DSML｜tool_calls>\n" + invokes joined by "\n" +
    # "\n</｜DSML｜tool_calls>"; an invoke is '<｜DSML｜invoke name="N">\n' + its parameters joined by
    # "\n" + "\n</｜DSML｜invoke>". The "\n\n" before the block is content as vLLM's deepseek_v4 parser
    # returns it (it cuts at the block), as the "\n" before a Qwen call is. The arguments are rebuilt from
    # their JSON: the parsers return JSON, so non-string values are re-serialised (convention's concern).
    out: list[Piece] = [f"<{DSML}tool_calls>\n"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        try:
            values = json.loads(args or "{}")
        except ValueError as exc:
            raise ProfileError("tool_arguments_invalid", f"tool call {name!r}: arguments are not JSON") from exc
        if not isinstance(values, dict):
            raise ProfileError("tool_arguments_invalid", f"tool call {name!r}: arguments are not a JSON object")
        if index:
            out += [(GAP_BETWEEN,), "\n"]
        body = "\n".join(_dsml_parameter(key, value) for key, value in values.items())
        out.append(f'<{DSML}invoke name="{name}">\n{body}\n</{DSML}invoke>')
    out.append(f"\n</{DSML}tool_calls>")
    return out


TOOL_PIECES: dict[str, Callable[[Sequence[ToolCall]], list[Piece]]] = {
    "deepseek-r1": _pieces_deepseek_r1,
    "deepseek-v3.1": _pieces_deepseek_v31,
    "dsml": _pieces_dsml,
    "kimi": _pieces_kimi,
    "qwen": _pieces_qwen,
}

