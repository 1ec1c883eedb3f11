"""The pacer without a broker or a clock: the AIMD rate estimate, the token bucket, the ramp,
the headers that state a limit, and a paced worker against the simulator's own token bucket
(services.simulator.limits, the outside truth) on one fake clock."""

from __future__ import annotations

import math
import random

import pytest

from services.inference.limits import ProviderLimits
from services.inference.pacer import (
    ADMIT_S,
    ADMITTED_SHARE,
    RAMP_DOUBLING_S,
    RAMP_START,
    SHORT_SPAN_S,
    STEP_SHARE,
    Pacer,
    Ramp,
    RateEstimate,
    TokenBucket,
    key_rate,
    stated_count,
    stated_rate,
)
from services.simulator.faults import choose_transient_fault
from services.simulator.limits import Refusal, RequestLimiter

# --- the estimate -----------------------------------------------------------------------


def test_nothing_known_is_not_paced_and_what_is_admitted_wins_over_what_is_stated() -> None:
    estimate = RateEstimate()
    estimate.answered(0.0)
    assert estimate.rate is None  # answers alone say nothing about a limit
    estimate.state(20.0)
    assert estimate.rate == 20.0  # a stated limit seeds the estimate...
    assert estimate.refused(seq=5, last_seq=30, admitted=12.0, sent_rate=20.0, in_use=True) is True
    assert estimate.rate == pytest.approx(ADMITTED_SHARE * 12.0)  # ...and loses to what was admitted
    estimate.state(20.0)
    assert estimate.rate == pytest.approx(ADMITTED_SHARE * 12.0)  # stated again: no reseeding


def test_a_refusal_sets_the_rate_admitted_once_per_round() -> None:
    estimate = RateEstimate(rate=30.0)
    assert estimate.refused(seq=5, last_seq=30, admitted=20.0, sent_rate=30.0, in_use=True) is True
    assert estimate.rate == pytest.approx(ADMITTED_SHARE * 20.0)  # a share: a bucket refills below its rate
    # Requests 6..30 were sent at the old pace: their refusals say nothing new.
    assert estimate.refused(seq=30, last_seq=31, admitted=5.0, sent_rate=30.0, in_use=True) is False
    assert estimate.rate == pytest.approx(ADMITTED_SHARE * 20.0)
    # Requests were not going at the pace (a burst was refused): all of what was admitted.
    assert estimate.refused(seq=31, last_seq=40, admitted=15.0, sent_rate=19.0, in_use=False) is True
    assert estimate.rate == pytest.approx(15.0)
    # What was admitted never raises the estimate (a burst after a pause admits more than the rate).
    assert estimate.refused(seq=41, last_seq=50, admitted=40.0, sent_rate=15.0, in_use=True) is True
    assert estimate.rate == pytest.approx(ADMITTED_SHARE * 15.0)


def test_the_probe_steps_up_and_doubles_its_step_each_second_nothing_is_refused() -> None:
    estimate = RateEstimate(rate=20.0)
    for _ in range(20):  # the first second at full pace: a step of STEP_SHARE of the rate
        estimate.answered(10.0)
    first = estimate.rate
    assert first == pytest.approx(20.0 * (1 + STEP_SHARE), rel=0.01)
    rate = first
    for _ in range(20):
        estimate.answered(11.0)  # a second later: steps twice as large
    assert estimate.rate is not None and estimate.rate - rate == pytest.approx(2 * (first - 20.0), rel=0.1)
    estimate.refused(seq=1, last_seq=1, admitted=20.0, sent_rate=25.0, in_use=True)
    estimate.answered(12.0)
    assert estimate.rate == pytest.approx(ADMITTED_SHARE * 20.0 * (1 + STEP_SHARE / (ADMITTED_SHARE * 20.0)), rel=0.01)
    estimate.restart()
    assert estimate.rate is None  # after a stall: measured afresh


def test_the_users_ceiling_caps_every_estimate() -> None:
    pacer = Pacer(ceiling=5.0)
    pacer.stated(50.0, now=0.0)
    assert pacer.rate == 5.0


# --- the bucket and the ramp ------------------------------------------------------------


