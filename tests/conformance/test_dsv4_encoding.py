"""DeepSeek-V4 prompts and tool calls against DeepSeek's own encoder, not against our template.

Truth: ``encoding_dsv4.py``, DeepSeek's reference encoder for V4, as vLLM 0.33.0 ships and renders V4 prompts
with (``vllm/tokenizers/deepseek_v4_encoding.py``: ``encode_messages``; SGLang 0.5.23 ships no copy — it calls
DeepSeek's ``deepseek-recipe`` package). The file is self-contained (json, copy, typing), so it is loaded
straight from the hash-pinned engines env (``make engines``), without importing vLLM. Request tools attach
to the first system message, one with no content inserted first when there is none, as vLLM's
``DeepseekV4Tokenizer.apply_chat_template`` does before calling the encoder. Reasoning effort: the
encoder's default ("low", no effort preamble).

Checked: our ``deepseek-v4`` profile renders every conversation shape (tools, assistant tool calls, tool
results out of call order, a user message right after results, thinking on and off) to the encoder's exact
text and ids; structured tool calls are rebuilt into the DSML the encoder writes for that call; and a V4
tool-call answer comes back from reconstruct with the ids of the encoder's text; and vLLM 0.33.0's own
deepseek_v4 parsers, run on encoder-written answers, return fields that reassemble to that text with our DSML.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from functools import cache
from types import ModuleType
from typing import Any

import msgspec
import pytest

from schemas import LogprobToken, Message, PromptPublished, ResponseReceived, SampleReconstructed, ToolCall, Usage
from services.audit.core import audit_batch
from services.common.config import AuditThresholds, load_settings
from services.common.kafka import DeadLetter
from services.profiles import Profile, load_profile
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct
from tests.conformance import engines as E
from tests.conformance import truth as T

EOS = "<｜end▁of▁sentence｜>"


@cache
def encoder() -> ModuleType:
    """DeepSeek's V4 encoder, loaded from the engines env's vLLM wheel as a standalone module."""
    path = E.ensure_engines_env() / "vllm" / "tokenizers" / "deepseek_v4_encoding.py"
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def encoder_prompt(messages: list[dict], tools: list[dict] | None, thinking: bool) -> str:
    """The prompt a V4 server renders: vLLM's tool attachment, then ``encode_messages``."""
    sent = copy.deepcopy(messages)
    if tools:
        index = next((i for i, m in enumerate(sent) if m.get("role") == "system"), None)
        if index is None:
            sent.insert(0, {"role": "system"})
            index = 0
        sent[index]["tools"] = tools
    return encoder().encode_messages(sent, thinking_mode="thinking" if thinking else "chat")


@cache
def v4(thinking: bool) -> Profile:
    if thinking:
        return load_profile("deepseek-v4")
    return load_profile("deepseek-v4-off", load_settings(None, profiles={
        "deepseek-v4-off": {"base": "deepseek-v4", "thinking": False}}))  # fmt: skip


def call(cid: str, name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}


WEATHER = call("c1", "get_weather", {"city": "東京", "unit": "celsius"})
SEARCH = call("c2", "search_docs", '{"query":"kafka \\"acks\\"","limit":3,"tags":["a",1,true,null],"x":{"y":1.5}}')
HISTORY = [
    {"role": "system", "content": "You are helpful.\n"},
    {"role": "user", "content": "Weather in 東京, and the docs on acks?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [WEATHER, SEARCH]},
    {"role": "tool", "tool_call_id": "c2", "content": '{"hits": 2}'},  # out of call order
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 °C"},
]
SHAPES: dict[str, list[dict]] = {
    "single_turn": [HISTORY[0], HISTORY[1]],
    "no_system": [HISTORY[1]],
    "after_tool_results": HISTORY,
    "user_after_tool_results": [*HISTORY, {"role": "user", "content": "Thanks. Now Paris?"}],
    "tool_round_then_answer_then_user": [
        *HISTORY, {"role": "assistant", "content": "It is sunny; two hits."}, {"role": "user", "content": "And Zürich?"}
    ],
    "calls_without_content": [HISTORY[1], {"role": "assistant", "content": "", "tool_calls": [SEARCH]},
                              {"role": "tool", "tool_call_id": "c2", "content": "none"}],
    "multi_turn_no_tools": [
        HISTORY[0], {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
}  # fmt: skip


def _messages(raw: list[dict]) -> list[Message]:
    return [msgspec.convert(m, Message) for m in raw]


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "chat"])
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no_tools"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_v4_prompt_equals_deepseeks_encoder(shape: str, with_tools: bool, thinking: bool) -> None:
    raw = SHAPES[shape]
    tools = copy.deepcopy(T._TOOLS) if with_tools else None
    want = encoder_prompt(raw, tools, thinking)
    profile = v4(thinking)
    ours = profile.render_prompt(_messages(raw), tools)
    assert ours == want
    assert profile.encode(ours) == profile.encode(want)  # the same text: the same ids, by construction
    if with_tools:
        assert "## Tools" in ours and "<｜DSML｜invoke" in encoder_prompt(HISTORY, tools, thinking)


def _encoder_block(calls: list[dict]) -> str:
    """The tool-call text the encoder writes for an assistant turn holding ``calls`` (and no content)."""
    turn = encoder_prompt([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}],
                          None, False)  # fmt: skip
    head = "<｜User｜>q<｜Assistant｜></think>"
    assert turn.startswith(encoder().bos_token + head) and turn.endswith(EOS)
    return turn[len(encoder().bos_token + head) : -len(EOS)]


@pytest.mark.parametrize("calls", [[WEATHER], [SEARCH], [WEATHER, SEARCH], [call("c3", "noop", {})]],
                         ids=["strings", "json_values", "two_calls", "no_arguments"])  # fmt: skip
