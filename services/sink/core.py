"""Training rows from accepted samples, and the pure parts of the shard bookkeeping.

A row is what SpecForge and vLLM's speculators read: ``id``, ``dataset``, ``input_ids``,
``loss_mask``, ``prompt_ids``, ``output_ids``, ``conversations`` (role, content,
reasoning_content, tool_calls: the prompt turns as the model saw them plus the generated
assistant turn), ``tools`` (when the request sent them) and ``metadata``. No file I/O here: the shell writes the bytes.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from schemas import Message, SampleAudited, ToolCall, sample_key

PART_RE = re.compile(r"^part-(\d{5,})\.(jsonl|parquet)$")

_row_encoder = msgspec.json.Encoder()
_line_decoder = msgspec.json.Decoder(dict[str, Any])


def _tool_calls(calls: list[ToolCall] | None) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    return [
        {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls
    ]


def _turn(m: Message) -> dict[str, Any]:
    # The request never carries earlier turns' reasoning (schemas.wire_messages): the model did
    # not see it, so the row does not claim it did (a re-render would add ids input_ids lack).
    turn: dict[str, Any] = {
        "role": m.role,
        "content": m.content,
        "reasoning_content": None,
        "tool_calls": _tool_calls(m.tool_calls),
    }
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    return turn


def training_row(audited: SampleAudited) -> dict[str, Any]:
    """The training row of one accepted sample."""
    s = audited.sample
    r = s.response
    conversations = [_turn(m) for m in r.prompt.messages]
    conversations.append({
        "role": "assistant",
        "content": r.content,
        "reasoning_content": r.reasoning or None,
        "tool_calls": _tool_calls(r.tool_calls),
    })
    return {
        "id": sample_key(s.dataset, s.sample_id),
        "dataset": s.dataset,
        "input_ids": [*s.prompt_ids, *s.output_ids],
        "loss_mask": list(s.loss_mask),
        "prompt_ids": list(s.prompt_ids),
        "output_ids": list(s.output_ids),
        "conversations": conversations,
        "tools": r.prompt.tools if r.tools_sent else None,  # only what the model saw
        "metadata": {
            "provider": r.provider,
            "upstream_provider": r.upstream_provider,
            "model": r.model,
            "profile": s.profile,
            "usage": msgspec.to_builtins(r.usage),
            "finish_reason": r.finish_reason,
            "reconstruction_method": s.method,
            "audit": {
                "passed": audited.passed,
                "checks": {c.code: c.passed for c in audited.results},
                "notes": {c.code: c.message for c in audited.results if c.message},
            },
        },
    }


def row_line(row: dict[str, Any]) -> bytes:
    """One JSONL line (newline included) for a row."""
    return _row_encoder.encode(row) + b"\n"


def parse_line(line: bytes) -> str | None:
    """The ``id`` of a stored JSONL line, or None when the line is corrupt."""
    try:
        obj = _line_decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    key = obj.get("id")
    return key if isinstance(key, str) and key else None


def part_number(filename: str) -> int | None:
    """The NNNNN of ``part-NNNNN.<ext>``, or None for other files."""
    m = PART_RE.match(filename)
    return int(m.group(1)) if m else None


def part_name(number: int, fmt: str) -> str:
    """The file name of part ``number``."""
    return f"part-{number:05d}.{fmt}"


def torn_tail(data: bytes) -> int:
    """How many bytes at the end of a JSONL part follow its last newline (a torn write)."""
    if not data or data.endswith(b"\n"):
        return 0
    return len(data) - (data.rfind(b"\n") + 1)


__all__ = ["parse_line", "part_name", "part_number", "row_line", "torn_tail", "training_row"]
