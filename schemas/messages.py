"""Chat messages as prompts carry them (OpenAI's ``messages`` shape) and what a request sends of them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from schemas.fields import Name, NonNegInt


class ToolFunction(Struct, kw_only=True, omit_defaults=True):
    """A function call: its name and its arguments as a JSON text (OpenAI shape)."""

    name: str
    arguments: str = "{}"


class ToolCall(Struct, kw_only=True, omit_defaults=True):
    """One structured tool call, as OpenAI-compatible APIs return it."""

    function: ToolFunction
    id: str = ""
    type: str = "function"


class Message(Struct, kw_only=True, omit_defaults=True):
    """One chat turn of a prompt (OpenAI ``messages`` shape).

    On the wire an assistant turn with tool calls may carry ``"content": null`` (as OpenAI
    writes it); it decodes to ``""``, what the publisher makes of the same turn.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def wire_messages(messages: list[Message], *, reasoning: bool = False) -> list[dict[str, Any]]:
    """The OpenAI ``messages`` a request carries for a prompt: what the server's template sees.

    ``content`` always present; ``tool_calls``, ``tool_call_id`` and ``name`` when set; earlier
    turns' ``reasoning_content`` only with ``reasoning`` (a multi-turn regeneration passes the
    model's own reasoning back and lets its chat template decide what of it to render; a dataset's
    history written by another model is never sent with its reasoning). The prompt ids are rendered
    from exactly this.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if reasoning and m.role == "assistant" and m.reasoning_content:
            item["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


class ConversationTurn(Struct, kw_only=True, omit_defaults=True):
    """Which turn of which conversation a prompt is, in a ``turns = "all"`` dataset.

    ``original`` is the dataset's whole conversation as published (every assistant turn
    included): the continuation stage takes the next user turn and the cached tool results from
    it. ``turn`` counts the regenerated assistant turns from 0.
    """

    conversation_id: Name
    turn: Annotated[int, Meta(ge=0, le=100_000)]
    original: list[Message]
    # The previous turn's full sequence (prompt + output ids): its length and schemas.prefix.ids_digest.
    # Set from turn 1 on; the row says whether its prompt ids extend it.
    previous_length: NonNegInt = 0
    previous_digest: str = ""
