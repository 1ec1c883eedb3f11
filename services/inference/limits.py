"""Rate limits, pure: the window of requests open at once, the pause, the stall.

No I/O and no clock: every method that needs the time takes ``now`` (monotonic seconds), so
the policy is unit-tested on its own and :mod:`services.inference.throttle` wires it to asyncio.

What a 429 shows of the limit decides what it moves:

- **The pace** (:class:`~services.inference.pacer.Pacer`): a refusal of the rate sets it to the
  rate the key admitted just before; requests go no faster, evenly spread.
- **The window** (:class:`OpenWindow`): a cap on requests open at once, stated (a bare
  ``X-RateLimit-Limit`` count below what was open) or found (refused twice, answers between, at
  an open count the key never admitted: the first time it may as well be the rate, and the
  window only keeps to it tentatively). Past a cap found it grows ``PLATEAU_SLOWDOWN`` times
  slower (a probe now and then); before anything is found it is ``provider.concurrency``.
- **The pause** (:class:`Pause`): a ``Retry-After`` holds the refused request; it holds every
  new request only when the key admits nothing now (``CLOSED_RUN`` requests refused in a row: a
  window of requests spent until its reset; not when the last was refused at an open count that
  may be a cap on open requests, which explains a run too). A pause ends at the pace, one request
  at a time.
- :class:`ProviderLimits` keeps one window for the provider (the key's own limit) and one
  per OpenRouter upstream that a reply or a refusal names; what may be in flight is the
  provider's window, and never more than the upstreams seen so far take together.
- :class:`StallClock`: refusals and no answer for ``stall_s`` means the limit admits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.inference.pacer import Pacer

KEY_SCOPE = "key"
"""The label of the provider's own window (a refusal that names no upstream)."""
TRIAL_S = 0.25
"""A tentative window tries one request past its limit this long after it was set (or last grew)..."""
PROBE_S = 0.05
"""...which was admitted when it is not refused within this long (a refusal comes back at once)."""
OPEN_SLACK = 3
"""A cap on open requests is not found at a count when answers came with this many more open."""
PLATEAU_SLOWDOWN = 32.0
"""How much slower the window grows past a cap on open requests it found."""
BELOW_MIN = 8
"""Outcomes at lower open counts needed to tell a cap on open requests from a share of everything refused."""


