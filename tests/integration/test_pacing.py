"""Pacing to a rate limit, on a real broker against the simulator over HTTP.

The simulator's limit is the outside truth: a token bucket of 20 requests/s with a burst of
5 and at most 16 open (``429`` + ``Retry-After: 1`` for the open cap, the time to the next
token for the bucket), answers in 0.5-1.0 s. The worker runs with its default provider
settings (no concurrency or rate settings): it must find the pace from what the key admits
and refuses, refuse-rate a small share of its requests, and dead-letter nothing. How close
it comes to the limit in time is a benchmark (``bench/bench_ratelimit.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from schemas import encode
from services.common.config import Settings
from services.common.kafka import ensure_topics
from tests.integration.test_inference_worker import Collector, prompt, publish, running, sim_factory  # noqa: F401
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka


# Paced at the stated 20/s against a burst of 5: a busy CPU beside it bunches the sends up and
# the bucket refuses them; the 10 % bound is about the pace, so the test runs alone.
@pytest.mark.serial
async def test_a_small_burst_bucket_is_paced_to_not_bounced_off(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]  # noqa: F811
) -> None:
    rps, burst, max_open, n = 20.0, 5.0, 16, 300
    sim = await sim_factory(
        rate_limit_rps=rps, rate_limit_burst=burst, max_open=max_open, retry_after_s=1.0,
        latency_s=0.5, latency_jitter_s=0.5,
    )
    settings = settings_factory(provider={"kind": "simulator", "base_url": sim.url})
    assert settings.provider.concurrency == 256 and settings.provider.requests_per_minute is None
    await ensure_topics(settings.kafka, ["paced"])
    prompts = [prompt("paced", i) for i in range(n)]
    await publish(settings, "paced", [(p.sample_id, encode(p)) for p in prompts])
    async with Collector(settings, "responses", "dead-letter") as out, running(settings) as worker:
        await wait_until(lambda: len(out.finished_keys()) >= n, timeout=180, message=f"{n} outputs")
        throttle = worker.guard.throttle if worker.guard is not None else None
    stats = sim.stats()
    refused, requests = stats["rate_limited"], stats["total_requests"]
    summary = (
        f"simulator: {requests} requests, {refused} refused, peak open {stats['peak_open_requests']}; "
        f"worker pace at the end {throttle.pace if throttle else '?'} req/s"
    )
    print(summary)
    assert out.dead_letters() == [], summary
    assert {r.sample_id for r in out.responses()} == {p.sample_id for p in prompts}, summary
    assert refused > 0, f"the limit never bound: nothing was tested; {summary}"
    assert refused <= 0.10 * requests, summary  # the run: 507 refused for 300 admitted
    # The pace came from the rate the key's 429s state (it probes above it now and then).
    assert throttle is not None and throttle.limits.pacer.estimate(None).stated == rps, summary
