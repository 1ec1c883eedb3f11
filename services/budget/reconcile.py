"""What lost attempts hold, and how a reading of the provider key's usage releases it: pure.

An attempt whose worker died unanswered is *lost*: the provider may have generated, and
billed, its answer to the end (a non-streaming request runs upstream whether or not the
client is still there to read it). It stays held at its worst case (``max_tokens``).

Where the provider reports what a key was charged (OpenRouter's ``GET /api/v1/key``:
``data.usage``, USD), the budget compares that with what the answers it read account for::

    unexplained = (usage now - usage when this ledger began) - dollars of the answers counted

Only attempts that could not still be billing when the key was read (started more than the
in-flight TTL before the reading) are released by it, and only down to
``ceil(unexplained / completion price per token)`` tokens: all of the unexplained dollars are
taken for completion tokens of lost attempts (prompt tokens, and answers billed but not read
yet, make that an over-estimate, never an under-one).
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
    read_at: float | None = None  # when the last reading was taken (not checkpointed: read again)

    def restore(self, base_usd: float | None, unexplained_usd: float | None) -> None:
        """The figures of a checkpoint."""
        self.base_usd, self.unexplained_usd = base_usd, unexplained_usd

    def read(self, usage_usd: float, answered_usd: float, now: float) -> None:
        """A new reading of the key's usage, beside the dollars of every answer counted so far.

        The first reading sets the base: the key's usage less what the ledger already counted
        (at a ledger's start that is nothing, and nothing is in flight).
        """
        if self.base_usd is None:
            self.base_usd = usage_usd - answered_usd
        self.unexplained_usd = max(0.0, usage_usd - self.base_usd - answered_usd)
        self.read_at = now

    def tokens(self, usd_per_token: float | None) -> int | None:
        """The completion tokens the unexplained dollars could have paid for (None: no reading, or no price)."""
        if self.unexplained_usd is None or self.read_at is None or not usd_per_token:
            return None
        return math.ceil(self.unexplained_usd / usd_per_token - 1e-9)

    def settled_before(self, billing_s: float) -> float:
        """Attempts started before this had stopped billing when the last reading was taken (-inf: no reading)."""
        return -math.inf if self.read_at is None else self.read_at - billing_s


def lost_hold(lost: Iterable[HeldAttempt], settled_before: float, reconciled_tokens: int | None) -> int:
    """What lost attempts hold: the worst case of those the last reading may not cover (still billing when
    it was taken), plus the others' worst case released down to ``reconciled_tokens`` (None: the worst case stands).
    """
    billing = settled = 0
    for held in lost:
        if held.started_at < settled_before:
            settled += held.max_tokens
        else:
            billing += held.max_tokens
    if reconciled_tokens is None:
        return billing + settled
    return billing + min(settled, max(0, reconciled_tokens))


def may_release(lost: Iterable[HeldAttempt], settled_before: float, can_read: bool) -> bool:
    """Whether a later reading may release some of these lost attempts (some started after ``settled_before``)."""
    return can_read and any(held.started_at >= settled_before for held in lost)
