"""Every event type travels through a real broker; bad records reach a consumer without killing it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

import schemas as s
from services.common.config import Settings
from services.common.kafka import (
    DeadLetter,
    Outgoing,
    ensure_topics,
    header,
    make_admin,
    make_producer,
)
from services.common.stage import StageRunner
from tests.kafka_fixture import read_records, wait_until
from tests.unit.test_schemas import all_events, make_response

pytestmark = pytest.mark.kafka


async def test_topics_are_created_idempotently_with_compacted_control(
    settings_factory: Callable[..., Settings],
) -> None:
    settings = settings_factory()
    first = await ensure_topics(settings.kafka, ["math"])
    assert settings.kafka.topic("control") in first
    assert settings.kafka.prompts_topic("math") in first
    assert await ensure_topics(settings.kafka, ["math"]) == []
    admin = make_admin(settings.kafka)
    await admin.start()

    async def described() -> Any:
        # (error code, message, type, name, entries); a broker that has not applied the new
        # topic's metadata yet answers UNKNOWN_TOPIC_OR_PARTITION (3) with no entries, for a moment.
        response = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, settings.kafka.topic("control"))]
        )
        resource = response[0].resources[0]
        assert resource[0] in (0, 3), resource[:2]
        return resource if resource[0] == 0 else None

    try:
        resource = await wait_until(described, 10, 0.05, message="the control topic's configs")
    finally:
        await admin.close()
    entries = {e[0]: e[1] for e in resource[4]}
    assert entries["cleanup.policy"] == "compact"


async def test_every_event_type_round_trips_through_the_broker(settings_factory: Callable[..., Settings]) -> None:
    settings = settings_factory()
    await ensure_topics(settings.kafka)
    topic = settings.kafka.topic("responses")
    events = all_events()
    # A 200k-token agent trajectory with its prompt must travel too.
    big = make_response(n_ids=200_000)
    big_sample = s.SampleReconstructed(
        dataset="agent",
        sample_id="long",
        profile="deepseek-v3",
        response=big,
        prompt_ids=list(range(100_000, 150_000)),
        output_ids=list(range(100_000, 300_000)),
        loss_mask=[0] * 50_000 + [1] * 200_000,
        method="native",
    )
    events.append(big_sample)
    assert len(s.encode(big_sample)) > 1_000_000, "the big sample must exceed Kafka's 1 MiB default"
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for i, event in enumerate(events):
            await producer.send_and_wait(topic, s.encode(event), key=str(i).encode(), partition=0)
    finally:
        await producer.stop()
    records = sorted(await read_records(settings, topic, len(events)), key=lambda r: int(r.key or b"0"))
    assert len(records) == len(events)
    for record, event in zip(records, events, strict=True):
        if isinstance(event, s.Halt | s.Resume):
            assert s.decode_control(record.value) == event
        elif isinstance(event, s.LeaseEvent):
            assert s.decode_lease(record.value) == event
        elif isinstance(event, s.ResponseIndexed | s.StoreCheckpointed):
            assert s.decode_store_index(record.value) == event
        else:
            assert s.decode(record.value, type(event)) == event


async def test_a_bad_record_reaches_a_stage_as_a_dead_letter_and_the_stage_goes_on(
    settings_factory: Callable[..., Settings],
) -> None:
    settings = settings_factory(stage={"batch_max": 10, "batch_timeout_ms": 100})
    await ensure_topics(settings.kafka)
    source, sink = settings.kafka.topic("responses"), settings.kafka.topic("samples")

    async def handler(records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[list[Outgoing] | DeadLetter]:
        results: list[list[Outgoing] | DeadLetter] = []
        for record in records:
            try:
                event = s.decode(record.value, s.RequestStarted)
            except s.SchemaError as exc:
                results.append(DeadLetter(exc.reason, exc.message))
                continue
            if event.sample_id == "boom":
                raise RuntimeError("handler bug on one record")
            results.append([Outgoing(topic=sink, value=record.value or b"", key=record.key)])
        return results

    runner = StageRunner(settings, "test", [source], f"g-{uuid.uuid4().hex}", handler)
    good = [s.encode(s.RequestStarted(dataset="d", sample_id=str(i), max_tokens=1)) for i in range(5)]
    bad = [b"{not json", b'{"dataset":"d"}', s.encode(s.RequestStarted(dataset="d", sample_id="boom", max_tokens=1))]
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for i, value in enumerate(good[:2] + bad + good[2:]):
            await producer.send_and_wait(source, value, key=f"d:{i}".encode(), partition=0)
    finally:
        await producer.stop()
    await runner.start()
    task = asyncio.create_task(runner.run())
    try:
        outs = await read_records(settings, sink, 5)
        dead = await read_records(settings, settings.kafka.topic("dead-letter"), 3)
    finally:
        runner.stop()
        await task
        await runner.close()
    assert sorted(r.value for r in outs) == sorted(good)
    reasons = sorted(header(r.headers, s.DLQ_HEADERS.REASON) or "" for r in dead)
    assert reasons == ["internal_error", "invalid_json", "missing_field"]
    for record in dead:
        assert record.value in bad, "a dead letter keeps the failed value byte for byte"
        assert header(record.headers, s.DLQ_HEADERS.TOPIC) == source
        assert header(record.headers, s.DLQ_HEADERS.STAGE) == "test"
        assert header(record.headers, s.DLQ_HEADERS.OFFSET) is not None
    assert not task.exception()
    assert runner.processed == 8
