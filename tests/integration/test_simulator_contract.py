"""Contract: simulator over HTTP -> inference's response parsers -> reconstruction's ids.

The simulator's truth is independent of reconstruction: it writes Qwen3's raw output in
the format of the official template, takes the tokenizer's ids of that text as the truth,
and returns what a vLLM (or legacy SGLang) server parses out of it. Reconstruction must
then either rebuild exactly those ids or refuse with a dead letter naming what was lost;
a sample with wrong ids is the one outcome never allowed. No broker involved.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from schemas import Message, PromptPublished, ResponseReceived, SampleReconstructed
from services.common.records import DeadLetter
from services.inference.adapters.wire import parse_openai, parse_openrouter
from services.profiles import load_profile
from services.profiles.conventions import convention_for
from services.reconstruct.core import reconstruct
from services.simulator.app import RunningSimulator, start_simulator
from services.simulator.options import SimulatorOptions
from services.simulator.server import KEY_HEADER

PROFILE = load_profile("qwen3")
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


async def rebuild(
    client: httpx.AsyncClient,
    sim: RunningSimulator,
    i: int,
    *,
    fault: str = "",
    logprobs: bool = False,
    tools: bool = False,
    native: bool = False,
    convention: str = "vllm",
) -> tuple[SampleReconstructed | DeadLetter, list[int], int]:
    """One round trip: (sample or dead letter, true ids from ``GET /_sim/truth``, usage.completion_tokens)."""
    text = f"contract question {i}"
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "logprobs": logprobs,
    }
    if tools:
        body["tools"] = [TOOL]
    if native:
        body["return_token_ids"] = True
    key = f"d:{uuid.uuid4().hex}"
    headers = {KEY_HEADER: key, **({"X-Simulator-Fault": fault} if fault else {})}
    r = await client.post(f"{sim.url}/chat/completions", json=body, headers=headers)
    result = (parse_openai if native else parse_openrouter)(r.json())
    truth = await client.get(f"{sim.base_url}/_sim/truth", params={"key": key})
    assert truth.status_code == 200, truth.text
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
        native_output_ids=result.native_output_ids,
        native_prompt_ids=result.native_prompt_ids,
        tools_sent=tools,
    )
    sample = reconstruct(response, PROFILE, convention_for("simulator", convention))
    assert result.usage.completion_tokens is not None
    return sample, truth.json()["true_ids"], result.usage.completion_tokens


def exact(sample: SampleReconstructed | DeadLetter) -> SampleReconstructed:
    """The sample, asserting reconstruction accepted it."""
    assert isinstance(sample, SampleReconstructed), sample
    return sample


@pytest.mark.parametrize("tools", [False, True])
async def test_reconstruction_matches_simulator_truth(tools: bool) -> None:
    sim = await start_simulator(SimulatorOptions(keep_truth=True), profile=PROFILE)
    try:
        async with httpx.AsyncClient() as client:
            for i in range(3):
                # Exact through logprob tokens and through native ids, tools or not.
                for how in ({"logprobs": True}, {"native": True}):
                    sample, truth, _ = await rebuild(client, sim, i, tools=tools, **how)
                    assert exact(sample).output_ids == truth
                    assert exact(sample).method == ("logprobs" if "logprobs" in how else "native")
                caught, caught_truth, _ = await rebuild(client, sim, i, fault="noncanonical_same", logprobs=True)
                assert exact(caught).output_ids == caught_truth  # logprob tokens carry the real split
                text, truth, _ = await rebuild(client, sim, i, tools=tools)
                if tools:
                    # vLLM's hermes parser re-serialises Qwen3's arguments: text alone cannot be trusted.
                    assert isinstance(text, DeadLetter) and text.reason == "tool_arguments_reserialized", text
                    continue
                assert exact(text).output_ids == truth and exact(text).method == "reencode"
                same, same_truth, same_usage = await rebuild(client, sim, i, fault="noncanonical_same")
                same = exact(same)
                assert same.output_ids != same_truth and same_usage == len(same.output_ids)  # invisible to counts
                longer, longer_truth, longer_usage = await rebuild(client, sim, i, fault="noncanonical_len")
                longer = exact(longer)
                assert longer.output_ids != longer_truth and longer_usage == len(longer.output_ids) + 1
    finally:
        await sim.close()


async def test_stripped_fields_are_rebuilt_exactly_or_refused() -> None:
    """Legacy SGLang strips the think block's newlines: exact ids on proof, else a dead letter."""
    sim = await start_simulator(SimulatorOptions(keep_truth=True, parser="sglang-legacy"), profile=PROFILE)
    try:
        verdicts = []
        async with httpx.AsyncClient() as client:
            for i in range(6):
                sample, truth, _ = await rebuild(client, sim, i, convention="sglang-legacy")
                if isinstance(sample, SampleReconstructed):
                    assert sample.output_ids == truth  # never a sample with wrong ids
                verdicts.append(sample.reason if isinstance(sample, DeadLetter) else "exact")
                native, native_truth, _ = await rebuild(client, sim, i, native=True, convention="sglang-legacy")
                assert exact(native).output_ids == native_truth
        # The whitespace the server stripped is named, not guessed back.
        assert set(verdicts) <= {"exact", "whitespace_stripped", "whitespace_ambiguous"}, verdicts
    finally:
        await sim.close()
