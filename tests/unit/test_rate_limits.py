"""Rate limits without a broker: the window of open requests, the Retry-After pause, the stall clock,
the throttle's queue, and the simulator's token bucket and open-request cap."""

from __future__ import annotations

import asyncio

import pytest

from services.common.config import ProviderSettings
from services.inference.limits import KEY_SCOPE, PLATEAU_SLOWDOWN, OpenWindow, Pause, ProviderLimits, StallClock
from services.inference.pacer import CLOSED_RUN
from services.inference.throttle import ProviderThrottle
from services.simulator.limits import OverCap, RequestLimiter, retry_after_text

# --- the window of open requests ----------------------------------------------------------


def test_a_window_grows_by_one_an_answer_until_a_cap_is_found_then_probes_past_it_slowly() -> None:
    window = OpenWindow(ceiling=256, size=64.0)
    for _ in range(300):
        window.answered(in_flight=window.limit)
    assert window.limit == 256  # slow start: one per answer, never past provider.concurrency
    window.hold(16, seq=10, last_seq=40)  # a cap on open requests found at 16
    assert window.limit == 16
    window.hold(8, seq=30, last_seq=41)  # requests sent before the hold: nothing new
    assert window.limit == 16
    answers = 0
    while window.limit == 16:
        window.answered(in_flight=16)
        answers += 1
    # Past the cap, one more per PLATEAU_SLOWDOWN windows of answers: a probe now and then.
    assert window.limit == 17 and answers == pytest.approx(16 * PLATEAU_SLOWDOWN, rel=0.05)
    window.answered(in_flight=2)  # most of the window idle: the demand is not there, no growth
    assert window.size == pytest.approx(17.0, abs=0.01)


def test_a_tentative_window_keeps_to_a_count_refused_once_and_grows_one_an_answer() -> None:
    window = OpenWindow(ceiling=256)
    window.tentative(16)
    assert window.limit == 16 and window.trial
    window.answered(in_flight=16)
    assert window.limit == 17  # unlike a cap found, it grows as fast as before
    window.tentative(40)
    assert window.limit == 17  # never grows by a tentative count
    window.cap_at(8, seq=5, last_seq=5)  # stated: held for good, the trial is over
    assert window.limit == 8 and not window.trial
    for _ in range(100):
        window.answered(in_flight=8)
    assert window.limit == 8
    window.restart()
    window.answered(in_flight=8)
    assert window.limit == 9


def test_the_window_never_shrinks_below_one() -> None:
    window = OpenWindow(ceiling=8)
    window.hold(0, seq=1, last_seq=1)
    assert window.limit == 1
    window.tentative(0)
    assert window.limit == 1


def test_an_open_cap_nobody_states_is_found_from_the_counts_refused_and_admitted() -> None:
    # 16 open at once, no header says so: the 17th is refused, tentatively a cap...
    limits = ProviderLimits(ceiling=256, stall_s=30)
    seqs = [limits.start(0.0) for _ in range(17)]
    limits.refused(seqs[-1], now=0.01, retry_after_s=1.0)
    assert limits.limit == 16 and limits.windows[KEY_SCOPE].trial
    assert limits.pacer.rate is not None  # (once, it may as well be the rate: the pace moved too)
    # ...refused there again after answers came: a cap found (held, grown past slowly).
    limits.answered(None, 0.6, seqs[0])
    limits.answered(None, 0.6, seqs[1])  # (each answer grows a tentative window by one: 18)
    more = [limits.start(0.6) for _ in range(3)]
    assert limits.opens[more[-1]] == 17
    limits.refused(more[-1], now=0.61, retry_after_s=1.0)
    assert limits.limit == 16 and not limits.windows[KEY_SCOPE].trial
    assert limits.pause.remaining(0.61) == 0.0  # nobody else waits: the window keeps the others to it
    # The cut the first refusal made was the cap's: the pace is back where it was (none). Kept,
    # a pace well above the rate the window allows holds back the refill after a clump of answers.
    assert limits.pacer.rate is None and limits.pacer.available(0.61) > 16


