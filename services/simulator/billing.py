"""What the simulator's key was charged: answers served, and answers whose client went away.

A provider bills an answer it generated whether or not the client is still there to read
it (a non-streaming request runs to its end upstream). The simulator does the same: a
request abandoned while its answer is being generated is billed when the generation would
have ended. ``GET /api/v1/key`` reports the dollars charged (OpenRouter's ``data.usage``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Billing:
    """Completion tokens and dollars charged to the key, and the abandoned answers among them."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self.cost_usd = 0.0
        self.abandoned = 0  # answers billed after their client went away
        self._later: set[asyncio.Task[None]] = set()

    def bill(self, completion_tokens: int, cost_usd: float) -> None:
        """Charge one generated answer."""
        self.completion_tokens += completion_tokens
        self.cost_usd += cost_usd

    def bill_when_done(self, remaining_s: float, answer: Callable[[], tuple[int, float] | None]) -> None:
        """Charge an abandoned answer once its generation ends: ``answer()`` gives (tokens, dollars), None: nothing."""

        async def finish() -> None:
            await asyncio.sleep(max(0.0, remaining_s))
            charged = answer()
            if charged is not None:
                self.bill(*charged)
                self.abandoned += 1

        task = asyncio.get_running_loop().create_task(finish())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    def figures(self) -> dict[str, int | float]:
        """The ``/_sim/stats`` figures: ``completion_tokens`` of every answer billed, served or abandoned."""
        return {"completion_tokens": self.completion_tokens, "cost_usd": self.cost_usd,
                "abandoned_billed": self.abandoned}

    @property
    def pending(self) -> int:
        """Abandoned answers still being generated (not billed yet)."""
        return len(self._later)
