"""Reading the dead-letter topic and replaying its records (the Kafka shell of the dlq tool).

The dead-letter topic is read with a manually assigned consumer (no group, nothing
committed): from the beginning up to the end offsets taken at start, then it stops.
Replays are remembered in the compacted ``dlq-replayed`` topic keyed by the dead
letter's ``<partition>:<offset>``; a replay sends the records, waits for the broker's
acknowledgement, then writes their ledger entries. A crash between the two can send a
record twice, which downstream stages absorb (they are idempotent by key); running the
command twice never does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from aiokafka import ConsumerRecord

from schemas import ACCEPTED_TOPIC, DEAD_LETTER_TOPIC, ReplayRecorded, encode
from services.common.config import KafkaSettings, Settings
from services.common.errors import CommandError
from services.common.kafka import Outgoing, create_topics, make_admin, make_producer, publish_all
from services.common.metrics import REPLAYS
from services.common.topics import read_to_end
from services.dlq.core import (
    DEFAULT_MAX_REPLAYS,
    REPLAYED_TOPIC,
    DeadLetterRecord,
    Filters,
    PlannedReplay,
    ReplayPlan,
    plan_replay,
)


class DlqError(CommandError):
    """The dead-letter tool cannot do what was asked; the message is one line."""


def to_dead_letter(record: ConsumerRecord[bytes, bytes]) -> DeadLetterRecord:
    """The pure view of a consumed dead-letter record."""
    return DeadLetterRecord(
        partition=record.partition,
        offset=record.offset,
        timestamp_ms=record.timestamp,
        key=record.key,
        value=record.value,
        headers=tuple((k, v) for k, v in (record.headers or ()) if v is not None),
    )


async def read_dead_letters(settings: Settings, filters: Filters | None = None) -> list[DeadLetterRecord]:
    """Every dead letter present now that passes ``filters``, in partition/offset order."""
    filters = filters or Filters()
    found: list[DeadLetterRecord] = []

    def keep(record: ConsumerRecord[bytes, bytes]) -> None:
        letter = to_dead_letter(record)
        if filters.matches(letter):
            found.append(letter)

    await read_to_end(settings.kafka, settings.kafka.topic(DEAD_LETTER_TOPIC), keep)
    found.sort(key=lambda r: (r.partition, r.offset))
    return found


async def read_accepted_keys(settings: Settings) -> set[str]:
    """The keys with a sample on ``accepted``: a dead letter of one was superseded by a replay that passed."""
    keys: set[str] = set()

    def note(record: ConsumerRecord[bytes, bytes]) -> None:
        if record.key is not None:
            keys.add(record.key.decode("utf-8", "replace"))

    await read_to_end(settings.kafka, settings.kafka.topic(ACCEPTED_TOPIC), note)
    return keys


async def read_replayed(kafka: KafkaSettings) -> set[str]:
    """Ids (``<partition>:<offset>``) of dead letters already replayed, from the ledger."""
    done: set[str] = set()

    def note(record: ConsumerRecord[bytes, bytes]) -> None:
        if record.key is None:
            return
        ident = record.key.decode("utf-8", "replace")
        if record.value is None:
            done.discard(ident)  # a tombstone forgets a replay
        else:
            done.add(ident)

    await read_to_end(kafka, kafka.topic(REPLAYED_TOPIC), note)
    return done


async def ensure_ledger(kafka: KafkaSettings) -> None:
    """Create the compacted replay ledger topic if it does not exist."""
    await create_topics(kafka, [REPLAYED_TOPIC])


async def list_topics(kafka: KafkaSettings) -> set[str]:
    """Names of the topics that exist on the cluster."""
    admin = make_admin(kafka)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


@dataclass
class ReplayReport(ReplayPlan):
    """What a replay did (or, with ``dry_run``, would do) with each matching dead letter."""

    matched: int = 0
    dry_run: bool = False

    @property
    def replayed(self) -> list[PlannedReplay]:
        """The dead letters sent again (or that would be, on a dry run)."""
        return self.send


async def replay(
    settings: Settings,
    filters: Filters | None = None,
    *,
    to: str | None = None,
    max_replays: int = DEFAULT_MAX_REPLAYS,
    dry_run: bool = False,
    fresh: bool = False,
    now_ms: Callable[[], int] = lambda: int(time.time() * 1000),
) -> ReplayReport:
    """Re-send matching dead letters to their original topic (or ``to``'s input topic).

    Skips records already replayed (ledger), refuses those replayed ``max_replays`` times,
    reports those whose target topic does not exist. ``dry_run`` sends and records nothing.
    ``fresh`` (with ``to="inference"``) has each prompt paid for again instead of answered from
    the response store.
    """
    kafka = settings.kafka
    records = await read_dead_letters(settings, filters)
    replayed_ids = await read_replayed(kafka)
    plan = plan_replay(
        records,
        topic_prefix=kafka.topic_prefix,
        existing_topics=await list_topics(kafka),
        replayed_ids=replayed_ids,
        to=to,
        max_replays=max_replays,
        fresh=fresh,
    )
    lists = {f.name: getattr(plan, f.name) for f in fields(plan)}
    report = ReplayReport(**lists, matched=len(records), dry_run=dry_run)
    if dry_run or not plan.send:
        return report

    await ensure_ledger(kafka)
    ledger_topic = kafka.topic(REPLAYED_TOPIC)
    producer = make_producer(kafka)
    await producer.start()
    try:
        # The records first, acknowledged; then the ledger (see the module docstring).
        await publish_all(
            producer,
            (
                Outgoing(topic=p.topic, value=p.payload, key=p.record.key, headers=p.headers)
                for p in plan.send
            ),
        )
        at = now_ms()
        await publish_all(
            producer,
            (
                Outgoing(
                    topic=ledger_topic,
                    key=p.record.id.encode(),
                    value=encode(
                        ReplayRecorded(
                            topic=p.topic,
                            key=p.record.key_text,
                            replay_count=p.record.replay_count + 1,
                            replayed_at_ms=at,
                        )
                    ),
                )
                for p in plan.send
            ),
        )
    finally:
        await producer.stop()
    for p in plan.send:
        REPLAYS.labels(stage=p.record.stage, reason=p.record.reason).inc()
    return report


__all__ = [
    "DlqError",
    "ReplayReport",
    "ensure_ledger",
    "list_topics",
    "read_dead_letters",
    "read_replayed",
    "replay",
    "to_dead_letter",
]
