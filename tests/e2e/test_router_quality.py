"""Issue 23 on the OpenRouter-like router: a dataset routed to a stripping upstream is halted;
pinned to the lossless upstream and resumed, it is accepted.

A real broker, the router over real HTTP with the five habit upstreams (services/simulator/
router.py), inference, reconstruct, audit and budget in this process, the default quality
settings. Phase 1 routes the dataset with ``provider.order = ["stripping"]`` and no
fallbacks: the stripped text cannot be rebuilt to the ids the usage count proves, every
answer is a dead letter, and the budget halts the dataset (``budget-quality``). Phase 2
restarts inference with ``provider.only = ["lossless"]`` and resumes: the rest of the
prompts are answered by the lossless upstream only, and at least 95% of them are accepted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from schemas import Halt, Resume, SampleAudited, decode
from services.budget.quality import dead_letter_verdict
from services.common.kafka import ensure_topics
from services.control import publish_control, read_control_state
from services.dlq.app import replay
from services.dlq.core import Filters
from services.inference.app import create_app as inference_app
from services.simulator.options import SimulatorOptions
from services.simulator.router import habit_upstreams, start_router
from tests.e2e.harness import Pipeline, dead_letters, prompt_value, read_all
from tests.e2e.test_quality_halt import assert_halted_in_time, run_until_quality_halt
from tests.e2e.test_replay_fixes import restart

pytestmark = pytest.mark.e2e

DATASET = "routed"
N_PROMPTS = 400
CONCURRENCY = 8  # the same as test_quality_halt's, whose bound counts it as the requests in flight


async def test_stripping_upstream_is_halted_and_the_pinned_lossless_upstream_is_accepted(
    settings_factory: Callable[..., Any], report: Callable[..., str]
) -> None:
    """Routed to stripping: quality halt. Pinned to lossless (provider.only) and resumed: >= 95% accepted;
    `dlq replay` of the paid-for dead letters then sends no request."""
    router = await start_router(
        habit_upstreams(SimulatorOptions(seed=31, reasoning_tokens=(8, 30), content_tokens=(8, 20)))
    )

    def settings_for(provider: dict[str, Any]) -> Any:
        return settings_factory(
            provider={"base_url": router.url, "concurrency": CONCURRENCY, "extra_body": {"provider": provider}},
            datasets={DATASET: {}},
        )

    stripping = settings_for({"order": ["stripping"], "allow_fallbacks": False})
    pinned = settings_for({"only": ["lossless"]})
    window = stripping.budget.quality_window
    await ensure_topics(stripping.kafka, [DATASET])
    keys = {prompt_value(DATASET, i)[0].decode() for i in range(N_PROMPTS)}
    accepted_topic = stripping.kafka.topic("accepted")

    async def accepted() -> list[SampleAudited]:
        return [decode(r.value, SampleAudited) for r in (await read_all(stripping, accepted_topic))[accepted_topic]]

    pipeline = Pipeline()
    try:
        halt, paid_stripped = await run_until_quality_halt(pipeline, stripping, DATASET, N_PROMPTS, router.stats)
        after_halt = router.requests_after(halt.at)
        chosen_before = dict(router.stats()["chosen"])

        await restart(pipeline, "inference", inference_app(pinned))
        await publish_control(stripping, Resume(scope=DATASET, reason="pinned provider.only = lossless"))

        async def accounted() -> bool:
            done = {f"{a.dataset}:{a.sample_id}" for a in await accepted()}
            done |= {d.key for d in await dead_letters(stripping)}
            return done >= keys

        await pipeline.wait(accounted, 240, "every prompt accepted or dead-lettered after the fix")
        standing = (await read_control_state(stripping)).get(DATASET)

        # Phase 3: `dlq replay` of the dataset's paid-for dead letters (reconstruct, audit) re-sends
        # the stored answers to their original topics: judged again, and not one request more.
        requests_before_replay = router.stats()["total_requests"]

        async def verdicts() -> int:  # records: each replayed answer ends as one more of either
            return len(await dead_letters(stripping)) + len(await accepted())

        verdicts_before = await verdicts()
        replayed = []
        for stage in ("reconstruct", "audit"):
            replayed += (await replay(pinned, Filters(stage=stage, dataset=DATASET))).replayed

        async def replays_judged() -> bool:
            return await verdicts() >= verdicts_before + len(replayed)

        await pipeline.wait(replays_judged, 120, "every replayed answer judged again")
        requests_after_replay = router.stats()["total_requests"]
    finally:
        await pipeline.stop()
        await router.close()

    stats = router.stats()
    routes = stats["key_upstreams"]
    letters = [d for d in await dead_letters(stripping) if d.stage in ("reconstruct", "audit")]
    judged = [dead_letter_verdict(d.stage, d.reason, d.value) for d in letters]
    lost = Counter(v.upstream for v in judged if v is not None)
    kept = Counter(a.sample.response.upstream_provider for a in await accepted())
    after_fix = {k for k, ups in routes.items() if ups[-1] == "lossless"}
    share = kept["lossless"] / len(after_fix) if after_fix else 0.0
    line = report(
        prompts=N_PROMPTS,
        quality_window=window,
        paid_stripped=paid_stripped,
        requests_after_halt=after_halt,
        chosen_before=chosen_before,
        chosen_total=stats["chosen"],
        halt_reason=halt.reason,
        dead_letters_by_upstream=dict(lost),
        dead_letter_reasons=dict(Counter(d.reason for d in letters)),
        accepted_by_upstream=dict(kept),
        lossless_accepted_share=round(share, 4),
    )
    # Phase 1: only the stripping upstream answered, and the halt came within the window + in flight.
    assert set(chosen_before) == {"stripping"}, line
    assert_halted_in_time(halt, window, paid_stripped, N_PROMPTS, line)
    assert "stripping" not in kept and lost["stripping"] > 0, line
    # Phase 2: every later request went to the lossless upstream; >= 95% of those were accepted.
    assert stats["chosen"]["stripping"] == chosen_before["stripping"], line
    # Every prompt the stripping upstream did not answer went to lossless; a prompt answered by stripping
    # but not committed when the worker was restarted is asked again under the new routing (another
    # request, so not in the store). Uncommitted: in flight at the restart, or answered behind a prompt
    # of its partition held at the halt gate (offsets commit in order). The worker runs at most twice
    # as many prompts as it has provider slots (services.inference.app.InFlight): at most that many.
    assert N_PROMPTS - paid_stripped <= len(after_fix) <= N_PROMPTS - paid_stripped + 2 * CONCURRENCY, line
    assert share >= 0.95, line
    # Phase 3: the replay paid for nothing.
    assert replayed, line
    assert requests_after_replay == requests_before_replay, (requests_before_replay, requests_after_replay, line)
    assert not isinstance(standing, Halt), line
