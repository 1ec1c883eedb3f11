"""What lost attempts hold, and how a reading of the provider key's usage releases it: pure.

An attempt whose worker died unanswered is *lost*: the provider may have generated, and
billed, its answer to the end (a non-streaming request runs upstream whether or not the
client is still there to read it). It stays held at its worst case (``max_tokens``).

Where the provider reports what a key was charged (OpenRouter's ``GET /api/v1/key``:
``data.usage``, USD), the budget compares that with what the answers it read account for::

    unexplained = (usage now - usage when this ledger began) - dollars of the answers counted

Only attempts that cannot still be billing (unanswered past the in-flight TTL) are released
by a reading, and only down to ``ceil(unexplained / completion price per token)`` tokens:
all of the unexplained dollars are taken for completion tokens of lost attempts (prompt
tokens, and answers billed but not read yet, make that an over-estimate, never an under-one).
Where nothing can be asked (self-hosted servers), nothing is released: the worst case stands.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from schemas import HeldAttempt


@dataclass
class KeyUsage:
    """The provider key's usage as this ledger read it: its start, and what the answers leave unexplained."""

    base_usd: float | None = None
    unexplained_usd: float | None = None

    def restore(self, base_usd: float | None, unexplained_usd: float | None) -> None:
        """The figures of a checkpoint."""
        self.base_usd, self.unexplained_usd = base_usd, unexplained_usd

    def read(self, usage_usd: float, answered_usd: float) -> None:
        """A new reading of the key's usage, beside the dollars of every answer counted so far.

        The first reading sets the base: the key's usage less what the ledger already counted
        (at a ledger's start that is nothing, and nothing is in flight).
        """
        if self.base_usd is None:
            self.base_usd = usage_usd - answered_usd
        self.unexplained_usd = max(0.0, usage_usd - self.base_usd - answered_usd)

    def tokens(self, usd_per_token: float | None) -> int | None:
        """The completion tokens the unexplained dollars could have paid for (None: no reading, or no price)."""
        if self.unexplained_usd is None or not usd_per_token:
            return None
        return math.ceil(self.unexplained_usd / usd_per_token - 1e-9)


def lost_hold(lost: Iterable[HeldAttempt], overdue_before: float, reconciled_tokens: int | None) -> int:
    """What lost attempts hold: the worst case of those that may still be billing, plus the settled ones'
    worst case released down to ``reconciled_tokens`` (None: no reading, the worst case stands)."""
    billing = settled = 0
    for held in lost:
        if held.started_at < overdue_before:
            settled += held.max_tokens
        else:
            billing += held.max_tokens
    if reconciled_tokens is not None:
        settled = min(settled, max(0, reconciled_tokens))
    return billing + settled
