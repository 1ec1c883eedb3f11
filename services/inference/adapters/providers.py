"""Provider clients behind one small interface: OpenRouter, OpenAI-compatible, SGLang, simulator.

Each provider turns a :class:`~schemas.PromptPublished` into one HTTP request and the answer
into a :class:`~services.inference.core.ProviderResult`. The response parsers
(:func:`parse_openrouter`, :func:`parse_openai`, :func:`parse_sglang`) are pure functions
over the decoded JSON body, so each wire shape is unit-tested on its own. Every failure is
raised as a classified :class:`~services.inference.core.ProviderFailure`; retrying is the
worker's business, not the client's. A request may carry ``may_send``, asked once more at the
last moment before its first byte is written: a halt that lands while a request waits for a
connection or for the event loop still stops it (:class:`~services.inference.core.NotSent`).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import json
import logging
import socket
import ssl
from collections.abc import Callable
from types import SimpleNamespace
from typing import Annotated, Any, Protocol

import aiohttp
import httpx
import msgspec
from httpx_aiohttp import HttpxAiohttpClient
from httpx_aiohttp.transport import AiohttpTransport
from msgspec import Meta, Struct

from schemas import LogprobToken, PromptPublished, ToolCall, ToolFunction, Usage, sample_key
from services.common.config import DatasetSettings, Settings
from services.inference.core import (
    FATAL_STATUSES,
    NotSent,
    ProviderCheck,
    ProviderFailure,
    ProviderResult,
    classify_status,
)
from services.inference.pacer import key_rate, stated_count, stated_rate

log = logging.getLogger(__name__)

KEY_HEADER = "X-Draftstream-Key"
SIMULATOR_FAULT_HEADER = "X-Simulator-Fault"
# PromptPublished.metadata keys honoured only by the simulator provider (fault injection in tests).
SIMULATOR_FAULT_METADATA = "simulator_fault"
SIMULATOR_HEADERS_METADATA = "simulator_headers"

_MAX_ERROR_TEXT = 2000
MODELS_NOT_IMPLEMENTED = frozenset({404, 405, 501})
"""Statuses of ``GET /models`` from a server that has no model list: unknown, not down."""

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


def _error_text(error: Any) -> str:
    """A short human-readable rendering of a provider's ``error`` object."""
    if isinstance(error, dict):
        message = error.get("message") or error.get("error") or ""
        code = error.get("code")
        text = f"{message} (code {code})" if code is not None else str(message)
        metadata = error.get("metadata")
        if metadata:
            text += f" {json.dumps(metadata, default=str)[:500]}"
        return text[:_MAX_ERROR_TEXT]
    return str(error)[:_MAX_ERROR_TEXT]


def _error_upstream(error: Any) -> str | None:
    """The upstream an OpenRouter error names (``error.metadata.provider_name``), if any."""
    metadata = error.get("metadata") if isinstance(error, dict) else None
    name = metadata.get("provider_name") if isinstance(metadata, dict) else None
    return name[:100] if isinstance(name, str) and name else None


def _body_error(error: Any) -> ProviderFailure:
    """An error object inside an HTTP 200 body: retryable, unless it says 401/402."""
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and code in FATAL_STATUSES:
        return classify_status(code, _error_text(error))
    return ProviderFailure(
        reason="provider_error_in_body", message=_error_text(error), retryable=True, http_status=200
    )


