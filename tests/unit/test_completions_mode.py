"""Completions mode: request building, the raw-text reconstruct, the simulator's route, pre-flight.

Truth from outside the code under test: the official Qwen3 (and DeepSeek-R1) chat templates in
``../shared/reference`` rendered the way ``tests/conformance/truth.py`` renders them (Hugging
Face semantics), and the real tokenizers (``truth.truth_tokenizer``), never our ``render_prompt``
or ``encode``. MockTransport only shows what a request carries and parses a canned reply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from aiohttp import web

import schemas as s
from schemas import Message, PromptPublished, ResponseReceived, SampleReconstructed, Usage
from services.audit.core import audit_batch
from services.common.config import AuditThresholds, Settings, load_settings
from services.common.records import DeadLetter
from services.inference.adapters.providers import make_provider
from services.inference.adapters.transport import make_http_client
from services.inference.adapters.wire import parse_completions
from services.inference.core import ProviderFailure, request_hash
from services.inference.guard import ProviderGuard
from services.profiles import load_profile
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct_batch
from services.reconstruct.raw import plan_raw
from services.simulator.app import start_simulator
from services.simulator.core import raw_completion_text
from services.simulator.options import SimulatorOptions
from services.simulator.request import parse_completion_request
from tests.bare_server import bare_server
from tests.conformance import truth as T

CHAT_TEMPLATES = T.reference_dir() / "chat-templates"
QWEN3_TEMPLATE = (CHAT_TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]  # fmt: skip
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
RAW = (
    "<think>\nThe user wants the weather in Paris.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
EOT = "<|im_end|>"


def official_qwen3(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The official Qwen3 template's render, generation prompt on (Hugging Face semantics)."""
    return T.render_template(QWEN3_TEMPLATE, messages, tools=tools, add_generation_prompt=True, bos_token="",
                             eos_token=EOT)


def _prompt(tools: list[dict[str, Any]] | None = TOOLS, dataset: str = "toolsc") -> PromptPublished:
    return PromptPublished(dataset=dataset, sample_id="s-1", messages=[msgspec.convert(m, Message) for m in MESSAGES],
                           tools=tools)


def _settings(kind: str = "simulator", **more: Any) -> Settings:
    return load_settings(
        None,
        provider={"kind": kind, "base_url": "http://provider.test/api/v1", "mode": "completions", **more},
        datasets={"toolsc": {"send_tools": True}, "chatty": {"mode": "chat"}},
    )


def _response(text: str, *, finish: str = "stop", tools: list[dict[str, Any]] | None = TOOLS) -> ResponseReceived:
    sent = official_qwen3(MESSAGES, tools)
    return ResponseReceived(dataset="toolsc", sample_id="s-1", prompt=_prompt(tools), provider="simulator",
                            model="qwen/qwen3-8b", profile="qwen3", finish_reason=finish, tools_sent=tools is not None,
                            usage=Usage(prompt_tokens=len(T.truth_tokenizer("qwen3").encode_prompt(sent)),
                                        completion_tokens=len(T.truth_tokenizer("qwen3").encode_output(text + EOT))),
                            mode="completions", text=text, sent_prompt=sent)


def _rebuild(response: ResponseReceived) -> SampleReconstructed | DeadLetter:
    (verdict,) = reconstruct_batch([response], load_profile("qwen3"), CONVENTIONS["vllm"])
    return verdict


class _Recorder:
    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(200, json=self.reply)


