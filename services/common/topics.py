"""The one reader of topics: a topic to its end, a compacted topic's state, a topic's partitions.

Reads use a manually assigned consumer, no consumer group and nothing committed, so
they never move a stage's offsets and never create a topic (subscribing to a missing
topic would let the broker auto-create it, without compaction). The dlq tool,
``status``, ``publish``, the control and budget-state readers, the inference worker's
control follower and response store, and the tests all read through here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import TopicAuthorizationFailedError

from services.common.config import KafkaSettings
from services.common.errors import CommandError
from services.common.kafka import existing_topics, make_admin, make_consumer

DEFAULT_DEADLINE_S = 120.0

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"
Handler: TypeAlias = Callable[[Record], object]


class TopicReadTimeout(CommandError):
    """A topic could not be read to its end within the deadline."""


class TopicNotReady(CommandError):
    """A topic has no partitions, or a partition without a leader, after waiting for it."""


class Compacted(NamedTuple):
    """A compacted topic's state: the latest value per key and each partition's end offset.

    The ends let a caller go on consuming from exactly where the read stopped.
    """

    values: dict[bytes, bytes]
    ends: dict[int, int]


async def follow(
    consumer: AIOKafkaConsumer, take: Callable[[Record], None], *, what: str, timeout_ms: int = 500
) -> None:
    """Hand every record a started consumer fetches to ``take``, until cancelled.

    A fetch that fails is logged and tried again a second later: a follower outlives broker trouble.
    """
    while True:
        try:
            batches = await consumer.getmany(timeout_ms=timeout_ms)
        except Exception:  # noqa: BLE001 - the follower must outlive broker trouble
            logging.getLogger(__name__).exception("%s follower failed; retrying", what)
            await asyncio.sleep(1.0)
            continue
        for records in batches.values():
            for record in records:
                take(record)


async def partitions_of(admin: AIOKafkaAdminClient, topics: Sequence[str]) -> dict[str, list[int]]:
    """Partition numbers of each topic that exists (missing topics are left out)."""
    if not topics:
        return {}
    described = await admin.describe_topics(list(topics))
    return {
        d["topic"]: sorted(p["partition"] for p in d["partitions"])
        for d in described
        if d.get("error_code", 0) == 0
    }


async def ready_partitions(kafka: KafkaSettings, topic: str, timeout_s: float = 60.0) -> list[int]:
    """The partition numbers of ``topic``, waiting (bounded) until each has a leader.

    For a topic just created: its partitions exist before their leaders are elected.
    Raises ``TopicAuthorizationFailedError`` at once when the ACLs hide the topic: a
    group-less consumer assigned to it would otherwise just see nothing.
    """
    admin = make_admin(kafka)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            (described,) = await admin.describe_topics([topic])
            if described.get("error_code") == TopicAuthorizationFailedError.errno:
                raise TopicAuthorizationFailedError(topic)
            found = described.get("partitions") or []
            if described.get("error_code") == 0 and found and all(p.get("leader", -1) >= 0 for p in found):
                return sorted(int(p["partition"]) for p in found)
            if time.monotonic() > deadline:
                raise TopicNotReady(f"topic {topic} is not ready (no partitions with a leader)")
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def catch_up(
    consumer: AIOKafkaConsumer,
    tps: Iterable[TopicPartition],
    handle: Handler,
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    past_end: bool = False,
    from_offsets: Mapping[TopicPartition, int] | None = None,
) -> dict[TopicPartition, int]:
    """Feed ``handle`` every record of ``tps`` from the beginning to the end offsets taken now.

    ``consumer`` is started and has ``tps`` assigned; it is left at (or just past) the
    ends, which are returned. Records fetched past an end are dropped, for a snapshot,
    unless ``past_end``: a caller that goes on following the topic must not lose them.
    ``from_offsets`` starts a partition there instead of at its beginning (a checkpoint;
    one outside the partition's offsets reads it from the beginning).
    Raises :class:`TopicReadTimeout` when the ends are not reached within ``deadline_s``.
    """
    tps = list(tps)
    if not tps:
        return {}
    end: dict[TopicPartition, int] = await consumer.end_offsets(tps)
    start: dict[TopicPartition, int] = await consumer.beginning_offsets(tps)
    for tp, offset in (from_offsets or {}).items():
        if tp in start and start[tp] < offset <= end[tp]:
            start[tp] = offset
    # A seek to a known offset, not seek_to_beginning(): that waits for the fetch the consumer
    # has in flight since assign(), which on an empty partition is the broker's whole wait.
    for tp in tps:
        consumer.seek(tp, start[tp])
    # A partition whose records were all compacted or deleted away has start == end.
    todo = {tp for tp in tps if end[tp] > start[tp]}
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while todo:
        if loop.time() > give_up:
            names = ", ".join(sorted({tp.topic for tp in todo}))
            raise TopicReadTimeout(f"could not read {names} to its end within {deadline_s:.0f}s")
        batches = await consumer.getmany(*todo, timeout_ms=500, max_records=1000)
        for tp, records in batches.items():
            for record in records:
                if past_end or record.offset < end[tp]:
                    handle(record)
        for tp in list(todo):
            if await consumer.position(tp) >= end[tp]:
                todo.discard(tp)
    return end


async def _read(
    kafka: KafkaSettings,
    topic: str,
    handle: Handler,
    deadline_s: float,
    from_offsets: Mapping[int, int] | None = None,
) -> dict[TopicPartition, int] | None:
    """Read ``topic`` to its end (from ``from_offsets``: partition -> offset, where given); the
    end offsets, or None when the topic does not exist."""
    admin = make_admin(kafka)
    try:
        await admin.start()  # inside the try: a broker that does not answer leaks no client
        if topic not in await existing_topics(admin, [topic]):
            return None
        partitions = (await partitions_of(admin, [topic])).get(topic, [])
    finally:
        await admin.close()
    tps = [TopicPartition(topic, p) for p in partitions]
    if not tps:
        return {}
    consumer = make_consumer(kafka, group_id=None)
    try:
        await consumer.start()  # inside the try: a failed start leaks no connection
        consumer.assign(tps)
        marks = from_offsets or {}
        starts = {tp: marks[tp.partition] for tp in tps if tp.partition in marks}
        return await catch_up(consumer, tps, handle, deadline_s=deadline_s, from_offsets=starts)
    finally:
        await consumer.stop()


async def read_to_end(
    kafka: KafkaSettings,
    topic: str,
    handle: Handler,
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    from_offsets: Mapping[int, int] | None = None,
) -> bool:
    """Feed every record of the physical ``topic`` present now, on every partition, to ``handle``.

    ``from_offsets`` (partition -> offset, e.g. a checkpoint's) starts a partition there
    instead of at its beginning. Returns False when the topic does not exist. Raises
    :class:`TopicReadTimeout` when the end offsets taken at the start are not reached
    within ``deadline_s``.
    """
    return await _read(kafka, topic, handle, deadline_s, from_offsets) is not None


async def read_compacted(kafka: KafkaSettings, topic: str, *, deadline_s: float = DEFAULT_DEADLINE_S) -> Compacted:
    """The latest value per key of the physical ``topic``, read to its current end.

    A tombstone deletes its key; records without a key are ignored. A topic that does
    not exist reads as empty.
    """
    latest: dict[bytes, bytes] = {}

    def keep(record: Record) -> None:
        if record.key is None:
            return
        if record.value is None:
            latest.pop(record.key, None)
        else:
            latest[record.key] = record.value

    ends = await _read(kafka, topic, keep, deadline_s) or {}
    return Compacted(latest, {tp.partition: offset for tp, offset in ends.items()})


async def read_keys(kafka: KafkaSettings, topic: str, *, deadline_s: float = DEFAULT_DEADLINE_S) -> set[bytes]:
    """Every record key on ``topic`` now (empty for a missing topic)."""
    keys: set[bytes] = set()

    def note(record: Record) -> None:
        if record.key is not None:
            keys.add(record.key)

    await read_to_end(kafka, topic, note, deadline_s=deadline_s)
    return keys


__all__ = [
    "DEFAULT_DEADLINE_S",
    "Compacted",
    "Handler",
    "Record",
    "TopicNotReady",
    "TopicReadTimeout",
    "catch_up",
    "follow",
    "partitions_of",
    "read_compacted",
    "read_keys",
    "read_to_end",
    "ready_partitions",
]