def test_a_cap_found_keeps_the_pace_a_refusal_at_another_count_set() -> None:
    # The 17th open is refused once (a cap or the rate?), then one with 5 open (the rate: the
    # pace is cut for it), then the 17th again: the cap is found, and the pace the rate set stays.
    limits = ProviderLimits(ceiling=256, stall_s=30)
    seqs = [limits.start(0.0) for _ in range(17)]
    limits.refused(seqs[-1], now=0.01, retry_after_s=1.0)
    for seq in seqs[:12]:
        limits.answered(None, 0.6, seq)
    low = [limits.start(0.7) for _ in range(1)]
    assert limits.opens[low[-1]] == 5
    limits.refused(low[-1], now=0.71, retry_after_s=1.0)
    paced = limits.pacer.rate
    assert paced is not None
    more = [limits.start(0.8) for _ in range(13)]
    assert limits.opens[more[-1]] == 17
    limits.refused(more[-1], now=0.81, retry_after_s=1.0)
    assert limits.limit == 16 and not limits.windows[KEY_SCOPE].trial
    assert limits.pacer.rate == paced


def test_a_count_admitted_as_often_as_refused_is_not_a_cap() -> None:
    # A bucket refuses at whatever count is open: counts it also admitted are the rate's.
    limits = ProviderLimits(ceiling=256, stall_s=30)
    now = 0.0
    for _ in range(3):  # three requests answered with 8 open each
        seqs = [limits.start(now) for _ in range(8)]
        for seq in seqs:
            limits.answered(None, now + 0.5, seq)
        now += 1.0
    seqs = [limits.start(now) for _ in range(8)]
    limits.refused(seqs[-1], now=now + 0.01, retry_after_s=1.0)
    assert limits.limit == 256  # refused once at 8, admitted three times there: the rate
    assert limits.pacer.rate is not None  # the pace moved instead


def test_an_upstream_refusal_paces_that_upstream_and_the_sum_of_upstreams_bounds_the_key() -> None:
    limits = ProviderLimits(ceiling=64, stall_s=30)
    seq = limits.start(0.0)
    limits.answered("Alpha", 0.5, seq)
    seq = limits.start(1.0)
    limits.refused(seq, now=1.01, retry_after_s=None, upstream="Alpha")
    alpha = limits.pacer.estimate("Alpha").rate
    assert alpha is not None and limits.pacer.estimate(None).rate is None
    assert limits.pacer.rate == alpha  # the only upstream seen takes the key's pace
    seq = limits.start(1.5)
    limits.answered("Beta", 2.0, seq)  # a second upstream serves the model too: not paced yet
    assert limits.pacer.rate is None or limits.pacer.rate >= alpha


def test_refusals_in_a_row_pause_new_requests_for_the_retry_after_and_one_alone_does_not() -> None:
    limits = ProviderLimits(ceiling=8, stall_s=30, default_pause_s=0.5)
    seqs = [limits.start(10.0) for _ in range(8)]
    assert not limits.may_start(now=10.0)  # the window is full
    # One refused among answered ones: the rate; only the refused request waits (the throttle's hold).
    limits.answered(None, 10.4, seqs[0])
    assert limits.refused(seqs[1], now=10.5, retry_after_s=2.0, stated_rps=5.0) == 0.0
    assert limits.wait_s(10.5) == 0.0
    # CLOSED_RUN refused in a row: the key admits nothing now (a window spent): everyone waits.
    run = seqs[8 - CLOSED_RUN:]
    for seq in run[:-1]:
        assert limits.refused(seq, now=11.0, retry_after_s=2.0, stated_rps=5.0) == 0.0
    assert limits.refused(run[-1], now=11.0, retry_after_s=2.0, stated_rps=5.0) == pytest.approx(2.0)
    assert limits.wait_s(11.0) == pytest.approx(2.0) and not limits.may_start(11.0)
    assert limits.pause.paused_s == pytest.approx(2.0)
    assert limits.may_start(13.0)  # the pause over: one request at the pace