def _shape_error(exc: Exception) -> ProviderFailure:
    return ProviderFailure(
        reason="provider_malformed_response",
        message=f"unexpected response shape: {exc}"[:_MAX_ERROR_TEXT],
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


def key_rate_limit(data: dict[str, Any]) -> str:
    """The rate limit OpenRouter's ``GET /key`` reports (``rate_limit: {requests, interval}``), as text."""
    limit = data.get("rate_limit")
    requests = limit.get("requests") if isinstance(limit, dict) else None  # topology: not a topic
    if not isinstance(limit, dict) or requests is None:
        return ""
    return f", rate limit {requests} request(s) per {limit.get('interval') or '?'}"


# --- transport failures ---


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 20:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def transport_reason(exc: BaseException) -> str:
    """The reason code of a failure to reach the provider, from the whole exception chain.

    httpx-aiohttp reports every connect failure as ``ConnectTimeout``; the cause underneath
    tells a refused connection from a DNS failure, a TLS error or a real timeout.
    """
    chain = _causes(exc)
    names = {type(e).__name__ for e in chain}
    if any(isinstance(e, socket.gaierror) for e in chain) or "ClientConnectorDNSError" in names:
        return "provider_dns"
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return "provider_connection_refused"
    if any(isinstance(e, ssl.SSLError | ssl.CertificateError) for e in chain) or names & {
        "ClientConnectorCertificateError",
        "ClientConnectorSSLError",
        "ClientSSLError",
    }:
        return "provider_tls"
    if names & {"ServerDisconnectedError", "RemoteProtocolError", "ClientPayloadError"} or any(
        isinstance(e, ConnectionResetError | BrokenPipeError) for e in chain
    ):
        return "provider_connection_closed"
    if names & {"ConnectTimeout", "ConnectionTimeoutError"}:
        return "provider_connect_timeout"
    if any(isinstance(e, httpx.TimeoutException | TimeoutError) for e in chain):
        return "provider_timeout"
    return "provider_connection"


# --- requests ---


def sends_tools(prompt: PromptPublished, dataset: DatasetSettings) -> bool:
    """Whether the request carries the ``tools`` parameter (dataset opt-in, prompt has tools)."""
    return bool(dataset.send_tools and prompt.tools)


def chat_request_body(
    prompt: PromptPublished,
    dataset: DatasetSettings,
    *,
    model: str,
    max_tokens: int,
    extra_body: dict[str, Any],
    logprobs: bool,
    native_ids: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The chat-completions request body; ``extra_body`` (routing, reasoning...) is merged last.

    ``template_kwargs`` (the profile's thinking switch and kwargs) go out as
    ``chat_template_kwargs``, so the server renders the prompt the way reconstruction does.
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": prompt.wire,
        "max_tokens": max_tokens,
    }
    if sends_tools(prompt, dataset):
        body["tools"] = prompt.tools
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    if logprobs:
        body["logprobs"] = True
    if native_ids:
        body["return_token_ids"] = True
    body.update(extra_body)
    return body


def completions_request_body(
    prompt_text: str,
    *,
    model: str,
    max_tokens: int,
    extra_body: dict[str, Any],
    vllm_style: bool,
    native_ids: bool = False,
) -> dict[str, Any]:
    """The text-completions request body for a prompt already rendered by the profile's template.

    ``skip_special_tokens: false`` keeps the think and tool tokens in the text (vLLM, SGLang
    and the simulator take it; OpenRouter passes it on where an upstream does). A vLLM-style
    server (``vllm_style``) also gets ``add_special_tokens: false``: the rendered template
    already carries the BOS where the model has one, and the server's tokenizer would add a
    second. ``extra_body`` is merged last.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_text,
        "max_tokens": max_tokens,
        "skip_special_tokens": False,
    }
    if vllm_style:
        body["add_special_tokens"] = False
    if native_ids:
        body["return_token_ids"] = True
    body.update(extra_body)
    return body


COMPLETIONS_PATH = "/completions"
# Statuses that say "this server has no text-completions endpoint" (not "this request failed").
COMPLETIONS_REFUSED = frozenset({404, 405, 501})

MaySend = Callable[[], bool]


class Provider(Protocol):
    """One provider: sends a prompt, returns a :class:`ProviderResult` or raises ProviderFailure."""

    name: str

    async def complete(
        self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int, may_send: MaySend | None = None
    ) -> ProviderResult:
        """Send one request for ``prompt``; raises ProviderFailure on any failure.

        ``may_send`` is asked at the last moment before the request's first byte is written
        (a connection in hand); when it says no, nothing is sent and :class:`NotSent` is raised.
        """
        ...

    def tools_sent(self, prompt: PromptPublished, dataset: DatasetSettings) -> bool:
        """Whether a request for ``prompt`` carries ``tools``."""
        ...

    def request_identity(self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int) -> dict[str, Any]:
        """What decides the answer to ``prompt``'s request (hashed into the response store key)."""
        ...

    async def check(self) -> ProviderCheck:
        """Whether the provider is reachable, the key valid and the model served (no cost)."""
        ...

    async def check_completions(self) -> ProviderCheck:
        """Completions mode: whether the provider serves ``POST .../completions`` (one 1-token request)."""
        ...


class HttpPoster(Protocol):
    """What a provider needs from an HTTP client: ``httpx.AsyncClient`` or a pool of them."""

    async def post(self, url: str | httpx.URL, *, content: bytes, headers: dict[str, str]) -> httpx.Response:
        """POST ``content`` to ``url``."""
        ...

    async def get(self, url: str, *, headers: dict[str, str]) -> httpx.Response:
        """GET ``url`` (pre-flight and outage probes)."""
        ...


class _HttpProvider:
    """Shared HTTP plumbing: auth, the key header, status and transport classification."""

    name = "openrouter"
    completion_path = "/chat/completions"  # where requests are POSTed, under base_url

    def __init__(self, settings: Settings, client: HttpPoster) -> None:
        self._settings = settings
        self._provider = settings.provider
        self._client = client
        self._base = self._provider.base_url.rstrip("/")
        self._urls: dict[str, httpx.URL] = {}  # parsed once: httpx parses a str URL per request
        self._secret = self._provider.api_key.get_secret_value() if self._provider.api_key else None

    def tools_sent(self, prompt: PromptPublished, dataset: DatasetSettings) -> bool:
        """Whether a request for ``prompt`` carries ``tools``."""
        return sends_tools(prompt, dataset)

    def _headers(self, prompt: PromptPublished) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            KEY_HEADER: sample_key(prompt.dataset, prompt.sample_id),
        }
        if self._secret:
            headers["Authorization"] = f"Bearer {self._secret}"
        return headers

    def _redact(self, text: str) -> str:
        if self._secret and len(self._secret) >= 4:
            return text.replace(self._secret, "**********")
        return text

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str], may_send: MaySend | None = None
    ) -> Any:
        """POST JSON; returns the decoded body or raises a classified ProviderFailure.

        ``may_send`` is asked now and, on the client of :func:`make_http_client`, again once a
        connection is in hand, just before the first byte is written; a no raises :class:`NotSent`.
        """
        _withhold_unless(may_send)
        asked = _MAY_SEND.set(may_send)
        try:
            url = self._urls.get(path) or self._urls.setdefault(path, httpx.URL(f"{self._base}{path}"))
            response = await self._client.post(url, content=msgspec.json.encode(body), headers=headers)
        except (httpx.TransportError, OSError) as exc:
            withheld = next((e for e in _causes(exc) if isinstance(e, NotSent)), None)
            if withheld is not None:
                raise withheld from None
            raise ProviderFailure(
                reason=transport_reason(exc),
                message=self._redact(f"{type(exc).__name__}: {exc}"),
                retryable=True,
            ) from None
        finally:
            _MAY_SEND.reset(asked)
        try:
            return self._decoded(response)
        finally:
            _unbind(response)

    def _decoded(self, response: httpx.Response) -> Any:
        """The body of a 2xx answer, decoded; a classified ProviderFailure for any other."""
        if not 200 <= response.status_code < 300:
            text, upstream = response.text[:_MAX_ERROR_TEXT], None
            try:
                parsed = json.loads(text)
                if isinstance(parsed, dict) and parsed.get("error"):
                    text, upstream = _error_text(parsed["error"]), _error_upstream(parsed["error"])
            except ValueError:
                pass
            failure = classify_status(response.status_code, self._redact(text), response.headers.get("retry-after"))
            failure.upstream = upstream
            if response.status_code == 429:
                failure.stated_rps = stated_rate(response.headers)
                failure.stated_count = stated_count(response.headers)
            raise failure
        return decode_json_body(response.content)


    # --- pre-flight and probes -------------------------------------------------------

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._secret}"} if self._secret else {}

    async def _get_data(self, url: str, got: httpx.Response | ProviderCheck | None = None) -> Any:
        """GET ``url`` (unless ``got`` is its answer already) and return the ``data`` field of its
        JSON answer (None when absent or not JSON).

        A transport failure or a non-2xx answer comes back as the failed :class:`ProviderCheck`.
        """
        if got is None:
            got = await self._get(url)
        if isinstance(got, ProviderCheck):
            return got
        failed = self._status_check(url, got)
        if failed is not None:
            return failed
        try:
            return got.json().get("data")
        except (ValueError, AttributeError):
            return None

    async def _get(self, url: str) -> httpx.Response | ProviderCheck:
        """GET ``url``; a transport failure comes back as a failed (outage) check."""
        try:
            return await self._client.get(url, headers=self._auth_headers())
        except (httpx.TransportError, OSError) as exc:
            reason = transport_reason(exc)
            return ProviderCheck(
                ok=False,
                reason=reason,
                message=self._redact(f"cannot reach {url} ({reason}): {type(exc).__name__}: {exc}"),
                outage=True,
            )

    def _status_check(self, url: str, response: httpx.Response) -> ProviderCheck | None:
        """The failed check a non-2xx answer means, or None for a 2xx."""
        status = response.status_code
        if 200 <= status < 300:
            return None
        text = self._redact(response.text[:300])
        if status in (401, 403):
            return ProviderCheck(
                ok=False,
                reason="provider_key_rejected",
                message=f"the provider refused the API key: GET {url} answered HTTP {status}: {text}",
            )
        if status == 404:
            return ProviderCheck(
                ok=False,
                reason="provider_base_url_404",
                message=f"base URL answers 404: GET {url} answered HTTP 404 (check provider.base_url)",
                outage=True,
            )
        return ProviderCheck(
            ok=False,
            reason=f"provider_http_{status}",
            message=f"GET {url} answered HTTP {status}: {text}",
            outage=status >= 500 or status in (408, 429),
        )

    async def _models_check(self, url: str, *, require_model: bool) -> ProviderCheck:
        """``GET .../models`` answers, and (when asked) lists the configured model.

        A server that does not implement the list (404, 405, 501) is not down: when its
        completion endpoint is there, the check passes as ``unknown`` and the first real
        request decides. Whether it is there costs nothing to ask: a ``GET`` of the path
        the requests are POSTed to answers 405 (or any status but 404) on a server that
        serves it, and 404 under a wrong base URL, which is an outage.
        """
        got = await self._get(url)
        if not isinstance(got, ProviderCheck) and got.status_code in MODELS_NOT_IMPLEMENTED:
            endpoint = f"{self._base}{self.completion_path}"
            served = await self._get(endpoint)
            if isinstance(served, ProviderCheck):
                return served
            if served.status_code != 404:
                return ProviderCheck(
                    ok=True,
                    unknown=True,
                    reason=f"provider_models_http_{got.status_code}",
                    detail=(
                        f"GET {url} answered HTTP {got.status_code} (no model list), GET {endpoint} HTTP "
                        f"{served.status_code} (the endpoint is there): the first request decides"
                    ),
                )
            failed = self._status_check(endpoint, served)  # a 404: the base URL is wrong
            if failed is not None:
                return failed
        data = await self._get_data(url, got)
        if isinstance(data, ProviderCheck):
            return data
        listed = [str(m.get("id")) for m in data or [] if isinstance(m, dict)] if isinstance(data, list | None) else []
        model = self._provider.model
        if require_model and model not in listed:
            shown = ", ".join(listed[:10]) or "none"
            return ProviderCheck(
                ok=False,
                reason="provider_model_not_served",
                message=f"GET {url} does not list the model {model!r} (provider.model); it serves: {shown}",
            )
        return ProviderCheck(ok=True, detail=f"GET {url}: {len(listed)} model(s) listed")

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/models`` answers (the model listed is checked by OpenAI-compatible kinds)."""
        return await self._models_check(f"{self._base}/models", require_model=False)

    async def check_completions(self) -> ProviderCheck:
        """Completions mode: one 1-token ``POST <base_url>/completions``; 404/405/501 mean not served.

        Which upstreams serve text completions is not documented for every provider: only a
        request shows it (``OPENROUTER.md``). Any other failure says nothing about the
        endpoint (the outage checks deal with it) and passes.
        """
        url = f"{self._base}{COMPLETIONS_PATH}"
        body = {"model": self._provider.model, "prompt": "Hello", "max_tokens": 1}
        headers = {"Content-Type": "application/json", **self._auth_headers()}
        try:
            await self._post(COMPLETIONS_PATH, body, headers)
        except ProviderFailure as failure:
            if failure.http_status in COMPLETIONS_REFUSED:
                return ProviderCheck(
                    ok=False,
                    reason="completions_unsupported",
                    message=(
                        f"completions mode: the provider refuses POST {url} (HTTP {failure.http_status}: "
                        f"{failure.message[:200]}); set mode = \"chat\" for this dataset or use a provider "
                        "that serves text completions"
                    ),
                )
            return ProviderCheck(ok=True, detail=f"POST {url}: {failure} (not a refusal of the endpoint)")
        return ProviderCheck(ok=True, detail=f"POST {url} answers")


class OpenRouterProvider(_HttpProvider):
    """OpenRouter's chat completions (reasoning, routing options passed through)."""

    name = "openrouter"
    native_ids = False
    # OpenRouter takes thinking switches through its own `reasoning` parameter (extra_body).
    sends_template_kwargs = False
    # vLLM-style servers take `add_special_tokens` on text completions (OpenRouter does not).
    vllm_style = False
    _load_profile: ProfileLoader | None = None

    def completion_prompt(self, prompt: PromptPublished, dataset: DatasetSettings) -> str:
        """Completions mode: the prompt rendered by the dataset profile's template, tools included.

        A template that cannot render this prompt is the prompt's fault: a final
        ``chat_template_error`` (a dead letter), never a crash.
        """
        if self._load_profile is None:
            self._load_profile = default_profile_loader(self._settings)
        tools = prompt.tools if sends_tools(prompt, dataset) else None
        try:
            profile = self._load_profile(dataset.profile)
            return profile.render_prompt(prompt.messages, tools, reasoning=prompt.conversation is not None)
        except Exception as exc:  # noqa: BLE001 - jinja2 and profile errors alike: this prompt cannot be sent
            raise ProviderFailure(
                reason="chat_template_error",
                message=f"completions mode: profile {dataset.profile!r} cannot render the prompt: "
                f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT],
                retryable=False,
            ) from None

    def _completions(self, dataset: DatasetSettings) -> bool:
        return self._settings.mode_of(dataset) == "completions"

    def template_kwargs(self, dataset: DatasetSettings) -> dict[str, Any] | None:
        """The dataset profile's ``chat_template_kwargs`` (thinking on/off), for servers that take them."""
        if not self.sends_template_kwargs:
            return None
        from services.profiles import ProfileError, profile_spec

        try:
            return profile_spec(dataset.profile, self._settings).render_kwargs() or None
        except ProfileError:
            return None  # an unknown profile is refused by pre-flight and reconstruct, not here

    def _body(self, prompt: PromptPublished, dataset: DatasetSettings, max_tokens: int) -> dict[str, Any]:
        if self._completions(dataset):
            return completions_request_body(
                self.completion_prompt(prompt, dataset),
                model=self._provider.model,
                max_tokens=max_tokens,
                extra_body=self._provider.extra_body,
                vllm_style=self.vllm_style,
                native_ids=self.native_ids,
            )
        return chat_request_body(
            prompt,
            dataset,
            model=self._provider.model,
            max_tokens=max_tokens,
            extra_body=self._provider.extra_body,
            logprobs=self._provider.request_logprobs,
            native_ids=self.native_ids,
            template_kwargs=self.template_kwargs(dataset),
        )

    def request_identity(self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int) -> dict[str, Any]:
        """The request body exactly as sent (messages or the rendered prompt, tools, model, sampling, max_tokens).

        In completions mode the identity also names the mode: a chat and a completions request
        for the same prompt are different requests (their bodies differ too: ``prompt`` text).
        """
        if not self._completions(dataset):
            return {"provider": self.name, "body": self._body(prompt, dataset, max_tokens)}
        try:
            return {"provider": self.name, "mode": "completions", "body": self._body(prompt, dataset, max_tokens)}
        except ProviderFailure as failure:  # complete() raises it again: a dead letter, nothing paid
            return {"provider": self.name, "mode": "completions", "unrenderable": failure.message}

    async def complete(
        self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int, may_send: MaySend | None = None
    ) -> ProviderResult:
        """Send one chat- or text-completions request for ``prompt`` (unless ``may_send`` says no: :class:`NotSent`)."""
        body = self._body(prompt, dataset, max_tokens)
        completions = self._completions(dataset)
        path = COMPLETIONS_PATH if completions else self.completion_path
        data = await self._post(path, body, self._headers(prompt), may_send)
        if not completions:
            return self._parse(data)
        try:
            return parse_completions(data, native_ids=self.native_ids, sent_prompt=body["prompt"])
        except ProviderFailure as failure:
            failure.message = self._redact(failure.message)
            raise

    async def check(self) -> ProviderCheck:
        """A key is set and valid (``GET /key``: its credit limit and usage are logged)."""
        if not self._secret:
            return ProviderCheck(
                ok=False,
                reason="provider_key_missing",
                message=(
                    "OpenRouter needs an API key and none is set: export OPENROUTER_API_KEY "
                    "(or DRAFTSTREAM_PROVIDER__API_KEY) before starting inference"
                ),
            )
        url = f"{self._base}/key"
        data = await self._get_data(url)
        if isinstance(data, ProviderCheck):
            return data
        if not isinstance(data, dict):
            data = {}
        limit, usage, remaining = data.get("limit"), data.get("usage"), data.get("limit_remaining")
        detail = (
            f"OpenRouter key {data.get('label') or '?'}: credit limit "
            f"{'none' if limit is None else f'${limit}'}, usage ${usage if usage is not None else '?'}"
            + (f", remaining ${remaining}" if remaining is not None else "")
            + key_rate_limit(data)
        )
        if remaining is not None and isinstance(remaining, int | float) and remaining <= 0:
            return ProviderCheck(
                ok=False, reason="provider_credit_exhausted", message=f"{detail}: no credit left on this key"
            )
        return ProviderCheck(ok=True, detail=detail, rate_limit_rps=key_rate(data))

    parse_body: Callable[[Any], ProviderResult] = staticmethod(parse_openrouter)

    def _parse(self, data: Any) -> ProviderResult:
        try:
            return self.parse_body(data)
        except ProviderFailure as failure:
            failure.message = self._redact(failure.message)
            raise


