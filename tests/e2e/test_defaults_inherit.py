"""A config whose dataset section names one key runs with every other key of [defaults].

The new user's file of issue 39: ``[defaults]`` sets ``max_tokens`` and
``[defaults.audit] require_reasoning = false``; ``[datasets.noreason]`` names only
``expected_prompts``. The simulator answers every request with empty reasoning (a model with
thinking off), over real HTTP, through every stage on a real broker. With the defaults
inherited, every answer is accepted and every request carried the default ``max_tokens``;
a second dataset that sets ``require_reasoning = true`` in its own audit table dead-letters
the same answers (``reasoning_nonempty``), so the check bites where it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import ResponseReceived, SampleAudited, decode, encode, sample_key
from services.common.config import load_settings
from services.common.kafka import ensure_topics
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.e2e.harness import Pipeline, dead_letters, produce, read_all, small_prompt

pytestmark = pytest.mark.e2e

N = 12
MAX_TOKENS = 300
CONFIG = f"""
[defaults]
max_tokens = {MAX_TOKENS}

[defaults.audit]
require_reasoning = false

[datasets.noreason]
expected_prompts = {N}

[datasets.strict.audit]
require_reasoning = true
"""


async def test_a_dataset_naming_one_key_runs_with_the_defaults(
    settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    sim = await start_simulator(SimulatorOptions(seed=9, rate_empty_reasoning=1.0, content_tokens=(8, 30)))
    base = settings_factory(provider={"base_url": sim.url, "concurrency": 16})
    path = tmp_path / "draftstream.toml"
    path.write_text(CONFIG, encoding="utf-8")
    settings = load_settings(path, kafka=base.kafka.model_dump(), metrics=base.metrics.model_dump(),
                             sink=base.sink.model_dump(), provider=base.provider.model_dump())  # fmt: skip
    assert settings.dataset("noreason").max_tokens == MAX_TOKENS  # what the run below relies on
    datasets = ("noreason", "strict")
    await ensure_topics(settings.kafka, list(datasets))
    for name in datasets:
        prompts = [small_prompt(name, i, max_tokens=None) for i in range(N)]
        await produce(settings, settings.kafka.prompts_topic(name),
                      [(sample_key(name, p.sample_id).encode(), encode(p)) for p in prompts])  # fmt: skip
    accepted_topic, responses_topic = settings.kafka.topic("accepted"), settings.kafka.topic("responses")

    async def accepted() -> dict[str, SampleAudited]:
        records = (await read_all(settings, accepted_topic))[accepted_topic]
        return {f"{a.dataset}:{a.sample_id}": a for a in (decode(r.value, SampleAudited) for r in records)}

    async def settled() -> bool:
        return len(set(await accepted()) | {d.key for d in await dead_letters(settings)}) >= 2 * N

    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "inference", "reconstruct", "audit")
        await pipeline.wait(settled, 180, "every prompt of both datasets accepted or dead-lettered")
    finally:
        await pipeline.stop()
        await sim.close()
    done = await accepted()
    dead = await dead_letters(settings)
    records = (await read_all(settings, responses_topic))[responses_topic]
    responses = [decode(r.value, ResponseReceived) for r in records]
    line = report(accepted=len(done), dead=len(dead), reasons=sorted({d.reason for d in dead}))
    assert all(not a.sample.response.reasoning.strip() for a in done.values()), line  # the fault held
    assert sorted(k for k in done if k.startswith("noreason:")) == sorted(f"noreason:s{i:05d}" for i in range(N)), line
    assert not any(k.startswith("strict:") for k in done), line
    strict_dead = [d for d in dead if d.key.startswith("strict:")]
    assert len({d.key for d in strict_dead}) == N and {d.reason for d in strict_dead} == {"reasoning_nonempty"}, line
    assert {r.request_max_tokens for r in responses} == {MAX_TOKENS}, line  # both datasets: the default