def test_a_run_of_refusals_past_a_cap_on_open_requests_pauses_nobody() -> None:
    # 16 open at once, none answered yet: the ramp's 17th to 20th are refused in a row. A cap on
    # open requests explains them (the key admitted every request below): the 16 open are not
    # refused, and the next may go the moment an answer frees a place.
    limits = ProviderLimits(ceiling=256, stall_s=30)
    seqs = [limits.start(0.0) for _ in range(20)]
    for seq in seqs[16:]:
        assert limits.refused(seq, now=0.01, retry_after_s=1.0) == 0.0
    assert limits.wait_s(0.01) == 0.0 and limits.pause.paused_s == 0.0
    limits.answered(None, 0.6, seqs[0])
    assert limits.may_start(0.6)


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
    pacer = throttle.limits.pacer
    pacer.measure_from -= 1.0  # as if the run had begun a second ago: its last second counts
    order: list[int] = []

    async def one(n: int) -> None:
        await throttle.admit()
        order.append(n)

    waiting = [asyncio.create_task(one(n)) for n in range(3)]
    await asyncio.sleep(0.05)
    assert order == [] and throttle.waiting == 3
    throttle.answered(None, 10, first)
    await asyncio.sleep(0.05)
    assert order == [0]  # one place freed: one waiter goes
    # Refused alone, the rest admitted: it waits its Retry-After by itself, nobody pauses, and
    # the pace is what the key admitted: 2 of the 3 sent over the second or so the run is old.
    # Refused with 2 open and never admitted there: maybe a cap at 1, which the window keeps to.
    assert throttle.refused(second, retry_after_s=0.2, upstream=None) == pytest.approx(0.2)
    assert throttle.pace is not None and 1.5 < throttle.pace < 2.0 and throttle.window == 1
    await asyncio.sleep(0.05)
    assert order == [0]
    throttle.release(3)  # the first waiter's request ends: the window of one admits the next
    await asyncio.sleep(0.05)
    assert order == [0, 1]
    throttle.release(4)
    await asyncio.sleep(0.05)
    assert order == [0, 1]  # the window has room, the pace not yet: one request every 1 / pace s
    await asyncio.sleep(1.0 / throttle.pace)
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
    seqs = [await throttle.admit() for _ in range(CLOSED_RUN)]
    for seq in seqs:  # refused in a row, at the stated rate: the key admits nothing now, a pause
        throttle.refused(seq, retry_after_s=2.5, upstream=None, stated_rps=10.0)
    throttle.close()
    rows = [r for r in rate_limits_from_metrics(generate_latest(REGISTRY).decode()) if r.provider == "status-test"]
    expected = [(KEY_SCOPE, 256, CLOSED_RUN, pytest.approx(2.5, abs=0.1))]
    assert [(r.upstream, r.window, r.refused, r.paused_s) for r in rows] == expected
    console = Console(width=160, record=True)
    console.print(render(StatusSnapshot(taken_at=0.0, rate_limits=rows)))
    text = console.export_text()
    assert "rate limits" in text and "status-test" in text and "256" in text and "2.5 s" in text
    console.print(render(StatusSnapshot(taken_at=0.0, rate_limits_source="http://127.0.0.1:9401/metrics")))
    assert "no inference metrics at http://127.0.0.1:9401/metrics" in console.export_text()


async def test_a_waiter_sleeping_out_a_slow_pace_goes_when_the_pace_rises() -> None:
    # One request in five seconds: the second waits on a timer. An answer that raises the pace
    # must bring the timer forward, not leave the waiter to sleep out the old five seconds.
    throttle = ProviderThrottle(ProviderSettings(concurrency=4), "simulator")
    pacer = throttle.limits.pacer
    pacer.ramp.over = pacer.paced = True
    pacer.estimate(None).rate = 0.2
    first = await throttle.admit()
    second = asyncio.create_task(throttle.admit())
    await asyncio.sleep(0.01)
    assert not second.done()
    pacer.estimate(None).rate = 50.0
    throttle.answered(None, 10, first)
    await asyncio.wait_for(second, 1.0)
    throttle.close()
