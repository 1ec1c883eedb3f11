"""Provider response shapes and request building, over httpx.MockTransport (parsing only)."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from schemas import Message, PromptPublished
from services.common.config import DatasetSettings, Settings, load_settings
from services.inference.adapters.http_provider import KEY_HEADER
from services.inference.adapters.providers import (
    SIMULATOR_FAULT_HEADER,
    OpenAIProvider,
    OpenRouterProvider,
    SGLangProvider,
    SimulatorProvider,
    make_provider,
)
from services.inference.adapters.transport import make_http_client
from services.inference.adapters.wire import parse_openai, parse_openrouter, parse_sglang
from services.inference.core import ProviderFailure
from services.profiles import load_profile
from tests.conformance import truth as T

SECRET = "sk-or-v1-test-secret-0123456789"

# An OpenRouter answer as the API returns it (DeepSeek via a routed upstream).
OPENROUTER_EXAMPLE: dict[str, Any] = {
    "id": "gen-1745-abc",
    "provider": "DeepInfra",
    "model": "deepseek/deepseek-r1",
    "object": "chat.completion",
    "created": 1745000000,
    "choices": [
        {
            "logprobs": None,
            "finish_reason": "stop",
            "native_finish_reason": "stop",
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "The answer is 4.",
                "refusal": None,
                "reasoning": "2 + 2 is 4.",
                "reasoning_details": [{"type": "reasoning.text", "text": "2 + 2 is 4.", "format": "unknown"}],
            },
        }
    ],
    "usage": {
        "prompt_tokens": 12,
        "completion_tokens": 11,
        "total_tokens": 23,
        "cost": 0.0000231,
        "is_byok": False,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 6},
    },
}


def _prompt(**kw: Any) -> PromptPublished:
    base: dict[str, Any] = {
        "dataset": "tools",
        "sample_id": "s-7",
        "messages": [Message(role="user", content="what is 2+2?")],
    }
    base.update(kw)
    return PromptPublished(**base)


def _settings(**provider: Any) -> Settings:
    return load_settings(None, provider={"base_url": "http://provider.test/api/v1", **provider})


class Recorder:
    """A MockTransport handler that records requests and replays canned responses."""

    def __init__(self, *responses: httpx.Response | Exception) -> None:
        self.responses = list(responses)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        item = self.responses.pop(0) if len(self.responses) > 1 else self.responses[0]
        if isinstance(item, Exception):
            raise item
        return item

    def body(self, i: int = -1) -> dict[str, Any]:
        return json.loads(self.requests[i].content)  # type: ignore[no-any-return]


def _client(recorder: Recorder) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(recorder))


# --- pure parsers --------------------------------------------------------------------


def test_openrouter_example_with_reasoning_provider_and_cost() -> None:
    r = parse_openrouter(OPENROUTER_EXAMPLE)
    assert r.content == "The answer is 4."
    assert r.reasoning == "2 + 2 is 4."
    assert r.upstream_provider == "DeepInfra" and r.model == "deepseek/deepseek-r1"
    assert r.finish_reason == "stop" and r.native_finish_reason == "stop"
    assert r.usage.prompt_tokens == 12 and r.usage.completion_tokens == 11
    assert r.usage.reasoning_tokens == 6 and r.usage.cost == pytest.approx(0.0000231)
    assert r.native_output_ids is None and r.logprobs is None and r.tool_calls == []


def test_openrouter_reasoning_details_only_and_logprobs_and_debug_ids() -> None:
    body = json.loads(json.dumps(OPENROUTER_EXAMPLE))
    msg = body["choices"][0]["message"]
    msg["reasoning"] = None
    msg["reasoning_details"] = [
        {"type": "reasoning.summary", "summary": "ignored"},
        {"type": "reasoning.text", "text": "part one, "},
        {"type": "reasoning.text", "text": "part two"},
    ]
    body["choices"][0]["logprobs"] = {
        "content": [
            {"token": "The", "bytes": [84, 104, 101], "logprob": -0.1, "top_logprobs": []},
            {"token": " answer", "bytes": None, "logprob": -0.2},
        ]
    }
    r = parse_openrouter(body)
    assert r.reasoning == "part one, part two"
    assert r.logprobs is not None and [t.token for t in r.logprobs] == ["The", " answer"]
    assert r.logprobs[0].bytes == [84, 104, 101] and r.logprobs[1].logprob == -0.2


def test_openrouter_structured_tool_calls() -> None:
    body = json.loads(json.dumps(OPENROUTER_EXAMPLE))
    body["choices"][0]["finish_reason"] = "tool_calls"
    body["choices"][0]["message"].update(
        content=None,
        tool_calls=[
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
            {"id": "call_2", "type": "function", "function": {"name": "mul", "arguments": {"b": 3}}},
        ],
    )
    r = parse_openrouter(body)
    assert r.content == "" and r.finish_reason == "tool_calls"
    assert [(c.id, c.function.name) for c in r.tool_calls] == [("call_1", "add"), ("call_2", "mul")]
    assert r.tool_calls[0].function.arguments == '{"a": 2}'
    assert json.loads(r.tool_calls[1].function.arguments) == {"b": 3}


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"code": 502, "message": "Provider returned error"}},
        {**OPENROUTER_EXAMPLE, "choices": [{**OPENROUTER_EXAMPLE["choices"][0], "error": {"code": 500}}]},
        {**OPENROUTER_EXAMPLE, "choices": [{**OPENROUTER_EXAMPLE["choices"][0], "finish_reason": "error"}]},
    ],
)
def test_error_inside_a_200_is_a_retryable_failure(body: dict[str, Any]) -> None:
    with pytest.raises(ProviderFailure) as info:
        parse_openrouter(body)
    assert info.value.reason == "provider_error_in_body" and info.value.retryable


def test_credit_error_inside_a_200_is_fatal() -> None:
    with pytest.raises(ProviderFailure) as info:
        parse_openrouter({"error": {"code": 402, "message": "Insufficient credits"}})
    assert info.value.fatal and info.value.http_status == 402


@pytest.mark.parametrize(
    "body",
    [
        {"choices": []},
        {"object": "chat.completion"},
        [1, 2],
        {"choices": [{"message": {"content": 5}}]},
        {**OPENROUTER_EXAMPLE, "usage": {"completion_tokens": -3}},
    ],
)
def test_unexpected_shapes_are_retryable_malformed_responses(body: Any) -> None:
    with pytest.raises(ProviderFailure) as info:
        parse_openrouter(body)
    assert info.value.reason == "provider_malformed_response" and info.value.retryable


def test_openai_reasoning_content_and_native_token_ids() -> None:
    body = {
        "id": "chatcmpl-1",
        "model": "deepseek-ai/DeepSeek-V3",
        "prompt_token_ids": [0, 128803, 17],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
                "finish_reason": "stop",
                "token_ids": [5, 6, 7, 1],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    r = parse_openai(body)
    assert r.reasoning == "simple sum" and r.content == "4"
    assert r.native_output_ids == [5, 6, 7, 1]
    assert r.usage.completion_tokens == 4 and r.usage.cost is None
    # the same body through the OpenRouter parser ignores token ids (OpenRouter has none)
    assert parse_openrouter(body).native_output_ids is None


def test_sglang_generate_shape() -> None:
    body = {
        "text": "let me think</think>The answer is 4.",
        "output_ids": [11, 12, 128822, 13, 1],
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "stop", "matched": 1},
            "prompt_tokens": 9,
            "completion_tokens": 5,
            "cached_tokens": 0,
        },
    }
    r = parse_sglang(body)
    assert r.native_output_ids == [11, 12, 128822, 13, 1]
    assert r.finish_reason == "stop" and r.usage.prompt_tokens == 9 and r.usage.completion_tokens == 5
    assert r.reasoning == "let me think" and r.content == "The answer is 4."
    length = parse_sglang({**body, "meta_info": {"finish_reason": {"type": "length", "length": 5}}})
    assert length.finish_reason == "length"


def test_sglang_abort_is_a_retryable_failure() -> None:
    with pytest.raises(ProviderFailure) as info:
        parse_sglang({"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}})
    assert info.value.reason == "provider_error_in_body" and "oom" in info.value.message


# --- requests over a mock transport --------------------------------------------------


async def test_openrouter_request_headers_body_and_options() -> None:
    settings = _settings(
        kind="openrouter",
        api_key=SECRET,
        model="deepseek/deepseek-r1",
        extra_body={
            "reasoning": {"effort": "high"},
            "provider": {"order": ["DeepInfra"], "require_parameters": True},
        },
        request_logprobs=True,
    )
    rec = Recorder(httpx.Response(200, json=OPENROUTER_EXAMPLE))
    async with _client(rec) as client:
        provider = make_provider(settings, client)
        assert isinstance(provider, OpenRouterProvider) and provider.name == "openrouter"
        tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
        prompt = _prompt(tools=tools)
        result = await provider.complete(prompt, settings.dataset("tools"), max_tokens=321)
    assert result.usage.cost == pytest.approx(0.0000231)
    req = rec.requests[0]
    assert str(req.url) == "http://provider.test/api/v1/chat/completions"
    assert req.headers["Authorization"] == f"Bearer {SECRET}"
    assert req.headers[KEY_HEADER] == "tools:s-7"
    assert SIMULATOR_FAULT_HEADER not in req.headers
    body = rec.body()
    assert body["model"] == "deepseek/deepseek-r1" and body["max_tokens"] == 321
    # The row's tools reach the model in the prompt text (raw tool text: no tools parameter, no parser):
    # the messages sent render, by the OFFICIAL Qwen3 template without tools, to its render of the row with them.
    def official(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return T.render_template(T.template_source("Qwen-Qwen3-0.6B.jinja"), messages, tools=tools,
                                 add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")  # fmt: skip

    assert body["messages"][0]["role"] == "system" and body["messages"][1:] == prompt.wire
    assert official(body["messages"], None) == official(prompt.wire, tools)
    assert body["reasoning"] == {"effort": "high"}
    assert body["provider"] == {"order": ["DeepInfra"], "require_parameters": True}
    assert body["logprobs"] is True
    assert "tools" not in body
    assert "return_token_ids" not in body
    assert provider.tools_sent(prompt, settings.dataset("tools")) is True  # the template renders them: reconstruct too


async def test_an_old_send_tools_true_still_sends_the_tools_parameter() -> None:
    settings = load_settings(
        None,
        provider={"kind": "openrouter", "base_url": "http://provider.test/api/v1"},
        datasets={"tools": {"send_tools": True}},
    )
    rec = Recorder(httpx.Response(200, json=OPENROUTER_EXAMPLE))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    async with _client(rec) as client:
        provider = make_provider(settings, client)
        await provider.complete(_prompt(tools=tools), settings.dataset("tools"), max_tokens=10)
        await provider.complete(_prompt(), settings.dataset("tools"), max_tokens=10)
        assert provider.tools_sent(_prompt(tools=tools), settings.dataset("tools")) is True
        assert provider.tools_sent(_prompt(), settings.dataset("tools")) is False
    assert settings.dataset("tools").tool_route == "parameter"
    assert rec.body(0)["tools"] == tools and rec.body(0)["messages"] == _prompt().wire  # once: not in the text too
    assert "tools" not in rec.body(1)
    assert "Authorization" not in rec.requests[0].headers  # no key configured, none sent


async def test_openai_asks_for_token_ids() -> None:
    settings = _settings(kind="openai")
    reply = {"choices": [{"message": {"content": "x"}, "token_ids": [3, 1]}]}
    rec = Recorder(httpx.Response(200, json=reply))
    async with _client(rec) as client:
        provider = make_provider(settings, client)
        assert isinstance(provider, OpenAIProvider)
        result = await provider.complete(_prompt(), settings.defaults, max_tokens=5)
    assert rec.body()["return_token_ids"] is True
    assert result.native_output_ids == [3, 1]


async def test_simulator_passes_test_fault_headers_from_metadata() -> None:
    settings = _settings(kind="simulator")
    rec = Recorder(httpx.Response(200, json=OPENROUTER_EXAMPLE))
    prompt = _prompt(metadata={"simulator_fault": "429", "simulator_headers": {"X-Simulator-Extra": "1",
                                                                                "Authorization": "nope"}})
    async with _client(rec) as client:
        provider = make_provider(settings, client)
        assert isinstance(provider, SimulatorProvider)
        await provider.complete(prompt, settings.defaults, max_tokens=5)
        # the same metadata means nothing to a real provider
        await OpenRouterProvider(settings, client).complete(prompt, settings.defaults, max_tokens=5)
    assert rec.requests[0].headers[SIMULATOR_FAULT_HEADER] == "429"
    assert rec.requests[0].headers["X-Simulator-Extra"] == "1"
    assert "Authorization" not in rec.requests[0].headers
    assert SIMULATOR_FAULT_HEADER not in rec.requests[1].headers


def _caused(exc: Exception, cause: BaseException) -> Exception:
    """``exc`` raised from ``cause`` (as httpx-aiohttp maps aiohttp's errors)."""
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(
    ("response", "reason", "retryable", "status"),
    [
        (httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {"code": 429, "message": "slow"}}),
         "provider_http_429", True, 429),
        (httpx.Response(503, text="<html>bad gateway</html>"), "provider_http_5xx", True, 503),
        (httpx.Response(400, json={"error": {"code": 400, "message": "bad model"}}),
         "provider_http_4xx", False, 400),
        (httpx.Response(200, content=b'{"choices": [tru'), "provider_malformed_json", True, 200),
        (httpx.Response(200, json={"error": {"code": 502, "message": "upstream"}}),
         "provider_error_in_body", True, 200),
        (httpx.ReadTimeout("timed out"), "provider_timeout", True, None),
        (httpx.ConnectError("refused"), "provider_connection", True, None),
        (httpx.RemoteProtocolError("peer closed connection"), "provider_connection_closed", True, None),
        (_caused(httpx.ConnectTimeout("connect"), ConnectionRefusedError(111, "refused")),
         "provider_connection_refused", True, None),
        (_caused(httpx.ConnectTimeout("connect"), socket.gaierror(-2, "Name or service not known")),
         "provider_dns", True, None),
        (httpx.ConnectTimeout("connect timed out"), "provider_connect_timeout", True, None),
    ],
)
async def test_http_failures_are_classified(
    response: httpx.Response | Exception, reason: str, retryable: bool, status: int | None
) -> None:
    settings = _settings(kind="openrouter", api_key=SECRET)
    async with _client(Recorder(response)) as client:
        with pytest.raises(ProviderFailure) as info:
            await make_provider(settings, client).complete(_prompt(), settings.defaults, max_tokens=5)
    assert (info.value.reason, info.value.retryable, info.value.http_status) == (reason, retryable, status)
    if reason == "provider_http_429":
        assert info.value.retry_after_s == 3.0
        assert "slow" in info.value.message


