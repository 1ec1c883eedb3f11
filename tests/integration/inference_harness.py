"""Helpers for tests of the inference worker on a real broker: prompts in, output topics read back, a worker run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from schemas import (
    Message,
    PromptPublished,
    ResponseReceived,
    decode,
    sample_key,
)
from services.common.config import Settings
from services.common.kafka import make_consumer, make_producer
from services.common.topics import ready_partitions
from services.inference.app import InferenceWorker, create_app
from services.profiles import load_profile
from services.simulator.app import RunningSimulator

PROFILE = load_profile("qwen3")
FAST = {"reasoning_tokens": (4, 12), "content_tokens": (4, 12)}


def prompt(dataset: str, i: int, **kw: Any) -> PromptPublished:
    """A small valid prompt."""
    fields: dict[str, Any] = {
        "messages": [Message(role="system", content="Answer briefly."), Message(role="user", content=f"Q{i}: 2+{i}?")],
        "max_tokens": 64,
        **kw,
    }
    return PromptPublished(dataset=dataset, sample_id=f"s{i:04d}", **fields)


async def publish(settings: Settings, dataset: str, values: list[tuple[str, bytes]]) -> None:
    """Send (sample_id, value) records to prompts.<dataset> and wait for the acks."""
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        topic = settings.kafka.prompts_topic(dataset)
        futures = [await producer.send(topic, value, key=sample_key(dataset, sid).encode()) for sid, value in values]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def publish_control(settings: Settings, scope: str, value: bytes) -> None:
    """Send one record to the control topic, keyed by scope."""
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await (await producer.send(settings.kafka.topic("control"), value, key=scope.encode()))
    finally:
        await producer.stop()


class Collector:
    """Reads output topics from the beginning (no group) into lists, in the background."""

    def __init__(self, settings: Settings, *logical: str) -> None:
        self.settings = settings
        self.topics = {settings.kafka.topic(name): name for name in logical}
        self.records: dict[str, list[ConsumerRecord[bytes, bytes]]] = {name: [] for name in logical}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Collector:
        consumer = make_consumer(self.settings.kafka, group_id=None)
        await consumer.start()
        tps = [TopicPartition(t, p) for t in self.topics for p in await ready_partitions(self.settings.kafka, t)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        self._consumer = consumer
        self._task = asyncio.create_task(self._pump())
        return self

    async def _pump(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=200)
            for tp, records in batches.items():
                self.records[self.topics[tp.topic]].extend(records)

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._consumer is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._consumer.stop()

    def responses(self) -> list[ResponseReceived]:
        return [decode(r.value, ResponseReceived) for r in self.records["responses"]]

    def dead_letters(self) -> list[ConsumerRecord[bytes, bytes]]:
        return self.records["dead-letter"]

    def finished_keys(self) -> set[str]:
        keys = {sample_key(r.dataset, r.sample_id) for r in self.responses()}
        keys |= {(r.key or b"").decode() for r in self.dead_letters()}
        return keys


@contextlib.asynccontextmanager
async def running(settings: Settings, **kw: Any) -> AsyncIterator[InferenceWorker]:
    """A started worker running in the background; stopped gracefully at the end."""
    worker = create_app(settings, **kw)
    await worker.start()
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        try:
            await asyncio.wait_for(task, timeout=60)
        finally:
            await worker.close()
    assert worker.failure is None




def provider_cfg(sim: RunningSimulator, **kw: Any) -> dict[str, Any]:
    return {
        "kind": "simulator",
        "base_url": sim.url,
        "concurrency": 32,
        "max_attempts": 3,
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.2,
        "timeout_s": 10.0,
        **kw,
    }


async def committed_all(settings: Settings, worker: InferenceWorker, dataset: str) -> bool:
    """True when the group's committed offsets reach the end of every prompts partition."""
    consumer = make_consumer(settings.kafka, group_id=worker.group_id)
    await consumer.start()
    try:
        topic = settings.kafka.prompts_topic(dataset)
        tps = [TopicPartition(topic, p) for p in await ready_partitions(settings.kafka, topic)]
        end = await consumer.end_offsets(tps)
        return all([(await consumer.committed(tp) or 0) >= end[tp] for tp in tps])
    finally:
        await consumer.stop()
