"""The simulator's other limit shapes (a fixed window a minute, a rate that changes mid-run),
and the pure pacing policy run against them on a fake clock."""

from __future__ import annotations

import pytest

from services.simulator.limits import RequestLimiter
from services.simulator.options import SimulatorOptions
from services.simulator.shapes import ScheduledLimiter, WindowLimiter, parse_schedule
from tests.unit.test_pacer import _run


def test_the_window_admits_its_count_then_refuses_until_the_next_window() -> None:
    window = WindowLimiter(per_window=3, window_s=60.0)
    assert [window.admit(61.0) for _ in range(3)] == [None, None, None]
    refusal = window.admit(70.0)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(50.0) and refusal.limit == "3/60s"
    assert window.admit(120.0) is None  # a new minute
    assert window.rps == pytest.approx(0.05)


def test_the_schedule_halves_then_restores_the_bucket() -> None:
    assert parse_schedule("50:1, 20:0.5") == ((20.0, 0.5), (50.0, 1.0))
    with pytest.raises(ValueError):
        parse_schedule("20")
    with pytest.raises(ValueError):
        parse_schedule("20:0")
    bucket = ScheduledLimiter(rps=10.0, burst=1.0, schedule=parse_schedule("20:0.5,50:1"))
    assert bucket.admit(100.0) is None  # the clock starts at the first request
    assert bucket.factor(119.0) == 1.0 and bucket.factor(120.0) == 0.5 and bucket.factor(150.0) == 1.0
    admitted = sum(bucket.admit(125.0 + i / 100) is None for i in range(1000))  # 10 s at the halved rate
    assert 49 <= admitted <= 51


def test_options_choose_the_shape() -> None:
    assert isinstance(SimulatorOptions(rate_limit_window=600).limiter(), WindowLimiter)
    assert isinstance(SimulatorOptions(rate_limit_rps=20.0, rate_limit_schedule="20:0.5").limiter(), ScheduledLimiter)
    assert type(SimulatorOptions(rate_limit_rps=20.0).limiter()) is RequestLimiter
    with pytest.raises(ValueError):
        SimulatorOptions(rate_limit_schedule="20:0.5")  # nothing to change


def test_a_paced_run_against_a_window_a_minute_uses_each_window() -> None:
    # 600 a minute, 1,500 prompts: the limit allows them in 2.5 minutes (three windows begun).
    elapsed, refused = _run(WindowLimiter(per_window=600, window_s=60.0), 1500, latency=(0.5, 1.0))
    assert elapsed <= 121.0 + 1.0 + 30.0, elapsed  # the third window's 300 at its 10/s pace
    assert refused <= 0.1 * 1500, refused


def test_a_paced_run_follows_a_halved_rate_and_refuses_little() -> None:
    limiter = ScheduledLimiter(rps=20.0, burst=5.0, schedule=parse_schedule("10:0.5,40:1"))
    elapsed, refused = _run(limiter, 1000, latency=(0.5, 1.0))
    # 200 in the first 10 s, 300 in the next 30 s, 500 at 20/s: 65 s at the limit.
    assert elapsed <= 65.0 / 0.85, elapsed
    assert refused <= 0.1 * 1000, refused
