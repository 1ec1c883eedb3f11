"""Pacing, pure: a client-side token bucket whose rate follows an estimate of what the key admits.

A window of requests in flight alone meets a rate limit by hitting it: a bucket with a small
burst refuses most of a window sent at once. The pacer spreads requests evenly at the rate
the key admits, alongside the window of :mod:`services.inference.limits`.

- :class:`RateEstimate` is one scope's rate (the key's own, or an OpenRouter upstream's). A
  refusal sets it to the rate the key **admitted** just before (:meth:`Pacer.admitted_rate`:
  requests sent over the last ``ADMIT_S`` and not refused), ``ADMITTED_SHARE`` of it when
  requests were going at the pace (a bucket refills below its rate), all of it when they were
  not (the refusal was of a burst), once per round (refusals of requests sent before the last
  cut say nothing new). While nothing is refused it probes upward by a step a second that
  doubles every second (``STEP_SHARE`` of the rate at first), and only while requests go at
  the pace. A limit the provider states (``X-RateLimit-*`` / ``RateLimit-*`` headers,
  OpenRouter's ``GET /key``) seeds the estimate while too little was sent to measure; after
  that, what is admitted wins over what is stated. Before anything is known a scope is not paced.
- Only refusals that follow the pace cut it (:meth:`Pacer.follows_pace`): every outcome is kept
  for ``HISTORY_S`` (the newest ``HISTORY_MIN`` however old: a pace cut low still judges)
  with the rate requests were being started at when it was sent; the
  outcomes sent at the higher half of those rates must be refused significantly more often
  than those sent at the lower half (a one-sided two-proportion test at ``FOLLOWS_Z``). A
  rate limit refuses more of a faster pace; an overloaded upstream that refuses a share of
  everything does not, and cutting for it only slows the run (the share stays the same).
  With too few outcomes, rates too close to tell apart, or fewer than ``MIN_SHARE`` refused,
  a refusal cuts; once refusals are found not to follow the pace, the cuts made since the
  last one that was found to follow it are undone (the estimate goes back to its peak).
- :class:`TokenBucket` sends at the combined rate (the key's estimate, within what the
  upstreams estimated so far take together, within ``requests_per_minute``) with a burst of
  one request, so it never catches up in a burst after a delay. After a ``Retry-After``
  pause it starts empty at the pause's end: requests resume at the paced rate.
- :class:`Ramp`: before the first refusal, requests in flight may double every
  ``RAMP_DOUBLING_S`` from ``RAMP_START`` (a window of thousands opened in one go is a burst
  no small bucket admits: its refusals would be most of the run's); past ``RAMP_END`` (or at
  the first refusal) the ramp is over and the window alone bounds what is in flight.

No I/O and no clock: every method that needs the time takes ``now`` (monotonic seconds).
Written here rather than with aiolimiter: its leaky bucket's rate is fixed at creation and
its capacity is its rate (a minute's worth at once for a per-minute limit).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

BACKOFF = 0.85
"""A refusal with nothing measured cuts the estimate to this share of the rate requests were sent at."""
STEP_SHARE = 0.1
"""While nothing is refused, the estimate grows by this share of itself a second (at full pace)..."""
MIN_STEP_RPS = 0.2
"""...and by at least this many requests a second per second; the step doubles every second..."""
MAX_STEPS = 8.0
"""...up to this many times its first size."""
IN_USE = 0.9
"""The pace grows only while requests are started at this share of it or more."""
MIN_RATE_RPS = 0.2
"""The estimate never goes below one request in five seconds (the stall halt deals with zero)."""
ADMITTED_SHARE = 0.95
"""A refusal sets the estimate to this share of the rate admitted (a bucket refills below its rate)."""
ADMIT_S = 2.0
"""The admitted rate is measured over the requests sent this long before a refusal..."""
MIN_ADMIT_S = 0.5
"""...when requests have been sent for this long since the run or a pause began (a shorter span
measures the provider's burst, not its rate: a stated rate is taken instead, when there is one)..."""
SHORT_SPAN_S = 0.2
"""...and over this long at least when nothing was stated (the ramp's first refusal comes within a
few tenths of a second: an estimate above the key's rate is brought down by the next refusals,
at a second's wait each for the refused requests alone; one below it only by the probe)."""
CLOSED_RUN = 4
"""Refusals in a row (nothing sent between them admitted): the key admits nothing now, not a pace."""
RAMP_START = 4
RAMP_DOUBLING_S = 0.1
RAMP_END = 1 << 20
MEASURE_S = 1.0
"""A refusal with nothing known cuts from the rate requests were started at over this long..."""
MIN_SPAN_S = 0.05
"""...or since the first request, while that is shorter (but at least this long)."""
BURST = 1.0
"""Requests the bucket lets go at once: one (no catching up after a delay)."""
HISTORY_S = 10.0
"""How long an outcome (answered or refused, and the rate it was sent at) counts in :meth:`Pacer.follows_pace`..."""
HISTORY_MIN = 45
"""...the newest this many however old: at a request a second, ten seconds hold too few to judge
(``2 * MIN_HALF`` settled), every refusal would cut, and a share of everything refused would pace
a run down to the floor."""
HISTORY_MAX = 4096
"""At most this many outcomes are kept (the newest)."""
MIN_HALF = 15
"""Outcomes each half needs before refusals are judged not to follow the pace."""
MIN_SHARE = 0.2
"""Refusals are judged not to follow the pace only when at least this share of requests is refused."""
MIN_SPREAD = 1.15
"""The higher half's mean rate over the lower half's below this: too close to tell apart."""
FOLLOWS_Z = 2.0
"""How many standard errors more refused the faster half must be for refusals to follow the pace."""
_EPS = 1e-9  # a token refilled in float steps counts whole


@dataclass
class RateEstimate:
    """The requests a second one scope admits (None: nothing known, not paced); see the module docstring."""

    rate: float | None = None
    ceiling: float | None = None
    stated: float | None = None
    cut_after: int = 0
    cut_at: float | None = None  # when it was last cut (or first known)
    peak: float | None = None  # the highest rate since the last cut found to follow the pace (inf: unpaced)

    def state(self, limit_rps: float | None) -> None:
        """The provider stated its limit (a header, ``GET /key``): it seeds the estimate while nothing is known."""
        if limit_rps is None or limit_rps <= 0:
            return
        self.stated = limit_rps
        if self.rate is None:
            self.rate = self._capped(limit_rps)

    def answered(self, now: float) -> None:
        """An answer: the estimate probes upward, by a step a second at full pace that doubles every
        second nothing is refused (``STEP_SHARE`` of the rate at first, at most ``MAX_STEPS`` times that)."""
        if self.rate is None:
            return
        if self.cut_at is None:
            self.cut_at = now
        steps = min(MAX_STEPS, 2.0 ** max(0.0, now - self.cut_at))
        self.rate = self._capped(self.rate + max(MIN_STEP_RPS, STEP_SHARE * self.rate) * steps / self.rate)
        if self.peak is not None:
            self.peak = max(self.peak, self.rate)

    def refused(
        self, seq: int, last_seq: int, admitted: float | None, sent_rate: float, *, in_use: bool, sure: bool = True
    ) -> bool:
        """Request ``seq`` was refused (``last_seq``: the newest sent; ``admitted``: the rate the key
        admitted just before, None when too little was sent to tell; ``sent_rate``: the pace it was
        sent at; ``in_use``: requests went at the pace; ``sure``: refusals were found to follow the
        pace). Returns True when the estimate was cut (once per round: refusals of requests sent
        before the last cut say nothing new).

        The estimate becomes a share of what was admitted, all of it when requests were not going
        at the pace (the refusal was of a burst, and what was admitted is only what was sent); with
        nothing measured, the rate stated, or a share of the rate it was sent at.
        """
        if seq <= self.cut_after:
            return False
        self.cut_after = last_seq
        if admitted is not None:
            rate = (ADMITTED_SHARE if in_use else 1.0) * (admitted if self.rate is None else min(self.rate, admitted))
        elif self.stated is not None:
            rate = self.stated
        else:
            rate = BACKOFF * (sent_rate if self.rate is None else min(self.rate, sent_rate))
        known = self.rate is not None  # before: nothing to go back to
        self.cut_at = None  # (the next answer's time)
        self.rate = self._capped(max(MIN_RATE_RPS, rate))
        if sure:
            self.peak = self.rate
        elif not known:
            self.peak = math.inf  # cut from unpaced, not surely for the pace: undone, back to unpaced
        return True

    def undo(self, last_seq: int) -> None:
        """Refusals were found not to follow the pace: back to the peak (requests up to ``last_seq`` are judged)."""
        self.cut_after = max(self.cut_after, last_seq)
        if self.rate is not None and self.peak is not None and self.peak > self.rate:
            self.rate = None if math.isinf(self.peak) and self.ceiling is None else self._capped(self.peak)

    def restart(self) -> None:
        """After a stall was lifted: where the limit now lies is not known (measured afresh at the next refusal)."""
        self.rate = self.peak = None

    def _capped(self, rate: float) -> float:
        return rate if self.ceiling is None else min(rate, self.ceiling)


@dataclass
class TokenBucket:
    """Sends at ``rate`` a second with a burst of one; ``rate`` None: unlimited."""

    rate: float | None = None
    tokens: float = BURST
    stamp: float | None = None

    def _refill(self, now: float) -> None:
        if self.rate is not None and self.stamp is not None and now > self.stamp:
            self.tokens = min(BURST, self.tokens + (now - self.stamp) * self.rate)
        if self.stamp is None or now > self.stamp:
            self.stamp = now

    def available(self, now: float) -> int:
        """Whole requests that may go now (a large number when unlimited)."""
        if self.rate is None:
            return 1 << 30
        self._refill(now)
        return int(self.tokens + _EPS) if self.stamp is not None and now >= self.stamp else 0

    def wait_s(self, now: float) -> float:
        """Seconds until the next request may go."""
        if self.rate is None:
            return 0.0
        self._refill(now)
        start = self.stamp if self.stamp is not None else now
        return max(0.0, start - now) + max(0.0, 1.0 - _EPS - self.tokens) / self.rate

    def take(self, now: float) -> None:
        """One request goes."""
        if self.rate is not None:
            self._refill(now)
            self.tokens -= 1.0

    def set_rate(self, rate: float | None, now: float) -> None:
        """Change the pace (what was earned at the old rate is kept)."""
        self._refill(now)
        if rate is not None and self.rate is None:
            self.tokens = min(self.tokens, BURST)
        self.rate = rate

    def resume_at(self, at: float) -> None:
        """After a pause ending at ``at``: one request then, the next at the paced rate."""
        if self.stamp is None or at > self.stamp:
            self.tokens, self.stamp = min(BURST, 1.0), at


@dataclass
class Ramp:
    """Before the first refusal: requests in flight doubling every ``RAMP_DOUBLING_S`` (None: over)."""

    started: float | None = None
    over: bool = False

    def cap(self, now: float) -> int | None:
        """Requests that may be in flight now; None once the ramp is over."""
        if self.over:
            return None
        if self.started is None:
            self.started = now
        doublings = (now - self.started) / RAMP_DOUBLING_S
        if doublings >= math.log2(RAMP_END / RAMP_START):  # (2 ** doublings would overflow later on)
            self.over = True
            return None
        return int(RAMP_START * 2.0**doublings + _EPS)

    def wait_s(self, now: float, in_flight: int) -> float:
        """Seconds until the cap admits one more than ``in_flight``."""
        cap = self.cap(now)
        if cap is None or in_flight < cap or self.started is None:
            return 0.0
        at = self.started + RAMP_DOUBLING_S * math.log2((in_flight + 1) / RAMP_START)
        return max(0.001, at - now)


@dataclass
class Pacer:
    """A provider's pace: one estimate per scope (the key's and each upstream's), one bucket."""

    ceiling: float | None = None  # requests a second (requests_per_minute / 60)
    estimates: dict[str, RateEstimate] = field(default_factory=dict)
    bucket: TokenBucket = field(default_factory=TokenBucket)
    ramp: Ramp = field(default_factory=Ramp)
    key_scope: str = "key"
    starts: deque[float] = field(default_factory=deque)  # start times within MEASURE_S
    first_start: float | None = None
    paced: bool = False  # some estimate has a rate (until then nothing is paced: the fast path)
    sent_rates: dict[int, tuple[float, float]] = field(default_factory=dict)  # seq -> (sent at, the rate then)
    outcomes: deque[tuple[float, float, bool, float]] = field(default_factory=deque)  # (sent at, rate, refused, took)
    sends: deque[tuple[float, int]] = field(default_factory=deque)  # (sent at, seq) within ADMIT_S
    refused_sends: set[int] = field(default_factory=set)  # the seqs among them that were refused
    measure_from: float | None = None  # the admitted rate counts from here (the first start, a pause's end)
    changed_at: float = -math.inf  # when the pace was last cut

    def estimate(self, scope: str | None) -> RateEstimate:
        """The estimate of ``scope`` (None: the key's own), made on first sight."""
        name = scope or self.key_scope
        found = self.estimates.get(name)
        if found is None:
            found = self.estimates[name] = RateEstimate(ceiling=self.ceiling)
        return found

    @property
    def rate(self) -> float | None:
        """The paced rate the estimates give (None: not paced by them)."""
        own = self.estimates[self.key_scope].rate if self.key_scope in self.estimates else None
        upstreams = [e.rate for n, e in self.estimates.items() if n != self.key_scope]
        total = None if not upstreams or None in upstreams else sum(r for r in upstreams if r is not None)
        rates = [r for r in (own, total) if r is not None]
        return min(rates) if rates else None

    def sync(self, now: float) -> None:
        """The bucket takes the rate the estimates give now (after one was set from outside)."""
        if not self.paced:
            return
        rate = self.rate
        if rate != self.bucket.rate:
            self.bucket.set_rate(rate, now)

    def available(self, now: float) -> int:
        """Requests that may go now."""
        self.sync(now)
        return self.bucket.available(now)

    def wait_s(self, now: float) -> float:
        """Seconds until the next request may go."""
        self.sync(now)
        return self.bucket.wait_s(now)

    def take(self, now: float, seq: int | None = None) -> None:
        """Request ``seq`` goes now."""
        self.sync(now)
        self.bucket.take(now)
        starts = self.starts
        if self.first_start is None:
            self.first_start = now
        if self.measure_from is None:
            self.measure_from = now
        starts.append(now)
        started_rate = self._started_rate(now)  # (drops the starts older than MEASURE_S)
        if seq is not None:
            self.sent_rates[seq] = (now, started_rate)  # until its outcome, or forget()
            self.sends.append((now, seq))
            self._drop_sends(now)

    def forget(self, seq: int) -> None:
        """Request ``seq`` ended without an outcome of the pace (not sent, another failure, a cap on open requests)."""
        self.sent_rates.pop(seq, None)

    def _drop_sends(self, now: float) -> None:
        sends = self.sends
        while sends and sends[0][0] < now - ADMIT_S:
            self.refused_sends.discard(sends.popleft()[1])

    def admitted_rate(self, now: float, *, short: bool = False) -> float | None:
        """Requests a second the key admitted: those sent over the last ``ADMIT_S`` (since the run or
        the last pause began, when that is later) and not refused, over that span; None while the
        span is shorter than ``MIN_ADMIT_S`` (with ``short``: over ``MIN_ADMIT_S`` all the same). A
        request not refused yet counts as admitted: a refusal comes back at once, an answer takes
        its time.
        """
        if self.measure_from is None:
            return None
        self._drop_sends(now)
        since = max(now - ADMIT_S, self.measure_from)
        if now - since < MIN_ADMIT_S and not short:
            return None
        admitted = sum(1 for at, seq in self.sends if at >= since and seq not in self.refused_sends)
        if now - since < MIN_ADMIT_S and admitted < RAMP_START:
            return None  # a refusal among the first few requests: nothing to measure yet
        return max(MIN_RATE_RPS, admitted / max(SHORT_SPAN_S, now - since))

    def closed(self, seq: int) -> bool:
        """Whether request ``seq`` and the ``CLOSED_RUN - 1`` sent before it were all refused."""
        return all(seq - back in self.refused_sends for back in range(CLOSED_RUN))

    def _outcome(self, seq: int | None, now: float, refused: bool) -> None:
        sent = self.sent_rates.pop(seq, None) if seq is not None else None
        if sent is None:
            return
        outcomes = self.outcomes
        outcomes.append((sent[0], sent[1], refused, now - sent[0]))
        self._drop_outcomes(now)

    def _drop_outcomes(self, now: float) -> None:
        outcomes = self.outcomes
        while len(outcomes) > HISTORY_MAX or (len(outcomes) > HISTORY_MIN and outcomes[0][0] < now - HISTORY_S):
            outcomes.popleft()

    def follows_pace(self, now: float) -> bool | None:
        """Whether the refusals of the last ``HISTORY_S`` (at least the last ``HISTORY_MIN``) follow the
        pace (None: it cannot be told).

        The requests sent over that time whose outcomes are all in (sent longer ago than the
        slowest outcome took: a refusal comes back sooner than an answer, and counting the
        newest requests would count their refusals before their answers) split in halves by
        the rate they were sent at: refusals follow the pace when the faster half was refused
        more often than the slower half by ``FOLLOWS_Z`` standard errors (pooled
        two-proportion test).
        """
        self._drop_outcomes(now)
        settle = max((o[3] for o in self.outcomes), default=0.0)
        outcomes = [o for o in self.outcomes if o[0] <= now - settle]
        if len(outcomes) < 2 * MIN_HALF:
            return None
        outcomes.sort(key=lambda o: o[1])
        half = len(outcomes) // 2
        low, high = outcomes[:half], outcomes[half:]
        low_rate, high_rate = (sum(o[1] for o in part) / len(part) for part in (low, high))
        if high_rate < MIN_SPREAD * low_rate:
            return None
        low_refused, high_refused = (sum(1 for o in part if o[2]) for part in (low, high))
        pooled = (low_refused + high_refused) / len(outcomes)
        if pooled <= 0.0 or pooled >= 1.0:
            return None
        error = math.sqrt(pooled * (1.0 - pooled) * (1.0 / len(low) + 1.0 / len(high)))
        if high_refused / len(high) - low_refused / len(low) > FOLLOWS_Z * error:
            return True
        # Not told apart: refusals do not follow the pace only when they are a large share (a few
        # refusals at the top of a probe, the pace's own, say nothing either way).
        return False if pooled >= MIN_SHARE else None

    def _started_rate(self, now: float) -> float:
        """Requests a second started over the last ``MEASURE_S`` (what an unpaced worker sent at);
        over the time since the first start while that is shorter (at least ``MIN_SPAN_S``)."""
        if self.first_start is None:
            return MIN_RATE_RPS
        starts = self.starts
        while starts and starts[0] < now - MEASURE_S:
            starts.popleft()
        # Kept for MEASURE_S: every start left lies within the span (a run younger than that
        # started them all since its first). O(1): this runs for every request sent.
        span = max(MIN_SPAN_S, min(MEASURE_S, now - self.first_start))
        return max(MIN_RATE_RPS, len(starts) / span)

    def ramp_cap(self, now: float) -> int | None:
        """Requests that may be in flight while the start-up ramp lasts (None: no ramp)."""
        return self.ramp.cap(now)

    def answered(self, upstream: str | None, now: float, seq: int | None = None) -> None:
        """An answer to request ``seq``: the key's estimate grows, and the upstream's that served it,
        while the pace is in use (requests were started at ``IN_USE`` of it or more over the last
        second: a pace nothing sends at proves nothing, and raising it would only let a burst go)."""
        self._outcome(seq, now, refused=False)
        if not self.paced:
            return
        if not self.in_use(now, grow=True):
            return
        self.estimate(None).answered(now)
        if upstream:
            self.estimate(upstream).answered(now)

    def in_use(self, now: float, *, grow: bool = False) -> bool:
        """Whether requests go at the pace: started at ``IN_USE`` of it or more over the last
        ``MEASURE_S`` (``grow``: now; else also set ``MIN_ADMIT_S`` ago or more)."""
        rate = self.bucket.rate
        if rate is None or (not grow and now - self.changed_at < MIN_ADMIT_S):
            return False
        return self._started_rate(now) >= IN_USE * rate

    def judge(self, seq: int, now: float) -> bool | None:
        """Request ``seq`` got a 429: keep it as an outcome; whether refusals follow the pace (:meth:`follows_pace`)."""
        self._outcome(seq, now, refused=True)
        return self.follows_pace(now)

    def refused(
        self,
        seq: int,
        last_seq: int,
        now: float,
        upstream: str | None = None,
        stated_rps: float | None = None,
        *,
        follows: bool | None = True,
    ) -> bool:
        """Request ``seq`` got a 429 (naming ``upstream``, stating ``stated_rps``); True when the pace was cut.

        The estimate of its scope becomes the rate the key admitted (:meth:`admitted_rate`); a
        stated rate seeds it only while nothing is measured. ``follows``: what :meth:`judge` said
        of it: when refusals do not follow the pace, a refusal cuts nothing and undoes the cuts
        since the last sure one; a later one is judged afresh.
        """
        if self.sends and seq >= self.sends[0][1]:
            self.refused_sends.add(seq)
        sent_rate = self.bucket.rate if self.bucket.rate is not None else self._started_rate(now)
        self.ramp.over = True
        self.paced = True
        estimate = self.estimate(upstream)
        estimate.state(stated_rps)
        if stated_rps is None and follows is False:
            estimate.undo(last_seq)
            cut = False
        else:
            sure = follows is True or stated_rps is not None
            admitted = self.admitted_rate(now, short=estimate.stated is None)
            cut = estimate.refused(seq, last_seq, admitted, sent_rate, in_use=self.in_use(now), sure=sure)
            if cut:
                self.changed_at = now
        self.sync(now)
        return cut

    def stated(self, limit_rps: float | None, now: float) -> None:
        """The key's limit as the provider states it (``GET /key`` at pre-flight, headers of an answer)."""
        if limit_rps is not None:
            self.estimate(None).state(limit_rps)
            self.paced = True
            self.sync(now)

    def resume_at(self, at: float) -> None:
        """A pause ends at ``at``: requests resume one at a time at the paced rate (measured afresh from then)."""
        self.sync(at)
        self.bucket.resume_at(at)
        if self.measure_from is None or at > self.measure_from:
            self.measure_from = at

    def restart(self) -> None:
        """A stall was lifted: every estimate grows fast again."""
        for estimate in self.estimates.values():
            estimate.restart()


_UNIT_S = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0, "h": 3600.0, "hour": 3600.0}
_PER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d*)\s*([a-z]+)\s*$")
_POLICY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*;\s*w\s*=\s*(\d+(?:\.\d+)?)")


