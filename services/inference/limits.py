"""Rate limits, pure: the adaptive window of requests in flight, the Retry-After pause, the stall.

No I/O and no clock: every method that needs the time takes ``now`` (monotonic seconds), so
the policy is unit-tested on its own and :mod:`services.inference.throttle` wires it to asyncio.

- :class:`AimdWindow` is additive-increase / multiplicative-decrease in the manner of
  Netflix's concurrency-limits ``AIMDLimit`` and TCP: until the first refusal (HTTP 429) an
  answer grows the window by one (slow start), after it by one per window of answers, and
  only while the window is in use (at least half of it in flight). A refusal shrinks it to
  the share of the last round's requests that got through, between a half and nine tenths
  (a first refusal with nothing to go by: a half), at most once per round: refusals of
  requests sent before the last cut were sent under the old window and say nothing new
  (TCP's one-decrease-per-RTT). The cut is from what was in flight when the window was
  larger than that, for a refusal of another limit than the rate (a window that never bound
  says nothing), and growth past the level of
  the last refusal is ``PLATEAU_SLOWDOWN`` times slower (CUBIC's plateau): a limit found is
  probed now and then, not bounced off every round (a 429 may cost a ``Retry-After`` of a second).
- :class:`ProviderLimits` keeps one window for the provider (the key's own limit) and one
  per OpenRouter upstream that a reply or a refusal names; what may be in flight is the
  provider's window, and never more than the upstreams seen so far take together.
- A ``Retry-After`` pauses every *new* request until it has passed (:class:`Pause`).
- :class:`StallClock`: refusals and no answer for ``stall_s`` means the limit admits nothing.
- The pace (:class:`~services.inference.pacer.Pacer`): requests go no faster than the rate the
  key admits, evenly spread, and resume at that rate after a pause.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.inference.pacer import Pacer

KEY_SCOPE = "key"
"""The label of the provider's own window (a refusal that names no upstream)."""
PLATEAU_SLOWDOWN = 8.0
"""How much slower the window grows past the level of its last refusal."""


@dataclass
class AimdWindow:
    """How many requests may be in flight: grows by one per answer, halves on a refusal."""

    ceiling: int
    floor: int = 1
    min_backoff: float = 0.5
    max_backoff: float = 0.9
    size: float = 0.0
    cut_after: int = 0  # requests numbered up to this were sent before the last cut
    slow_start: bool = True
    answers: int = 0  # since the last cut
    refusals: int = 0  # since the last cut
    plateau: float = float("inf")  # the level of the last refusal, less one
    hard_cap: int | None = None  # requests open at once the provider stated it admits
    peak: float = 0.0  # the largest size since the last cut found to follow the pace

    def __post_init__(self) -> None:
        if self.size <= 0:
            self.size = float(self.ceiling)
        self.peak = self.size

    @property
    def limit(self) -> int:
        """The whole number of requests the window admits."""
        return max(self.floor, min(self.ceiling, int(self.size)))

    def answered(self, in_flight: int) -> None:
        """An answer: grow by one while at least half the window is used (an idle window stays put)."""
        self.answers += 1
        if 2 * in_flight >= self.limit:
            step = 1.0 if self.slow_start else 1.0 / self.size
            if self.size >= self.plateau:
                step /= PLATEAU_SLOWDOWN
            top = self.ceiling if self.hard_cap is None else min(self.ceiling, self.hard_cap)
            self.size = min(float(top), self.size + step)
            self.peak = max(self.peak, self.size)

    def refused(self, seq: int, last_seq: int, in_flight: int | None = None, *, sure: bool = True) -> bool:
        """A refusal of request ``seq`` (``last_seq``: the newest sent; ``in_flight``: with it, open
        when it was refused; ``sure``: found to follow the pace, not merely not found otherwise);
        True when the window shrank."""
        self.refusals += 1
        if seq <= self.cut_after:
            return False
        share = self.answers / (self.answers + self.refusals) if not self.slow_start else 0.0
        backoff = min(self.max_backoff, max(self.min_backoff, share))
        base = self.size if in_flight is None else min(self.size, float(in_flight))
        if in_flight is not None:
            self.plateau = max(float(self.floor), in_flight - 1.0)
        self.size = max(float(self.floor), base * backoff)
        self.cut_after = last_seq
        self.slow_start = False
        self.answers = self.refusals = 0
        if sure:
            self.peak = self.size
        return True

    def undo(self, last_seq: int) -> None:
        """A refusal found not to follow the pace: counted, no cut, and the cuts since the last
        sure one undone (back to the peak since then); requests up to ``last_seq`` are judged."""
        self.refusals += 1
        self.cut_after = max(self.cut_after, last_seq)
        top = self.ceiling if self.hard_cap is None else min(self.ceiling, self.hard_cap)
        self.size = min(float(top), max(self.size, self.peak))

    def cap_at(self, count: int, seq: int, last_seq: int) -> None:
        """The provider stated it admits ``count`` open at once: the window keeps to it (until a restart)."""
        self.refusals += 1
        self.hard_cap = max(self.floor, count)
        self.size = min(self.size, float(self.hard_cap))
        if seq > self.cut_after:
            self.cut_after = last_seq
        self.slow_start = False

    def restart(self) -> None:
        """Grow fast again (after a stall was lifted: where the limit now lies is not known)."""
        self.slow_start = True
        self.hard_cap = None


