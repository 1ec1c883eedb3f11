"""Completions mode end to end: a Qwen3 tool-use dataset, the simulator over real HTTP, a real broker.

publish → inference (completions mode: the prompt rendered by the profile's template, tools in
Qwen3's native ``<tools>`` block, sent as text to ``POST /completions``) → reconstruct (the raw
text) → audit → sink. The simulator reads the tools from the prompt text itself and answers
with tool calls in Qwen3's own format, returning the raw text (specials kept, the stop token
dropped); it keeps each key's true output ids apart (``GET /_sim/truth``). The truth for the
prompt ids is the OFFICIAL Qwen3 template in ``../shared/reference`` rendered with the tools and
the real tokenizer (``tests/conformance/truth.py``), never our renderer.

Asserts: every prompt accounted for (one sink row or dead letters), at least 95 % accepted,
every accepted sample's output ids equal to the simulator's truth and its prompt ids to the
official render, tool calls present in the accepted answers, and every response is a raw
text from ``/completions`` (the chat route returns no raw text) with the prompt it was sent.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import ResponseReceived, SampleAudited, decode
from services.audit.app import create_app as audit_app
from services.common.kafka import ensure_topics
from services.inference.app import create_app as inference_app
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from tests.conformance import truth as T
from tests.e2e.harness import Pipeline, dead_letters, read_all, sink_rows
from tests.e2e.test_pipeline_truth import OFFICIAL_QWEN3, publish_and_settle

pytestmark = pytest.mark.e2e

DATASET = "toolsc"
N_PROMPTS = 60
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert", "description": "Convert an amount between currencies.",
        "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}}}}},
]  # fmt: skip


def messages(i: int) -> list[dict[str, str]]:
    """The i-th tool-use conversation."""
    return [{"role": "user", "content": f"Request {i}: the weather in city {i} and {i} euros in dollars, please."}]


def true_prompt_ids(i: int) -> list[int]:
    """What Qwen3 is fed for prompt i with the tools: the official template, the real tokenizer."""
    text = T.render_template(OFFICIAL_QWEN3.read_text(encoding="utf-8"), messages(i), tools=TOOLS,
                             add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")
    return list(T.truth_tokenizer("qwen3").encode_prompt(text))


async def test_completions_mode_tool_use_matches_the_truth(
    settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    """A Qwen3 tool-use dataset in completions mode: >= 95 % accepted, ids equal to the truth."""
    sim = await start_simulator(
        SimulatorOptions(seed=5, reasoning_tokens=(30, 60), content_tokens=(10, 30), rate_429=0.05,
                         retry_after_s=0.05, keep_truth=True)
    )
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 16, "backoff_initial_s": 0.05, "backoff_max_s": 0.2,
                  "max_attempts": 8},
        datasets={DATASET: {"mode": "completions", "send_tools": True, "audit": {"usage_offset": 0}}},
    )
    assert settings.mode_of(settings.dataset(DATASET)) == "completions"
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"t{i:03d}", "messages": messages(i), "tools": TOOLS}) + "\n"
                                    for i in range(N_PROMPTS)), encoding="utf-8")
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, [DATASET])
    pipeline = Pipeline()
    try:
        for name, factory in (("inference", inference_app), ("reconstruct", reconstruct_app),
                              ("audit", audit_app), ("sink", sink_app)):
            await pipeline.start(name, factory(settings))
        await publish_and_settle(pipeline, settings, prompts_file, DATASET, N_PROMPTS)
    finally:
        await pipeline.stop()
        truths = sim.truth()
        await sim.close()

    accepted_topic, responses_topic = settings.kafka.topic("accepted"), settings.kafka.topic("responses")
    got = await read_all(settings, accepted_topic, responses_topic)
    accepted = {f"{a.dataset}:{a.sample_id}": a for a in (decode(r.value, SampleAudited) for r in got[accepted_topic])}
    responses = [decode(r.value, ResponseReceived) for r in got[responses_topic]]
    rows = sink_rows(out_dir)
    letters = await dead_letters(settings)
    wrong_output = [k for k, a in accepted.items() if list(a.sample.output_ids) != truths.get(k)]
    wrong_prompt = [k for k, a in accepted.items()
                    if list(a.sample.prompt_ids) != true_prompt_ids(int(a.sample_id[1:]))]
    with_calls = sum(1 for a in accepted.values() if a.sample.response.tool_calls)
    line = report(
        published=N_PROMPTS,
        accepted=len(accepted),
        rows=len(rows),
        dead_letter_reasons=dict(Counter(f"{d.stage}/{d.reason}" for d in letters)),
        accepted_with_tool_calls=with_calls,
        output_ids_differ_from_truth=len(wrong_output),
        prompt_ids_differ_from_official_template=len(wrong_prompt),
        modes=dict(Counter(r.mode for r in responses)),
    )
    assert {r["id"] for r in rows} | {d.key for d in letters} == {f"{DATASET}:t{i:03d}" for i in range(N_PROMPTS)}
    assert len(accepted) >= 0.95 * N_PROMPTS, line
    assert not wrong_output, f"accepted with ids that differ from the simulator's truth: {wrong_output[:5]} {line}"
    assert not wrong_prompt, f"prompt ids differ from the official template's render: {wrong_prompt[:5]} {line}"
    assert with_calls >= 0.95 * len(accepted), line  # every prompt offers tools: the model calls one
    assert all(r.mode == "completions" and r.sent_prompt and r.text for r in responses), line
    assert all("<tool_call>" in r.text for r in responses), line  # the raw text: no tool parser in between
    assert all(a.sample.method == "reencode" for a in accepted.values()), line
