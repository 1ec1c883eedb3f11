"""The consume → decide → publish → commit loop shared by the batch stages.

reconstruct, audit and sink read a topic in batches, hand each batch to one core
call, publish what it returns (outputs or dead letters), wait for the broker's
acknowledgement, and only then commit the batch's offsets: at most once per ``[stage]
commit_interval_ms`` (default 1 s), at once on a clean stop or a revocation. A crash
before the commit replays what was done since the last one (at-least-once; duplicates
downstream are idempotent by key), a crash after it loses nothing because the outputs were
already acknowledged.

Written on aiokafka directly rather than as a FastStream subscriber because the stages
need the raw record (value bytes, headers, partition, offset) for byte-exact dead
letters, commits only of acknowledged batches, and a pause/stop they control.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from schemas import DEAD_LETTER_TOPIC, topology
from services.common.checkpoint import Checkpoint
from services.common.config import Settings
from services.common.kafka import (
    STREAM_FETCH,
    DeadLetter,
    Outgoing,
    dead_letter_of,
    make_consumer,
    make_producer,
    publish_all,
    refused_as,
    report_lag,
)
from services.common.metrics import DEAD_LETTERS, STAGE_RECORDS

log = logging.getLogger(__name__)

Result = list[Outgoing] | DeadLetter
BatchHandler = Callable[[Sequence[ConsumerRecord[bytes, bytes]]], Awaitable[list[Result]]]


class _ForgetRevoked(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no type stubs
    """Partitions taken away are committed, then leave the checkpoint (a batch is always finished
    before a fetch, so what was taken of them is done)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        gone = list(revoked)
        await self._checkpoint.commit(only=gone)
        self._checkpoint.forget(gone)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        """Nothing to do: a new owner starts from the committed offsets."""


