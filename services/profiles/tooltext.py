"""Raw tool text: a row's tools written into the prompt's system text exactly as the template writes them.

In chat mode the server renders the messages with the model's template. Sent with the ``tools``
parameter, the tools reach the template and the server's tool parser takes the model's calls
apart (a rebuild that cannot always be proven). Written into the system message instead, the
same prompt text reaches the model with no ``tools`` parameter, so no tool parser runs and the
calls come back in ``content`` as the model wrote them.

A template can express this where its tool block lies inside the first system message's text
(Qwen's ``# Tools``, DeepSeek's tool section); Kimi declares tools in a ``tool_declare`` turn of
its own, which no system text renders. Nothing here is assumed about a template: the system
text is read off the render with tools, and the rewritten messages are accepted only when they
render, without tools, to that very text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from schemas import Message

Render = Callable[[Sequence[Message], "list[dict[str, Any]] | None"], str]
"""A profile's prompt render: messages and tools to the prompt text (generation prompt on)."""

_MARK = "\x00draftstream-system-text\x00"

# vLLM's FunctionDefinition field order: its request model dumps a function's keys in this order.
_FUNCTION_ORDER = ("name", "description", "parameters")


def server_tools(tools: Sequence[dict[str, object]], null_fields: Sequence[str]) -> list[dict[str, object]]:
    """The tools as the server's request model hands them to the template: absent fields rendered null.

    ``description`` (vLLM): a function without one gets ``"description": null``, its keys in
    the request model's order (name, description, parameters, then the rest).
    ``defer_loading`` (SGLang 0.5.23): every tool gets ``"defer_loading": null`` after its
    own keys. Facts of PARSERS.md "Corrections"; the key placement is the models' field order.
    """
    out: list[dict[str, object]] = []
    for tool in tools:
        served = dict(tool)
        function = served.get("function")
        if "description" in null_fields and isinstance(function, dict):
            named = {key: function.get(key) for key in _FUNCTION_ORDER if key in function or key == "description"}
            served["function"] = {**named, **{k: v for k, v in function.items() if k not in named}}
        if "defer_loading" in null_fields:
            served.setdefault("defer_loading", None)
        out.append(served)
    return out


def tools_in_system_text(
    render: Render, messages: Sequence[Message], tools: list[dict[str, Any]]
) -> list[Message] | None:
    """``messages`` with the tools written into the system text, or None where the template cannot say it so.

    The result renders without tools to exactly the text ``messages`` render to with ``tools``.
    """
    with_tools = render(messages, tools)
    if render(messages, None) == with_tools:  # a template that renders no tools (DeepSeek-R1's)
        return list(messages)
    rest = list(messages[1:]) if messages and messages[0].role == "system" else list(messages)
    first = messages[0] if messages and messages[0].role == "system" else Message(role="system")
    marked = render([msgspec.structs.replace(first, content=_MARK), *rest], None)
    before, found, after = marked.partition(_MARK)
    if not found or _MARK in after:
        return None
    if not (with_tools.startswith(before) and with_tools.endswith(after)):
        return None
    if len(before) + len(after) > len(with_tools):
        return None
    text = with_tools[len(before) : len(with_tools) - len(after)]
    rewritten = [msgspec.structs.replace(first, content=text), *rest]
    return rewritten if render(rewritten, None) == with_tools else None


__all__ = ["Render", "server_tools", "tools_in_system_text"]
