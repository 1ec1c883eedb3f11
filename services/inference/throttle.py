"""The rate-limit gate every provider request passes: the adaptive window, the pace, Retry-After, ceilings.

:class:`ProviderThrottle` wires the pure policy of :mod:`services.inference.limits` to
asyncio: :meth:`~ProviderThrottle.admit` waits while a ``Retry-After`` pause stands, the
window is full or the pace (:mod:`services.inference.pacer`) says not yet, then for the
optional ``requests_per_minute`` / ``tokens_per_minute`` ceilings (aiolimiter's leaky
buckets; ``requests_per_minute`` also caps the pace); each request then reports how it
ended, and the window and the pace move. Each worker has its own throttle: several workers on one key adapt
independently (docs/leases-and-rate-limits.md says how they share the key's limit).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from aiolimiter import AsyncLimiter

from services.common.config import ProviderSettings
from services.common.metrics import PROVIDER_WINDOW, RATE_LIMIT_PAUSED, RATE_LIMITED
from services.inference.limits import KEY_SCOPE, ProviderLimits

TIMER_SLACK_S = 0.005
"""A wake-up timer is moved forward only when the new wait ends this much sooner (not on every answer)."""


class ProviderThrottle:
    """Admits a provider's requests under its adaptive window and ceilings (see the module docstring).

    Waiting requests queue in arrival order and are woken only as the window has room (no
    thundering herd of a thousand waiters on every answer); a pause wakes them by one timer.
    """

    def __init__(
        self, cfg: ProviderSettings, provider: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.provider = provider
        self.limits = ProviderLimits(
            ceiling=cfg.concurrency,
            stall_s=cfg.rate_limit_stall_s,
            default_pause_s=cfg.backoff_initial_s,
            rate_ceiling=cfg.requests_per_minute / 60.0 if cfg.requests_per_minute else None,
        )
        self._clock = clock
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._woken = 0  # waiters told to go that have not started yet
        self._timer: asyncio.TimerHandle | None = None
        self._rpm = AsyncLimiter(cfg.requests_per_minute, 60) if cfg.requests_per_minute else None
        self._tpm = AsyncLimiter(cfg.tokens_per_minute, 60) if cfg.tokens_per_minute else None
        self._completion_tokens = 0
        self._answers = 0
        self._reported: dict[str, int] = {}
        self._report()
        # The series exist from the start (at 0), so a dashboard shows "none yet", not "no data".
        RATE_LIMITED.labels(provider=provider, upstream=KEY_SCOPE)
        RATE_LIMIT_PAUSED.labels(provider=provider)

    @property
    def window(self) -> int:
        """Requests that may be in flight now."""
        return self.limits.limit

    @property
    def waiting(self) -> int:
        """Requests waiting for the pace, the pause or room in the window."""
        return len(self._waiters)

    @property
    def open(self) -> int:
        """Requests sent and not ended: open at the provider."""
        return self.limits.in_flight

    @property
    def counts_tokens(self) -> bool:
        """Whether a ``tokens_per_minute`` ceiling is set (requests then say what they may use)."""
        return self._tpm is not None

    def unstall(self) -> None:
        """A request got through another way (the probe), or a person resumed: the stall clock stops."""
        self.limits.unstall()

    def stalled(self) -> bool:
        """Nothing but 429s for ``provider.rate_limit_stall_s``."""
        return self.limits.stalled(self._clock())

    def tokens_estimate(self, prompt_chars: int, max_tokens: int) -> int:
        """What a request may use of ``tokens_per_minute``: prompt chars / 4 and the mean answer so far."""
        completion = self._completion_tokens // self._answers if self._answers else max_tokens
        return prompt_chars // 4 + min(completion, max_tokens)

    @property
    def pace(self) -> float | None:
        """Requests a second the pace allows now (None: not paced)."""
        return self.limits.pacer.bucket.rate

    def stated(self, limit_rps: float | None) -> None:
        """The key's rate limit as the provider states it (OpenRouter's ``GET /key`` at pre-flight)."""
        self.limits.pacer.stated(limit_rps, self._clock())

    def _room(self, now: float) -> int:
        return self.limits.room(now) - self._woken

    async def admit(self, tokens: int = 0) -> int:
        """Wait for the pause, a place in the window and the ceilings; the request's sequence number."""
        queued = bool(self._waiters)  # first come, first served
        while queued or self._room(self._clock()) <= 0:
            queued = False
            turn = asyncio.get_running_loop().create_future()
            self._waiters.append(turn)
            self._wake()
            try:
                await turn
            except asyncio.CancelledError:
                if turn in self._waiters:
                    self._waiters.remove(turn)
                elif turn.done() and not turn.cancelled():
                    self._woken -= 1
                self._wake()  # a turn this task was given goes to the next
                raise
            self._woken -= 1
        seq = self.limits.start(self._clock())
        if self._waiters:
            # The next waiters' turn: now if the window has room (the ramp may have ended since
            # they were told to wait), else when the pace or the ramp allows (a timer).
            self._wake()
        try:
            if self._rpm is not None:
                await self._rpm.acquire()
            if self._tpm is not None and tokens > 0:
                await self._tpm.acquire(min(float(tokens), self._tpm.max_rate))
        except BaseException:
            self.release(seq)
            raise
        return seq

    def answered(self, upstream: str | None, completion_tokens: int | None, seq: int | None = None) -> None:
        """Request ``seq`` was answered (by ``upstream`` when the reply names one)."""
        self.limits.answered(upstream, self._clock(), seq)
        if completion_tokens is not None:
            self._answers += 1
            self._completion_tokens += completion_tokens
        self._changed()

    def refused(
        self,
        seq: int,
        retry_after_s: float | None,
        upstream: str | None,
        stated_rps: float | None = None,
        stated_count: int | None = None,
    ) -> float:
        """Request ``seq`` got a 429: the window, the pace and the pause move (:meth:`ProviderLimits.refused`).

        Returns the seconds the refused request itself waits before it is tried again: 0 when a
        pause holds every new request (it waits with the rest), else its ``Retry-After``.
        """
        now = self._clock()
        added = self.limits.refused(seq, now, retry_after_s, upstream, stated_rps, stated_count)
        RATE_LIMITED.labels(provider=self.provider, upstream=upstream or KEY_SCOPE).inc()
        if added > 0:
            RATE_LIMIT_PAUSED.labels(provider=self.provider).inc(added)
        self._changed()
        if self.limits.wait_s(now) > 0:
            return 0.0
        return self.limits.default_pause_s if retry_after_s is None else retry_after_s

    def release(self, seq: int) -> None:
        """Request ``seq`` ended in a way that says nothing about the limit (another failure, not sent)."""
        self.limits.release(seq)
        self._changed()

    def _changed(self) -> None:
        self._report()
        self._wake()

    def _wake(self) -> None:
        """Tell as many waiters to go as the window and the pace have room for; after a pause, by a timer."""
        if not self._waiters:
            return
        now = self._clock()  # one reading: the ramp must not grow between the room and the wait
        room = self._room(now)
        if room <= 0:
            delay = self.limits.next_s(now)
            if delay > 0:
                # A timer set for a slower pace is brought forward when the pace rises (an answer
                # grew it): a waiter must not sleep out the old, longer wait.
                loop = asyncio.get_running_loop()
                if self._timer is not None and self._timer.when() > loop.time() + delay + TIMER_SLACK_S:
                    self._timer.cancel()
                    self._timer = None
                if self._timer is None:
                    self._timer = loop.call_later(delay, self._pause_over)
            return
        while room > 0 and self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                self._woken += 1
                room -= 1

    def _pause_over(self) -> None:
        self._timer = None
        self._wake()

    def close(self) -> None:
        """Cancel the pause timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _report(self) -> None:
        for name, window in self.limits.windows.items():
            if self._reported.get(name) != window.limit:  # the gauge is set only when it moves
                self._reported[name] = window.limit
                PROVIDER_WINDOW.labels(provider=self.provider, upstream=name).set(window.limit)
