"""Issue 23's probe on the OpenRouter-like router: facts per upstream, at most n paid, exit 1 below the floor.

A real broker and the router over real HTTP with its five habit upstreams
(services/simulator/router.py); no pipeline stage runs: the probe pays through the
inference worker's own path (halt gate, ``requests``, ``responses``, the response store)
and judges with the reconstruct and audit cores. Truth is the router's configuration
(``GET /_sim/router``) and its request counts, never the probe's own output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.common.kafka import ensure_topics
from services.probe.app import run_probe
from services.simulator.options import SimulatorOptions
from services.simulator.router import habit_upstreams, start_router
from tests.e2e.harness import produce, prompt_value

pytestmark = pytest.mark.e2e

N = 20
PROMPTS = 60


def toml_of(settings: Any, base_url: str, dataset: str, provider: str) -> str:
    """The config file a person would write for this probe."""
    return f"""
[kafka]
bootstrap_servers = "{settings.kafka.bootstrap_servers}"
topic_prefix = "{settings.kafka.topic_prefix}"

[provider]
base_url = "{base_url}"
request_logprobs = true
extra_body = {{ provider = {provider} }}

[datasets.{dataset}]
max_tokens = 256
"""


def requests_of(stats: dict[str, Any], dataset: str) -> int:
    """Requests the router received for a dataset's sample keys."""
    return sum(n for key, n in stats["keys"].items() if key.startswith(f"{dataset}:"))