@dataclass
class StageRunner:
    """Runs one batch stage until :meth:`stop` is called."""

    settings: Settings
    stage: str
    topics: Sequence[str]
    group_id: str
    handler: BatchHandler
    producer: AIOKafkaProducer | None = None
    pattern: str | None = None

    @classmethod
    def of_stage(
        cls, settings: Settings, stage: str, handler: BatchHandler, *, producer: AIOKafkaProducer | None = None
    ) -> StageRunner:
        """The runner of a pipeline stage: its input topic and consumer group from the topology."""
        kafka = settings.kafka
        return cls(
            settings=settings,
            stage=stage,
            topics=[kafka.topic(topology.STAGE_INPUT[stage])],
            group_id=kafka.group(topology.GROUPS[stage]),
            handler=handler,
            producer=producer,
        )

    def __post_init__(self) -> None:
        self._stopping = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._checkpoint: Checkpoint | None = None
        self._own_producer = self.producer is None
        self.processed = 0

    async def start(self) -> None:
        """Connect the consumer and the producer."""
        kafka = self.settings.kafka
        if self.producer is None:
            self.producer = make_producer(kafka)
            with refused_as(kafka, "WRITE"):
                await self.producer.start()
        self._consumer = make_consumer(
            kafka, group_id=self.group_id, **STREAM_FETCH, fetch_max_wait_ms=self.settings.stage.fetch_wait_ms
        )
        self._checkpoint = Checkpoint(
            self._consumer, label=self.stage, interval_s=self.settings.stage.commit_interval_ms / 1000
        )
        listener = _ForgetRevoked(self._checkpoint)
        if self.pattern:
            self._consumer.subscribe(pattern=self.pattern, listener=listener)
        else:
            self._consumer.subscribe(list(self.topics), listener=listener)
        with refused_as(kafka, "READ"):
            await self._consumer.start()

    def stop(self) -> None:
        """Ask the loop to finish its current batch and return."""
        self._stopping.set()

    async def close(self) -> None:
        """Release the Kafka clients."""
        if self._consumer is not None:
            await self._consumer.stop()
        if self.producer is not None and self._own_producer:
            await self.producer.stop()

    async def run(self) -> None:
        """Consume until stopped; never lets one bad record stop the stage."""
        assert self._consumer is not None and self.producer is not None  # noqa: S101 - start() first
        assert self._checkpoint is not None  # noqa: S101 - start() first
        consumer, checkpoint = self._consumer, self._checkpoint
        stage_cfg = self.settings.stage
        while not self._stopping.is_set():
            # An authorization failure stops the stage with one line and commits nothing:
            # a batch whose outputs were refused is read again once the ACLs allow them.
            with refused_as(self.settings.kafka, "READ"):
                batches = await consumer.getmany(
                    timeout_ms=stage_cfg.batch_timeout_ms or 100, max_records=stage_cfg.batch_max
                )
            records = [r for part in batches.values() for r in part]
            if not records:
                await checkpoint.commit_due()
                await self._report_lag(consumer)
                continue
            for tp, part in batches.items():
                for record in part:
                    checkpoint.take(tp, record.offset)
            results = await self._decide(records)
            outgoing: list[Outgoing] = []
            for record, result in zip(records, results, strict=True):
                if isinstance(result, DeadLetter):
                    DEAD_LETTERS.labels(stage=self.stage, reason=result.reason).inc()
                    outgoing.append(self._dead_letter(record, result))
                else:
                    outgoing.extend(result)
            with refused_as(self.settings.kafka, "WRITE"):
                await publish_all(self.producer, outgoing)
            # The outputs are acknowledged: the batch is done. A failed commit is only a batch
            # read again (downstream is idempotent by key), not a crash loop on a rebalance.
            for tp, part in batches.items():
                for record in part:
                    checkpoint.done(tp, record.offset)
            await checkpoint.commit_due()
            self.processed += len(records)
            STAGE_RECORDS.labels(stage=self.stage).inc(len(records))
            await self._report_lag(consumer)
        await checkpoint.commit()  # a clean stop leaves nothing done uncommitted

    async def _decide(self, records: list[ConsumerRecord[bytes, bytes]]) -> list[Result]:
        """The handler's verdicts; a failing batch is retried record by record."""
        try:
            results = await self.handler(records)
            if len(results) != len(records):
                raise RuntimeError(f"handler returned {len(results)} results for {len(records)} records")
            return results
        except Exception:
            log.exception("%s: batch of %d failed; isolating the bad record(s)", self.stage, len(records))
        isolated: list[Result] = []
        for record in records:
            try:
                (one,) = await self.handler([record])
                isolated.append(one)
            except Exception as exc:  # noqa: BLE001 - a poison record becomes a dead letter
                log.exception("%s: record %s@%d failed", self.stage, record.topic, record.offset)
                isolated.append(DeadLetter("internal_error", f"{type(exc).__name__}: {exc}"))
        return isolated

    def _dead_letter(self, record: ConsumerRecord[bytes, bytes], verdict: DeadLetter) -> Outgoing:
        return dead_letter_of(
            record, dlq_topic=self.settings.kafka.topic(DEAD_LETTER_TOPIC), stage=self.stage, verdict=verdict
        )

    async def _report_lag(self, consumer: AIOKafkaConsumer) -> None:
        await report_lag(consumer, self.group_id)


class RunnerService:
    """The service lifecycle of a batch stage: everything is its :class:`StageRunner`'s.

    A stage sets ``self.runner`` in its constructor and overrides what it adds (a sink's
    folder lock, a reconstructor's profile loading), calling ``super()`` for the rest.
    """

    runner: StageRunner

    async def start(self) -> None:
        """Connect to Kafka."""
        await self.runner.start()

    async def run(self) -> None:
        """Consume until stopped."""
        await self.runner.run()

    def stop(self) -> None:
        """Finish the current batch and return."""
        self.runner.stop()

    async def close(self) -> None:
        """Release the Kafka clients."""
        await self.runner.close()

    @property
    def processed(self) -> int:
        """Records consumed so far."""
        return self.runner.processed


__all__ = ["BatchHandler", "Result", "RunnerService", "StageRunner"]
