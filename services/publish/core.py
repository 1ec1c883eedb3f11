"""Normalising dataset rows into :class:`schemas.PromptPublished` (pure: no I/O, no clock).

Three input shapes are understood:

* OpenAI ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}``
* ShareGPT ``conversations``: ``{"conversations": [{"from": "human", "value": ...}, ...]}``
* Alpaca: ``{"instruction": ..., "input": ..., "output": ...}``

A trailing assistant turn is dropped (it is what the target model regenerates). With
``turns = "all"`` the whole conversation is kept as the prompt's ``conversation`` and the prompt
is its turn 0 (see ``services/continuation/core.py``). Tool
definitions come from a ``tools`` field (or the one named by ``tools_field``), or, in the
Glaive style, from JSON function specs written inside the system message: the system
text is kept verbatim, the specs are also parsed into ``tools`` and the prompt says
``tools_in_text`` (the model reads them there; they are never rendered again).

Every problem is a :class:`RowError` with a stable reason code, so the publisher can
report it with file and line and skip the row (or refuse the whole run with ``--strict``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from schemas import Message, PromptPublished, ToolCall, ToolFunction
from services.continuation.core import ConversationError, first_turn, turn_sample_id

Format = Literal["messages", "sharegpt", "alpaca"]
FORMATS: Final[tuple[str, ...]] = ("auto", "messages", "sharegpt", "alpaca")

# Stable reason codes for rejected rows (metric label values; keep the set bounded).
INVALID_JSON: Final = "invalid_json"
INVALID_RECORD: Final = "invalid_record"
UNKNOWN_FORMAT: Final = "unknown_format"
UNKNOWN_ROLE: Final = "unknown_role"
NO_USER_TURN: Final = "no_user_turn"
EMPTY_CONTENT: Final = "empty_content"
OVERSIZE: Final = "oversize"
INVALID_TOOLS: Final = "invalid_tools"
DUPLICATE: Final = "duplicate"

ID_FIELDS: Final = ("id", "sample_id", "uuid")
_MAX_ID_LEN = 200

_OPENAI_ROLES: Final[Mapping[str, str]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}

_SHAREGPT_ROLES: Final[Mapping[str, str]] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}


class RowError(ValueError):
    """A dataset row that cannot become a prompt; ``reason`` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class NormaliseOptions:
    """How to read rows: format, default system prompt, tools field, size limit."""

    dataset: str
    fmt: str = "auto"
    system: str | None = None
    tools_field: str | None = None
    max_prompt_chars: int = 2_000_000
    # "all": every assistant turn is regenerated; the row becomes its conversation's turn 0.
    turns: str = "last"


def detect_format(record: Mapping[str, Any]) -> Format:
    """Which of the three shapes a row has; raises ``RowError(unknown_format)`` otherwise."""
    if "messages" in record:
        return "messages"
    if "conversations" in record or "conversation" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    keys = ", ".join(sorted(str(k) for k in record)[:8]) or "none"
    raise RowError(
        UNKNOWN_FORMAT,
        f"row has no 'messages', 'conversations' or 'instruction' field (fields: {keys})",
    )