def interval_s(text: str) -> float | None:
    """Seconds in an interval such as ``1s``, ``10s``, ``1m``, ``minute`` (None: not one)."""
    match = re.match(r"^\s*(\d*(?:\.\d+)?)\s*([a-z]+)\s*$", text.lower())
    if match is None or match.group(2) not in _UNIT_S:
        return None
    count = float(match.group(1)) if match.group(1) else 1.0
    return count * _UNIT_S[match.group(2)] if count > 0 else None


def stated_rate(headers: Mapping[str, str]) -> float | None:
    """The request rate (per second) a response's headers state, if they state one.

    Read: ``RateLimit-Policy: 600;w=60`` (the IETF draft), and ``X-RateLimit-Limit`` /
    ``RateLimit-Limit`` in the form ``20/s`` or ``600/1m``, or a bare count with
    ``X-RateLimit-Interval`` / a ``w=`` policy beside it. A bare count alone says nothing
    of its period (it may count requests open at once): None.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    policy = lower.get("ratelimit-policy")
    if policy:
        match = _POLICY.match(policy.split(",")[0])
        if match and float(match.group(2)) > 0:
            return float(match.group(1)) / float(match.group(2))
    for name in ("x-ratelimit-limit-requests", "x-ratelimit-limit", "ratelimit-limit"):
        value = lower.get(name)
        if not value:
            continue
        match = _PER.match(value.lower())
        if match and match.group(3) in _UNIT_S:
            per = float(match.group(2) or 1) * _UNIT_S[match.group(3)]
            return float(match.group(1)) / per if per > 0 else None
        window = lower.get("x-ratelimit-interval")
        seconds = interval_s(window) if window else None
        if seconds and re.fullmatch(r"\s*\d+(?:\.\d+)?\s*", value):
            return float(value) / seconds
    return None


def stated_count(headers: Mapping[str, str]) -> int | None:
    """A bare count ``X-RateLimit-Limit`` / ``RateLimit-Limit`` states with no period (None: a rate, or nothing)."""
    if stated_rate(headers) is not None:
        return None
    lower = {k.lower(): v for k, v in headers.items()}
    for name in ("x-ratelimit-limit", "ratelimit-limit"):
        value = lower.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def key_rate(data: Mapping[str, object]) -> float | None:
    """The request rate OpenRouter's ``GET /key`` states (``rate_limit: {requests, interval}``), per second."""
    limit = data.get("rate_limit")
    if not isinstance(limit, Mapping):
        return None
    requests, interval = limit.get("requests"), limit.get("interval")  # topology: not a topic
    seconds = interval_s(interval) if isinstance(interval, str) else None
    if not isinstance(requests, int | float) or requests <= 0 or not seconds:
        return None
    return float(requests) / seconds


__all__ = ["Pacer", "Ramp", "RateEstimate", "TokenBucket", "interval_s", "key_rate", "stated_count", "stated_rate"]
