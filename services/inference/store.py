"""The response store: every paid response, keyed by its exact request, on a compacted topic.

Key ``<dataset>:<sample_id>|<request hash>`` (see :func:`services.inference.core.store_key`),
value the encoded :class:`~schemas.ResponseReceived`. The topic is the store: any worker
of the consumer group, on any machine, sees every other worker's paid responses, and
nothing is lost with a worker. Compaction keeps the latest response per request.

Each worker keeps an index in memory (key → partition and offset, a few dozen bytes per
request) built by reading the topic to its end at start (:func:`services.common.topics.catch_up`)
and kept current by following it (its own writes are indexed at once, on the broker's acknowledgement). Values stay on
Kafka; the most recent ones are cached (bounded in bytes), older ones are fetched by
offset when a request is seen again, which is rare (a re-publish, a restart, a replay).

Written on aiokafka directly: no library keeps a compacted-topic key/value index for
asyncio (Kafka Streams' state stores are Java only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from schemas import RESPONSE_STORE_TOPIC, ResponseReceived, SchemaError, decode, encode
from services.common.config import KafkaSettings
from services.common.kafka import make_consumer
from services.common.service import release
from services.common.topics import Record, catch_up

log = logging.getLogger(__name__)

_CACHE_BYTES = 64 * 1024 * 1024


class ResponseStore:
    """Lookup and write of paid responses by request key (see the module docstring)."""

    def __init__(self, kafka: KafkaSettings, producer: AIOKafkaProducer, *, cache_bytes: int = _CACHE_BYTES) -> None:
        self._kafka = kafka
        self._producer = producer
        self.topic = kafka.topic(RESPONSE_STORE_TOPIC)
        self._index: dict[str, tuple[int, int]] = {}
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = cache_bytes
        self._follower: AIOKafkaConsumer | None = None
        self._fetcher: AIOKafkaConsumer | None = None
        self._fetch_lock = asyncio.Lock()
        self._follow_task: asyncio.Task[None] | None = None
        self._tps: list[TopicPartition] = []
        self._positions: dict[int, int] = {}
        self._advanced = asyncio.Event()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    async def start(self, partitions: list[int], timeout_s: float) -> None:
        """Read the store to its end (the index), then follow it in the background."""
        self._tps = [TopicPartition(self.topic, p) for p in partitions]
        follower = make_consumer(self._kafka, group_id=None)
        self._follower = follower
        await follower.start()
        follower.assign(self._tps)
        self._fetcher = make_consumer(self._kafka, group_id=None)
        await self._fetcher.start()
        t0 = time.monotonic()
        await catch_up(follower, self._tps, self._index_record, deadline_s=timeout_s, past_end=True)
        for tp in self._tps:
            self._positions[tp.partition] = await follower.position(tp)
        log.info(
            "response store %s: %d paid response(s) indexed in %.1f s",
            self.topic,
            len(self._index),
            time.monotonic() - t0,
        )
        self._follow_task = asyncio.create_task(self._follow(), name="inference-response-store")

    async def close(self) -> None:
        """Stop following and release the consumers."""
        await release(self._follow_task, self._follower, self._fetcher)

    async def _poll(self, consumer: AIOKafkaConsumer) -> None:
        batches = await consumer.getmany(timeout_ms=500)
        for records in batches.values():
            for record in records:
                self._index_record(record)

    def _index_record(self, record: Record) -> None:
        if record.key is None:
            return
        key = record.key.decode("utf-8", "replace")
        if record.value is None:  # a tombstone: the response was deleted on purpose
            self._index.pop(key, None)
            return
        self._index[key] = (record.partition, record.offset)
        self._remember((record.partition, record.offset), record.value)

    async def _follow(self) -> None:
        follower = self._follower
        assert follower is not None  # noqa: S101 - set in start()
        while True:
            try:
                await self._poll(follower)
                for tp in self._tps:
                    self._positions[tp.partition] = await follower.position(tp)
            except KafkaError:
                log.warning("response store follower failed; retrying", exc_info=True)
                await asyncio.sleep(1.0)
                continue
            old, self._advanced = self._advanced, asyncio.Event()
            old.set()

    async def catch_up(self, timeout_s: float = 30.0) -> bool:
        """Wait until every write acknowledged before this call is indexed (after a rebalance).

        A partition handed over by another worker may hold prompts that worker paid for
        just before it stopped: their responses must be found before they are sent again.
        """
        fetcher = self._fetcher
        if fetcher is None or not self._tps:
            return True
        async with self._fetch_lock:
            ends = await fetcher.end_offsets(self._tps)
        deadline = time.monotonic() + timeout_s
        while any(self._positions.get(tp.partition, 0) < ends[tp] for tp in self._tps):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("response store: not caught up with %s within %.0f s", self.topic, timeout_s)
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), timeout=min(remaining, 1.0))
        return True

    def _remember(self, where: tuple[int, int], value: bytes) -> None:
        if len(value) > self._cache_limit // 4:
            return
        old = self._cache.pop(where, None)
        if old is not None:
            self._cache_bytes -= len(old)
        self._cache[where] = value
        self._cache_bytes += len(value)
        while self._cache_bytes > self._cache_limit and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= len(dropped)

    async def get(self, key: str) -> ResponseReceived | None:
        """The paid response of request ``key``, or None when it was never paid for."""
        where = self._index.get(key)
        if where is None:
            return None
        value = self._cache.get(where)
        if value is None:
            value = await self._fetch(key, where)
            if value is None:
                return None
        try:
            return decode(value, ResponseReceived)
        except SchemaError as exc:
            log.warning("response store record %s unreadable (%s): paying again", key, exc.reason)
            return None

    async def _fetch(self, key: str, where: tuple[int, int]) -> bytes | None:
        """Read one record by offset (and cache what came with it)."""
        fetcher = self._fetcher
        if fetcher is None:
            return None
        partition, offset = where
        tp = TopicPartition(self.topic, partition)
        async with self._fetch_lock:
            fetcher.assign([tp])
            fetcher.seek(tp, offset)
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                batches = await fetcher.getmany(tp, timeout_ms=1000, max_records=500)
                records = batches.get(tp, [])
                if not records:
                    continue
                found: bytes | None = None
                for record in records:
                    if record.value is not None:
                        self._remember((record.partition, record.offset), record.value)
                    if record.offset == offset and record.key is not None and record.key.decode() == key:
                        found = record.value
                if found is not None or records[-1].offset >= offset:
                    return found  # None: compacted away meanwhile (a newer value is indexed)
        log.warning("response store: could not read %s at %d:%d; paying again", key, partition, offset)
        return None

    async def put(self, key: str, response: ResponseReceived) -> asyncio.Future[object]:
        """Send a paid response to the store; the returned future resolves on the broker's ack.

        The index is updated as soon as the broker acknowledges the write.
        """
        value = encode(response)
        future: asyncio.Future[object] = await self._producer.send(self.topic, value, key=key.encode())

        def indexed(done: asyncio.Future[object]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            meta = done.result()
            where = (int(getattr(meta, "partition", 0)), int(getattr(meta, "offset", -1)))
            if where[1] >= 0:
                self._index[key] = where
                self._remember(where, value)

        future.add_done_callback(indexed)
        return future


__all__ = ["ResponseStore"]