def _text(value: Any, where: str) -> str:
    """Message content as text: a string, or OpenAI content parts of type text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str] = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif (
                isinstance(part, Mapping)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RowError(INVALID_RECORD, f"{where}: unsupported content part {kind!r} (text only)")
        return "".join(parts)
    raise RowError(INVALID_RECORD, f"{where}: content is {type(value).__name__}, expected text")


def _tool_calls(value: Any, where: str) -> list[ToolCall] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RowError(INVALID_RECORD, f"{where}: tool_calls is not a list")
    calls: list[ToolCall] = []
    for raw in value:
        if not isinstance(raw, Mapping):
            raise RowError(INVALID_RECORD, f"{where}: a tool call is not an object")
        inner = raw.get("function")
        fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else raw
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RowError(INVALID_RECORD, f"{where}: a tool call has no function name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(function=ToolFunction(name=name, arguments=args), id=str(raw.get("id") or "")))
    return calls or None


def _openai_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list):
        raise RowError(INVALID_RECORD, "'messages' is not a list")
    out: list[Message] = []
    for i, item in enumerate(raw):
        where = f"message {i}"
        if not isinstance(item, Mapping):
            raise RowError(INVALID_RECORD, f"{where} is not an object")
        role_raw = item.get("role")
        role = _OPENAI_ROLES.get(str(role_raw).lower()) if isinstance(role_raw, str) else None
        if role is None:
            raise RowError(UNKNOWN_ROLE, f"{where}: unknown role {role_raw!r}")
        reasoning = item.get("reasoning_content")
        name = item.get("name")
        tool_call_id = item.get("tool_call_id")
        out.append(
            Message(
                role=role,  # type: ignore[arg-type]  # checked against the role table above
                content=_text(item.get("content"), where),
                tool_calls=_tool_calls(item.get("tool_calls"), where),
                tool_call_id=tool_call_id if isinstance(tool_call_id, str) and tool_call_id else None,
                name=name if isinstance(name, str) and name else None,
                reasoning_content=reasoning if isinstance(reasoning, str) and reasoning else None,
            )
        )
    return out


def _sharegpt_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list):
        raise RowError(INVALID_RECORD, "'conversations' is not a list")
    out: list[Message] = []
    for i, item in enumerate(raw):
        where = f"turn {i}"
        if not isinstance(item, Mapping):
            raise RowError(INVALID_RECORD, f"{where} is not an object")
        who = item.get("from", item.get("role"))
        role = _SHAREGPT_ROLES.get(who.lower()) if isinstance(who, str) else None
        if role is None:
            raise RowError(UNKNOWN_ROLE, f"{where}: unknown speaker {who!r}")
        value = item.get("value", item.get("content"))
        out.append(Message(role=role, content=_text(value, where)))  # type: ignore[arg-type]
    return out


def _alpaca_messages(record: Mapping[str, Any]) -> list[Message]:
    instruction = _text(record.get("instruction"), "instruction")
    extra = _text(record.get("input"), "input")
    user = f"{instruction.strip()}\n\n{extra.strip()}" if extra.strip() else instruction
    out: list[Message] = []
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        out.append(Message(role="system", content=system))
    out.append(Message(role="user", content=user))
    return out


def _as_tool(spec: Any) -> dict[str, Any] | None:
    """An OpenAI ``tools`` entry from a function spec, or None when it is not one."""
    if not isinstance(spec, Mapping):
        return None
    if spec.get("type") == "function" and isinstance(spec.get("function"), Mapping):
        fn = spec["function"]
        return dict(spec) if isinstance(fn.get("name"), str) and fn["name"] else None
    name = spec.get("name")
    if isinstance(name, str) and name and ("parameters" in spec or "description" in spec):
        return {"type": "function", "function": dict(spec)}
    return None


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """A ``tools`` field (list of specs or a JSON text of one) as OpenAI tools; None if empty."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(INVALID_TOOLS, f"tools field is not valid JSON: {exc}") from None
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list):
        raise RowError(INVALID_TOOLS, f"tools field is {type(value).__name__}, expected a list")
    tools: list[dict[str, Any]] = []
    for i, spec in enumerate(value):
        tool = _as_tool(spec)
        if tool is None:
            raise RowError(INVALID_TOOLS, f"tool {i} is not a function spec (needs a name)")
        tools.append(tool)
    return tools or None


def tools_from_system_text(text: str) -> list[dict[str, Any]] | None:
    """Glaive-style function specs embedded in a system message, parsed as OpenAI tools.

    Scans the text for JSON objects (or arrays of objects) and keeps those that look like
    function specs; returns None when there are none. The text itself is not changed.
    """
    decoder = json.JSONDecoder()
    tools: list[dict[str, Any]] = []
    pos = 0
    while True:
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        candidates = obj if isinstance(obj, list) else [obj]
        found = [t for t in (_as_tool(c) for c in candidates) if t is not None]
        tools.extend(found)
        pos = end if found or isinstance(obj, Mapping) else start + 1
    return tools or None


_hash_encoder = msgspec.json.Encoder(order="sorted")