class OpenAIProvider(OpenRouterProvider):
    """Any OpenAI-compatible server; asks for output token ids (vLLM ``return_token_ids``)."""

    name = "openai"
    native_ids = True
    sends_template_kwargs = True
    vllm_style = True
    parse_body = staticmethod(parse_openai)

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/models`` answers and lists ``provider.model``."""
        return await self._models_check(f"{self._base}/models", require_model=True)


class SimulatorProvider(OpenRouterProvider):
    """The local simulator: OpenRouter's shape, plus test-only fault headers from metadata."""

    name = "simulator"
    sends_template_kwargs = True
    vllm_style = True

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/models`` answers (the simulator serves any model name)."""
        return await _HttpProvider.check(self)

    def _headers(self, prompt: PromptPublished) -> dict[str, str]:
        headers = super()._headers(prompt)
        fault = prompt.metadata.get(SIMULATOR_FAULT_METADATA)
        if isinstance(fault, str) and fault:
            headers[SIMULATOR_FAULT_HEADER] = fault
        extra = prompt.metadata.get(SIMULATOR_HEADERS_METADATA)
        if isinstance(extra, dict):
            for name, value in extra.items():
                if isinstance(name, str) and name.lower().startswith("x-simulator-"):
                    headers[name] = str(value)
        return headers


class PromptEncoder(Protocol):
    """What the SGLang provider needs from a model profile."""

    def render_prompt(self, messages: Any, tools: Any, *, reasoning: bool = False) -> str:
        """The chat-template text of a prompt, ending where the assistant turn starts."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, as the server tokenizes it."""
        ...


