"""The providers' answers on the wire, and their parsers.

msgspec shapes of the OpenAI/OpenRouter chat- and text-completions answers and of SGLang's native
``/generate`` (unknown fields are ignored), and pure functions from a decoded JSON body to a
:class:`~services.inference.core.ProviderResult` (:func:`parse_openrouter`, :func:`parse_openai`,
:func:`parse_completions`, :func:`parse_sglang`), so each wire shape is unit-tested on its own. An
error object in a body, a body of the wrong shape or one that is not JSON is raised as a classified
:class:`~services.inference.core.ProviderFailure`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from schemas import LogprobToken, ToolCall, ToolFunction, Usage
from services.inference.core import FATAL_STATUSES, ProviderFailure, ProviderResult, classify_status

MAX_ERROR_TEXT = 2000


NonNeg = Annotated[int, Meta(ge=0, le=50_000_000)]
TokenId = Annotated[int, Meta(ge=0, le=10_000_000)]
Byte = Annotated[int, Meta(ge=0, le=255)]
Cost = Annotated[float, Meta(ge=0.0, le=1e9)]


# --- OpenAI / OpenRouter chat-completions wire shape (unknown fields are ignored) ---


class _Function(Struct):
    name: str = ""
    arguments: str | dict[str, Any] | None = None


class _ToolCall(Struct):
    function: _Function
    id: str | None = None
    type: str | None = None


class _ReasoningDetail(Struct):
    type: str = ""
    text: str | None = None
    summary: str | None = None


class _LogprobToken(Struct):
    token: str
    bytes: list[Byte] | None = None
    logprob: float | None = None


class _Logprobs(Struct):
    content: list[_LogprobToken] | None = None


class _ChatMessage(Struct):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    reasoning_details: list[_ReasoningDetail] | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(Struct):
    message: _ChatMessage
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    logprobs: _Logprobs | None = None
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None
    error: Any = None


class _CompletionDetails(Struct):
    reasoning_tokens: NonNeg | None = None


class _ChatUsage(Struct):
    prompt_tokens: NonNeg | None = None
    completion_tokens: NonNeg | None = None
    completion_tokens_details: _CompletionDetails | None = None
    cost: Cost | None = None


class _ChatCompletion(Struct):
    choices: list[_Choice]
    model: str | None = None
    provider: str | None = None
    usage: _ChatUsage | None = None
    prompt_token_ids: list[TokenId] | None = None


# --- OpenAI text-completions wire shape (``POST /completions`` with ``prompt``) ---


class _TextChoice(Struct):
    text: str | None = None
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None
    error: Any = None


class _TextCompletion(Struct):
    choices: list[_TextChoice]
    model: str | None = None
    provider: str | None = None
    usage: _ChatUsage | None = None
    prompt_token_ids: list[TokenId] | None = None


# --- SGLang native /generate wire shape ---


class _SglangFinish(Struct):
    type: str | None = None
    message: str | None = None


class _SglangMeta(Struct):
    finish_reason: _SglangFinish | str | None = None
    prompt_tokens: NonNeg | None = None
    completion_tokens: NonNeg | None = None


class _SglangGenerate(Struct):
    text: str = ""
    output_ids: list[TokenId] | None = None
    meta_info: _SglangMeta = msgspec.field(default_factory=_SglangMeta)


def error_text(error: Any) -> str:
    """A short human-readable rendering of a provider's ``error`` object."""
    if isinstance(error, dict):
        message = error.get("message") or error.get("error") or ""
        code = error.get("code")
        text = f"{message} (code {code})" if code is not None else str(message)
        metadata = error.get("metadata")
        if metadata:
            text += f" {json.dumps(metadata, default=str)[:500]}"
        return text[:MAX_ERROR_TEXT]
    return str(error)[:MAX_ERROR_TEXT]


def error_upstream(error: Any) -> str | None:
    """The upstream an OpenRouter error names (``error.metadata.provider_name``), if any."""
    metadata = error.get("metadata") if isinstance(error, dict) else None
    name = metadata.get("provider_name") if isinstance(metadata, dict) else None
    return name[:100] if isinstance(name, str) and name else None


def _body_error(error: Any) -> ProviderFailure:
    """An error object inside an HTTP 200 body: retryable, unless it says 401/402."""
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and code in FATAL_STATUSES:
        return classify_status(code, error_text(error))
    return ProviderFailure(
        reason="provider_error_in_body", message=error_text(error), retryable=True, http_status=200
    )


def _shape_error(exc: Exception) -> ProviderFailure:
    return ProviderFailure(
        reason="provider_malformed_response",
        message=f"unexpected response shape: {exc}"[:MAX_ERROR_TEXT],
        retryable=True,
        http_status=200,
    )


def decode_json_body(content: bytes) -> Any:
    """Decode a response body; invalid JSON is a retryable ``provider_malformed_json``."""
    try:
        return msgspec.json.decode(content)
    except msgspec.DecodeError as exc:
        snippet = content[:200].decode("utf-8", "replace")
        raise ProviderFailure(
            reason="provider_malformed_json",
            message=f"{exc}; body starts {snippet!r}",
            retryable=True,
            http_status=200,
        ) from None


