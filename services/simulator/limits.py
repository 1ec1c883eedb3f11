"""The simulator's rate limit, pure: a token bucket of requests per second and a cap on open requests.

What a paid API does to a key: beyond ``rps`` requests a second (``burst`` of them at once)
or ``max_open`` requests being answered at the same time, a request is refused with HTTP
429 and a ``Retry-After``. With ``headers`` off the limiter is silent, as many fronts are: no
``X-RateLimit-*`` header states the limit, and ``Retry-After`` is in whole seconds (HTTP's
delay-seconds; at least 1), the wait rounded up. The clock is a parameter (monotonic seconds), so the limiter is
tested on its own; :mod:`services.simulator.server` asks it once per chat request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused, and when to come back (seconds)."""

    reason: str
    retry_after_s: float
    limit: str


@dataclass
class RequestLimiter:
    """A token bucket (``rps``, ``burst``) and an open-request cap; ``None`` turns either off.

    ``burst`` 0 with a rate admits nothing (a limit that never lets a request through).
    ``open_retry_after_s`` is the Retry-After of a refusal by the open cap (when a request
    will finish is not known to the limiter). ``headers``: whether a refusal states the limit
    (``X-RateLimit-*``) and its wait to the millisecond; off, only a whole-second ``Retry-After``.
    """

    rps: float | None = None
    burst: float = 0.0
    max_open: int | None = None
    open_retry_after_s: float = 1.0
    headers: bool = True
    tokens: float = field(init=False)
    stamp: float | None = None
    open: int = 0

    def __post_init__(self) -> None:
        if self.rps is not None and self.rps <= 0:
            raise ValueError(f"rate limit must be positive requests per second, got {self.rps}")
        if self.burst < 0 or (self.max_open is not None and self.max_open < 0):
            raise ValueError("burst and max open requests must not be negative")
        self.tokens = self.burst

    @property
    def active(self) -> bool:
        """Whether any limit is set."""
        return self.rps is not None or self.max_open is not None

    def open_refusal(self) -> Refusal | None:
        """The refusal by the open cap, when it is full."""
        if self.max_open is not None and self.open >= self.max_open:
            return Refusal(
                reason=f"{self.max_open} request(s) open at once",
                retry_after_s=self.wait_s(self.open_retry_after_s),
                limit=str(self.max_open),
            )
        return None

    def admit(self, now: float) -> Refusal | None:
        """Take one request now: None when admitted (count it open until :meth:`done`), else the refusal."""
        refusal = self.open_refusal()
        if refusal is not None:
            return refusal
        if self.rps is not None:
            if self.stamp is not None:
                self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rps)
            self.stamp = now
            if self.tokens < 1.0:
                # Seconds until a whole token is back, to the millisecond above (never 0); a bucket
                # smaller than one token never admits: come back in a second.
                wait = (1.0 - self.tokens) / self.rps if self.burst >= 1.0 else 1.0
                return Refusal(
                    reason=f"{self.rps:g} request(s) per second",
                    retry_after_s=self.wait_s(wait),
                    limit=f"{self.rps:g}/s",
                )
            self.tokens -= 1.0
        self.open += 1
        return None

    def wait_s(self, seconds: float) -> float:
        """The ``Retry-After`` of a wait: to the millisecond above (never 0), or whole seconds when silent."""
        if not self.headers:
            return float(max(1, math.ceil(seconds - 1e-9)))
        return max(0.001, math.ceil(seconds * 1000) / 1000)

    def done(self) -> None:
        """An admitted request was answered (or abandoned)."""
        self.open = max(0, self.open - 1)


@dataclass
class OverCap:
    """How long more than ``cap`` requests were open at once (the worker's share of the blame)."""

    cap: int | None
    open: int = 0
    since: float = 0.0
    over_s: float = 0.0
    peak: int = 0

    def change(self, now: float, delta: int) -> None:
        """``delta`` requests opened (+) or ended (-) at ``now``."""
        if self.cap is not None and self.open > self.cap:
            self.over_s += max(0.0, now - self.since)
        self.since = now
        self.open += delta
        self.peak = max(self.peak, self.open)


def retry_after_text(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds as an integer, else up to the millisecond."""
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:.3f}".rstrip("0").rstrip(".")


__all__ = ["OverCap", "Refusal", "RequestLimiter", "retry_after_text"]