async def test_probe_reports_each_upstreams_habits_pays_at_most_n_and_fails_below_min_yield(
    settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    router = await start_router(
        habit_upstreams(SimulatorOptions(seed=41, reasoning_tokens=(8, 40), content_tokens=(8, 40))), seed=5
    )
    try:
        mixed = settings_factory(
            provider={"base_url": router.url, "request_logprobs": True, "extra_body": {}},
            datasets={"mixed": {"max_tokens": 256}, "pinned": {"max_tokens": 256}},
        )
        await ensure_topics(mixed.kafka, ["mixed", "pinned"])
        for name in ("mixed", "pinned"):
            await produce(mixed, mixed.kafka.prompts_topic(name), [prompt_value(name, i) for i in range(PROMPTS)])

        # Load-balanced over every upstream: what the answers prove, per upstream.
        run = await run_probe(mixed, ["mixed"], N)
        [found] = run.reports
        sent = requests_of(router.stats(), "mixed")
        again = await run_probe(mixed, ["mixed"], N)  # the same prompts: answered from the store
        sent_again = requests_of(router.stats(), "mixed")

        # The command, on a config pinned to the lossless upstream, and on the mixed one.
        pinned_toml = tmp_path / "pinned.toml"
        pinned_toml.write_text(toml_of(mixed, router.url, "pinned", '{ only = ["lossless"] }'), encoding="utf-8")
        mixed_toml = tmp_path / "mixed.toml"
        mixed_toml.write_text(toml_of(mixed, router.url, "mixed", "{}"), encoding="utf-8")
        runner = CliRunner()
        # The compact table in an 80-column terminal; every column (--wide) in a 250-column one.
        ok = await asyncio.to_thread(runner.invoke, app, ["probe", "-c", str(pinned_toml), "--n", "10"],
                                     env={"COLUMNS": "80"})  # fmt: skip
        bad = await asyncio.to_thread(runner.invoke, app, ["probe", "-c", str(mixed_toml), "--n", str(N), "--wide"],
                                      env={"COLUMNS": "250"})  # fmt: skip
    finally:
        await router.close()

    truth = router.configuration()
    line = report(
        requests_mixed=sent,
        requests_after_second_probe=sent_again,
        requests_pinned=requests_of(router.stats(), "pinned"),
        share=round(found.findings.share, 3),
        upstream_answers={u: f.answers for u, f in found.upstreams.items()},
        reasons=dict(found.findings.reasons),
        exit_pinned=ok.exit_code,
        exit_mixed=bad.exit_code,
    )
    # Never more than n paid per dataset; a second probe pays nothing.
    assert sent <= N and found.findings.answers == N, line
    assert sent_again == sent and again.reports[0].requests_sent == 0, line
    assert requests_of(router.stats(), "pinned") <= 10, line
    # Per upstream, every fact the answers established equals the router's configuration.
    assert set(found.upstreams) <= set(truth) and len(found.upstreams) >= 4, line
    for name, facts in found.upstreams.items():
        habits = truth[name]
        assert facts.logprobs == habits["logprobs"], (name, facts, line)
        whitespace = set(facts.whitespace.values()) - {"unproven"}
        if habits["logprobs"] == "present":
            assert whitespace == {habits["whitespace"]}, (name, facts.whitespace, line)
            expected_eot = "counted" if habits["end_of_turn_counted"] else "not counted"
            assert facts.end_of_turn == expected_eot, (name, facts, line)
            assert facts.prompt_agrees == facts.prompt_compared, (name, facts, line)
            if habits["bad_usage_rate"] == 0:
                assert facts.usage_wrong == 0, (name, facts, line)
        else:
            assert whitespace == set() and facts.end_of_turn == "unproven", (name, facts, line)
    # The forecast: the pinned lossless config passes, the mixed one is below min_yield (exit 1).
    assert ok.exit_code == 0, ok.output
    assert "lossless" in ok.output and "ok" in ok.output
    assert bad.exit_code == 1, bad.output
    assert "below min_yield" in bad.output and "stripping" in bad.output
    assert "what the answers proved" in bad.output and "what the answers proved" not in ok.output
    for run_output, width in ((ok.output, 80), (bad.output, 250)):
        assert max(len(line) for line in run_output.splitlines()) <= width, run_output


async def test_probe_first_halts_a_bad_route_before_the_spend_and_a_good_route_pays_each_prompt_once(
    settings_factory: Callable[..., Any], report: Callable[..., str]
) -> None:
    """[inference] probe_first = 10: stripping without logprobs is halted after 10 answers; lossless runs,
    and the run reuses the probe's answers (the router sees each prompt once)."""
    from schemas import Halt, SampleAudited, decode
    from services.control import read_control_state
    from services.probe.app import PROBE_ACTOR
    from tests.e2e.harness import Pipeline, read_all

    router = await start_router(
        habit_upstreams(SimulatorOptions(seed=43, reasoning_tokens=(8, 30), content_tokens=(8, 20))), seed=6
    )
    probe_n = 10
    try:
        def settings_for(only: str) -> Any:
            return settings_factory(
                provider={"base_url": router.url, "concurrency": 8, "extra_body": {"provider": {"only": [only]}}},
                inference={"probe_first": probe_n},
                datasets={"bad": {}} if only == "stripping" else {"good": {}},
            )

        bad, good = settings_for("stripping"), settings_for("lossless")
        await ensure_topics(bad.kafka, ["bad", "good"])
        await produce(bad, bad.kafka.prompts_topic("bad"), [prompt_value("bad", i) for i in range(PROMPTS)])

        pipeline = Pipeline()
        try:
            await pipeline.start_stages(bad, "inference")
            halted = (await read_control_state(bad)).get("bad")
        finally:
            await pipeline.stop()
        paid_bad = requests_of(router.stats(), "bad")
        # Only now the good dataset's prompts: the first worker (routed to stripping) follows every
        # prompts topic, and would otherwise pay for good prompts in the moment before it stops.
        await produce(good, good.kafka.prompts_topic("good"), [prompt_value("good", i) for i in range(PROMPTS)])

        accepted_topic = good.kafka.topic("accepted")

        async def all_good_accepted() -> bool:
            records = (await read_all(good, accepted_topic))[accepted_topic]
            return len({decode(r.value, SampleAudited).sample_id for r in records}) == PROMPTS

        pipeline = Pipeline()
        try:
            await pipeline.start_stages(good, "budget", "inference", "reconstruct", "audit")
            await pipeline.wait(all_good_accepted, 180, "every good prompt accepted")
        finally:
            await pipeline.stop()
    finally:
        await router.close()

    keys = router.stats()["keys"]
    good_keys = {k: n for k, n in keys.items() if k.startswith("good:")}
    line = report(paid_bad=paid_bad, halt=halted.reason if halted else None, good_requests=sum(good_keys.values()))
    assert isinstance(halted, Halt) and halted.by == PROBE_ACTOR, line
    # The stripping upstream's answers miss their counts at edges nothing proves kept: refused by reconstruct.
    assert "below min_yield" in halted.reason and "whitespace_stripped" in halted.reason, line
    assert paid_bad == probe_n, line  # the probe's n, and nothing after the halt
    assert len(good_keys) == PROMPTS and set(good_keys.values()) == {1}, line  # probed once, reused by the run