@dataclass
class Pause:
    """New requests wait until ``until``; ``paused_s`` is how much waiting Retry-After added in all."""

    until: float = 0.0
    paused_s: float = 0.0

    def extend(self, now: float, seconds: float) -> float:
        """Pause until ``now + seconds`` (never shorter than a pause already standing); seconds added."""
        start = max(self.until, now)
        end = now + max(0.0, seconds)
        if end <= start:
            return 0.0
        self.until = end
        self.paused_s += end - start
        return end - start

    def remaining(self, now: float) -> float:
        """Seconds a new request still waits."""
        return max(0.0, self.until - now)


@dataclass
class StallClock:
    """Refused since ``since`` with no answer in between: after ``stall_s`` the limit admits nothing."""

    stall_s: float
    since: float | None = None
    last: float = 0.0
    refusals: int = 0

    def refused(self, now: float) -> None:
        """A refusal: the clock starts at the first one after an answer, or after a quiet spell.

        Refusals ``stall_s`` apart with nothing sent between (the prompts held by a halt
        meanwhile) are not a storm: the clock starts again.
        """
        if self.since is None or now - self.last > self.stall_s:
            self.since, self.refusals = now, 0
        self.last = now
        self.refusals += 1

    def answered(self) -> None:
        """Something got through: the clock stops."""
        self.since = None
        self.refusals = 0

    def stalled(self, now: float) -> bool:
        """Nothing but refusals for ``stall_s``."""
        return self.since is not None and now - self.since >= self.stall_s