@pytest.mark.parametrize("status", [401, 402])
async def test_auth_failures_are_fatal_and_never_echo_the_key(status: int) -> None:
    settings = _settings(kind="openrouter", api_key=SECRET)
    echo = httpx.Response(status, json={"error": {"code": status, "message": f"key {SECRET} is invalid"}})
    async with _client(Recorder(echo)) as client:
        with pytest.raises(ProviderFailure) as info:
            await make_provider(settings, client).complete(_prompt(), settings.defaults, max_tokens=5)
    assert info.value.fatal and info.value.http_status == status
    assert SECRET not in info.value.message and SECRET not in str(info.value)
    assert "invalid" in info.value.message


async def test_sglang_sends_input_ids_from_the_profile() -> None:
    settings = _settings(
        kind="sglang", base_url="http://sglang.test", extra_body={"sampling_params": {"temperature": 0.6}}
    )
    reply = {"text": "ok", "output_ids": [100, 1], "meta_info": {"finish_reason": {"type": "stop"},
                                                                  "prompt_tokens": 7, "completion_tokens": 2}}
    rec = Recorder(httpx.Response(200, json=reply))
    async with _client(rec) as client:
        provider = SGLangProvider(settings, client)  # the real default (qwen3) profile
        result = await provider.complete(_prompt(), settings.defaults, max_tokens=64)
    profile = load_profile(settings.defaults.profile, settings)
    assert str(rec.requests[0].url) == "http://sglang.test/generate"
    body = rec.body()
    ids = body["input_ids"]
    assert ids == profile.encode_prompt(profile.render_prompt(_prompt().messages, None))
    # Qwen3 ChatML, written out: <|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n
    assert ids[0] == 151644 and ids.count(151645) == 1 and ids[-3:-1] == [151644, 77091]
    assert body["sampling_params"] == {"max_new_tokens": 64, "skip_special_tokens": False, "temperature": 0.6}
    assert result.native_output_ids == [100, 1] and result.usage.completion_tokens == 2