ProfileLoader = Callable[[str], PromptEncoder]


def default_profile_loader(settings: Settings) -> ProfileLoader:
    """Load profiles through services.profiles, once per name."""
    cache: dict[str, PromptEncoder] = {}

    def load(name: str) -> PromptEncoder:
        if name not in cache:
            # Imported by name: services.profiles is optional until a sglang provider needs it.
            profiles = importlib.import_module("services.profiles")
            cache[name] = profiles.load_profile(name, settings)
        return cache[name]

    return load


class SGLangProvider(_HttpProvider):
    """SGLang's native ``/generate`` with ``input_ids`` from the profile's chat template."""

    name = "sglang"
    completion_path = "/generate"

    def __init__(
        self, settings: Settings, client: HttpPoster, profile_loader: ProfileLoader | None = None
    ) -> None:
        super().__init__(settings, client)
        self._load_profile = profile_loader or default_profile_loader(settings)

    def tools_sent(self, prompt: PromptPublished, dataset: DatasetSettings) -> bool:
        """Whether the chat template renders the tool definitions into ``input_ids``.

        Same rule as the chat APIs' ``tools`` parameter (the dataset's ``send_tools``), so
        reconstruction renders the prompt exactly as the model saw it.
        """
        return sends_tools(prompt, dataset)

    async def input_ids(self, prompt: PromptPublished, dataset: DatasetSettings) -> list[int]:
        """The prompt's token ids under the dataset's profile (rendered off the event loop)."""
        profile = await asyncio.to_thread(self._load_profile, dataset.profile)

        def render() -> list[int]:
            tools = prompt.tools if self.tools_sent(prompt, dataset) else None
            text = profile.render_prompt(prompt.messages, tools, reasoning=prompt.conversation is not None)
            return profile.encode_prompt(text)

        return await asyncio.to_thread(render)

    def _sampling(self, max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
        extra = dict(self._provider.extra_body)
        sampling: dict[str, Any] = {"max_new_tokens": max_tokens, "skip_special_tokens": False}
        sampling.update(extra.pop("sampling_params", {}) or {})
        return sampling, extra

    def request_identity(self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int) -> dict[str, Any]:
        """What the ``input_ids`` are rendered from (messages, tools, profile) plus the sampling."""
        sampling, extra = self._sampling(max_tokens)
        return {
            "provider": self.name,
            "model": self._provider.model,
            "messages": prompt.wire,
            "tools": prompt.tools if self.tools_sent(prompt, dataset) else None,
            "profile": dataset.profile,
            "sampling_params": sampling,
            "extra_body": extra,
        }

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/v1/models`` answers (SGLang names the model by its path)."""
        return await self._models_check(f"{self._base}/v1/models", require_model=False)

    async def check_completions(self) -> ProviderCheck:
        """SGLang's native ``/generate`` is raw text from ``input_ids`` already: nothing to check."""
        return ProviderCheck(ok=True, detail="sglang /generate takes rendered input_ids: raw text by construction")

    async def complete(
        self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int, may_send: MaySend | None = None
    ) -> ProviderResult:
        """Send one ``/generate`` request for ``prompt`` (unless ``may_send`` says no: :class:`NotSent`)."""
        ids = await self.input_ids(prompt, dataset)
        sampling, extra = self._sampling(max_tokens)
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling, "stream": False}
        body.update(extra)
        data = await self._post(self.completion_path, body, self._headers(prompt), may_send)
        try:
            return parse_sglang(data)
        except ProviderFailure as failure:
            failure.message = self._redact(failure.message)
            raise


