"""Rate limits without a broker: the adaptive window, the Retry-After pause, the stall clock,
the throttle's queue, and the simulator's token bucket and open-request cap."""

from __future__ import annotations

import asyncio

import pytest

from services.common.config import ProviderSettings
from services.inference.limits import KEY_SCOPE, AimdWindow, Pause, ProviderLimits, StallClock
from services.inference.throttle import ProviderThrottle
from services.simulator.limits import OverCap, RequestLimiter, retry_after_text

# --- the adaptive window ---------------------------------------------------------------


def test_a_first_refusal_halves_the_window_once_per_round_and_later_ones_cut_by_the_share_refused() -> None:
    window = AimdWindow(ceiling=256)
    assert window.limit == 256
    assert window.refused(seq=10, last_seq=40) is True
    assert window.limit == 128  # nothing to go by yet: a half
    # Requests 11..40 were sent under the old window: their refusals say nothing new.
    assert window.refused(seq=40, last_seq=45) is False
    assert window.limit == 128
    for _ in range(39):
        window.answered(in_flight=128)
    # The round since the cut: 39 answered, 1 refused before this one, and this one: 39/41 got through.
    assert window.refused(seq=41, last_seq=60) is True
    # 95 % got through; the cut is nine tenths at most (the window had grown by 39 / 128 meanwhile).
    assert window.size == pytest.approx((128.0 + 39 / 128) * 0.9, abs=0.01)
    assert window.limit == 115
    assert window.refused(seq=61, last_seq=61) is True  # nothing answered since: a half
    assert window.limit == 57


def test_after_the_first_refusal_the_window_grows_by_one_per_window_of_answers() -> None:
    fast = AimdWindow(ceiling=256, size=64.0)
    for _ in range(300):
        fast.answered(in_flight=fast.limit)
    assert fast.limit == 256  # slow start: one per answer, never past provider.concurrency
    slow = AimdWindow(ceiling=256, size=128.0)
    slow.refused(seq=1, last_seq=1)
    assert slow.limit == 64
    for _ in range(64):
        slow.answered(in_flight=64)
    assert slow.size == pytest.approx(65.0, abs=0.01)  # one more per 64 answers
    slow.answered(in_flight=10)  # most of the window idle: the demand is not there, no growth
    assert slow.size == pytest.approx(65.0, abs=0.01)
    slow.restart()  # a stall was lifted: fast again
    slow.answered(in_flight=65)
    assert slow.size == pytest.approx(66.0, abs=0.01)


def test_the_window_never_shrinks_below_one_and_an_idle_window_does_not_grow() -> None:
    window = AimdWindow(ceiling=8)
    for seq in range(1, 20):
        window.refused(seq=seq * 100, last_seq=seq * 100)
    assert window.limit == 1
    window.answered(in_flight=1)  # the one request it admits was in use: grows
    assert window.limit == 2
    grown = AimdWindow(ceiling=100, size=40.0)
    grown.answered(in_flight=5)  # a tenth of it in flight: the demand is not there, no growth
    assert grown.limit == 40


def test_an_upstream_refusal_shrinks_that_upstreams_window_and_the_sum_of_upstreams_bounds_the_key() -> None:
    limits = ProviderLimits(ceiling=64, stall_s=30)
    seq = limits.start()
    limits.answered("Alpha")
    assert limits.limit == 64
    seq = limits.start()
    limits.refused(seq, now=0.0, retry_after_s=None, upstream="Alpha")
    assert limits.windows["Alpha"].limit == 32 and limits.windows[KEY_SCOPE].limit == 64
    assert limits.limit == 32  # the only upstream seen takes 32
    limits.start()
    limits.answered("Beta")  # a second upstream serves the model too
    assert limits.limit == 64


def test_refusals_pause_new_requests_for_the_retry_after_and_count_the_seconds_paused() -> None:
    limits = ProviderLimits(ceiling=4, stall_s=30, default_pause_s=0.5)
    seqs = [limits.start() for _ in range(4)]
    assert not limits.may_start(now=0.0)  # the window is full
    assert limits.refused(seqs[0], now=10.0, retry_after_s=2.0) == pytest.approx(2.0)
    # A shorter Retry-After does not cut the pause short; a later, longer one extends it.
    assert limits.refused(seqs[1], now=10.5, retry_after_s=1.0) == 0.0
    assert limits.refused(seqs[2], now=11.0, retry_after_s=3.0) == pytest.approx(2.0)
    assert limits.wait_s(11.0) == pytest.approx(3.0) and not limits.may_start(11.0)
    assert limits.pause.paused_s == pytest.approx(4.0)
    assert limits.may_start(14.0)  # one in flight, window 2
    assert limits.refused(seqs[3], now=20.0, retry_after_s=None) == pytest.approx(0.5)  # no header: the default


def test_pause_extend_from_an_expired_pause_starts_now() -> None:
    pause = Pause(until=5.0, paused_s=5.0)
    assert pause.extend(now=100.0, seconds=1.0) == 1.0
    assert pause.remaining(100.5) == pytest.approx(0.5) and pause.remaining(102.0) == 0.0