def _tool_calls(calls: list[_ToolCall] | None) -> list[ToolCall]:
    out: list[ToolCall] = []
    for call in calls or ():
        args = call.function.arguments
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append(
            ToolCall(
                function=ToolFunction(name=call.function.name, arguments=args),
                id=call.id or "",
                type=call.type or "function",
            )
        )
    return out


def _reasoning_from_details(details: list[_ReasoningDetail] | None) -> str:
    """The reasoning text carried by OpenRouter's ``reasoning_details`` (text parts only)."""
    parts = [d.text for d in details or () if d.type == "reasoning.text" and d.text]
    return "".join(parts)


def _first_choice(body: Any, shape: type[_ChatCompletion] | type[_TextCompletion]) -> tuple[Any, Any]:
    """(the decoded body, its first choice); errors in the body or in the choice raised classified."""
    if isinstance(body, dict) and body.get("error"):
        raise _body_error(body["error"])
    try:
        reply = msgspec.convert(body, shape)
    except msgspec.ValidationError as exc:
        raise _shape_error(exc) from None
    if not reply.choices:
        raise _shape_error(ValueError("no choices"))
    choice = reply.choices[0]
    if choice.error:
        raise _body_error(choice.error)
    if choice.finish_reason == "error":
        raise ProviderFailure(
            reason="provider_error_in_body",
            message=f"finish_reason error (native {choice.native_finish_reason!r})",
            retryable=True,
            http_status=200,
        )
    return reply, choice


def _usage(usage: _ChatUsage | None) -> Usage:
    if usage is None:
        return Usage()
    details = usage.completion_tokens_details
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        reasoning_tokens=details.reasoning_tokens if details else None,
        cost=usage.cost,
    )


def parse_completions(body: Any, *, native_ids: bool = False, sent_prompt: str = "") -> ProviderResult:
    """Parse a text-completions body: ``choices[0].text`` is the model's raw output.

    ``sent_prompt`` (the rendered prompt that was sent) travels with the result, so
    reconstruction encodes exactly that text as the prompt.
    """
    reply, choice = _first_choice(body, _TextCompletion)
    return ProviderResult(
        finish_reason=choice.finish_reason,
        native_finish_reason=choice.native_finish_reason,
        usage=_usage(reply.usage),
        model=reply.model,
        upstream_provider=reply.provider,
        native_output_ids=choice.token_ids if native_ids else None,
        native_prompt_ids=(reply.prompt_token_ids or choice.prompt_token_ids) if native_ids else None,
        mode="completions",
        text=choice.text or "",
        sent_prompt=sent_prompt,
    )


def _parse_chat(body: Any, *, native_ids: bool) -> ProviderResult:
    chat, choice = _first_choice(body, _ChatCompletion)
    message = choice.message
    reasoning = message.reasoning or message.reasoning_content or _reasoning_from_details(
        message.reasoning_details
    )
    usage = _usage(chat.usage)
    logprobs = None
    if choice.logprobs is not None and choice.logprobs.content is not None:
        logprobs = [
            LogprobToken(token=t.token, bytes=t.bytes, logprob=t.logprob) for t in choice.logprobs.content
        ]
    return ProviderResult(
        content=message.content or "",
        reasoning=reasoning,
        tool_calls=_tool_calls(message.tool_calls),
        finish_reason=choice.finish_reason,
        native_finish_reason=choice.native_finish_reason,
        usage=usage,
        model=chat.model,
        upstream_provider=chat.provider,
        native_output_ids=choice.token_ids if native_ids else None,
        native_prompt_ids=(chat.prompt_token_ids or choice.prompt_token_ids) if native_ids else None,
        logprobs=logprobs,
    )


def parse_openrouter(body: Any) -> ProviderResult:
    """Parse an OpenRouter chat-completions body (reasoning, provider, usage.cost, logprobs)."""
    return _parse_chat(body, native_ids=False)


def parse_openai(body: Any) -> ProviderResult:
    """Parse an OpenAI-compatible body (vLLM/SGLang): also ``reasoning_content`` and ``token_ids``."""
    return _parse_chat(body, native_ids=True)


def parse_sglang(body: Any, *, think_end: str | None = "</think>") -> ProviderResult:
    """Parse SGLang's native ``/generate`` body: output ids, finish reason and counts."""
    if isinstance(body, dict) and body.get("error"):
        raise _body_error(body["error"])
    try:
        gen = msgspec.convert(body, _SglangGenerate)
    except msgspec.ValidationError as exc:
        raise _shape_error(exc) from None
    finish = gen.meta_info.finish_reason
    finish_type = finish.type if isinstance(finish, _SglangFinish) else finish
    if finish_type == "abort":
        message = finish.message if isinstance(finish, _SglangFinish) else None
        raise ProviderFailure(
            reason="provider_error_in_body",
            message=f"request aborted: {message or 'no message'}",
            retryable=True,
            http_status=200,
        )
    reasoning, content = "", gen.text
    if think_end and think_end in gen.text:
        reasoning, _, content = gen.text.partition(think_end)
    return ProviderResult(
        content=content,
        reasoning=reasoning,
        finish_reason=finish_type,
        native_finish_reason=finish_type,
        usage=Usage(
            prompt_tokens=gen.meta_info.prompt_tokens, completion_tokens=gen.meta_info.completion_tokens
        ),
        native_output_ids=gen.output_ids,
    )
