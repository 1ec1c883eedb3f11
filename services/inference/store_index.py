"""The response store's index on Kafka: a worker's start-up that does not grow with the answers' size.

Reading ``response-store`` to its end at start moves every paid answer's full value over
the wire (83,000 answers of thousands of tokens, prompts of up to 60,000 tokens: gigabytes
at each restart). ``response-index`` (compacted) holds, per store key, a
:class:`~schemas.ResponseIndexed` (the store record's partition and offset, tens of bytes)
and, per store partition, a :class:`~schemas.StoreCheckpointed` keyed ``#<partition>``: every
store record below ``next_offset`` has its index record acknowledged. A worker reads the
index, then the store only from each checkpoint on (the tail); values are fetched by
offset when a request is seen again.

The index records are written by each worker's store follower, which reads every store
partition in order (so N workers write each record N times, tens of bytes each; compaction
keeps one): a checkpoint is sent only after the index records of everything below
it are acknowledged, so whichever worker's checkpoint compaction keeps, it is true. Any
worker may lag or die between the two: the next start then reads a longer tail, never a
shorter one. A store without an index (written by a worker that kept none) is read whole once and
indexed on the way (the worker logs it).

Written on aiokafka directly (no library keeps a Kafka-backed index of a compacted topic
for asyncio).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import ResponseIndexed, SchemaError, StoreCheckpointed, decode_store_index, encode
from services.common.config import KafkaSettings
from services.common.topics import Record, read_to_end

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "#"
"""Key prefix of a partition's checkpoint; a store key always holds ``|`` and never starts with it."""


def checkpoint_key(partition: int) -> str:
    """The ``response-index`` key of one store partition's checkpoint."""
    return f"{CHECKPOINT_PREFIX}{partition}"


@dataclass
class LoadedIndex:
    """What ``response-index`` says: where each paid response is, and each partition's checkpoint."""

    entries: dict[str, tuple[int, int]] = field(default_factory=dict)
    checkpoints: dict[int, int] = field(default_factory=dict)
    records: int = 0
    unreadable: int = 0

    def apply(self, key: str, event: ResponseIndexed | StoreCheckpointed | None, partitions: set[int]) -> None:
        """Fold one index record in (``None``: a tombstone, the response was deleted on purpose).

        Two workers' followers may write one key's records in either order: the higher offset
        (the newer store record; a key lives on one store partition) wins.
        """
        self.records += 1
        if event is None:
            self.entries.pop(key, None)
        elif isinstance(event, StoreCheckpointed):
            if event.partition in partitions:
                self.checkpoints[event.partition] = event.next_offset
        elif event.partition in partitions:
            where = (event.partition, event.offset)
            if self.entries.get(key, (-1, -1)) < where:
                self.entries[key] = where


class StoreIndex:
    """Reads ``response-index`` at start; writes index records and checkpoints as the store is followed."""

    def __init__(self, kafka: KafkaSettings, producer: AIOKafkaProducer, topic: str) -> None:
        self._kafka = kafka
        self._producer = producer
        self.topic = topic
        self._pending: list[tuple[str, bytes | None]] = []
        self._checkpointed: dict[int, int] = {}
        self._broken = False

    async def load(self, partitions: list[int], deadline_s: float) -> LoadedIndex:
        """Every index record now on the topic (a missing or empty topic loads as empty)."""
        loaded = LoadedIndex()
        wanted = set(partitions)

        def take(record: Record) -> None:
            if record.key is None:
                return
            key = record.key.decode("utf-8", "replace")
            try:
                event = None if record.value is None else decode_store_index(record.value)
            except SchemaError as exc:
                loaded.unreadable += 1
                log.warning("response-index record %s unreadable (%s): ignored", key, exc.reason)
                return
            loaded.apply(key, event, wanted)

        await read_to_end(self._kafka, self.topic, take, deadline_s=deadline_s)
        self._checkpointed = dict(loaded.checkpoints)
        return loaded

    def note(self, record: Record) -> None:
        """Queue the index record of one store record read in order (a tombstone for a tombstone)."""
        if record.key is None:
            return
        where = ResponseIndexed(partition=record.partition, offset=record.offset)
        value = None if record.value is None else encode(where)
        self._pending.append((record.key.decode("utf-8", "replace"), value))

    async def flush(self, positions: dict[int, int]) -> None:
        """Send the queued index records; once acknowledged, checkpoint each partition at ``positions``.

        A failed write stops this worker's checkpoints for good (a later start reads a longer
        tail of the store): a checkpoint must never cover a record whose index write was lost.
        """
        if self._broken:
            return
        pending = list(self._pending)  # dropped only once acknowledged: a cancelled flush loses nothing
        try:
            acks = [await self._producer.send(self.topic, value, key=key.encode()) for key, value in pending]
            if acks:
                await asyncio.gather(*acks)
            del self._pending[: len(pending)]
            moved = {p: o for p, o in positions.items() if o > self._checkpointed.get(p, 0)}
            acks = [
                await self._producer.send(
                    self.topic,
                    encode(StoreCheckpointed(partition=p, next_offset=o)),
                    key=checkpoint_key(p).encode(),
                )
                for p, o in moved.items()
            ]
            if acks:
                await asyncio.gather(*acks)
            self._checkpointed.update(moved)
        except KafkaError:
            self._broken = True
            log.warning(
                "response-index %s: a write failed; no more checkpoints from this worker "
                "(the next start reads more of the store)",
                self.topic,
                exc_info=True,
            )


__all__ = ["CHECKPOINT_PREFIX", "LoadedIndex", "StoreIndex", "checkpoint_key"]
