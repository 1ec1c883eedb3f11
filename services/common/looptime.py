"""Whether this process's event loop keeps up: a timer that notes how late it runs.

One asyncio loop does all of a worker's work: a callback that takes 80 ms holds every
other one back by that much. A worker that takes new work while its loop is behind only
makes the queue longer: its requests in flight wait to be read, and their slots are idle
at the provider meanwhile. :class:`LoopLateness` ticks every ``TICK_S`` and says when the
last tick ran, or the next is overdue, by more than ``LATE_S``; the inference worker takes
new prompts only while it is not behind (``services.inference.app``).
"""

from __future__ import annotations

import asyncio
import contextlib

TICK_S = 0.01
"""How often the loop is looked at (a hundred wake-ups a second, a few microseconds each)."""
LATE_S = 0.02
"""A tick this late (or overdue by this much) means the loop is behind."""


class LoopLateness:
    """How late the running loop's timers fire (see the module docstring)."""

    def __init__(self, *, tick_s: float = TICK_S, late_s: float = LATE_S) -> None:
        self.tick_s, self.late_s = tick_s, late_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._late = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start ticking on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self.tick_s
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.0, self._due - loop.time()))
            now = loop.time()
            self._late, self._due = now - self._due, now + self.tick_s

    @property
    def late_by(self) -> float:
        """Seconds the loop is behind now: the last tick's lateness, or how overdue the next one is."""
        if self._loop is None:
            return 0.0
        return max(self._late, self._loop.time() - self._due)

    def behind(self) -> bool:
        """Whether the loop runs more than ``late_s`` late (False before :meth:`start`)."""
        return self.late_by > self.late_s

    async def close(self) -> None:
        """Stop ticking."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
