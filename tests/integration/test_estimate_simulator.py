"""The estimate's prompt tokens against the provider simulator's ``usage.prompt_tokens`` over HTTP.

The simulator renders and counts the request it receives as a server does; the estimate
renders the prompts it has not sent yet. For every demo prompt the two counts must agree.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common.config import DatasetSettings, Settings
from services.estimate.app import DatasetFiles, estimate_files
from services.inference.adapters.request_bodies import chat_request_body
from services.profiles import load_profile, profile_spec
from services.publish.app import Rejection, iter_prompts
from services.publish.core import NormaliseOptions
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions

DEMO = Path(__file__).resolve().parents[2] / "services" / "demo" / "data"


async def test_estimate_matches_the_simulators_usage_prompt_tokens() -> None:
    sim = await start_simulator(SimulatorOptions(), profile=load_profile("qwen3"))
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            for name, send_tools in (("math", False), ("code", False), ("tools", True)):
                dataset = DatasetSettings(profile="qwen3", send_tools=send_tools, max_tokens=64)
                settings = Settings(datasets={name: dataset})
                estimate = estimate_files(settings, DatasetFiles(name, [DEMO / f"{name}.jsonl"], limit=12))
                reported = 0
                items = iter_prompts([DEMO / f"{name}.jsonl"], NormaliseOptions(dataset=name), limit=12)
                for prompt in items:
                    assert prompt is not None and not isinstance(prompt, Rejection)
                    body = chat_request_body(
                        prompt, dataset, model="qwen/qwen3-8b", max_tokens=64, extra_body={}, logprobs=False,
                        template_kwargs=profile_spec("qwen3").render_kwargs() or None,
                    )  # fmt: skip
                    response = await client.post(f"{sim.url}/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    reported += response.json()["usage"]["prompt_tokens"]
                assert estimate.prompts == 12
                assert estimate.prompt_tokens == reported, name
    finally:
        await sim.close()