@dataclass
class ProviderLimits:
    """The windows of one provider (and its upstreams), its pace, the pause and the stall clock."""

    ceiling: int
    stall_s: float
    default_pause_s: float = 0.5
    rate_ceiling: float | None = None  # requests a second: the user's own ceiling
    windows: dict[str, AimdWindow] = field(default_factory=dict)
    pause: Pause = field(default_factory=Pause)
    stall: StallClock = field(init=False)
    pacer: Pacer = field(init=False)
    in_flight: int = 0
    sent: int = 0
    refusals: int = 0

    def __post_init__(self) -> None:
        self.stall = StallClock(self.stall_s)
        self.pacer = Pacer(ceiling=self.rate_ceiling, key_scope=KEY_SCOPE)
        self.pacer.estimate(None)
        self.windows.setdefault(KEY_SCOPE, AimdWindow(self.ceiling))

    def window(self, scope: str | None) -> AimdWindow:
        """The window of ``scope`` (an upstream's name; None: the key's own), made on first sight."""
        name = scope or KEY_SCOPE
        if name not in self.windows:
            self.windows[name] = AimdWindow(self.ceiling)
        return self.windows[name]

    @property
    def limit(self) -> int:
        """Requests that may be in flight: the key's window, within what the upstreams take together."""
        own = self.windows[KEY_SCOPE].limit
        upstreams = [w.limit for name, w in self.windows.items() if name != KEY_SCOPE]
        return min(own, sum(upstreams)) if upstreams else own

    def wait_s(self, now: float) -> float:
        """How long a new request waits for the pause (0: it may go when the window has room)."""
        return self.pause.remaining(now)

    def next_s(self, now: float) -> float:
        """How long a new request waits for the pause and the pace (the window aside)."""
        ramp = self.pacer.ramp.wait_s(now, self.in_flight)
        return max(self.pause.remaining(now), self.pacer.wait_s(now), ramp)

    def room(self, now: float) -> int:
        """New requests that may be sent now: none in a pause, else what the window and the pace allow."""
        if self.pause.remaining(now) > 0:
            return 0
        ramp = self.pacer.ramp_cap(now)
        window = self.limit if ramp is None else min(self.limit, ramp)
        return min(window - self.in_flight, self.pacer.available(now))

    def may_start(self, now: float) -> bool:
        """Whether a new request may be sent now."""
        return self.room(now) > 0

    def start(self, now: float | None = None) -> int:
        """A request is sent (at ``now``: it takes its place in the pace); its sequence number."""
        self.in_flight += 1
        self.sent += 1
        if now is not None:
            self.pacer.take(now, self.sent)
        return self.sent

    def release(self, seq: int) -> None:
        """Request ``seq`` ended without saying anything about the limit (another failure, or not sent)."""
        self._ended()
        self.pacer.forget(seq)

    def _ended(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def answered(self, upstream: str | None, now: float | None = None, seq: int | None = None) -> None:
        """An answer to request ``seq`` (served by ``upstream`` when the reply names one): windows
        and pace grow, no stall."""
        self._ended()
        self.windows[KEY_SCOPE].answered(self.in_flight + 1)
        if upstream:
            self.window(upstream).answered(self.in_flight + 1)
        if now is not None:
            self.pacer.answered(upstream, now, seq)
        self.stall.answered()

    def refused(
        self,
        seq: int,
        now: float,
        retry_after_s: float | None,
        upstream: str | None = None,
        stated_rps: float | None = None,
        stated_count: int | None = None,
    ) -> float:
        """Request ``seq`` got a 429: shrink the window and the pace it names, pause new requests.

        ``stated_rps``: the rate the refusal's headers state; ``stated_count``: a bare count they
        state instead. Returns the seconds added to the pause.
        """
        open_with_it = self.in_flight
        self._ended()
        self.refusals += 1
        window = self.window(upstream)
        if self.open_cap(stated_rps, stated_count, open_with_it):
            # A cap on requests open at once: the window keeps to it from now on, the pace is not
            # cut and new requests are not paused (the refused one waits its Retry-After).
            window.cap_at(stated_count or 0, seq, self.sent)
            self.pacer.ramp.over = True  # a limit was found: the window bounds what is in flight
            self.stall.refused(now)
            self.pacer.forget(seq)  # not an outcome of the pace
            return 0.0
        # A refusal stating no rate where one was stated is about another limit (requests open
        # at once): the window is cut from what was open.
        other = stated_rps is None and self.pacer.stated_fresh(upstream, now)
        # Refusals that do not follow the pace (a share of everything refused, whatever the
        # pace) cut neither the window nor the pace: sending slower would not refuse fewer.
        follows = True if stated_rps is not None else self.pacer.judge(seq, now)
        if follows is False and not other:
            window.undo(self.sent)
        else:
            window.refused(seq, self.sent, open_with_it if other else None, sure=follows is True or other)
        self.pacer.refused(seq, self.sent, now, upstream, stated_rps, follows=follows)
        self.pacer.forget(seq)  # kept as an outcome by judge(), when it was asked
        self.stall.refused(now)
        added = self.pause.extend(now, self.default_pause_s if retry_after_s is None else retry_after_s)
        self.pacer.resume_at(max(now, self.pause.until))
        return added

    def open_cap(self, stated_rps: float | None, stated_count: int | None, open_with_it: int | None = None) -> bool:
        """Whether a refusal stating ``stated_count`` (and no rate) refused more open requests than that."""
        open_now = self.in_flight if open_with_it is None else open_with_it
        return stated_rps is None and stated_count is not None and open_now > stated_count

    def stalled(self, now: float) -> bool:
        """Nothing but 429s for ``stall_s``."""
        return self.stall.stalled(now)

    def unstall(self) -> None:
        """The stall is over (a probe got through, or a person resumed): windows grow fast again."""
        self.stall.answered()
        for window in self.windows.values():
            window.restart()
        self.pacer.restart()


__all__ = ["KEY_SCOPE", "AimdWindow", "Pause", "ProviderLimits", "StallClock"]