async def test_the_worker_client_pools_connections_for_the_configured_concurrency() -> None:
    client = make_http_client(_settings(concurrency=1000))
    try:
        assert isinstance(client, httpx.AsyncClient)
        assert client._transport.limits.max_connections == 1000  # type: ignore[attr-defined]
    finally:
        await client.aclose()


# --- pre-flight checks and request identity ----------------------------------------------


async def test_openrouter_without_a_key_fails_the_check_without_a_request() -> None:
    rec = Recorder(httpx.Response(200, json={"data": {}}))
    async with _client(rec) as client:
        check = await make_provider(_settings(kind="openrouter"), client).check()
    assert not check.ok and check.reason == "provider_key_missing" and not check.outage
    assert "OPENROUTER_API_KEY" in check.message
    assert rec.requests == []


async def test_openrouter_check_reads_the_key_limit_and_usage() -> None:
    body = {"data": {"label": "sk-or-v1-abc...", "limit": 50, "usage": 12.5, "limit_remaining": 37.5}}
    rec = Recorder(httpx.Response(200, json=body))
    async with _client(rec) as client:
        check = await make_provider(_settings(kind="openrouter", api_key=SECRET), client).check()
    assert check.ok, check
    assert "$50" in check.detail and "12.5" in check.detail and "37.5" in check.detail
    assert rec.requests[0].method == "GET" and rec.requests[0].url.path.endswith("/key")
    assert rec.requests[0].headers["Authorization"] == f"Bearer {SECRET}"