def make_provider(
    settings: Settings, client: HttpPoster, *, profile_loader: ProfileLoader | None = None
) -> Provider:
    """The provider named by ``settings.provider.kind``."""
    kind = settings.provider.kind
    if kind == "openrouter":
        return OpenRouterProvider(settings, client)
    if kind == "openai":
        return OpenAIProvider(settings, client)
    if kind == "sglang":
        return SGLangProvider(settings, client, profile_loader)
    return SimulatorProvider(settings, client)


# --- the last moment before a request is written ---

# The ``may_send`` of the request being sent: set by _HttpProvider._post in the request's own
# task, so aiohttp's trace callbacks (run in that task, or in the body-writing task it starts,
# which copies the task's context) read the right one.
_MAY_SEND: contextvars.ContextVar[MaySend | None] = contextvars.ContextVar("draftstream_may_send", default=None)


def _unbind(response: httpx.Response) -> None:
    """Break the reference cycle between an httpx response and its stream once the body is read.

    httpx binds the stream to its response (``response.stream._response is response``), so a
    response is freed only by the cycle collector, and its body with it. At 1,000 requests in
    flight with answers of thousands of tokens (and their logprobs) those bodies piled up between
    collections, and each young-generation collection freed thousands of them at once: 100-160 ms
    with nothing else running in the worker (the control follower's thread included).
    """
    response.stream = httpx.ByteStream(b"")


