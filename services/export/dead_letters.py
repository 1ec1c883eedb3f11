"""The dead letters an export's card counts: read from the configured dead-letter topic at export time.

Optional (``export --dead-letters``): an export is a file operation and needs no broker
otherwise. One prompt, one outcome, as ``status`` and ``draftstream dlq list`` count them:
each key's latest dead letter (a replay that failed again supersedes the one before it), none
for a key with a sample on ``accepted`` (a replay passed: its row may be in this very export),
counted by dataset, stage and primary reason.
"""

from __future__ import annotations

from collections import Counter

from services.common.config import Settings
from services.dlq.app import read_accepted_keys, read_dead_letters
from services.dlq.core import latest_per_key

DeadLetterCounts = Counter[tuple[str, str, str]]
"""Dead-lettered keys by (dataset, stage, primary reason)."""


async def dead_letter_counts(settings: Settings) -> DeadLetterCounts:
    """The keys dead-lettered now and not accepted, counted by dataset, stage and reason of their latest dead letter."""
    letters = latest_per_key(await read_dead_letters(settings))
    accepted = await read_accepted_keys(settings)
    return Counter(
        (letter.dataset, letter.stage, letter.reason)
        for letter in letters
        if letter.key is None or letter.key_text not in accepted
    )


__all__ = ["DeadLetterCounts", "dead_letter_counts"]