async def test_a_rejected_key_and_a_wrong_base_url_fail_the_check() -> None:
    for response, reason, outage in (
        (httpx.Response(401, json={"error": {"code": 401, "message": "No auth"}}), "provider_key_rejected", False),
        (httpx.Response(404, text="not found"), "provider_base_url_404", True),
        (httpx.Response(503, text="busy"), "provider_http_503", True),
    ):
        async with _client(Recorder(response)) as client:
            check = await make_provider(_settings(kind="openrouter", api_key=SECRET), client).check()
        assert (check.ok, check.reason, check.outage) == (False, reason, outage)
        assert SECRET not in check.message


async def test_openai_check_requires_the_model_in_the_list() -> None:
    settings = _settings(kind="openai", model="qwen/qwen3-8b")
    listed = Recorder(httpx.Response(200, json={"data": [{"id": "qwen/qwen3-8b"}, {"id": "other"}]}))
    async with _client(listed) as client:
        assert (await make_provider(settings, client).check()).ok
    assert listed.requests[0].url.path.endswith("/models")
    missing = Recorder(httpx.Response(200, json={"data": [{"id": "other"}]}))
    async with _client(missing) as client:
        check = await make_provider(settings, client).check()
    assert (check.ok, check.reason) == (False, "provider_model_not_served")
    assert "other" in check.message and "qwen/qwen3-8b" in check.message