def _withhold_unless(may_send: MaySend | None) -> None:
    """Raise :class:`NotSent` when ``may_send`` says the request must not go out."""
    if may_send is not None and not may_send():
        raise NotSent("withheld before any byte of the request was written")


async def _before_headers(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
    """A connection is in hand; aiohttp is about to serialise the headers (nothing written yet)."""
    _withhold_unless(_MAY_SEND.get())


async def _before_first_chunk(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
    """aiohttp is about to write the first body chunk; the headers still wait in its buffer.

    On Python < 3.12 the body is written by a task of its own, one event-loop turn after the
    headers were buffered: a halt applied meanwhile still stops the request here. aiohttp
    reports the raised NotSent as a connection error caused by it and closes the connection.
    """
    if getattr(ctx, "asked", False):
        return  # a later chunk: the request is on the wire already
    ctx.asked = True
    _withhold_unless(_MAY_SEND.get())


class _LastMomentTransport(AiohttpTransport):
    """httpx-aiohttp's transport whose session asks each request's ``may_send`` before writing it."""

    def get_client(self) -> aiohttp.ClientSession:
        """The aiohttp session (created once, on the first request): the pool plus the trace hooks."""
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_before_headers)
        trace.on_request_chunk_sent.append(_before_first_chunk)
        connector = aiohttp.TCPConnector(
            limit=self.limits.max_connections or 0,
            keepalive_timeout=self.limits.keepalive_expiry,
            ssl=self.ssl_context,
        )
        return aiohttp.ClientSession(connector=connector, trace_configs=[trace])


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing a server sets."""

    def extract_cookies(self, response: httpx.Response) -> None:
        """Ignore the response's ``Set-Cookie`` headers."""


class _ProviderClient(HttpxAiohttpClient):  # type: ignore[misc]  # httpx-aiohttp ships no type stubs
    """httpx's client without a cookie jar: a provider authenticates each request with its key.

    httpx reads every response's cookies through urllib's cookie machinery (a urllib request
    built from the httpx one, the host parsed as an IP address): a tenth of the worker's
    time spent in httpx, for cookies (a CDN's, say) that no provider call needs.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._none = _NoCookies()

    @property  # type: ignore[override]
    def cookies(self) -> httpx.Cookies:
        """Always empty."""
        return self._none

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        """Nothing is kept."""


def make_http_client(settings: Settings) -> httpx.AsyncClient:
    """An httpx client on aiohttp's connection pool, sized for ``provider.concurrency``.

    httpcore's pool scans every connection for every request it schedules (O(n) per
    request, worse with idle ones), which caps one process far below 1,000 requests in
    flight; the ``httpx-aiohttp`` transport keeps httpx's API over aiohttp's pool. Its
    requests ask their ``may_send`` once a connection is in hand, before any byte is written
    (:meth:`_HttpProvider._post`), so a halt applied while a request waited for a connection
    or for the event loop still stops it.
    """
    p = settings.provider
    limits = httpx.Limits(max_connections=p.concurrency, max_keepalive_connections=p.concurrency)
    return _ProviderClient(
        timeout=httpx.Timeout(p.timeout_s, connect=p.connect_timeout_s),
        limits=limits,
        transport=_LastMomentTransport(limits=limits),
    )
