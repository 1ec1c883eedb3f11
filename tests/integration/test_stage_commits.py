"""A stage commits its offsets at most once per ``[stage] commit_interval_ms``, and at once on a
clean stop and on a revocation, so that nothing done is read again by the next owner."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
from aiokafka import ConsumerRecord

import schemas as s
from services.common.config import Settings
from services.common.kafka import DeadLetter, Outgoing, ensure_topics, make_admin
from services.common.stage import StageRunner
from tests.kafka_fixture import read_records, send_records, wait_until

pytestmark = pytest.mark.kafka

N = 30


async def _committed(settings: Settings, group: str) -> int:
    """The sum of the group's committed offsets over the partitions it committed."""
    admin = make_admin(settings.kafka)
    await admin.start()
    try:
        return sum(meta.offset for meta in (await admin.list_consumer_group_offsets(group)).values())
    finally:
        await admin.close()


def _forwarding(sink: str) -> Callable[[Sequence[ConsumerRecord[bytes, bytes]]], Any]:
    async def handler(records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[list[Outgoing] | DeadLetter]:
        return [[Outgoing(topic=sink, value=r.value or b"", key=r.key)] for r in records]

    return handler


@contextlib.asynccontextmanager
async def _running(runner: StageRunner) -> AsyncIterator[StageRunner]:
    """The runner started and running; stopped cleanly (its last commit included) on exit."""
    await runner.start()
    task = asyncio.create_task(runner.run())
    try:
        yield runner
    finally:
        runner.stop()
        await task
        await runner.close()


async def _setup(settings_factory: Callable[..., Settings], interval_ms: int) -> tuple[Settings, str, str]:
    settings = settings_factory(stage={"batch_max": 4, "batch_timeout_ms": 50, "commit_interval_ms": interval_ms})
    await ensure_topics(settings.kafka)
    records = [
        (f"d:{i}".encode(), s.encode(s.RequestStarted(dataset="d", sample_id=str(i), max_tokens=1)))
        for i in range(N)
    ]
    await send_records(settings, "responses", records)
    return settings, settings.kafka.topic("responses"), settings.kafka.topic("samples")


async def test_offsets_wait_for_the_interval_and_a_clean_stop_commits_them(
    settings_factory: Callable[..., Settings],
) -> None:
    settings, source, sink = await _setup(settings_factory, interval_ms=60_000)
    group = f"g-{uuid.uuid4().hex}"
    async with _running(StageRunner(settings, "test", [source], group, _forwarding(sink))) as runner:
        await read_records(settings, sink, N)
        await wait_until(lambda: runner.processed >= N, timeout=30, message="every record processed")
        assert await _committed(settings, group) == 0, "nothing is due before the interval has passed"
    assert await _committed(settings, group) == N, "a clean stop commits everything done"


async def test_with_no_interval_offsets_are_committed_while_the_stage_runs(
    settings_factory: Callable[..., Settings],
) -> None:
    settings, source, sink = await _setup(settings_factory, interval_ms=0)
    group = f"g-{uuid.uuid4().hex}"
    async with _running(StageRunner(settings, "test", [source], group, _forwarding(sink))):
        await read_records(settings, sink, N)

        async def all_committed() -> bool:
            return await _committed(settings, group) == N

        await wait_until(all_committed, timeout=30, interval=0.2, message="offsets committed while running")


async def test_a_revocation_commits_so_the_next_owner_reads_nothing_again(
    settings_factory: Callable[..., Settings],
) -> None:
    settings, source, sink = await _setup(settings_factory, interval_ms=60_000)
    group = f"g-{uuid.uuid4().hex}"
    first = StageRunner(settings, "first", [source], group, _forwarding(sink))
    second = StageRunner(settings, "second", [source], group, _forwarding(sink))
    async with _running(first):
        await read_records(settings, sink, N)
        await wait_until(lambda: first.processed >= N, timeout=30, message="the first runner did every record")
        async with _running(second):  # a rebalance: the first gives some partitions to the second

            async def both_assigned() -> bool:
                consumers = [r._consumer for r in (first, second)]  # noqa: SLF001 - the assignment is the point
                return all(c is not None and c.assignment() for c in consumers)

            await wait_until(both_assigned, timeout=60, interval=0.2, message="both runners own partitions")
            await asyncio.sleep(1.0)  # what the second would read again, it would have read by now
    assert second.processed == 0, "the revoked partitions were committed before they moved"
    assert len(await read_records(settings, sink, N)) == N