def test_the_stall_clock_runs_from_the_first_refusal_after_an_answer() -> None:
    clock = StallClock(stall_s=30.0)
    clock.refused(now=100.0)
    clock.refused(now=120.0)
    assert not clock.stalled(now=129.9)
    assert clock.stalled(now=130.0) and clock.refusals == 2
    clock.answered()
    assert not clock.stalled(now=1000.0)
    clock.refused(now=1000.0)
    assert not clock.stalled(now=1029.0) and clock.stalled(now=1030.0)
    # A refusal after a quiet spell longer than the stall (prompts held by a halt meanwhile)
    # starts the clock again: one refusal is not a storm.
    clock.refused(now=1100.0)
    assert clock.since == 1100.0 and clock.refusals == 1 and not clock.stalled(now=1100.0)


# --- the throttle ------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_throttle_admits_no_more_than_the_window_and_wakes_waiters_in_order() -> None:
    throttle = ProviderThrottle(ProviderSettings(concurrency=2), "simulator")
    first, second = await throttle.admit(), await throttle.admit()
    throttle.limits.pacer.first_start -= 1.0  # as if the run had begun a second ago: its last second counts
    order: list[int] = []

    async def one(n: int) -> None:
        await throttle.admit()
        order.append(n)

    waiting = [asyncio.create_task(one(n)) for n in range(3)]
    await asyncio.sleep(0.05)
    assert order == [] and throttle.waiting == 3
    throttle.answered(None, 10)
    await asyncio.sleep(0.05)
    assert order == [0]  # one place freed: one waiter goes
    throttle.refused(second, retry_after_s=0.2, upstream=None)  # window 2 -> 1, pause 0.2 s
    # Nothing stated a rate: the pace is 0.85 of what was started over the last second (3 requests).
    assert throttle.pace == pytest.approx(0.85 * 3)
    await asyncio.sleep(0.05)
    assert order == [0] and throttle.window == 1
    throttle.release(first)  # the first request ends, and the first waiter's: the window is empty, but paused
    throttle.release(3)
    await asyncio.sleep(0.3)
    assert order == [0, 1]  # after the pause, the window of one admits one
    throttle.release(4)
    await asyncio.sleep(0.05)
    assert order == [0, 1]  # the window has room, the pace not yet: one request every 1 / 2.55 s
    await asyncio.sleep(1 / 2.55)
    assert order == [0, 1, 2]
    assert first == 1
    for task in waiting:
        await task
    throttle.close()


async def test_requests_waiting_when_the_ramp_ends_go_at_once_without_an_answer() -> None:
    # 1,000 requests at once: the start-up ramp lets 4 go, then twice as many every 0.1 s. Its
    # end must send every waiting request at once, not when some answer (minutes away for long
    # answers, never at a provider that answers only once 1,000 are open) next wakes the line.
    clock = _Clock()
    throttle = ProviderThrottle(ProviderSettings(concurrency=1000), "simulator", clock=clock)
    tasks = [asyncio.create_task(throttle.admit()) for _ in range(1000)]
    await asyncio.sleep(0)
    assert throttle.limits.in_flight == 4 and throttle.waiting == 996
    seq = next(task.result() for task in tasks if task.done())
    clock.now += 0.35  # the ramp allows 45 now: an answer hands out its room...
    throttle.answered(None, 10, seq)
    clock.now += 10.0  # ...and the ramp is over before the requests told to go start
    for _ in range(3):
        await asyncio.sleep(0)  # no clock time: the ramp's own timer does not fire meanwhile
    assert throttle.waiting == 0 and throttle.limits.in_flight == 999
    assert all(task.done() for task in tasks)
    throttle.close()


async def test_a_waiter_is_woken_when_the_ramp_grows_while_the_throttle_looks_at_the_clock() -> None:
    # A slow machine: the ramp (4 requests, twice as many every 0.1 s) grows between the throttle's
    # look at the room and its look at how long to wait. The waiter must still get its turn.
    clock = _Clock()
    throttle = ProviderThrottle(ProviderSettings(concurrency=1000), "simulator", clock=clock)
    for _ in range(4):
        await throttle.admit()
    room = throttle.limits.room
    looks: list[float] = []

    def room_then_later(now: float) -> int:
        looks.append(now)
        if len(looks) == 2:  # the waiter's wake-up call found no room: 0.1 s pass right then
            clock.now += 0.1
        return room(now)

    throttle.limits.room = room_then_later  # type: ignore[method-assign]
    await asyncio.wait_for(throttle.admit(), 1.0)  # the ramp allows 8 by then: it goes
    assert throttle.limits.in_flight == 5 and looks[:2] == [1000.0, 1000.0]
    throttle.close()