def content_hash(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A stable id from the normalised messages and tools (same prompt, same id)."""
    payload = _hash_encoder.encode({"messages": list(messages), "tools": list(tools or [])})
    return hashlib.sha256(payload).hexdigest()[:32]


def own_id(record: Mapping[str, Any]) -> str | None:
    """The dataset's own id (``id``/``sample_id``/``uuid``) when it is usable as a key part."""
    for name in ID_FIELDS:
        value = record.get(name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | str):
            text = str(value).strip()
            if 0 < len(text) <= _MAX_ID_LEN and text.isprintable():
                return text
    return None


def _check(messages: list[Message]) -> None:
    for i, msg in enumerate(messages):
        if not msg.content.strip() and not (msg.role == "assistant" and msg.tool_calls):
            raise RowError(EMPTY_CONTENT, f"message {i} ({msg.role}) has empty content")
    if not any(m.role == "user" for m in messages):
        raise RowError(NO_USER_TURN, "no user turn to answer")


def prompt_chars(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> int:
    """Size of a prompt in characters: every message's text plus the tools' JSON."""
    size = sum(len(m.content) + len(m.reasoning_content or "") for m in messages)
    for m in messages:
        for call in m.tool_calls or ():
            size += len(call.function.name) + len(call.function.arguments)
    if tools:
        size += len(json.dumps(list(tools), ensure_ascii=False))
    return size


def normalise(record: Any, options: NormaliseOptions, *, source: str = "") -> PromptPublished:
    """Turn one parsed dataset row into a prompt; raises :class:`RowError` with a reason code."""
    if not isinstance(record, Mapping):
        raise RowError(INVALID_RECORD, f"row is {type(record).__name__}, expected a JSON object")
    fmt = detect_format(record) if options.fmt == "auto" else options.fmt
    if fmt == "messages":
        if "messages" not in record:
            raise RowError(UNKNOWN_FORMAT, "row has no 'messages' field")
        messages = _openai_messages(record["messages"])
    elif fmt == "sharegpt":
        if "conversations" not in record and "conversation" not in record:
            raise RowError(UNKNOWN_FORMAT, "row has no 'conversations' field")
        messages = _sharegpt_messages(record.get("conversations", record.get("conversation")))
    elif fmt == "alpaca":
        if "instruction" not in record:
            raise RowError(UNKNOWN_FORMAT, "row has no 'instruction' field")
        messages = _alpaca_messages(record)
    else:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")

    # A top-level system prompt (common in ShareGPT exports), then the --system default.
    top_system = record.get("system") if fmt != "alpaca" else None
    if not any(m.role == "system" for m in messages):
        if isinstance(top_system, str) and top_system.strip():
            messages.insert(0, Message(role="system", content=top_system))
        elif options.system:
            messages.insert(0, Message(role="system", content=options.system))

    if options.turns != "all":
        while messages and messages[-1].role == "assistant":
            messages.pop()  # the answer we regenerate
    _check(messages)

    tools_field = options.tools_field or "tools"
    tools = parse_tools(record.get(tools_field))
    in_text = False
    if tools is None:
        system_text = "\n".join(m.content for m in messages if m.role == "system")
        tools = tools_from_system_text(system_text) if system_text else None
        in_text = tools is not None

    size = prompt_chars(messages, tools)
    if size > options.max_prompt_chars:
        raise RowError(OVERSIZE, f"prompt is {size} characters, over the limit of {options.max_prompt_chars}")

    sample_id = own_id(record) or content_hash(messages, tools)
    if options.turns == "all":
        return msgspec.structs.replace(
            _first_turn(options.dataset, sample_id, messages, tools, source), tools_in_text=in_text
        )
    return PromptPublished(
        dataset=options.dataset,
        sample_id=sample_id,
        messages=messages,
        tools=tools,
        source=source,
        tools_in_text=in_text,
    )


def _first_turn(
    dataset: str, conversation_id: str, original: list[Message], tools: list[dict[str, Any]] | None, source: str
) -> PromptPublished:
    """Turn 0 of a multi-turn conversation, keyed ``<dataset>:<conversation_id>:0``, carrying the original."""
    try:
        messages, conversation = first_turn(original, conversation_id)
    except ConversationError as exc:
        raise RowError(NO_USER_TURN, exc.message) from None
    return PromptPublished(
        dataset=dataset,
        sample_id=turn_sample_id(conversation_id, 0),
        messages=messages,
        tools=tools,
        source=source,
        conversation=conversation,
    )


__all__ = [
    "DUPLICATE",
    "EMPTY_CONTENT",
    "FORMATS",
    "INVALID_JSON",
    "INVALID_RECORD",
    "INVALID_TOOLS",
    "NO_USER_TURN",
    "OVERSIZE",
    "UNKNOWN_FORMAT",
    "UNKNOWN_ROLE",
    "NormaliseOptions",
    "RowError",
    "content_hash",
    "detect_format",
    "normalise",
    "own_id",
    "parse_tools",
    "prompt_chars",
    "tools_from_system_text",
]
