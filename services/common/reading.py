"""The one reader of "a topic to its end": every record present now, then stop.

Manual assignment of every partition, no consumer group, nothing committed: a read-only
snapshot that the dlq tool, ``status`` and ``publish`` (which keys are already on a
prompts topic) share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from services.common.config import KafkaSettings
from services.common.errors import CommandError
from services.common.kafka import make_admin, make_consumer

DEFAULT_DEADLINE_S = 120.0


class TopicReadTimeout(CommandError):
    """A topic could not be read to its end within the deadline."""


async def topic_partitions(admin: AIOKafkaAdminClient, topics: Sequence[str]) -> dict[str, list[int]]:
    """Partition numbers of each topic that exists (missing topics are left out)."""
    if not topics:
        return {}
    described = await admin.describe_topics(list(topics))
    return {
        d["topic"]: sorted(p["partition"] for p in d["partitions"])
        for d in described
        if d.get("error_code", 0) == 0
    }


async def read_to_end(
    kafka: KafkaSettings,
    topic: str,
    handle: Callable[[ConsumerRecord[bytes, bytes]], None],
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> bool:
    """Feed every record of ``topic`` present now, on every partition, to ``handle``.

    Returns False when the topic does not exist. Raises :class:`TopicReadTimeout` when
    the end offsets taken at the start are not reached within ``deadline_s``.
    """
    admin = make_admin(kafka)
    try:
        await admin.start()  # inside the try: a broker that does not answer leaks no client
        if topic not in set(await admin.list_topics()):
            return False
        partitions = (await topic_partitions(admin, [topic])).get(topic, [])
    finally:
        await admin.close()
    tps = [TopicPartition(topic, p) for p in partitions]
    if not tps:
        return True
    consumer = make_consumer(kafka, group_id=None)
    try:
        await consumer.start()
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        start = await consumer.beginning_offsets(tps)
        todo = {tp for tp in tps if end[tp] > start[tp]}
        if not todo:
            return True
        await consumer.seek_to_beginning(*todo)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline_s
        while todo:
            if loop.time() > give_up:
                raise TopicReadTimeout(f"could not read {topic} to its end within {deadline_s:.0f}s")
            batches = await consumer.getmany(*todo, timeout_ms=500, max_records=1000)
            for tp, records in batches.items():
                for record in records:
                    if record.offset < end[tp]:
                        handle(record)
            for tp in list(todo):
                if await consumer.position(tp) >= end[tp]:
                    todo.discard(tp)
        return True
    finally:
        await consumer.stop()


async def read_keys(kafka: KafkaSettings, topic: str, *, deadline_s: float = DEFAULT_DEADLINE_S) -> set[bytes]:
    """Every record key on ``topic`` now (empty for a missing topic)."""
    keys: set[bytes] = set()

    def note(record: ConsumerRecord[bytes, bytes]) -> None:
        if record.key is not None:
            keys.add(record.key)

    await read_to_end(kafka, topic, note, deadline_s=deadline_s)
    return keys


__all__ = ["DEFAULT_DEADLINE_S", "TopicReadTimeout", "read_keys", "read_to_end", "topic_partitions"]
