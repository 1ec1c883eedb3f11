"""Generates the JSON Schema of every event from the msgspec Structs (never by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Final

import msgspec

import schemas as s

EVENTS: dict[str, Any] = {
    "prompt_published": s.PromptPublished,
    "request_started": s.RequestStarted,
    "response_received": s.ResponseReceived,
    "sample_reconstructed": s.SampleReconstructed,
    "sample_audited": s.SampleAudited,
    "control_event": s.Halt | s.Resume,
    "budget_snapshot": s.BudgetSnapshot,
}


DRAFT: Final = "https://json-schema.org/draft/2020-12/schema"
# msgspec decodes a float field into an IEEE-754 double and refuses a number beyond its range
# (``1e400``, or a 400-digit integer literal); a schema validator holds such an integer exactly.
_DOUBLE_MAX: Final = sys.float_info.max

CONTRACT: Final = (
    "Generated from the msgspec Structs in schemas/__init__.py; schemas.decode accepts exactly "
    "the records this schema accepts (see docs/contracts.md). Records are UTF-8 JSON without "
    "unpaired surrogates. An integer is any number with a zero fractional part, as in draft "
    "2020-12: 300, 300.0 and 3e2 are the same integer; numbers with a fraction or an exponent "
    "are read as IEEE-754 doubles. A record whose schema_version is above the build's is "
    "refused. Unknown fields are allowed (schema evolution) and not read."
)
NULL_CONTENT: Final = (
    "null only on an assistant turn with at least one tool call (OpenAI's shape); it means the "
    "empty string, what `draftstream publish` writes for the same turn"
)


def _bound_doubles(node: Any) -> None:
    """Give every unbounded ``number`` the double range the decoder enforces."""
    if isinstance(node, dict):
        if node.get("type") == "number":
            node.setdefault("minimum", -_DOUBLE_MAX)
            node.setdefault("maximum", _DOUBLE_MAX)
        for child in node.values():
            _bound_doubles(child)
    elif isinstance(node, list):
        for child in node:
            _bound_doubles(child)


def _null_content(message: dict[str, Any]) -> None:
    """``Message.content`` as the decoder reads it: null allowed on an assistant tool-call turn."""
    content = message["properties"]["content"]
    message["properties"]["content"] = {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "default": content["default"],
        "description": NULL_CONTENT,
    }
    message["if"] = {"properties": {"content": {"type": "null"}}, "required": ["content"]}
    message["then"] = {
        "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
        "required": ["role", "tool_calls"],
    }


def schema_of(type_: Any) -> dict[str, Any]:
    """The JSON Schema of one event type: msgspec's, plus the wire rules it cannot know."""
    schema: dict[str, Any] = {"$schema": DRAFT, "$comment": CONTRACT, **msgspec.json.schema(type_)}
    _bound_doubles(schema)
    message = schema.get("$defs", {}).get("Message")
    if message is not None:
        _null_content(message)
    return schema


def render() -> dict[str, str]:
    """File name to JSON text for every event schema."""
    return {
        f"{name}.schema.json": json.dumps(schema_of(type_), indent=2, sort_keys=True) + "\n"
        for name, type_ in EVENTS.items()
    }


def export(folder: Path) -> list[Path]:
    """Write every schema under ``folder``; returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, text in render().items():
        path = folder / file_name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