def test_the_bucket_spreads_requests_evenly_and_never_catches_up_in_a_burst() -> None:
    bucket = TokenBucket(rate=10.0)
    assert bucket.available(0.0) == 1
    bucket.take(0.0)
    assert bucket.available(0.0) == 0 and bucket.wait_s(0.0) == pytest.approx(0.1)
    assert bucket.available(5.0) == 1  # five idle seconds earn one request, not fifty
    bucket.take(5.0)
    bucket.resume_at(6.0)  # a pause until 6.0: one request then, the next a tenth later
    assert bucket.available(5.5) == 0 and bucket.wait_s(5.5) == pytest.approx(0.5)
    assert bucket.available(6.0) == 1
    bucket.take(6.0)
    assert bucket.available(6.05) == 0 and bucket.available(6.1) == 1
    assert TokenBucket().available(0.0) > 1_000_000  # unlimited


def test_the_ramp_doubles_what_may_be_in_flight_until_it_is_over() -> None:
    ramp = Ramp()
    assert ramp.cap(10.0) == RAMP_START
    # One more than the start may go when the cap has grown by a factor (start + 1) / start.
    assert ramp.wait_s(10.0, RAMP_START) == pytest.approx(RAMP_DOUBLING_S * math.log2((RAMP_START + 1) / RAMP_START))
    assert ramp.cap(10.0 + RAMP_DOUBLING_S) == 2 * RAMP_START
    assert ramp.cap(10.0 + 100 * RAMP_DOUBLING_S) is None and ramp.over
    pacer = Pacer()
    pacer.ramp_cap(0.0)
    pacer.refused(seq=1, last_seq=16, now=0.0)
    assert pacer.ramp_cap(0.0) is None  # the first refusal ends the ramp


# --- what a provider states -------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "rps"),
    [
        ({"X-RateLimit-Limit": "20/s"}, 20.0),  # the simulator's bucket
        ({"X-RateLimit-Limit": "600/60s"}, 10.0),
        ({"x-ratelimit-limit": "120/m"}, 2.0),
        ({"RateLimit-Policy": "600;w=60", "RateLimit-Limit": "600"}, 10.0),  # IETF draft
        ({"X-RateLimit-Limit": "100", "X-RateLimit-Interval": "10s"}, 10.0),
        ({"X-RateLimit-Limit": "16"}, None),  # a bare count: per what? (the simulator's open cap)
        ({"X-RateLimit-Limit": "lots"}, None),
        ({}, None),
    ],
)
def test_stated_rate_reads_the_rate_limit_headers(headers: dict[str, str], rps: float | None) -> None:
    assert stated_rate(headers) == (pytest.approx(rps) if rps is not None else None)


def test_key_rate_reads_openrouters_key_answer() -> None:
    assert key_rate({"rate_limit": {"requests": 200, "interval": "10s"}}) == 20.0
    assert key_rate({"rate_limit": {"requests": -1, "interval": "10s"}}) is None
    assert key_rate({"rate_limit": None}) is None
    assert key_rate({}) is None


# --- a paced worker against a real token bucket, on one fake clock ----------------------


class _RandomRefusals:
    """A provider refusing a share of every request whatever the pace (the simulator's own 429 fault draw)."""

    def __init__(self, share: float, retry_after_s: float, seed: int) -> None:
        self.rng, self.rates, self.retry_after_s = random.Random(seed), {"429": share}, retry_after_s

    def admit(self, now: float) -> Refusal | None:  # noqa: ARG002 - the share does not depend on the time
        if choose_transient_fault(self.rng, self.rates) == "429":
            return Refusal(reason="429", retry_after_s=self.retry_after_s, limit="")
        return None

    def done(self) -> None:
        """An answer ended (nothing is counted here)."""


def _run(
    limiter: RequestLimiter | _RandomRefusals,
    prompts: int,
    *,
    latency: tuple[float, float],
    seed: int = 7,
    limits: ProviderLimits | None = None,
) -> tuple[float, int]:
    """Event-driven run of the pure policy against ``limiter``: (seconds to answer all, refusals)."""
    rng = random.Random(seed)
    limits = limits or ProviderLimits(ceiling=256, stall_s=60.0)
    now, waiting, refused = 0.0, prompts, 0
    ends: list[tuple[float, int]] = []  # (answer time, seq)
    answered = 0
    while answered < prompts:
        while waiting and limits.may_start(now):
            seq = limits.start(now)
            refusal = limiter.admit(now)
            if refusal is None:
                ends.append((now + rng.uniform(*latency), seq))
                waiting -= 1
            else:
                refused += 1
                headers = {"X-RateLimit-Limit": refusal.limit}
                limits.refused(seq, now, refusal.retry_after_s, None, stated_rate(headers), stated_count(headers))
        ends.sort()
        nxt = [limits.next_s(now) + now if waiting else float("inf")]
        if ends:
            nxt.append(ends[0][0])
        step = min(nxt)
        now = max(now + 1e-4, step)
        while ends and ends[0][0] <= now:
            _, seq = ends.pop(0)
            limiter.done()
            limits.answered(None, now, seq)
            answered += 1
    return now, refused