async def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    throttle = ProviderThrottle(ProviderSettings(concurrency=1), "simulator")
    seq = await throttle.admit()
    cancelled = asyncio.create_task(throttle.admit())
    later = asyncio.create_task(throttle.admit())
    await asyncio.sleep(0.02)
    throttle.release(seq)  # the first waiter's turn...
    cancelled.cancel()  # ...is given to it just as it is cancelled
    await asyncio.sleep(0.05)
    assert later.done() and throttle.limits.in_flight == 1
    throttle.close()


async def test_the_throttle_stalls_after_refusals_only_and_the_requests_per_minute_ceiling_holds() -> None:
    clock = _Clock()
    throttle = ProviderThrottle(
        ProviderSettings(concurrency=8, rate_limit_stall_s=30, requests_per_minute=3), "simulator", clock=clock
    )
    seqs = [await throttle.admit() for _ in range(3)]
    fourth = asyncio.create_task(throttle.admit())
    await asyncio.sleep(0.1)
    assert not fourth.done()  # 3 a minute: the fourth waits for the leaky bucket
    fourth.cancel()
    throttle.refused(seqs[0], retry_after_s=None, upstream=None)
    clock.now += 29
    assert not throttle.stalled()
    clock.now += 1
    assert throttle.stalled()
    throttle.answered(None, None)
    assert not throttle.stalled()
    throttle.close()


def test_the_tokens_estimate_uses_the_mean_answer_once_there_is_one() -> None:
    throttle = ProviderThrottle(ProviderSettings(tokens_per_minute=100_000), "simulator")
    assert throttle.counts_tokens
    assert throttle.tokens_estimate(prompt_chars=400, max_tokens=4096) == 100 + 4096
    throttle.limits.start()
    throttle.answered(None, 300)
    assert throttle.tokens_estimate(prompt_chars=400, max_tokens=4096) == 100 + 300


# --- the simulator's limit ---------------------------------------------------------------


def test_the_token_bucket_admits_its_burst_then_its_rate_and_says_when_to_come_back() -> None:
    bucket = RequestLimiter(rps=10.0, burst=3.0)
    assert [bucket.admit(0.0) for _ in range(3)] == [None, None, None]
    refusal = bucket.admit(0.0)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(0.1)
    assert bucket.admit(0.05) is not None  # half a token back
    assert bucket.admit(0.1) is None  # a whole one
    admitted = sum(bucket.admit(0.1 + i / 1000) is None for i in range(1, 1001))
    assert 9 <= admitted <= 11  # one second at 10/s


def test_the_open_cap_refuses_beyond_max_open_until_a_request_ends() -> None:
    cap = RequestLimiter(max_open=2, open_retry_after_s=1.0)
    assert cap.admit(0.0) is None and cap.admit(0.0) is None
    refusal = cap.admit(0.0)
    assert refusal is not None and refusal.retry_after_s == 1.0 and refusal.limit == "2"
    cap.done()
    assert cap.admit(0.0) is None


def test_a_bucket_of_no_burst_never_admits_and_bad_limits_are_refused() -> None:
    never = RequestLimiter(rps=5.0, burst=0.0)
    assert all(never.admit(float(t)) is not None for t in range(100))
    with pytest.raises(ValueError):
        RequestLimiter(rps=0.0)
    with pytest.raises(ValueError):
        RequestLimiter(max_open=-1)
    assert not RequestLimiter().active


def test_over_cap_counts_only_the_time_more_than_the_cap_were_open() -> None:
    over = OverCap(cap=1)
    over.change(0.0, +1)
    over.change(1.0, +1)  # two open from 1.0
    over.change(1.5, -1)  # ...to 1.5
    over.change(3.0, -1)
    assert over.over_s == pytest.approx(0.5) and over.peak == 2


def test_retry_after_text() -> None:
    assert retry_after_text(1.0) == "1"
    assert retry_after_text(0.1) == "0.1"
    assert retry_after_text(0.0125) == "0.013" or retry_after_text(0.0125) == "0.012"


# --- draftstream status ------------------------------------------------------------------


async def test_status_reads_the_window_429s_and_pause_from_a_workers_metrics() -> None:
    from prometheus_client import REGISTRY, generate_latest
    from rich.console import Console

    from services.status.core import StatusSnapshot, rate_limits_from_metrics, render

    throttle = ProviderThrottle(ProviderSettings(concurrency=256), "status-test")
    seq = await throttle.admit()
    throttle.refused(seq, retry_after_s=2.5, upstream=None)
    throttle.close()
    rows = [r for r in rate_limits_from_metrics(generate_latest(REGISTRY).decode()) if r.provider == "status-test"]
    assert [(r.upstream, r.window, r.refused, r.paused_s) for r in rows] == [(KEY_SCOPE, 128, 1, pytest.approx(2.5))]
    console = Console(width=160, record=True)
    console.print(render(StatusSnapshot(taken_at=0.0, rate_limits=rows)))
    text = console.export_text()
    assert "rate limits" in text and "status-test" in text and "128" in text and "2.5 s" in text
    console.print(render(StatusSnapshot(taken_at=0.0, rate_limits_source="http://127.0.0.1:9401/metrics")))
    assert "no inference metrics at http://127.0.0.1:9401/metrics" in console.export_text()
