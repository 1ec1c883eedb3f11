"""Issue 23's quality halt, end to end: a dataset whose answers are mostly unusable stops paying.

A real broker, the simulator over real HTTP (every request counted there), inference,
reconstruct, audit and budget in this process, the default ``[budget]`` settings
(``quality_window`` 200, ``min_yield`` 0.9). The simulator gets most usage counts wrong
(``bad_usage``), so the audit's ``usage_matches`` fails on most answers. Then:

1. the budget halts the dataset on ``control`` (by ``budget-quality``) with a reason that
   names ``usage_matches`` first, judged on at most ``quality_window`` verdicts; the simulator
   received at most ``quality_window`` requests plus those in flight at that moment
   (``provider.concurrency`` bounds them at the provider), far fewer than the prompts
   published (the requests that arrived after the halt's decision are reported);
2. the fix (here: the audit without ``usage_matches``, which these answers cannot pass),
   ``resume``, and ``dlq replay --to inference`` of the dead letters: every replayed
   sample is accepted from the response store, and the simulator sees no request again for
   any of them.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from schemas import Halt, Resume, SampleAudited, decode
from services.audit.app import create_app as audit_app
from services.budget.quality import QUALITY_ACTOR
from services.common.kafka import ensure_topics
from services.control import publish_control, read_control_state
from services.dlq.app import replay
from services.dlq.core import Filters
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.e2e.harness import Pipeline, dead_letters, delete_to_end, produce, prompt_value, read_all
from tests.e2e.test_replay_fixes import restart

pytestmark = pytest.mark.e2e

DATASET = "garbage"
N_PROMPTS = 400
CONCURRENCY = 8
DOMINANT = "usage_matches"


async def quality_halt_of(settings: Any, dataset: str) -> Halt | None:
    """The quality halt standing on ``control`` for the dataset, if any."""
    event = (await read_control_state(settings)).get(dataset)
    return event if isinstance(event, Halt) and event.by == QUALITY_ACTOR else None


async def run_until_quality_halt(
    pipeline: Pipeline, settings: Any, dataset: str, prompts: int, stats: Callable[[], dict[str, Any]]
) -> tuple[Halt, int]:
    """Start budget, inference, reconstruct and audit, publish ``prompts`` prompts, wait for the quality
    halt and for the requests in flight at it to be answered; the halt and the provider's request count."""
    await pipeline.start_stages(settings, "budget", "inference", "reconstruct", "audit")
    await produce(settings, settings.kafka.prompts_topic(dataset), [prompt_value(dataset, i) for i in range(prompts)])
    halt = await pipeline.wait(lambda: quality_halt_of(settings, dataset), 180, "the quality halt on control")
    assert isinstance(halt, Halt)
    paid = await pipeline.wait(lambda: requests_settled(stats), 60, "no more requests after the halt")
    return halt, paid


def judged_at_halt(halt: Halt) -> int:
    """How many verdicts the halt was decided on ("... of its last N audit verdicts ...")."""
    match = re.search(r"of its last (\d+) audit verdicts", halt.reason)
    assert match, halt.reason
    return int(match.group(1))


def assert_halted_in_time(halt: Halt, window: int, paid: int, prompts: int, line: str) -> None:
    """Decided on at most ``window`` verdicts; the provider saw at most ``window`` requests plus those in
    flight (``provider.concurrency`` at the provider), long before the prompts ran out."""
    assert judged_at_halt(halt) <= window, line
    assert paid <= window + CONCURRENCY, line
    assert paid < prompts - window, line


async def requests_settled(stats: Callable[[], dict[str, Any]], quiet_s: float = 1.5) -> int | None:
    """The provider's request count once it stopped growing for ``quiet_s`` (the halt held), else None."""
    before = stats()["total_requests"]
    await asyncio.sleep(quiet_s)
    after = stats()["total_requests"]
    return after if after == before and after > 0 else None


@pytest.mark.long(25)
async def test_quality_halt_stops_a_dataset_of_unusable_answers_and_replay_pays_nothing(
    settings_factory: Callable[..., Any], report: Callable[..., str]
) -> None:
    """Halted within quality_window verdicts + requests in flight; after the fix, replay sends nothing."""
    sim = await start_simulator(
        SimulatorOptions(seed=23, reasoning_tokens=(8, 30), content_tokens=(8, 20), rate_bad_usage=0.8)
    )
    provider = {"base_url": sim.url, "concurrency": CONCURRENCY}
    settings = settings_factory(provider=provider, datasets={DATASET: {}})
    window = settings.budget.quality_window
    assert (window, settings.budget.min_yield) == (200, 0.9), "the test runs on the default config"
    assert N_PROMPTS > window + CONCURRENCY
    fixed = settings_factory(provider=provider, datasets={DATASET: {"audit": {"disabled_checks": [DOMINANT]}}})
    await ensure_topics(settings.kafka, [DATASET])

    pipeline = Pipeline()
    try:
        halt, paid = await run_until_quality_halt(pipeline, settings, DATASET, N_PROMPTS, sim.stats)
        after_halt = sim.requests_after(halt.at)
        halted_letters = [d for d in await dead_letters(settings) if d.stage in ("reconstruct", "audit")]
        reasons = Counter(d.reason for d in halted_letters)

        # The prompts the halt held back are not part of what the replay proves: removed from the
        # topic, so that the replayed samples are not queued behind hundreds of them.
        await delete_to_end(settings, settings.kafka.prompts_topic(DATASET))
        # The fix, the resume, the replay of the dead letters to inference.
        await restart(pipeline, "audit", audit_app(fixed))
        await publish_control(settings, Resume(scope=DATASET, reason="usage_matches off: the provider miscounts"))
        replayed = await replay(fixed, Filters(stage="audit"), to="inference")
        replayed_keys = {p.record.key_text for p in replayed.replayed}
        accepted_topic = settings.kafka.topic("accepted")

        async def accepted() -> set[str]:
            records = (await read_all(settings, accepted_topic))[accepted_topic]
            return {f"{a.dataset}:{a.sample_id}" for a in (decode(r.value, SampleAudited) for r in records)}

        async def replays_accepted() -> bool:
            return replayed_keys <= await accepted()

        await pipeline.wait(replays_accepted, 180, "every replayed sample accepted")
    finally:
        await pipeline.stop()
        await sim.close()

    keys_paid = Counter(sim.stats()["keys"])
    line = report(
        prompts=N_PROMPTS,
        quality_window=window,
        concurrency=CONCURRENCY,
        requests_at_halt_settled=paid,
        verdicts_at_halt=judged_at_halt(halt),
        requests_after_halt=after_halt,
        judged_dead_letters=len(halted_letters),
        reasons=dict(reasons),
        halt_reason=halt.reason,
        replayed=len(replayed_keys),
        requests_total=sim.stats()["total_requests"],
    )
    # 1. Halted on at most the window's verdicts plus what was in flight, long before the prompts ran out.
    assert_halted_in_time(halt, window, paid, N_PROMPTS, line)
    # The reason names the dominant dead-letter reason first, with its count.
    top = halt.reason.split("top reasons: ", 1)[1]
    assert top.startswith(f"{DOMINANT} "), line
    assert reasons.most_common(1)[0][0] == DOMINANT, line
    # 2. Replay after the fix: every audit dead letter replayed and accepted, none paid twice.
    assert replayed_keys and replayed_keys == {d.key for d in halted_letters if d.stage == "audit"}, line
    assert all(keys_paid[k] == 1 for k in replayed_keys), line
