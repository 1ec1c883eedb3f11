"""The dead letters an export's card counts: read from the configured dead-letter topic at export time.

Optional (``export --dead-letters``): an export is a file operation and needs no broker
otherwise. Every record on the topic is counted by dataset, stage and primary reason, as the
topic holds them at that moment: a letter that was replayed and then accepted still counts,
as ``draftstream dlq list`` shows it.
"""

from __future__ import annotations

from collections import Counter

from schemas import DEAD_LETTER_TOPIC
from services.common.config import Settings
from services.common.topics import Record, read_to_end
from services.dlq.core import DeadLetterRecord

DeadLetterCounts = Counter[tuple[str, str, str]]
"""Dead letters by (dataset, stage, primary reason)."""


async def dead_letter_counts(settings: Settings) -> DeadLetterCounts:
    """Every dead letter on the topic now, counted by dataset, stage and reason."""
    counts: DeadLetterCounts = Counter()

    def count(record: Record) -> None:
        letter = DeadLetterRecord(
            partition=record.partition, offset=record.offset, timestamp_ms=record.timestamp, key=record.key,
            value=record.value, headers=tuple((k, v) for k, v in record.headers or ()),
        )  # fmt: skip
        counts[(letter.dataset, letter.stage, letter.reason)] += 1

    await read_to_end(settings.kafka, settings.kafka.topic(DEAD_LETTER_TOPIC), count)
    return counts


__all__ = ["DeadLetterCounts", "dead_letter_counts"]
