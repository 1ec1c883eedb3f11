"""Rebuilt ids equal the simulator's ground-truth ids: the raw text the model writes, encoded.

The simulator writes the model's raw output in its own format and parses it the way vLLM
does; reconstruction sees only the parsed fields. Every answer is either rebuilt exactly
or refused with the reason the vLLM convention gives (Qwen's re-serialised arguments, a
cut answer whose tail cannot be pinned).
"""

from __future__ import annotations

import pytest

from schemas import Message, PromptPublished, ResponseReceived, SampleReconstructed, Usage
from services.common.kafka import DeadLetter
from services.profiles import load_profile
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct_batch
from services.simulator.core import GenerationParams, generate
from services.simulator.request import ChatRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


# Structured tool calls are refused whatever their count (tool_*): only native ids or logprobs prove them.
REFUSED_UNDER_VLLM = {"tool_arguments_reserialized", "tool_call_text_lost", "truncated_tail_ambiguous",
                      "truncated_tail_lost"}


@pytest.mark.parametrize("profile_name", ["deepseek-r1", "qwen3", "deepseek-v3.1"])
def test_rebuilt_ids_equal_true_ids(profile_name: str) -> None:
    profile = load_profile(profile_name)
    responses, truths = [], []
    for i in range(40):
        tools = TOOLS if i % 3 == 0 else None
        messages = [{"role": "user", "content": f"question number {i}"}]
        request = ChatRequest(
            model="m", messages=messages, tools=tools, max_tokens=30 if i % 7 == 0 else None
        )
        gen = generate(
            profile, request, GenerationParams(seed=i), content_faults=["truncate"] if i % 5 == 0 else []
        )
        if "\ufffd" in gen.reasoning + gen.content:
            continue  # cut inside a character: no text can say which bytes were lost (audit's job)
        prompt = PromptPublished(
            dataset="d",
            sample_id=str(i),
            messages=[Message(role="user", content=messages[0]["content"])],
            tools=tools,
        )
        responses.append(
            ResponseReceived(
                dataset="d",
                sample_id=str(i),
                prompt=prompt,
                provider="simulator",
                model="m",
                reasoning=gen.reasoning,
                content=gen.content,
                tool_calls=gen.tool_calls,
                finish_reason=gen.finish_reason,
                usage=Usage(completion_tokens=gen.completion_tokens),
                tools_sent=bool(tools),
            )
        )
        truths.append(gen.true_ids)
    assert len(responses) >= 30
    finishes = {r.finish_reason for r in responses}
    assert {"stop", "length", "tool_calls"} <= finishes
    samples = reconstruct_batch(responses, profile, CONVENTIONS["vllm"])
    wrong = [r.sample_id for r, s, truth in zip(responses, samples, truths, strict=True)
             if isinstance(s, SampleReconstructed) and s.output_ids != truth]
    refused = [s.reason for s in samples if isinstance(s, DeadLetter)]
    assert wrong == []
    assert set(refused) <= REFUSED_UNDER_VLLM, refused
    exact = sum(isinstance(s, SampleReconstructed) for s in samples)
    assert exact >= 0.6 * len(samples), (exact, refused)
