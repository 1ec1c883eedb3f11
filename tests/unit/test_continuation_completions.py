"""Multi-turn regeneration in completions mode: the raw text of a turn becomes the next turn's history.

For each template family (Qwen3 hybrid, Qwen3-2507, DeepSeek-R1, DeepSeek-V3.1, Kimi-K2-Thinking)
a turn answering with two parallel tool calls is written as the model writes it (the raw output
formats of ``tests/conformance/truth.py``, taken from the OFFICIAL templates), sent back as a
completions-mode response, and continued. The next prompt must carry exactly the model's reasoning,
content and calls (arguments' exact text) with the cached tool results under the regenerated ids;
its ids (our profile's render) must equal the official template's render of that history with the
real tokenizer; and the row says whether they extend the previous turn's whole sequence, which the
official ids decide (an append-only template, or one that drops the reasoning).
"""

from __future__ import annotations

import msgspec
import pytest

import schemas as s
from services.continuation import core as C
from services.profiles.split import TOOL_BLOCK_MALFORMED, TOOL_NOT_OFFERED, OutputFormat
from services.sink.core import training_row
from tests.conformance import truth as T
from tests.conformance.test_matrix import profile_for
from tests.unit.test_continuation import SHAREGPT, TRAJECTORY, WEATHER, all_turns, official_ids

# Whether the official template keeps the answer as the model wrote it when the tool results follow.
EXTENDS = {
    "qwen3": True,
    "qwen3-thinking-2507": True,
    "kimi-k2-thinking": True,
    "deepseek-r1": False,  # R1 renders a tool-call turn without its reasoning
    "deepseek-v3.1": False,  # V3.1 renders it as '</think>' + content + calls
}


def completions_sample(prompt: s.PromptPublished, model: str, raw: str) -> s.SampleAudited:
    """An accepted completions-mode turn: the prompt our profile renders, the raw text, real ids."""
    profile = profile_for(model, True)
    sent = profile.render_prompt(prompt.messages, prompt.tools, reasoning=True)
    response = s.ResponseReceived(
        dataset=prompt.dataset, sample_id=prompt.sample_id, prompt=prompt, provider="sim", model="m",
        finish_reason="stop", mode="completions", text=raw, sent_prompt=sent, tools_sent=prompt.tools is not None,
    )  # fmt: skip
    prompt_ids = profile.encode_prompt(sent)
    output_ids = profile.encode(raw + profile.end_of_turn)
    sample = s.SampleReconstructed(
        dataset=prompt.dataset, sample_id=prompt.sample_id, profile=model, response=response,
        prompt_ids=prompt_ids, output_ids=output_ids, loss_mask=[0] * len(prompt_ids) + [1] * len(output_ids),
        method="reencode",
    )  # fmt: skip
    return s.SampleAudited(dataset=prompt.dataset, sample_id=prompt.sample_id, sample=sample, passed=True)


def written(model: str, reasoning: str, content: str, calls: list[T.ToolCall]) -> str:
    """The raw output the model writes for these parts (the end-of-turn the server drops left off)."""
    spec = T._SPECS[model]
    if calls and spec.tools == "hermes" and content:
        content += "\n"
    return T._assemble(spec, spec.r_wrap[0] + reasoning + spec.r_wrap[1], True, spec.c_pre + content, calls)


@pytest.mark.parametrize("model", sorted(EXTENDS))
def test_a_turn_with_parallel_calls_continues_on_its_own_split_text(model: str) -> None:
    kimi = model.startswith("kimi")
    # Canonical JSON: a server hands Qwen's and Kimi's templates the arguments as an object, re-serialised.
    calls = [T.ToolCall("get_weather", '{"city": "Oslo"}', "functions.get_weather:0" if kimi else ""),
             T.ToolCall("get_weather", '{"city": "Rome"}', "functions.get_weather:1" if kimi else "")]  # fmt: skip
    p0 = all_turns(TRAJECTORY)
    profile = profile_for(model, True)
    audited = completions_sample(p0, model, written(model, "Both cities.", "Checking.", calls))
    verdict = C.continue_conversation(audited, output_format=OutputFormat.of(profile))
    assert isinstance(verdict, C.Continued), verdict
    ids = [c.id or f"call_{p0.sample_id}_{i}" for i, c in enumerate(calls)]
    regenerated = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                   for i, c in zip(ids, calls, strict=True)]  # fmt: skip
    expected = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Both cities.", "tool_calls": regenerated},
        {"role": "tool", "content": "Oslo: 3C", "tool_call_id": ids[0]},
        {"role": "tool", "content": "Rome: 17C", "tool_call_id": ids[1]},
    ]
    p1 = verdict.prompt
    assert p1.wire == expected
    _, truth = official_ids(model, expected, WEATHER)
    ours = profile.encode_prompt(profile.render_prompt(p1.messages, p1.tools, reasoning=True))
    assert ours == truth, f"{model}: turn 1's prompt ids differ from the official template's render"
    previous = [*audited.sample.prompt_ids, *audited.sample.output_ids]
    assert (truth[: len(previous)] == previous) is EXTENDS[model]
    response1 = msgspec.structs.replace(audited.sample.response, prompt=p1)
    turn1 = msgspec.structs.replace(audited.sample, response=response1, prompt_ids=ours)
    row = training_row(msgspec.structs.replace(audited, sample=turn1))
    assert row.metadata.turn == 1 and row.metadata.extends_previous_turn is EXTENDS[model]
    assert training_row(audited).metadata.extends_previous_turn is False  # turn 0 has nothing to extend


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ('<think>\nr\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', TOOL_NOT_OFFERED),
        ('<think>\nr\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {', TOOL_BLOCK_MALFORMED),
    ],
)
def test_a_raw_text_that_does_not_split_ends_the_conversation_with_its_reason(raw: str, reason: str) -> None:
    audited = completions_sample(all_turns(TRAJECTORY), "qwen3", raw)
    verdict = C.continue_conversation(audited, output_format=OutputFormat.of(profile_for("qwen3", True)))
    assert isinstance(verdict, C.Ended)
    assert verdict.progress.state == "ended_early" and verdict.progress.reason == reason
    assert reason in C.END_REASONS  # a bounded label set for the conversation metrics


def test_a_chat_conversation_in_completions_mode_runs_to_its_end() -> None:
    fmt = OutputFormat.of(profile_for("qwen3", True))
    prompt, turns = all_turns(SHAREGPT), 0
    while True:
        raw = written("qwen3", f"think {turns}", f"answer {turns}", [])
        verdict = C.continue_conversation(completions_sample(prompt, "qwen3", raw), output_format=fmt)
        turns += 1
        if isinstance(verdict, C.Ended):
            break
        assert isinstance(verdict, C.Continued)
        prompt = verdict.prompt
        answers = [m for m in prompt.messages if m.role == "assistant"]
        assert [(m.content, m.reasoning_content) for m in answers] == [(f"answer {k}", f"think {k}")
                                                                       for k in range(turns)]  # fmt: skip
    assert verdict.progress.state == "finished" and turns == 3
