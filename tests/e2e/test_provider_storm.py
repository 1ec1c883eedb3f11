"""Provider storms: 429s with Retry-After, a burst of 5xx, stalls past the timeout and
connections dropped mid-body, against the real inference worker over HTTP on a real broker.

Asserts: the run completes; every prompt ends exactly once as a response or an inference
dead letter (nothing lost, nothing doubled); no prompt was sent to the provider more than
``max_attempts`` times besides the requests a 429 refused (never a dead letter); every dead
letter names the transient failure of its last attempt.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from schemas import DLQ_HEADERS, ResponseReceived, decode
from services.common.kafka import ensure_topics, header
from services.inference.app import create_app as inference_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.e2e.harness import Pipeline, dead_letters, produce, prompt_value, read_all

pytestmark = pytest.mark.e2e

N_PROMPTS = 240
MAX_ATTEMPTS = 4
DATASET = "storm"
# What a prompt may die of after its last attempt: only transient provider failures, and
# never a 429 (a rate limit slows the run down; its refusals use none of the attempts).
TRANSIENT_REASONS = {
    "provider_http_5xx",
    "provider_timeout",
    "provider_connection",
    "provider_connection_closed",  # the simulator's "drop" fault: the server closes mid-answer
    "provider_malformed_json",
    "provider_malformed_response",
    "provider_error_in_body",
}


@pytest.mark.long(33)
async def test_provider_storm_loses_nothing_and_bounds_retries(
    settings_factory: Callable[..., Any], report: Callable[..., str]
) -> None:
    """30% 429 + 5xx burst + timeouts + drops: every prompt accounted for once, retries bounded."""
    sim = await start_simulator(
        SimulatorOptions(
            reasoning_tokens=(4, 16),
            content_tokens=(4, 16),
            rate_429=0.30,
            retry_after_s=0.2,
            rate_5xx=0.05,
            rate_timeout=0.04,
            timeout_sleep_s=2.5,
            rate_drop=0.05,
            seed=7,
        )
    )
    settings = settings_factory(
        provider={
            "base_url": sim.url,
            "concurrency": 32,
            "max_attempts": MAX_ATTEMPTS,
            # A storm of per-request faults, not an outage: eight failures in a row happen by
            # chance at these rates, and an outage halt (tested in test_money_safety) would
            # rightly send the held prompts again after it lifts.
            "outage_after": 100_000,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.5,
            "timeout_s": 1.0,
            "connect_timeout_s": 1.0,
        },
    )
    await ensure_topics(settings.kafka, [DATASET])
    pipeline = Pipeline()
    try:
        worker = await pipeline.start("inference", inference_app(settings))
        records = [prompt_value(DATASET, i) for i in range(N_PROMPTS)]
        responses_topic = settings.kafka.topic("responses")
        dlq_topic = settings.kafka.topic("dead-letter")

        async def outputs() -> int:
            got = await read_all(settings, responses_topic, dlq_topic)
            return sum(len(v) for v in got.values())

        # First third, then a 5xx burst (every request fails for a while), then the rest.
        third = N_PROMPTS // 3
        await produce(settings, settings.kafka.prompts_topic(DATASET), records[:third])
        await pipeline.wait(lambda: _at_least(outputs, third // 2), 120, "first responses")
        sim.server.rates["5xx"] = 1.0
        await produce(settings, settings.kafka.prompts_topic(DATASET), records[third : 2 * third])
        await pipeline.wait(lambda: sim.server.stats.faults["5xx"] >= 40, 60, "a 5xx burst")
        sim.server.rates["5xx"] = 0.05
        await produce(settings, settings.kafka.prompts_topic(DATASET), records[2 * third :])
        await pipeline.wait(lambda: _at_least(outputs, N_PROMPTS), 240, "every prompt accounted for")
        assert worker is not None
    finally:
        await pipeline.stop()
        stats = sim.stats()
        await sim.close()

    got = await read_all(settings, responses_topic, dlq_topic)
    responses = [decode(r.value, ResponseReceived) for r in got[responses_topic]]
    letters = await dead_letters(settings)
    response_keys = Counter(f"{r.dataset}:{r.sample_id}" for r in responses)
    dead_keys = Counter(d.key for d in letters)
    expected = {k.decode() for k, _ in records}
    per_key = Counter(stats["keys"])
    refused = Counter({k: faults.count("429") for k, faults in stats["key_faults"].items()})
    attempts = per_key - refused  # requests that were not refused by the rate limit
    repeated = sum(n - 1 for n in per_key.values() if n > 1)
    reasons = Counter(d.reason for d in letters)
    line = report(
        prompts=N_PROMPTS,
        responses=len(responses),
        dead_letters=len(letters),
        duplicates=sum(n - 1 for n in (response_keys + dead_keys).values() if n > 1),
        provider_requests=stats["total_requests"],
        repeated_requests=repeated,
        max_requests_per_key=max(per_key.values()),
        faults=dict(stats["faults"]),
        dead_letter_reasons=dict(reasons),
    )
    assert set(response_keys) | set(dead_keys) == expected, line
    assert not set(response_keys) & set(dead_keys), f"answered and dead-lettered: {line}"
    assert all(n == 1 for n in (response_keys + dead_keys).values()), f"a key came out twice: {line}"
    assert len(responses) + len(letters) == N_PROMPTS, line
    assert max(attempts.values()) <= MAX_ATTEMPTS, f"retries beyond max_attempts: {line}"
    assert set(per_key) == expected, line
    # The storm really happened: each kind of fault hit, and retries recovered most prompts.
    for fault in ("429", "5xx", "timeout", "drop"):
        assert stats["faults"].get(fault, 0) > 0, f"fault {fault} never fired: {line}"
    assert repeated > N_PROMPTS * 0.3, line
    assert len(responses) > N_PROMPTS // 2, line
    assert {d.stage for d in letters} <= {"inference"}, line
    unexpected = set(reasons) - TRANSIENT_REASONS
    assert not unexpected, f"dead letters with non-transient reasons {unexpected}: {line}"
    # A transient failure is dead-lettered only after the last attempt, and says so: its
    # request number counts the 429s before it too. (The simulator may have seen fewer: a
    # request that timed out before its handler ran.)
    for d in letters:
        attempt = header(d.headers, DLQ_HEADERS.ATTEMPT)
        assert attempt == str(MAX_ATTEMPTS + refused[d.key]), f"{d.key} dead-lettered at attempt {attempt}: {line}"
        assert 1 <= attempts[d.key] <= MAX_ATTEMPTS, line


async def _at_least(count: Callable[[], Any], n: int) -> bool:
    return bool(await count() >= n)