def test_a_paced_run_against_a_bucket_of_small_burst_refuses_little_and_keeps_near_the_rate() -> None:
    rps, prompts = 20.0, 300
    elapsed, refused = _run(RequestLimiter(rps=rps, burst=5.0), prompts, latency=(0.5, 1.0))
    assert refused <= 0.1 * prompts, refused
    # The limit allows prompts / rps seconds (and one latency for the last answers).
    assert elapsed <= (prompts / rps + 1.0) / 0.9, elapsed


def test_a_refusal_by_a_stated_open_cap_holds_the_window_to_it_and_leaves_the_pace() -> None:
    limits = ProviderLimits(ceiling=256, stall_s=60.0)
    limits.pacer.stated(20.0, now=0.0)
    seqs = [limits.start() for _ in range(17)]
    assert limits.refused(seqs[-1], now=0.1, retry_after_s=1.0, stated_count=16) == 0.0  # no pause...
    assert limits.limit == 16 and limits.pacer.rate == 20.0  # ...the window keeps to 16, the pace stands
    assert not limits.may_start(0.1)  # 16 open: full
    limits.answered(None, now=0.1)
    assert limits.may_start(0.1)  # one answered: the next may go at once, no pause
    for _ in range(200):
        limits.start()
        limits.answered(None, now=0.2)
    assert limits.limit == 16  # answers do not grow it past what the provider stated
    assert stated_count({"X-RateLimit-Limit": "16"}) == 16 and stated_count({"X-RateLimit-Limit": "20/s"}) is None


@pytest.mark.parametrize(
    ("limiter", "allowed_rps"),
    [
        (RequestLimiter(rps=20.0, burst=5.0, max_open=16, open_retry_after_s=1.0), 20.0),  # issue 41's key
        (RequestLimiter(max_open=16, open_retry_after_s=1.0), 16 / 0.75),  # an open cap: 16 over the mean latency
    ],
)
def test_a_stated_open_cap_is_kept_by_the_window_not_bounced_off(limiter: RequestLimiter, allowed_rps: float) -> None:
    prompts = 300
    elapsed, refused = _run(limiter, prompts, latency=(0.5, 1.0))
    assert refused <= 0.1 * prompts, refused
    assert elapsed <= (prompts / allowed_rps + 1.0) / 0.9, elapsed


def test_a_ramp_first_asked_long_after_it_started_is_over() -> None:
    ramp = Ramp()
    assert ramp.cap(0.0) == RAMP_START
    assert ramp.cap(10_000.0) is None  # no float overflow of 2 ** (10,000 / 0.25)


def test_refusals_of_a_share_of_everything_do_not_pace_the_run_down() -> None:
    """30 % refused whatever the pace (an overloaded upstream): slowing down would not refuse
    fewer, so neither the pace nor the window is cut for them; the Retry-After pauses stand."""
    limits = ProviderLimits(ceiling=32, stall_s=60.0)
    elapsed, refused = _run(_RandomRefusals(0.3, 0.2, seed=3), 240, latency=(0.0, 0.2), limits=limits)
    rate = 240 / elapsed
    # Cut once a round, as for a rate limit, the pace fell to ~2 answers a second (~110 s here).
    assert elapsed < 40.0, (elapsed, refused)
    assert limits.pacer.rate is None or limits.pacer.rate > rate, (limits.pacer.rate, rate)


def test_refusals_that_follow_the_pace_are_told_from_a_share_of_everything() -> None:
    """The same sends, 10/s then 20/s: refusals of the faster requests only follow the pace; a
    third of every request refused does not."""
    for faster_only in (True, False):
        assert _judged(((0.1, 60), (0.05, 60)), faster_only=faster_only) is faster_only