@pytest.mark.parametrize("status", [404, 405, 501])
@pytest.mark.parametrize("kind", ["openai", "simulator", "sglang"])
async def test_a_server_without_a_model_list_is_unknown_not_down(kind: str, status: int) -> None:
    # GET /models: not there; GET of the completion path: 405, the route exists (POST only).
    rec = Recorder(httpx.Response(status, text="not implemented"), httpx.Response(405, text="method not allowed"))
    async with _client(rec) as client:
        check = await make_provider(_settings(kind=kind, model="qwen/qwen3-8b"), client).check()
    assert (check.ok, check.unknown, check.outage) == (True, True, False)
    assert check.reason == f"provider_models_http_{status}" and "first request decides" in check.detail
    assert [r.method for r in rec.requests] == ["GET", "GET"]
    assert rec.requests[0].url.path.endswith("/models")
    assert rec.requests[1].url.path.endswith("/generate" if kind == "sglang" else "/chat/completions")


@pytest.mark.parametrize("status", [404, 405, 501])
async def test_no_model_list_and_no_completion_endpoint_is_a_wrong_base_url(status: int) -> None:
    rec = Recorder(httpx.Response(status, text="no"), httpx.Response(404, text="not found"))
    async with _client(rec) as client:
        check = await make_provider(_settings(kind="openai", model="m"), client).check()
    assert (check.ok, check.unknown, check.reason, check.outage) == (False, False, "provider_base_url_404", True)
    assert "/chat/completions" in check.message


