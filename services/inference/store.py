"""The response store: every paid response, keyed by its exact request, on a compacted topic.

Key ``<dataset>:<sample_id>|<request hash>`` (see :func:`services.inference.core.store_key`),
value the encoded :class:`~schemas.ResponseReceived`. The topic is the store: any worker
of the consumer group, on any machine, sees every other worker's paid responses, and
nothing is lost with a worker. Compaction keeps the latest response per request.

Each worker keeps an index in memory (key → partition and offset, a few dozen bytes per
request) built at start from the small ``response-index`` topic and the store's tail past
its checkpoints (:mod:`services.inference.store_index`; a store without an index is read
to its end once, :func:`services.common.topics.catch_up`) and kept current by following it
(its own writes are indexed at once, on the broker's acknowledgement). Values stay on
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

from schemas import RESPONSE_INDEX_TOPIC, RESPONSE_STORE_TOPIC, ResponseReceived, SchemaError, decode
from services.common.config import KafkaSettings, Settings
from services.common.kafka import FOLLOW_FETCH, make_consumer
from services.common.service import release
from services.common.topics import Record, catch_up, ready_partitions
from services.inference.store_index import StoreIndex

log = logging.getLogger(__name__)

_CACHE_BYTES = 64 * 1024 * 1024


class ResponseStore:
    """Lookup and write of paid responses by request key (see the module docstring)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        producer: AIOKafkaProducer,
        *,
        cache_bytes: int = _CACHE_BYTES,
        use_index: bool = True,
    ) -> None:
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
        self._catching_up = 0  # catch_up() calls under way
        self._caught_up = asyncio.Event()  # set while none is (lookups wait for them)
        self._caught_up.set()
        self.index = StoreIndex(kafka, producer, kafka.topic(RESPONSE_INDEX_TOPIC)) if use_index else None
        # What the last start read: index records, store records and value bytes of the tail.
        self.loaded_from_index = 0
        self.tail_records = 0
        self.tail_bytes = 0

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    async def start(self, partitions: list[int], timeout_s: float) -> None:
        """Load the index (``response-index``, then the store past its checkpoints), then follow the store."""
        self._tps = [TopicPartition(self.topic, p) for p in partitions]
        follower = make_consumer(self._kafka, group_id=None, **FOLLOW_FETCH)  # every worker's writes
        self._follower = follower
        await follower.start()
        follower.assign(self._tps)
        self._fetcher = make_consumer(self._kafka, group_id=None)
        await self._fetcher.start()
        t0 = time.monotonic()
        from_offsets: dict[TopicPartition, int] = {}
        if self.index is not None:
            loaded = await self.index.load(partitions, timeout_s)
            self._index.update(loaded.entries)
            self.loaded_from_index = len(loaded.entries)
            marks = loaded.checkpoints
            from_offsets = {tp: marks[tp.partition] for tp in self._tps if tp.partition in marks}
            unindexed = sorted(p for p in partitions if p not in loaded.checkpoints)
            if unindexed and await self._holds_records(unindexed):
                log.info(
                    "response store %s: no index checkpoint for partition(s) %s on %s: building the index "
                    "from the store once (this start reads every stored value there)",
                    self.topic,
                    ",".join(map(str, unindexed)),
                    self.index.topic,
                )
        await catch_up(
            follower, self._tps, self._index_tail, deadline_s=timeout_s, past_end=True, from_offsets=from_offsets
        )
        for tp in self._tps:
            self._positions[tp.partition] = await follower.position(tp)
        if self.index is not None:
            await self.index.flush(self._positions)
        log.info(
            "response store %s: %d paid response(s) indexed in %.1f s (%d from the index, "
            "%d store record(s) of %.1f MB read)",
            self.topic,
            len(self._index),
            time.monotonic() - t0,
            self.loaded_from_index,
            self.tail_records,
            self.tail_bytes / 1e6,
        )
        self._follow_task = asyncio.create_task(self._follow(), name="inference-response-store")

    async def _holds_records(self, partitions: list[int]) -> bool:
        assert self._fetcher is not None  # noqa: S101 - set in start()
        tps = [TopicPartition(self.topic, p) for p in partitions]
        ends = await self._fetcher.end_offsets(tps)
        return any(ends[tp] > 0 for tp in tps)

    def _index_tail(self, record: Record) -> None:
        self.tail_records += 1
        self.tail_bytes += len(record.value or b"")
        self._index_record(record)

    async def close(self) -> None:
        """Stop following, checkpoint the index up to the store's end (bounded), release the consumers."""
        await release(self._follow_task)
        self._follow_task = None
        if self.index is not None and self._follower is not None:
            try:
                await asyncio.wait_for(self._checkpoint_to_end(self._follower), timeout=10.0)
            except (KafkaError, TimeoutError):
                log.warning("response store: no final index checkpoint (the next start reads more of the store)")
        await release(self._follower, self._fetcher)

    async def _checkpoint_to_end(self, follower: AIOKafkaConsumer) -> None:
        """Index what is on the store now, so that the next start reads none of it."""
        ends = await follower.end_offsets(self._tps)
        while any(self._positions.get(tp.partition, 0) < ends[tp] for tp in self._tps):
            await self._poll(follower)
            for tp in self._tps:
                self._positions[tp.partition] = await follower.position(tp)
        assert self.index is not None  # noqa: S101 - checked by the caller
        await self.index.flush(self._positions)

    async def _poll(self, consumer: AIOKafkaConsumer) -> None:
        batches = await consumer.getmany(timeout_ms=500)
        for records in batches.values():
            for record in records:
                self._index_record(record)

    def _index_record(self, record: Record) -> None:
        if record.key is None:
            return
        key = record.key.decode("utf-8", "replace")
        if self.index is not None:
            self.index.note(record)
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
                if self.index is not None:
                    await self.index.flush(self._positions)
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
        Lookups (:meth:`get`) wait meanwhile: aiokafka fetches the partitions just assigned
        while the rebalance listener that calls this still runs, so a prompt of one can be
        looked up before its last owner's answer is indexed, and be paid for twice.
        """
        fetcher = self._fetcher
        if fetcher is None or not self._tps:
            return True
        self._catching_up += 1
        self._caught_up.clear()
        try:
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
        finally:
            self._catching_up -= 1
            if not self._catching_up:
                self._caught_up.set()

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
        """The paid response of request ``key``, or None when it was never paid for.

        Asked while a :meth:`catch_up` is under way, it answers once that is over.
        """
        await self._caught_up.wait()  # at once when no catch-up is under way
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

    async def put(self, key: str, value: bytes) -> asyncio.Future[object]:
        """Send a paid response (``value``, its encoded :class:`ResponseReceived`) to the store;
        the returned future resolves on the broker's ack.

        The index is updated as soon as the broker acknowledges the write.
        """
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


async def open_store(settings: Settings, producer: AIOKafkaProducer) -> ResponseStore | None:
    """The response store read to its end, or None when ``inference.reuse_responses`` is off."""
    if not settings.inference.reuse_responses:
        return None
    store = ResponseStore(settings.kafka, producer, use_index=settings.inference.store_index)
    partitions = await ready_partitions(settings.kafka, store.topic)
    await store.start(partitions, settings.inference.store_load_timeout_s)
    return store
