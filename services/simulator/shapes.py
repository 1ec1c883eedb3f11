"""More shapes of a key's rate limit, pure: a fixed window of requests per minute, a limit that changes mid-run.

Beside the token bucket and the open-request cap of :mod:`services.simulator.limits`, what
paid APIs do to a key:

- :class:`WindowLimiter`: at most ``per_window`` requests in each fixed window of
  ``window_s`` seconds (600 a minute, counted from the minute's start and reset on the next);
  a request beyond it is refused until the next window starts (``Retry-After`` says when).
- :class:`ScheduledLimiter`: a token bucket whose rate changes at set times after the first
  request (halved at 20 s, restored at 50 s: ``20:0.5,50:1``), the burst kept.

Both are :class:`~services.simulator.limits.RequestLimiter` s (the open cap included), so
the server asks them as it asks the bucket; the clock is a parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.simulator.limits import Refusal, RequestLimiter


@dataclass
class WindowLimiter(RequestLimiter):
    """``per_window`` requests in each fixed window of ``window_s`` seconds, and the open cap."""

    per_window: int = 0
    window_s: float = 60.0
    window: int | None = None
    used: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.per_window <= 0 or self.window_s <= 0:
            raise ValueError("a window limit needs a positive count and a positive window")
        self.rps = self.per_window / self.window_s  # what GET /key reports

    @property
    def active(self) -> bool:
        """Always: the window is a limit."""
        return True

    def admit(self, now: float) -> Refusal | None:
        """Take one request now: None when admitted, else the refusal until the next window."""
        refusal = self.open_refusal()
        if refusal is not None:
            return refusal
        window = math.floor(now / self.window_s)
        if window != self.window:
            self.window, self.used = window, 0
        if self.used >= self.per_window:
            wait = (window + 1) * self.window_s - now
            return Refusal(
                reason=f"{self.per_window} request(s) per {self.window_s:g} s",
                retry_after_s=self.wait_s(wait),
                limit=f"{self.per_window}/{self.window_s:g}s",
            )
        self.used += 1
        self.open += 1
        return None


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """``"20:0.5,50:1"``: at 20 s the rate is halved, at 50 s restored (seconds after the first request)."""
    steps: list[tuple[float, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        at, _, factor = part.partition(":")
        try:
            step = (float(at), float(factor))
        except ValueError:
            raise ValueError(f"a limit schedule step is <seconds>:<factor>, got {part!r}") from None
        if step[0] < 0 or step[1] <= 0:
            raise ValueError(f"a limit schedule step needs seconds >= 0 and a factor > 0, got {part!r}")
        steps.append(step)
    return tuple(sorted(steps))


@dataclass
class ScheduledLimiter(RequestLimiter):
    """A token bucket of ``base_rps`` scaled by ``schedule`` (seconds after the first request, factor)."""

    schedule: tuple[tuple[float, float], ...] = ()
    base_rps: float = field(init=False)
    started: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rps is None:
            raise ValueError("a limit schedule needs a rate limit to change")
        self.base_rps = self.rps

    def factor(self, now: float) -> float:
        """The share of ``base_rps`` in force at ``now``."""
        if self.started is None:
            return 1.0
        factor = 1.0
        for at, step in self.schedule:
            if now - self.started >= at:
                factor = step
        return factor

    def admit(self, now: float) -> Refusal | None:
        """The bucket at the rate in force now."""
        if self.started is None:
            self.started = now
        self.rps = self.base_rps * self.factor(now)
        return super().admit(now)


def shaped(
    base: RequestLimiter, *, per_window: int | None, window_s: float, schedule: str | None
) -> RequestLimiter:
    """The limiter of these options: ``base`` (a bucket and an open cap), a window, or a schedule over the bucket."""
    if per_window is not None:
        return WindowLimiter(
            max_open=base.max_open, open_retry_after_s=base.open_retry_after_s, headers=base.headers,
            per_window=per_window, window_s=window_s,
        )
    if schedule:
        return ScheduledLimiter(
            rps=base.rps, burst=base.burst, max_open=base.max_open, open_retry_after_s=base.open_retry_after_s,
            headers=base.headers, schedule=parse_schedule(schedule),
        )
    return base


__all__ = ["ScheduledLimiter", "WindowLimiter", "parse_schedule", "shaped"]
