"""The wire rules a JSON Schema needs beyond what msgspec derives from the Structs.

Shared by the event schemas (schemas/export.py) and the AsyncAPI payloads (schemas/asyncapi.py),
so both describe what ``schemas.decode`` accepts.
"""

from __future__ import annotations

import sys
from typing import Any, Final

DRAFT: Final = "https://json-schema.org/draft/2020-12/schema"
# msgspec decodes a float field into an IEEE-754 double and refuses a number beyond its range
# (``1e400``, or a 400-digit integer literal); a schema validator holds such an integer exactly.
_DOUBLE_MAX: Final = sys.float_info.max

CONTRACT: Final = (
    "Generated from the msgspec Structs of the schemas package; schemas.decode accepts exactly "
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



def apply_wire_rules(schema: dict[str, Any], defs: dict[str, Any]) -> None:
    """Bound every double under ``schema``; give ``Message`` in ``defs`` its null-content rule."""
    _bound_doubles(schema)
    message = defs.get("Message")
    if message is not None:
        _null_content(message)


__all__ = ["CONTRACT", "DRAFT", "NULL_CONTENT", "apply_wire_rules"]