async def test_a_refused_key_or_a_5xx_on_the_model_list_still_fails_the_check() -> None:
    for status, reason, outage in ((401, "provider_key_rejected", False), (402, "provider_http_402", False),
                                   (503, "provider_http_503", True)):
        async with _client(Recorder(httpx.Response(status, text="no"))) as client:
            check = await make_provider(_settings(kind="openai", model="m"), client).check()
        assert (check.ok, check.unknown, check.reason, check.outage) == (False, False, reason, outage)


async def test_an_unreachable_provider_is_an_outage_with_its_own_reason() -> None:
    refused = _caused(httpx.ConnectTimeout("connect"), ConnectionRefusedError(111, "refused"))
    async with _client(Recorder(refused)) as client:
        check = await make_provider(_settings(kind="simulator"), client).check()
    assert (check.ok, check.reason, check.outage) == (False, "provider_connection_refused", True)


NO_CLIENT: Any = None  # request_identity never touches the HTTP client


def test_request_identity_changes_with_what_decides_the_answer() -> None:
    from services.inference.core import request_hash

    settings = _settings(kind="simulator")
    provider = make_provider(settings, NO_CLIENT)
    base = request_hash(provider.request_identity(_prompt(), settings.defaults, max_tokens=5))
    assert base == request_hash(provider.request_identity(_prompt(), settings.defaults, max_tokens=5))
    assert base != request_hash(provider.request_identity(_prompt(), settings.defaults, max_tokens=6))
    other_text = _prompt(messages=[Message(role="user", content="something else")])
    assert base != request_hash(provider.request_identity(other_text, settings.defaults, max_tokens=5))
    hot = _settings(kind="simulator", extra_body={"temperature": 0.9})
    hot_provider = make_provider(hot, NO_CLIENT)
    assert base != request_hash(hot_provider.request_identity(_prompt(), hot.defaults, max_tokens=5))
    # metadata is not sent to the provider: it does not change the request
    tagged = _prompt(metadata={"source_line": 7})
    assert base == request_hash(provider.request_identity(tagged, settings.defaults, max_tokens=5))


async def test_a_429_naming_an_openrouter_upstream_carries_it_and_its_retry_after() -> None:
    body = {"error": {"code": 429, "message": "Provider returned error",
                      "metadata": {"provider_name": "DeepInfra", "raw": "rate limited upstream"}}}
    rec = Recorder(httpx.Response(429, headers={"Retry-After": "2"}, json=body))
    async with _client(rec) as client:
        provider = make_provider(_settings(kind="openrouter", api_key=SECRET), client)
        with pytest.raises(ProviderFailure) as caught:
            await provider.complete(_prompt(), DatasetSettings(), max_tokens=8)
    failure = caught.value
    assert (failure.http_status, failure.reason, failure.upstream) == (429, "provider_http_429", "DeepInfra")
    assert failure.retry_after_s == 2.0 and failure.retryable
    # The key's own limit names no upstream.
    own = Recorder(httpx.Response(429, json={"error": {"code": 429, "message": "Rate limit exceeded"}}))
    async with _client(own) as client:
        with pytest.raises(ProviderFailure) as caught:
            await make_provider(_settings(kind="openrouter", api_key=SECRET), client).complete(
                _prompt(), DatasetSettings(), max_tokens=8
            )
    assert caught.value.upstream is None and caught.value.retry_after_s is None


async def test_openrouter_check_logs_the_keys_rate_limit_when_it_reports_one() -> None:
    body = {"data": {"label": "k", "limit": None, "usage": 0, "rate_limit": {"requests": 200, "interval": "10s"}}}
    async with _client(Recorder(httpx.Response(200, json=body))) as client:
        check = await make_provider(_settings(kind="openrouter", api_key=SECRET), client).check()
    assert check.ok and "rate limit 200 request(s) per 10s" in check.detail
    async with _client(Recorder(httpx.Response(200, json={"data": {"label": "k"}}))) as client:
        check = await make_provider(_settings(kind="openrouter", api_key=SECRET), client).check()
    assert check.ok and "rate limit" not in check.detail
