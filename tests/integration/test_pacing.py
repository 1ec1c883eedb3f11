"""Pacing to a rate limit, on a real broker against the simulator over HTTP.

The simulator's limit is the outside truth: a token bucket of 20 requests/s with a burst of
5 and at most 16 open (``429`` + ``Retry-After: 1`` for the open cap, the time to the next
token for the bucket), answers in 0.5-1.0 s; stated in ``X-RateLimit-*`` headers, or silent
(no such header, a whole-second ``Retry-After``, an OpenRouter-style body). The worker runs
with its default provider settings (no concurrency or rate settings): it must find the pace
from what the key admits and refuses, refuse a small share of its requests, and dead-letter
nothing. How close it comes to the limit in time is a benchmark (``bench/bench_ratelimit.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from schemas import encode
from services.common.config import Settings
from services.common.kafka import ensure_topics
from tests.integration.test_inference_worker import Collector, prompt, publish, running, sim_factory  # noqa: F401
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka


async def _paced_run(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any], limit_headers: str, topic: str  # noqa: F811
) -> tuple[dict[str, Any], Any, str]:
    """300 prompts through one worker against the bucket: the simulator's stats, the throttle, a summary."""
    rps, burst, max_open, n = 20.0, 5.0, 16, 300
    sim = await sim_factory(
        rate_limit_rps=rps, rate_limit_burst=burst, max_open=max_open, retry_after_s=1.0,
        latency_s=0.5, latency_jitter_s=0.5, limit_headers=limit_headers,
    )
    settings = settings_factory(
        provider={"kind": "simulator", "base_url": sim.url}, inference={"progress_interval_s": 1.0}
    )
    assert settings.provider.concurrency == 256 and settings.provider.requests_per_minute is None
    await ensure_topics(settings.kafka, [topic])
    prompts = [prompt(topic, i) for i in range(n)]
    await publish(settings, topic, [(p.sample_id, encode(p)) for p in prompts])
    async with Collector(settings, "responses", "dead-letter") as out, running(settings) as worker:
        await wait_until(lambda: len(out.finished_keys()) >= n, timeout=180, message=f"{n} outputs")
        throttle = worker.guard.throttle if worker.guard is not None else None
    stats = sim.stats()
    summary = (
        f"simulator ({limit_headers}): {stats['total_requests']} requests, {stats['rate_limited']} refused, "
        f"peak open {stats['peak_open_requests']}; worker pace at the end {throttle.pace if throttle else '?'} req/s"
    )
    print(summary)
    assert out.dead_letters() == [], summary
    assert {r.sample_id for r in out.responses()} == {p.sample_id for p in prompts}, summary
    return stats, throttle, summary


# Paced at 20/s against a burst of 5: a busy CPU beside it bunches the sends up and the bucket
# refuses them; the 10 % bound is about the pace, so these tests run alone.
@pytest.mark.serial
async def test_a_small_burst_bucket_is_paced_to_not_bounced_off(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]  # noqa: F811
) -> None:
    stats, throttle, summary = await _paced_run(settings_factory, sim_factory, "x-ratelimit", "paced")
    refused, requests = stats["rate_limited"], stats["total_requests"]
    assert refused > 0, f"the limit never bound: nothing was tested; {summary}"
    assert refused <= 0.10 * requests, summary  # the run: 507 refused for 300 admitted
    # The pace began at the rate the key's 429s state (what is admitted moves it since).
    assert throttle is not None and throttle.limits.pacer.estimate(None).stated == 20.0, summary


@pytest.mark.serial
async def test_a_silent_bucket_is_paced_from_what_it_admits(
    settings_factory: Callable[..., Settings],
    sim_factory: Callable[..., Any],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No header states the limit and every Retry-After says 1 s: the run refused 58
    # requests for 300 admitted (16 %) and took 38.8 s where the limit allows 15 s.
    caplog.set_level(logging.INFO, logger="services.inference.app")
    stats, throttle, summary = await _paced_run(settings_factory, sim_factory, "none", "silent")
    refused, requests = stats["rate_limited"], stats["total_requests"]
    assert refused > 0, f"the limit never bound: nothing was tested; {summary}"
    assert refused <= 0.10 * requests, summary
    assert throttle is not None and throttle.limits.pacer.estimate(None).stated is None, summary
    # The progress line tells the requests open at the provider from those waiting for the pace.
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("inference progress")]
    assert progress and all("open at the provider" in p and "waiting for the pace" in p for p in progress)
