"""Contract: simulator over HTTP -> inference's OpenRouter parser -> reconstruction's ids.

Clean answers must rebuild to the simulator's true ids exactly (text and logprobs paths);
non-canonical faults must be exact through logprobs and differ through re-encoding, the
same-length one invisibly to the usage count. No broker involved.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from schemas import Message, PromptPublished, ResponseReceived, SampleReconstructed
from services.inference.adapters.providers import parse_openrouter
from services.profiles import load_profile
from services.reconstruct.core import reconstruct
from services.simulator.app import SimulatorOptions, start_simulator

PROFILE = load_profile("deepseek-v3")
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


async def rebuild(
    client: httpx.AsyncClient, url: str, i: int, *, fault: str, logprobs: bool, tools: bool
) -> tuple[SampleReconstructed, list[int], int]:
    """One round trip: (sample, true ids, usage.completion_tokens)."""
    text = f"contract question {i}"
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "logprobs": logprobs,
    }
    if tools:
        body["tools"] = [TOOL]
    headers = {"X-Simulator-Fault": fault} if fault else {}
    r = await client.post(f"{url}/chat/completions", json=body, headers=headers)
    result = parse_openrouter(r.json())
    prompt = PromptPublished(
        dataset="d",
        sample_id=str(i),
        messages=[Message(role="user", content=text)],
        tools=[TOOL] if tools else None,
    )
    response = ResponseReceived(
        dataset="d",
        sample_id=str(i),
        prompt=prompt,
        provider="simulator",
        model="m",
        profile=PROFILE.name,
        reasoning=result.reasoning or "",
        content=result.content,
        tool_calls=result.tool_calls,
        finish_reason=result.finish_reason,
        native_finish_reason=result.native_finish_reason,
        usage=result.usage,
        logprobs=result.logprobs,
        tools_sent=tools,
    )
    sample = reconstruct(response, PROFILE)
    assert isinstance(sample, SampleReconstructed), sample
    assert result.debug_true_ids is not None and result.usage.completion_tokens is not None
    return sample, result.debug_true_ids, result.usage.completion_tokens


@pytest.mark.parametrize("tools", [False, True])
async def test_reconstruction_matches_simulator_truth(tools: bool) -> None:
    sim = await start_simulator(SimulatorOptions(debug_true_ids=True), profile=PROFILE)
    try:
        async with httpx.AsyncClient() as client:
            for i in range(3):
                for logprobs in (False, True):
                    sample, truth, _ = await rebuild(client, sim.url, i, fault="", logprobs=logprobs, tools=tools)
                    assert sample.output_ids == truth
                    assert sample.method == ("logprobs" if logprobs else "reencode")
                same, same_truth, same_usage = await rebuild(
                    client, sim.url, i, fault="noncanonical_same", logprobs=False, tools=tools
                )
                assert same.output_ids != same_truth and same_usage == len(same.output_ids)  # invisible to counts
                longer, longer_truth, longer_usage = await rebuild(
                    client, sim.url, i, fault="noncanonical_len", logprobs=False, tools=tools
                )
                assert longer.output_ids != longer_truth and longer_usage == len(longer.output_ids) + 1
                caught, caught_truth, _ = await rebuild(
                    client, sim.url, i, fault="noncanonical_same", logprobs=True, tools=tools
                )
                assert caught.output_ids == caught_truth  # logprob tokens carry the real split
    finally:
        await sim.close()