COMPLETION_REPLY = {"object": "text_completion", "model": "qwen/qwen3-8b",
                    "choices": [{"index": 0, "text": RAW, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 180, "completion_tokens": 33}}  # fmt: skip


# --- the raw-text reconstruct ------------------------------------------------------------


def test_raw_text_rebuilds_the_official_prompt_and_the_true_output_ids() -> None:
    verdict = _rebuild(_response(RAW))
    assert isinstance(verdict, SampleReconstructed), verdict
    truth = T.truth_tokenizer("qwen3")
    assert verdict.prompt_ids == truth.encode_prompt(official_qwen3(MESSAGES, TOOLS))
    assert verdict.output_ids == truth.encode_output(RAW + EOT)
    assert verdict.output_ids[-1] == 151645 and verdict.method == "reencode"
    # Derived with the profile's own markers, nothing stripped.
    derived = verdict.response
    assert derived.reasoning == "\nThe user wants the weather in Paris.\n" and derived.content == "\n\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in derived.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    (audited,) = audit_batch([verdict], load_profile("qwen3"), AuditThresholds(usage_offset=0))
    assert audited.passed, [r for r in audited.results if not r.passed]


def test_a_stop_token_the_server_kept_in_the_text_is_not_doubled() -> None:
    verdict = _rebuild(msgspec.structs.replace(_response(RAW), text=RAW + EOT))
    assert isinstance(verdict, SampleReconstructed)
    assert verdict.output_ids == T.truth_tokenizer("qwen3").encode_output(RAW + EOT)


def test_a_cut_answer_gets_no_end_of_turn() -> None:
    cut = "<think>\nThe user wants"
    plan = plan_raw(_response(cut, finish="length"), load_profile("qwen3"))
    assert not isinstance(plan, DeadLetter)
    assert plan.output_text == cut and plan.layout is not None and not plan.layout.end_of_turn
    assert plan.response.reasoning == "\nThe user wants" and plan.response.content == ""


def test_two_think_ends_in_the_raw_text_are_a_dead_letter() -> None:
    verdict = _rebuild(_response("<think>\na\n</think>\n\nb</think> c"))
    assert isinstance(verdict, DeadLetter) and verdict.reason == "special_token_in_text", verdict


def test_a_control_token_the_model_cannot_write_is_a_dead_letter() -> None:
    verdict = _rebuild(_response("<think>\na\n</think>\n\nb<|im_start|>user"))
    assert isinstance(verdict, DeadLetter) and verdict.reason == "special_token_in_text", verdict


def test_empty_text_is_a_dead_letter() -> None:
    verdict = _rebuild(_response(""))
    assert isinstance(verdict, DeadLetter) and verdict.reason == "empty_response"


def test_tool_tokens_where_the_prompt_offered_no_tools_fail_the_audit() -> None:
    response = msgspec.structs.replace(_response(RAW, tools=None), prompt=_prompt(tools=None))
    verdict = _rebuild(response)
    assert isinstance(verdict, SampleReconstructed)
    (audited,) = audit_batch([verdict], load_profile("qwen3"), AuditThresholds(usage_offset=0))
    assert not audited.passed and "tool_calls_well_formed" in audited.reasons


def test_an_old_response_payload_decodes_as_chat_mode() -> None:
    fixture = Path(__file__).parents[1] / "fixtures" / "payloads" / "v1_response.json"
    old = s.decode(fixture.read_bytes(), ResponseReceived)
    assert (old.mode, old.text, old.sent_prompt) == ("chat", "", "")


# --- request building ----------------------------------------------------------------------


async def test_completions_request_sends_the_official_render_with_tools_as_prompt() -> None:
    settings = _settings()
    rec = _Recorder(COMPLETION_REPLY)
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        provider = make_provider(settings, client)
        result = await provider.complete(_prompt(), settings.dataset("toolsc"), max_tokens=77)
    (request,) = rec.requests
    assert str(request.url) == "http://provider.test/api/v1/completions"
    body = json.loads(request.content)
    assert body["prompt"] == official_qwen3(MESSAGES, TOOLS)  # tools in Qwen3's native <tools> block
    assert "<tools>" in body["prompt"] and "messages" not in body and "tools" not in body
    assert (body["max_tokens"], body["skip_special_tokens"], body["add_special_tokens"]) == (77, False, False)
    assert (result.mode, result.text, result.finish_reason) == ("completions", RAW, "stop")
    assert result.sent_prompt == body["prompt"] and result.usage.completion_tokens == 33


async def test_openrouter_completions_passes_skip_special_tokens_but_not_add_special_tokens() -> None:
    settings = _settings("openrouter", api_key="sk-or-test-0123456789")
    rec = _Recorder(COMPLETION_REPLY)
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        await make_provider(settings, client).complete(_prompt(), settings.dataset("toolsc"), max_tokens=5)
    body = json.loads(rec.requests[0].content)
    assert str(rec.requests[0].url).endswith("/api/v1/completions")
    assert body["skip_special_tokens"] is False and "add_special_tokens" not in body


async def test_a_dataset_in_chat_mode_still_sends_chat_under_a_completions_provider() -> None:
    settings = _settings()
    reply = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
    rec = _Recorder(reply)
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        result = await make_provider(settings, client).complete(_prompt(dataset="chatty"), settings.dataset("chatty"),
                                                                max_tokens=5)
    assert str(rec.requests[0].url).endswith("/chat/completions") and result.mode == "chat"


def test_mode_comes_from_the_environment_and_a_dataset_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(None).provider.mode == "chat"
    monkeypatch.setenv("DRAFTSTREAM_PROVIDER__MODE", "completions")
    settings = load_settings(None, datasets={"chatty": {"mode": "chat"}})
    assert settings.mode_of(settings.dataset("other")) == "completions"
    assert settings.mode_of(settings.dataset("chatty")) == "chat"


def test_the_request_hash_covers_the_mode_and_the_prompt_text() -> None:
    settings = _settings()
    provider = make_provider(settings, client=None)  # type: ignore[arg-type]  # nothing is sent
    prompt, dataset = _prompt(), settings.dataset("toolsc")
    completions = provider.request_identity(prompt, dataset, max_tokens=10)
    chat = provider.request_identity(_prompt(dataset="chatty"), settings.dataset("chatty"), max_tokens=10)
    assert completions["mode"] == "completions" and "mode" not in chat
    assert completions["body"]["prompt"] == official_qwen3(MESSAGES, TOOLS)
    assert request_hash(completions) != request_hash({**completions, "mode": "chat"})
    other = msgspec.structs.replace(prompt, messages=[*prompt.messages[:1], Message(role="user", content="Rome?")])
    assert request_hash(provider.request_identity(other, dataset, max_tokens=10)) != request_hash(completions)


def test_deepseek_r1_prompt_carries_its_bos_once_and_the_server_adds_none() -> None:
    settings = load_settings(None, provider={"kind": "openai", "mode": "completions"},
                             datasets={"r1": {"profile": "deepseek-r1"}})
    provider = make_provider(settings, client=None)  # type: ignore[arg-type]  # nothing is sent
    body = provider.request_identity(_prompt(tools=None, dataset="r1"), settings.dataset("r1"), max_tokens=9)["body"]
    r1 = (CHAT_TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(encoding="utf-8")
    official = T.render_template(r1, MESSAGES, add_generation_prompt=True, bos_token=T.DS_BOS, eos_token=T.DS_EOS)
    assert body["prompt"] == official and official.count(T.DS_BOS) == 1 and official.startswith(T.DS_BOS)
    assert body["add_special_tokens"] is False  # vLLM would otherwise add a second BOS


@pytest.mark.parametrize("body", [{"error": {"code": 500, "message": "x"}}, {"choices": []}, {"choices": "x"},
                                  {"choices": [{"text": "a", "finish_reason": "error"}]}])  # fmt: skip
def test_bad_completions_bodies_are_classified_failures(body: dict[str, Any]) -> None:
    with pytest.raises(ProviderFailure) as err:
        parse_completions(body)
    assert err.value.retryable and err.value.reason in {"provider_error_in_body", "provider_malformed_response"}
    assert parse_completions({"choices": [{}]}).text == ""  # no text at all: reconstruct's empty_response


# --- the simulator's completions route and pre-flight ---------------------------------------


def test_simulator_reads_the_tools_from_the_rendered_prompt() -> None:
    prompt = official_qwen3(MESSAGES, TOOLS)
    request, text = parse_completion_request(json.dumps({"prompt": prompt, "max_tokens": 20}).encode())
    assert text == prompt and request.tools == TOOLS and request.max_tokens == 20
    request, _ = parse_completion_request(json.dumps({"prompt": official_qwen3(MESSAGES, None)}).encode())
    assert request.tools is None


def test_simulator_raw_text_drops_only_the_final_stop_token() -> None:
    profile = load_profile("qwen3")
    ids = T.truth_tokenizer("qwen3").encode_output(RAW + EOT)
    assert raw_completion_text(profile, ids) == RAW
    assert raw_completion_text(profile, ids[:-1]) == RAW  # cut before the stop token: nothing dropped


async def test_simulator_answers_completions_with_raw_text_and_truth() -> None:
    sim = await start_simulator(SimulatorOptions(keep_truth=True))
    settings = load_settings(None, provider={"base_url": sim.url, "mode": "completions"},
                             datasets={"toolsc": {"send_tools": True}})
    client = make_http_client(settings)
    try:
        provider = make_provider(settings, client)
        assert (await provider.check_completions()).ok
        result = await provider.complete(_prompt(), settings.dataset("toolsc"), max_tokens=2000)
    finally:
        await client.aclose()
        truth = sim.truth()
        await sim.close()
    assert result.mode == "completions" and result.finish_reason == "stop"
    assert "<tool_call>" in result.text and "</think>" in result.text and EOT not in result.text
    true_ids = truth["toolsc:s-1"]
    assert T.truth_tokenizer("qwen3").encode_output(result.text + EOT) == true_ids
    assert result.usage.completion_tokens == len(true_ids)
    assert result.usage.prompt_tokens == len(T.truth_tokenizer("qwen3").encode_prompt(official_qwen3(MESSAGES, TOOLS)))


class _Halts:
    """What the guard needs of a HaltFollower: the standing halts and a way to publish one."""

    def __init__(self) -> None:
        self.listeners: list[Any] = []
        self.published: list[Any] = []

    def standing(self, scope: str) -> None:
        return None

    async def publish(self, event: Any) -> None:
        self.published.append(event)


@pytest.mark.parametrize("status", [404, 405, 501])
async def test_preflight_halts_a_completions_dataset_the_provider_refuses(status: int) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": status, "message": "no such route"}}, status=status)

    halts = _Halts()
    async with bare_server("/v1/completions", refuse) as port:
        settings = load_settings(None, provider={"base_url": f"http://127.0.0.1:{port}/v1", "mode": "completions"},
                                 datasets={"toolsc": {}, "chatty": {"mode": "chat"}})
        client = make_http_client(settings)
        try:
            guard = ProviderGuard(settings, make_provider(settings, client), halts)  # type: ignore[arg-type]
            assert await guard.check_dataset("toolsc") is False
            assert await guard.check_dataset("chatty") is True  # chat mode: the endpoint is not needed
        finally:
            await client.aclose()
    (halt,) = halts.published
    assert halt.scope == "toolsc" and halt.by == "preflight"
    assert "completions mode" in halt.reason and f"HTTP {status}" in halt.reason
    assert guard.preflight["toolsc"].reason == "completions_unsupported"
