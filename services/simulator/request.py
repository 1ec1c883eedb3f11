"""The requests the simulator takes: a chat-completions or text-completions body, parsed and checked.

A body a real provider would refuse raises :class:`RequestError` (HTTP 400).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class RequestError(ValueError):
    """A request the simulator refuses (HTTP 400), like a real provider would."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ChatRequest:
    """The parts of an OpenAI chat-completions body the simulator looks at."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    tool_choice: Any = None
    # vLLM's extensions: kwargs for the chat template, and the prompt/output ids in the body.
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    raise RequestError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def _json_object(body: bytes) -> dict[str, Any]:
    """A request body's JSON object; raises :class:`RequestError` when it is not one."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    return data


def parse_request(body: bytes) -> ChatRequest:
    """Parse and validate a chat-completions request body; raises :class:`RequestError`."""
    data = _json_object(body)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    clean: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        clean.append({**message, "content": _message_text(message.get("content"))})
    tools = data.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of objects")
    model, max_tokens = _model_and_max_tokens(data)
    top = data.get("top_logprobs") or 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
        raise RequestError("'top_logprobs' must be an integer in 0..20")
    template_kwargs = data.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    return ChatRequest(
        model=model,
        messages=clean,
        tools=tools or None,
        max_tokens=max_tokens,
        logprobs=bool(data.get("logprobs")),
        top_logprobs=top,
        tool_choice=data.get("tool_choice"),
        chat_template_kwargs=template_kwargs or None,
        return_token_ids=bool(data.get("return_token_ids")),
    )


def _model_and_max_tokens(data: dict[str, Any]) -> tuple[str, int | None]:
    """The ``model`` and ``max_tokens`` of a request body, validated as a provider does."""
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError("'max_tokens' must be a positive integer")
    model = data.get("model") or "simulator/model"
    if not isinstance(model, str):
        raise RequestError("'model' must be a string")
    return model, max_tokens


# The tool definitions a Hermes-style template (Qwen3) renders into the prompt: one JSON per line.
_PROMPT_TOOLS = re.compile(r"<tools>\n(?P<lines>.*?)\n</tools>", re.DOTALL)


def prompt_tools(prompt: str) -> list[dict[str, Any]] | None:
    """The tools a rendered prompt offers in the native ``<tools>`` block (Qwen3's templates), else None."""
    match = _PROMPT_TOOLS.search(prompt)
    if match is None:
        return None
    tools = []
    for line in match["lines"].splitlines():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict):
            tools.append(tool)
    return tools or None


def parse_completion_request(body: bytes) -> tuple[ChatRequest, str]:
    """Parse a text-completions body (``prompt`` already rendered): the request the generator reads, and the prompt.

    The prompt stands as one system message (so tool text in it is seen as a system prompt's
    is), and the tools the prompt offers natively are the request's tools: the model answers
    them with tool calls in its own format. Raises :class:`RequestError`.
    """
    data = _json_object(body)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string")
    model, max_tokens = _model_and_max_tokens(data)
    request = ChatRequest(
        model=model, messages=[{"role": "system", "content": prompt}], tools=prompt_tools(prompt), max_tokens=max_tokens
    )
    return request, prompt