@dataclass
class OpenWindow:
    """How many requests may be open at once: the provider's concurrency, or a cap on open requests found."""

    ceiling: int
    floor: int = 1
    size: float = 0.0
    cut_after: int = 0  # requests numbered up to this were sent before the last hold
    slow_start: bool = True
    plateau: float = float("inf")  # the cap last found
    hard_cap: int | None = None  # requests open at once the provider stated it admits
    trial: bool = False  # kept to a count refused once (tentative)

    def __post_init__(self) -> None:
        if self.size <= 0:
            self.size = float(self.ceiling)

    @property
    def limit(self) -> int:
        """The whole number of requests the window admits."""
        return max(self.floor, min(self.ceiling, int(self.size)))

    def answered(self, in_flight: int) -> None:
        """An answer: grow while at least half the window is used (an idle window stays put): by one
        in slow start, else by one per window of answers, ``PLATEAU_SLOWDOWN`` times slower past a cap
        found (a probe now and then, not a refusal every round)."""
        if 2 * in_flight >= self.limit:
            step = 1.0 if self.slow_start else 1.0 / self.size
            if self.size >= self.plateau:
                step /= PLATEAU_SLOWDOWN
            top = self.ceiling if self.hard_cap is None else min(self.ceiling, self.hard_cap)
            self.size = min(float(top), self.size + step)

    def tentative(self, count: int) -> None:
        """Maybe a cap on open requests at ``count`` (one refusal): keep to it, growing by one an
        answer, and doubling when a trial request past it is admitted (:class:`ProviderLimits`)."""
        if count < self.size:
            self.size = float(max(self.floor, count))
            self.slow_start = self.trial = True

    def hold(self, count: int, seq: int, last_seq: int) -> None:
        """A cap on open requests at ``count`` (refused there again, and never admitted above it): the
        window keeps to it and probes past it slowly; once per round (``last_seq``: the newest sent)."""
        if seq <= self.cut_after:
            return
        self.size = min(self.size, float(max(self.floor, count)))
        self.plateau = float(max(self.floor, count))
        self.cut_after = last_seq
        self.slow_start = self.trial = False

    def cap_at(self, count: int, seq: int, last_seq: int) -> None:
        """The provider stated it admits ``count`` open at once: the window keeps to it (until a restart)."""
        self.hard_cap = max(self.floor, count)
        self.size = min(self.size, float(self.hard_cap))
        if seq > self.cut_after:
            self.cut_after = last_seq
        self.slow_start = self.trial = False

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
    windows: dict[str, OpenWindow] = field(default_factory=dict)
    pause: Pause = field(default_factory=Pause)
    stall: StallClock = field(init=False)
    pacer: Pacer = field(init=False)
    in_flight: int = 0
    sent: int = 0
    refusals: int = 0
    opens: dict[int, int] = field(default_factory=dict)  # seq -> requests open when it was sent (itself too)
    at_open: dict[int, list[int]] = field(default_factory=dict)  # see _capped_open
    admitted_max: int = 0  # the most requests open when one that was answered was sent
    trial: float | None = None  # when a tentative window may try one request past its limit
    probe: tuple[int, float] | None = None  # that request, and when it counts as admitted
    answers: int = 0
    open_cut: tuple[str | None, float | None] | None = None  # (upstream, the pace before): refusals
    # since cut the pace while they could not be told from a cap on open requests (see refused)

    def __post_init__(self) -> None:
        self.stall = StallClock(self.stall_s)
        self.pacer = Pacer(ceiling=self.rate_ceiling, key_scope=KEY_SCOPE)
        self.pacer.estimate(None)
        self.windows.setdefault(KEY_SCOPE, OpenWindow(self.ceiling))

    def window(self, scope: str | None) -> OpenWindow:
        """The window of ``scope`` (an upstream's name; None: the key's own), made on first sight."""
        name = scope or KEY_SCOPE
        if name not in self.windows:
            self.windows[name] = OpenWindow(self.ceiling)
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
        """How long a new request waits for the pause and the pace (the window aside, but for its trial)."""
        ramp = self.pacer.ramp.wait_s(now, self.in_flight)
        wait = max(self.pause.remaining(now), self.pacer.wait_s(now), ramp)
        if self.in_flight >= self.limit:
            due = self.probe[1] if self.probe is not None else self.trial
            if due is not None:
                wait = max(wait, due - now)
        return wait

    def room(self, now: float) -> int:
        """New requests that may be sent now: none in a pause, else what the window and the pace allow
        (one past a tentative window, its trial, when it is due)."""
        self._tried(now)
        if self.pause.remaining(now) > 0:
            return 0
        ramp = self.pacer.ramp_cap(now)
        window = self.limit if ramp is None else min(self.limit, ramp)
        if self._trying(now):
            window += 1
        return min(window - self.in_flight, self.pacer.available(now))

    def _trying(self, now: float) -> bool:
        return self.trial is not None and now >= self.trial and self.probe is None and self.windows[KEY_SCOPE].trial

    def _tried(self, now: float) -> None:
        """The trial request was not refused within ``PROBE_S``: it was admitted past the tentative
        window, which doubles (the count refused once was not a cap); the next trial is due
        ``TRIAL_S`` later."""
        if self.probe is None or now < self.probe[1]:
            return
        self.probe = None
        window = self.windows[KEY_SCOPE]
        if window.trial:
            window.size = min(float(window.ceiling), 2.0 * window.size)
            self.trial = now + TRIAL_S

    def may_start(self, now: float) -> bool:
        """Whether a new request may be sent now."""
        return self.room(now) > 0

    def start(self, now: float | None = None) -> int:
        """A request is sent (at ``now``: it takes its place in the pace); its sequence number."""
        self.in_flight += 1
        self.sent += 1
        self.opens[self.sent] = self.in_flight
        if now is not None:
            self.pacer.take(now, self.sent)
            if self.in_flight > self.limit and self._trying(now):
                self.probe, self.trial = (self.sent, now + PROBE_S), None
        return self.sent

    def release(self, seq: int) -> None:
        """Request ``seq`` ended without saying anything about the limit (another failure, or not sent)."""
        self._ended()
        self.opens.pop(seq, None)
        self.pacer.forget(seq)

    def _ended(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def answered(self, upstream: str | None, now: float | None = None, seq: int | None = None) -> None:
        """An answer to request ``seq`` (served by ``upstream`` when the reply names one): windows
        and pace grow, no stall."""
        self._ended()
        self.answers += 1
        opened = self.opens.pop(seq, None) if seq is not None else None
        if opened is not None:
            self.at_open.setdefault(opened, [0, 0, -1])[0] += 1
            self.admitted_max = max(self.admitted_max, opened)
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
        """Request ``seq`` got a 429: what it shows of the limit moves the window or the pace it names.

        ``stated_rps``: the rate the refusal's headers state; ``stated_count``: a bare count they
        state instead. A cap on open requests (stated, or found from the open count) moves the
        window; any other refusal sets the pace to the rate admitted (:mod:`services.inference.pacer`).
        New requests are paused for the ``Retry-After`` only when the key admits nothing now
        (``CLOSED_RUN`` refused in a row, the last not at a count that may be a cap on open requests:
        a window spent until its reset); otherwise only the refused request waits it, and the others
        go at the pace. Returns the seconds added to the pause.
        """
        open_with_it = self.opens.pop(seq, self.in_flight)
        if self.probe is not None and self.probe[0] == seq:
            self.probe = None  # the trial was refused: the tentative window stands (and is tried again)
        self._ended()
        self.refusals += 1
        window = self.window(upstream)
        self.pacer.ramp.over = True  # a limit was found: the window and the pace bound what is in flight
        self.stall.refused(now)
        if stated_rps is None and stated_count is not None and open_with_it > stated_count:
            window.cap_at(stated_count, seq, self.sent)  # a cap on open requests, stated
            self.pacer.forget(seq)  # not an outcome of the pace
            return 0.0
        found = self._capped_open(window, open_with_it, now) if stated_rps is None else None
        estimate = self.pacer.estimate(upstream)
        if found is True:
            window.hold(open_with_it - 1, seq, self.sent)  # a cap on open requests, found
            self.pacer.forget(seq)
            if self.open_cut is not None and self.open_cut[0] == upstream:
                # The refusals that cut the pace while they could not be told from a cap were
                # the cap's: the pace goes back to what it was before them (unpaced, when it was).
                estimate.rate = self.open_cut[1]
                self.pacer.sync(now)
            self.open_cut = None
            return 0.0
        before = estimate.rate
        # Refusals that do not follow the pace (a share of everything refused, whatever the
        # pace) do not cut it: sending slower would not refuse fewer.
        follows = True if stated_rps is not None else self.pacer.judge(seq, now)
        self.pacer.refused(seq, self.sent, now, upstream, stated_rps, follows=follows)
        self.pacer.forget(seq)  # kept as an outcome by judge(), when it was asked
        if found is None:
            self.open_cut = None  # a cut for the rate: none to undo
        elif self.open_cut is None or self.open_cut[0] != upstream:
            self.open_cut = (upstream, before)
        if found is False or not self.pacer.closed(seq):
            return 0.0  # (refused above every count the key admitted: a cap's run, not a key closed)
        added = self.pause.extend(now, self.default_pause_s if retry_after_s is None else retry_after_s)
        self.pacer.resume_at(max(now, self.pause.until))
        return added

    def _capped_open(self, window: OpenWindow, open_with_it: int, now: float) -> bool | None:
        """Whether a refusal stating nothing, with ``open_with_it`` open (itself too), shows a cap on
        open requests: at that count, more were refused than admitted, and it was refused there
        before with answers since, and never admitted with ``OPEN_SLACK`` more open (True). Refused
        there once, it may as well have been the rate (False): the window keeps to the count
        tentatively, and the pace is cut too until the cap is found. None: not a cap. The worker
        counts an answer open until it has read it, a little longer than the provider does, so a
        cap shows as a count refused more often than not, not as one never admitted."""
        seen = self.at_open.setdefault(open_with_it, [0, 0, -1])  # admitted, refused, answers at the last refusal
        again = seen[1] > 0 and self.answers > seen[2]
        seen[1] += 1
        seen[2] = self.answers
        if open_with_it < 2:
            return None  # refused alone: the rate, not a cap
        if seen[1] <= seen[0] or self.admitted_max >= open_with_it + OPEN_SLACK:
            return None
        if self._refused_below(open_with_it, seen):
            return None
        if again:
            return True
        window.tentative(open_with_it - 1)
        self.trial = now + TRIAL_S
        return False

    def _refused_below(self, count: int, seen: list[int]) -> bool:
        """Whether fewer open were refused about as often as ``count`` was (half its share or more, of
        ``BELOW_MIN`` outcomes or more): a share of everything refused, not a cap on open requests,
        which admits what is below it."""
        admitted = refused = 0
        for below, (a, r, _) in self.at_open.items():
            if below < count:
                admitted, refused = admitted + a, refused + r
        if admitted + refused < BELOW_MIN:
            return False
        return 2 * refused / (admitted + refused) >= seen[1] / (seen[0] + seen[1])

    def stalled(self, now: float) -> bool:
        """Nothing but 429s for ``stall_s``."""
        return self.stall.stalled(now)

    def unstall(self) -> None:
        """The stall is over (a probe got through, or a person resumed): windows grow fast again."""
        self.stall.answered()
        for window in self.windows.values():
            window.restart()
        self.pacer.restart()


__all__ = ["KEY_SCOPE", "OpenWindow", "Pause", "ProviderLimits", "StallClock"]

