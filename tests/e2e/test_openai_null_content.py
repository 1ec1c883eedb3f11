"""An OpenAI-shaped prompt produced straight to a prompts topic, ``"content": null`` and all.

OpenAI writes an assistant turn that only calls tools as ``{"role": "assistant", "content":
null, "tool_calls": [...]}``. Produced raw (not through ``draftstream publish``) to a prompts
topic on a real broker, with the whole pipeline running against the simulator over HTTP, it
must not be a schema dead letter: it is accepted, with the same prompt ids as the same row
published by ``draftstream publish`` (which reads null as ``""``), and those ids equal the
ids of the OFFICIAL Qwen3 chat template (``../shared/reference``) rendered by the test itself
and encoded by the real tokenizer, never our ``render_prompt``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import SampleAudited, decode
from services.common.kafka import ensure_topics
from services.publish.app import publish
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.conformance import truth as T
from tests.e2e.harness import Pipeline, accepted_keys, dead_letters, produce, read_all

pytestmark = pytest.mark.e2e

RAW, PUBLISHED = "rawopenai", "published"
OFFICIAL_QWEN3 = T.reference_dir() / "chat-templates" / "Qwen-Qwen3-0.6B.jinja"
SCHEMA_REASONS = {"invalid_json", "invalid_utf8", "invalid_field", "missing_field", "empty_record",
                  "unsupported_schema_version"}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
    {"role": "user", "content": "And should I take an umbrella?"},
]


def official_prompt_ids() -> list[int]:
    """The prompt ids a vLLM server feeds Qwen3: the official template over the messages with
    null read as "" (the template itself tests ``'</think>' in message.content``, which null
    cannot pass), encoded by the real tokenizer.
    """
    messages = [{**m, "content": m["content"] or ""} for m in MESSAGES]
    text = T.render_template(OFFICIAL_QWEN3.read_text(encoding="utf-8"), messages, tools=TOOLS,
                             add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")
    return list(T.truth_tokenizer("qwen3").encode_prompt(text))


async def test_openai_null_content_tool_turn_produced_raw_is_accepted_like_the_published_one(
    settings_factory: Callable[..., Any], tmp_path: Path
) -> None:
    # Logprob tokens make a tool call's ids exact (a vLLM parser re-serialises its arguments).
    sim = await start_simulator(SimulatorOptions(reasoning_tokens=(8, 24), content_tokens=(8, 24), seed=7,
                                                 logprobs=True, chat_template_file=str(OFFICIAL_QWEN3)))
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 4, "request_logprobs": True},
        datasets={name: {"send_tools": True, "audit": {"usage_offset": 0}} for name in (RAW, PUBLISHED)},
        stage={"batch_max": 8, "batch_timeout_ms": 50},
    )
    await ensure_topics(settings.kafka, [RAW, PUBLISHED])
    # As an OpenAI client would write it (a whole number for max_tokens included).
    raw = {"dataset": RAW, "sample_id": "weather", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 512.0}
    raw_value = json.dumps(raw).encode()
    assert b'"content": null' in raw_value
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "weather", "messages": MESSAGES, "tools": TOOLS}) + "\n", encoding="utf-8")
    keys = {f"{RAW}:weather", f"{PUBLISHED}:weather"}
    accepted_topic = settings.kafka.topic("accepted")
    out_dir = Path(settings.sink.out_dir)
    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "inference", "reconstruct", "audit", "sink")
        await produce(settings, settings.kafka.prompts_topic(RAW), [(f"{RAW}:weather".encode(), raw_value)])
        report = await publish(settings, [rows], dataset=PUBLISHED)
        assert report.published == 1, report

        async def settled() -> bool:
            failed = {d.key for d in await dead_letters(settings)}
            return keys <= set(accepted_keys(out_dir)) | failed

        await pipeline.wait(settled, 120, "both prompts in the training files or dead-lettered")
        pipeline.check_alive()
    finally:
        await pipeline.stop()
        await sim.close()

    letters = [d for d in await dead_letters(settings) if d.key in keys]
    assert not [d for d in letters if d.reason in SCHEMA_REASONS], f"a schema dead letter: {letters}"
    assert not letters, f"dead letters for a valid tool-call conversation: {[(d.key, d.reason) for d in letters]}"
    audited = {
        (r.key or b"").decode(): decode(r.value, SampleAudited)
        for r in (await read_all(settings, accepted_topic))[accepted_topic]
    }
    assert set(audited) == keys
    from_raw, from_publish = audited[f"{RAW}:weather"], audited[f"{PUBLISHED}:weather"]
    tool_turn = from_raw.sample.response.prompt.messages[2]
    assert tool_turn.content == "" and tool_turn.tool_calls
    assert from_raw.sample.response.prompt.messages == from_publish.sample.response.prompt.messages
    assert from_raw.sample.response.prompt.max_tokens == 512
    assert from_raw.sample.response.tools_sent
    rows_by_key = {
        row["id"]: row
        for part in sorted(out_dir.glob("*/part-*.jsonl"))
        for row in map(json.loads, part.read_text(encoding="utf-8").splitlines())
    }
    raw_row, published_row = rows_by_key[f"{RAW}:weather"], rows_by_key[f"{PUBLISHED}:weather"]
    assert raw_row["conversations"][2]["content"] == "" and raw_row["conversations"][2]["tool_calls"]
    assert raw_row["conversations"][:5] == published_row["conversations"][:5]  # the prompt turns
    truth = official_prompt_ids()
    assert list(from_raw.sample.prompt_ids) == truth
    assert list(from_publish.sample.prompt_ids) == truth