def _judged(spells: tuple[tuple[float, int], ...], *, faster_only: bool) -> bool | None:
    """Requests sent ``count`` at a time ``gap`` apart, spell after spell; every third refused (in
    the faster spell only, or in every spell): what :meth:`Pacer.follows_pace` says a second later."""
    pacer = Pacer()
    now, seq, slowest = 0.0, 0, max(gap for gap, _ in spells)
    for gap, count in spells:
        for _ in range(count):
            seq += 1
            now += gap
            pacer.take(now, seq)
            if seq % 3 == 0 and (gap < slowest or not faster_only):
                pacer.judge(seq, now + 0.01)
            else:
                pacer.answered(None, now + 0.01, seq)
    return pacer.follows_pace(now + 1.0)


def test_a_young_run_is_measured_over_its_age_and_at_least_a_fifth_of_a_second() -> None:
    pacer = Pacer()
    for i in range(10):
        pacer.take(i * 0.01, i + 1)  # ten requests in a tenth of a second, the tenth refused
    pacer.refused(10, 10, 0.1)
    assert pacer.rate == pytest.approx(9 / SHORT_SPAN_S)
    older = Pacer()
    for i in range(40):
        older.take(i * 0.05, i + 1)  # forty requests in two seconds, the last refused
    older.refused(40, 40, 2.0)
    assert older.rate == pytest.approx(39 / ADMIT_S, rel=0.05)


def test_the_pace_keeps_the_send_rate_of_requests_in_flight_only() -> None:
    # Every way a request ends lets go of the rate it was sent at: answered, refused (a rate
    # stated or not, a cap on open requests), or ended saying nothing (released).
    limits = ProviderLimits(ceiling=256, stall_s=60.0)
    now = 0.0
    endings = ["answered", "refused", "stated", "open cap", "released"] * 200
    for i, ending in enumerate(endings):
        now += 0.01
        seq = limits.start(now)
        if ending == "answered":
            limits.answered(None, now + 0.5, seq)
        elif ending == "refused":
            limits.refused(seq, now + 0.1, 1.0)
        elif ending == "stated":
            limits.refused(seq, now + 0.1, 1.0, stated_rps=50.0)
        elif ending == "open cap":
            limits.refused(seq, now + 0.1, 1.0, stated_count=0)
        else:
            limits.release(seq)
        assert len(limits.pacer.sent_rates) == 0, (i, ending)
    held = [limits.start(now + 1.0) for _ in range(7)]
    assert sorted(limits.pacer.sent_rates) == held


def test_most_of_everything_refused_neither_paces_a_small_run_to_the_floor_nor_finds_a_cap() -> None:
    """60 % refused whatever the pace, 16 open at most (the integration test's provider): before the
    cuts were judged, each refusal cut the pace to the share admitted, down to one request in five
    seconds (660 s here, 23 s now), and the refusals at every open count looked like a cap."""
    limits = ProviderLimits(ceiling=16, stall_s=600.0)
    elapsed, refused = _run(_RandomRefusals(0.6, 0.02, seed=3), 120, latency=(0.0, 0.2), limits=limits)
    assert refused > 120, refused  # most requests were refused...
    assert elapsed < 60.0, (elapsed, refused)  # ...and the run still went at the window's pace
    assert limits.windows["key"].plateau == math.inf and limits.limit == 16  # no cap on open requests found


def test_refusals_at_a_slow_pace_are_still_judged_from_the_last_outcomes() -> None:
    """At one or two requests a second, ten seconds hold too few outcomes to judge: the newest
    ``HISTORY_MIN`` count however old, and a share of everything refused is told apart."""
    for faster_only in (True, False):
        assert _judged(((1.0, 25), (0.5, 25)), faster_only=faster_only) is faster_only


def test_cuts_from_unpaced_that_were_never_sure_are_undone_back_to_unpaced() -> None:
    estimate = RateEstimate()
    assert estimate.refused(1, 5, admitted=4.0, sent_rate=10.0, in_use=False, sure=False)
    assert estimate.refused(6, 9, admitted=2.0, sent_rate=4.0, in_use=True, sure=False)
    assert estimate.rate == pytest.approx(ADMITTED_SHARE * 2.0)
    estimate.undo(9)  # refusals found not to follow the pace: nothing was ever sure
    assert estimate.rate is None
    sure = RateEstimate()
    sure.refused(1, 5, admitted=4.0, sent_rate=10.0, in_use=False, sure=True)
    sure.refused(6, 9, admitted=2.0, sent_rate=4.0, in_use=True, sure=False)
    sure.undo(9)
    assert sure.rate == 4.0  # back to the sure cut, not past it
