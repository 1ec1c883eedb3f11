"""A tool-use dataset by each route its tools may travel, end to end: a real broker, the simulator over HTTP.

One file of Qwen3 tool-use rows (an OpenAI ``tools`` field per row) is published three times:

- ``toolsp``: chat mode, ``tool_route = "parameter"``: the ``tools`` parameter, and the simulator
  answers as a parsing server (vLLM's hermes parser: the calls come back structured, their
  arguments re-serialised). The worker's pre-flight must warn that the calls cannot be proven,
  and not one accepted row may differ from the truth (the rows the parser made unprovable are
  refused: their number is reported, not asserted);
- ``toolsr``: chat mode, ``tool_route = "prompt"`` (raw tool text): the tools written into the
  system text as the template writes them, no ``tools`` parameter, so no parser: the block comes
  back in ``content`` as the model wrote it; the pre-flight says the route is provable;
- ``toolsc``: completions mode: the prompt rendered by us, the raw text back; at least 95 % kept.

The worker probes each dataset first (``[inference] probe_first``): the probe says the route again over the
prompts it read, before it pays. Run with and without logprobs: with them, the parser route's calls are
proven by the tokens (rows kept, still exact); without, every row it keeps must be exact too (the
simulator's hermes parser re-serialises every call's arguments, so none is expected).

The truth is built apart from the code under test: the simulator's true output ids per key
(``GET /_sim/truth``, never through the pipeline) and the prompt ids the OFFICIAL Qwen3 template
renders from the row with its tools, encoded by the truth tokenizer (``tests/conformance/truth.py``).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import ResponseReceived, SampleAudited, decode
from services.audit.app import create_app as audit_app
from services.common.kafka import ensure_topics
from services.inference.app import create_app as inference_app
from services.inference.tool_route import PARSED_ADVICE
from services.probe.app import probe_first
from services.publish.app import publish
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from tests.e2e.harness import Pipeline, dead_letters, read_all, sink_rows
from tests.e2e.test_completions_mode import TOOLS, messages, true_prompt_ids
from tests.e2e.test_pipeline_truth import OFFICIAL_QWEN3

pytestmark = pytest.mark.e2e

PARAMETER, RAW, COMPLETIONS = "toolsp", "toolsr", "toolsc"
N_PROMPTS = 40


@pytest.mark.parametrize("logprobs", [False, True], ids=["text", "logprobs"])
async def test_each_tool_route_says_itself_before_paying_and_accepts_only_exact_rows(
    logprobs: bool,
    settings_factory: Callable[..., Any],
    report: Callable[..., str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Parsed calls: warned before paying, 0 wrong rows; raw tool text and completions: exact, kept."""
    caplog.set_level(logging.INFO, logger="services.inference.guard")
    caplog.set_level(logging.INFO, logger="services.probe.app")
    sim = await start_simulator(
        SimulatorOptions(seed=7, reasoning_tokens=(30, 60), content_tokens=(10, 30), keep_truth=True,
                         logprobs=logprobs, chat_template_file=str(OFFICIAL_QWEN3))  # fmt: skip
    )
    audit = {"usage_offset": 0}
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 16, "backoff_initial_s": 0.05, "backoff_max_s": 0.2,
                  "max_attempts": 8, "request_logprobs": logprobs},
        datasets={PARAMETER: {"tool_route": "parameter", "audit": audit},
                  RAW: {"tool_route": "prompt", "audit": audit},
                  COMPLETIONS: {"mode": "completions", "audit": audit}},
        # The parser route is expected to lose rows: the quality halt would stop it before the count.
        budget={"min_yield": 0},
        inference={"probe_first": 3},  # the worker's probe says the routes too, before it pays
    )  # fmt: skip
    prompts_file = tmp_path / "tools.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"t{i:03d}", "messages": messages(i), "tools": TOOLS}) + "\n"
                                    for i in range(N_PROMPTS)), encoding="utf-8")  # fmt: skip
    names = (PARAMETER, RAW, COMPLETIONS)
    await ensure_topics(settings.kafka, list(names))
    out_dir = Path(settings.sink.out_dir)
    pipeline = Pipeline()
    try:
        for name in names:  # on the topics before the worker starts: its probe reads the first prompts
            published = await publish(settings, [prompts_file], dataset=name)
            assert published.published == N_PROMPTS, published
        await pipeline.start("inference", inference_app(settings, probe=probe_first))
        for name, factory in (("reconstruct", reconstruct_app), ("audit", audit_app), ("sink", sink_app)):
            await pipeline.start(name, factory(settings))

        async def settled() -> bool:
            done = {r["id"] for r in sink_rows(out_dir)} | {d.key for d in await dead_letters(settings)}
            return len(done) >= len(names) * N_PROMPTS

        await pipeline.wait(settled, 300, "every prompt accepted or dead-lettered")
    finally:
        await pipeline.stop()
        truths = sim.truth()
        await sim.close()

    said = [r for r in caplog.records if r.name == "services.inference.guard"]
    preflight = {name: [r for r in said if r.getMessage().startswith(f"pre-flight: tools of dataset {name}, where")]
                 for name in names}  # fmt: skip
    probed = {name: [r for r in caplog.records if r.getMessage().startswith(f"probe {name}: tools of dataset {name}:")]
              for name in names}  # fmt: skip
    accepted_topic, responses_topic = settings.kafka.topic("accepted"), settings.kafka.topic("responses")
    got = await read_all(settings, accepted_topic, responses_topic)
    accepted = [decode(r.value, SampleAudited) for r in got[accepted_topic]]
    responses = [decode(r.value, ResponseReceived) for r in got[responses_topic]]
    letters = await dead_letters(settings)
    rows = sink_rows(out_dir)
    by: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [a for a in accepted if a.dataset == name]  # every record checked; the probe's answers twice
        answers = list({r.sample_id: r for r in responses if r.dataset == name}.values())  # the probe's, reused
        by[name] = {
            "accepted": len({a.sample_id for a in mine}),
            "wrong_output": [a.sample_id for a in mine
                             if list(a.sample.output_ids) != truths.get(f"{name}:{a.sample_id}")],
            "wrong_prompt": [a.sample_id for a in mine
                             if list(a.sample.prompt_ids) != true_prompt_ids(int(a.sample_id[1:]))],
            "structured_calls": sum(1 for r in answers if r.tool_calls),
            "raw_blocks": sum(1 for r in answers if "<tool_call>" in (r.text or r.content)),
            "tools_sent": sum(1 for r in answers if r.tools_sent),
            "answers": len(answers),
            "dead": dict(Counter(d.reason for d in letters if d.key.startswith(f"{name}:"))),
        }  # fmt: skip
    line = report(
        **{f"{name}_{key}": (len(value) if isinstance(value, list) else value)
           for name, found in by.items() for key, value in found.items()},
        preflight={name: [r.levelname for r in records] for name, records in preflight.items()},
        probe={name: [r.levelname for r in records] for name, records in probed.items()},
    )  # fmt: skip

    # Said before money moved: the parser route warns, naming the sound routes; the others say they are provable.
    assert [r.levelno for r in preflight[PARAMETER]] == [logging.WARNING], line
    assert not [r for r in said if r.getMessage().startswith(f"dataset {PARAMETER}: a prompt's tools")], line  # once
    assert PARSED_ADVICE in preflight[PARAMETER][0].getMessage(), line
    for name in (RAW, COMPLETIONS):
        assert [r.levelno for r in preflight[name]] == [logging.INFO], line
        assert preflight[name][0].getMessage().endswith(": provable"), line
    # The probe (here the worker's probe_first) says it again over the prompts it reads, before it pays.
    assert [r.levelno for r in probed[PARAMETER]] == [logging.WARNING], line
    assert PARSED_ADVICE in probed[PARAMETER][0].getMessage(), line
    assert all([r.levelno for r in probed[name]] == [logging.INFO] for name in (RAW, COMPLETIONS)), line

    assert {r["id"] for r in rows} | {d.key for d in letters} == {
        f"{name}:t{i:03d}" for name in names for i in range(N_PROMPTS)
    }, line
    for name in names:  # every request carried the row's tools to the model, by its route
        assert by[name]["answers"] == by[name]["tools_sent"] == N_PROMPTS, line
        assert not by[name]["wrong_output"], f"{name}: accepted with ids that differ from the truth: {line}"
        assert not by[name]["wrong_prompt"], f"{name}: prompt ids differ from the official template's: {line}"
    # The parser route: the calls came back structured (the simulator parsed them), and 0 wrong rows above;
    # with logprobs, the tokens prove the calls whatever the parser did to their text.
    assert by[PARAMETER]["structured_calls"] >= 0.9 * N_PROMPTS and by[PARAMETER]["raw_blocks"] == 0, line
    if logprobs:
        assert by[PARAMETER]["accepted"] > 0, line
        assert "provable only where the answers carry the logprobs" in preflight[PARAMETER][0].getMessage(), line
    # Raw tool text: no parser stood between the model and us; the block is kept, and so are the rows.
    assert by[RAW]["structured_calls"] == 0 and by[RAW]["raw_blocks"] >= 0.9 * N_PROMPTS, line
    assert by[RAW]["accepted"] >= 0.95 * N_PROMPTS, line
    assert by[COMPLETIONS]["accepted"] >= 0.95 * N_PROMPTS, line