def test_structured_calls_are_rebuilt_into_the_encoders_dsml(calls: list[dict]) -> None:
    structured = [msgspec.convert(c, ToolCall) for c in calls]
    pieces = v4(True).tool_call_pieces(structured)
    text = "".join(p for p in pieces if isinstance(p, str))
    assert "\n\n" + text == _encoder_block(calls)  # the "\n\n" before the block is the content's (vLLM)


def _v4_answer(tail: str) -> tuple[ResponseReceived, list[int]]:
    """A V4 tool-call answer to the single-turn prompt: the response and the ids the model wrote."""
    profile = v4(True)
    messages = SHAPES["single_turn"]
    reasoning, content = "The user wants the weather.", "Checking."
    ids = profile.encode(reasoning + "</think>" + content + tail + EOS)
    prompt = PromptPublished(dataset="v4", sample_id="s1", messages=_messages(messages), tools=T._TOOLS,
                             max_tokens=512)  # fmt: skip
    prompt_tokens = len(profile.encode(encoder_prompt(messages, T._TOOLS, True)))
    response = ResponseReceived(
        dataset="v4", sample_id="s1", prompt=prompt, provider="vllm", model="deepseek-v4", reasoning=reasoning,
        content=content + "\n\n", tool_calls=[msgspec.convert(WEATHER, ToolCall)], finish_reason="tool_calls",
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(ids)), tools_sent=True,
    )  # fmt: skip
    return response, ids


def _with_logprobs(response: ResponseReceived, ids: list[int]) -> ResponseReceived:
    profile = v4(True)
    tokens = [LogprobToken(token=profile.decode([i]), bytes=list(profile.token_bytes(i))) for i in ids]
    return msgspec.structs.replace(response, logprobs=tokens)


def test_v4_tool_call_answer_through_reconstruct_and_audit() -> None:
    """vLLM's deepseek_v4 parser returns JSON built from the DSML parameters: without the model's tokens nothing
    proves the block (a count that singles out the encoder's form is no proof: issue 53), so it is refused naming
    the argument text; with them, the sample holds the encoder's ids and passes the audit's DSML check."""
    profile = v4(True)
    response, want = _v4_answer(_encoder_block([WEATHER]))
    restored = reconstruct(response, profile, CONVENTIONS["vllm"])
    assert isinstance(restored, DeadLetter) and restored.reason == "tool_arguments_reserialized", restored
    assert "the argument text" in restored.message
    wrong_count = msgspec.structs.replace(response, usage=Usage(completion_tokens=len(want) + 1))
    refused = reconstruct(wrong_count, profile, CONVENTIONS["vllm"])
    assert isinstance(refused, DeadLetter), refused
    sample = reconstruct(_with_logprobs(response, want), profile, CONVENTIONS["vllm"])
    assert isinstance(sample, SampleReconstructed), sample
    assert list(sample.output_ids) == want
    assert list(sample.prompt_ids) == profile.encode(encoder_prompt(SHAPES["single_turn"], T._TOOLS, True))
    (verdict,) = audit_batch([sample], profile, AuditThresholds())
    checks = {c.code: c for c in verdict.results}
    assert checks["tool_calls_well_formed"].passed and checks["tool_calls_well_formed"].value == 1.0
    assert verdict.passed, verdict.reasons


def test_v4_broken_dsml_block_fails_the_audit() -> None:
    profile = v4(True)
    unclosed = _encoder_block([WEATHER]).removesuffix("\n</｜DSML｜tool_calls>")
    response, ids = _v4_answer(unclosed)
    sample = reconstruct(_with_logprobs(response, ids), profile, CONVENTIONS["vllm"])
    assert isinstance(sample, SampleReconstructed), sample
    (verdict,) = audit_batch([sample], profile, AuditThresholds())
    assert "tool_calls_well_formed" in verdict.reasons


ANSWER_CALLS = {"one_call": [WEATHER], "json_values": [SEARCH], "two_calls": [WEATHER, SEARCH]}


@cache
def vllm_parses() -> dict[str, Any]:
    """vLLM 0.33.0's deepseek_v4 parsers over encoder-written answers (``engines.run_dsv4``, a child process)."""
    answers = []
    for calls in ANSWER_CALLS.values():
        for content in ("Checking.", ""):
            text = "The user wants the weather.</think>" + content + _encoder_block(calls)
            fields = {"messages": SHAPES["single_turn"], "tools": T._TOOLS, "chat_template_kwargs": {"thinking": True}}
            answers.append({"text": text, "fields": fields, "content": content, "calls": calls})
    return {"answers": answers, **E.run_dsv4(answers)}


def test_vllm_deepseek_v4_answers_reassemble_from_our_dsml() -> None:
    """Content as vLLM returns it + our DSML for its structured calls == the text the model wrote, whenever
    the model's arguments are what the encoder writes (the "\\n\\n" before the block stays in the content;
    whitespace-only content next to calls comes back null, as PARSERS.md says of vLLM's serving layer)."""
    run = vllm_parses()
    assert all("/vllm/distributed/parallel_state.py:" in c for c in run["stub_calls"]), run["stub_calls"]
    for answer, got in zip(run["answers"], run["responses"], strict=True):
        assert got["reasoning"] == "The user wants the weather."
        assert got["content"] == (answer["content"] + "\n\n" if answer["content"] else None)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["calls"]
        ]
        structured = [msgspec.convert(c, ToolCall) for c in got["tool_calls"]]
        pieces = "".join(p for p in v4(True).tool_call_pieces(structured) if isinstance(p, str))
        rebuilt = got["reasoning"] + "</think>" + (got["content"] or "\n\n") + pieces
        assert rebuilt == answer["text"]
        assert got["finish_reason"] == "tool_calls"
