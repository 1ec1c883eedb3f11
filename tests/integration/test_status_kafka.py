"""The status screen on a real broker: records per stage, consumer lag, budget and dead letters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from typer.testing import CliRunner

from schemas import BudgetSnapshot, encode, topology
from services.common.kafka import (
    DeadLetter,
    Outgoing,
    dead_letter,
    ensure_topics,
    make_consumer,
    make_producer,
    publish_all,
)
from services.publish.app import publish
from services.status.app import collect

pytestmark = pytest.mark.kafka

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


async def prepare(settings) -> None:
    kafka = settings.kafka
    await ensure_topics(kafka, ["math"])
    await publish(settings, [DATA / "openai_math.jsonl", DATA / "alpaca.jsonl"], dataset="math")
    producer = make_producer(kafka)
    await producer.start()
    try:
        await publish_all(
            producer,
            [
                dead_letter(
                    dlq_topic=kafka.topic("dead-letter"),
                    stage="audit",
                    verdict=DeadLetter("usage_mismatch", "off by 3"),
                    value=b"{}",
                    key=f"math:{'ab'[i]}".encode(),  # two prompts (one key's dead letters count once)
                    topic=kafka.topic("samples"),
                    partition=0,
                    offset=i,
                )
                for i in range(2)
            ],
        )
        snap = BudgetSnapshot(
            scope="math",
            completion_tokens=12345,
            cost_usd=1.5,
            requests=4,
            cap_completion_tokens=100000,
            state="soft-limit",
        )
        await producer.send_and_wait(kafka.topic("budget-state"), encode(snap), key=b"math")
        newer = BudgetSnapshot(
            scope="math",
            completion_tokens=23456,
            cost_usd=2.5,
            requests=7,
            cap_completion_tokens=100000,
            state="halted",
        )
        await producer.send_and_wait(kafka.topic("budget-state"), encode(newer), key=b"math")
        await producer.send_and_wait(kafka.topic("budget-state"), b"not json", key=b"junk")
    finally:
        await producer.stop()


async def commit(settings, group: str, topic: str, offsets: dict[int, int]) -> None:
    consumer = make_consumer(settings.kafka, group_id=settings.kafka.topic(group))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in offsets]
        consumer.assign(tps)
        await consumer.commit({TopicPartition(topic, p): o for p, o in offsets.items()})
    finally:
        await consumer.stop()


async def test_collect_counts_lag_budget_and_dead_letters(settings_factory) -> None:
    settings = settings_factory()
    await prepare(settings)
    prefix = settings.kafka.topic_prefix
    prompts = settings.kafka.prompts_topic("math")
    group = f"{prefix}inference-test"
    # the group has processed everything on partition 0 and nothing elsewhere
    before = await collect(settings, groups={group: (topology.PROMPTS,)})
    p0 = next(lag for lag in before.lags if lag.partition == 0)
    await commit(settings, group, prompts, {0: p0.end})

    snap = await collect(settings, groups={group: (topology.PROMPTS,), "idle": ("samples",)})
    assert snap.stage_records(topology.PROMPTS) == 4
    assert snap.topic_records[prompts] == 4
    assert snap.stage_records("dead-letter") == 2
    lag = sum(x.lag for x in snap.lags if x.group == group)
    assert lag == 4 - p0.end
    assert {x.committed for x in snap.lags if x.group == group and x.partition == 0} == {p0.end}
    assert snap.dead_letters == {("audit", "usage_mismatch"): 2}
    (budget,) = snap.budgets
    assert budget.state == "halted" and budget.completion_tokens == 23456  # latest per scope
    assert snap.unreadable_budget_records == 1


def test_cli_status_prints_counts_and_lag(settings_factory, tmp_path: Path) -> None:
    from services.cli import app

    settings = settings_factory()
    asyncio.run(prepare(settings))
    config = tmp_path / "draftstream.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = "{settings.kafka.bootstrap_servers}"\n'
        f'topic_prefix = "{settings.kafka.topic_prefix}"\n'
    )
    result = CliRunner().invoke(app, ["status", "-c", str(config)], terminal_width=200)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    publish_line = next(ln for ln in lines if "prompts.*" in ln)
    assert " 4 " in publish_line
    inference_lag = next(ln for ln in lines if "draftstream-inference" in ln)
    assert "4 (not started)" in inference_lag
    assert any("usage_mismatch" in ln and " 2 " in ln for ln in lines)
    assert any(ln.strip().startswith("│ math") and "halted" in ln and "23,456" in ln for ln in lines)


def _dead(kafka, stage: str, reason: str, i: int) -> Outgoing:
    return dead_letter(
        dlq_topic=kafka.topic("dead-letter"),
        stage=stage,
        verdict=DeadLetter(reason, "test"),
        value=b"{}",
        key=f"math:s{i}".encode(),
        topic=kafka.topic("samples"),
        partition=0,
        offset=i,
    )


def _truncated(kafka, dataset: str, i: int) -> Outgoing:
    return Outgoing(kafka.topic("accepted"), b"{}", f"{dataset}:t{i}".encode(), [(topology.TRUNCATED_HEADER, b"1")])


async def test_status_counts_from_the_budget_tally_and_reads_only_the_records_after_it(settings_factory) -> None:
    """Issue 27: ``status`` counts dead letters and truncated answers from the budget's checkpointed
    tally and reads only the records after its offsets, not both topics whole.

    Without deleting anything the count is exact (a tally plus a whole read would count the
    first records twice); once the records the tally covers are deleted from the broker, the
    count still includes them (a whole read alone would miss them).
    """
    from aiokafka.admin import RecordsToDelete

    from services.budget.app import create_app as create_budget
    from services.common.kafka import make_admin
    from services.control import read_budget_snapshots
    from tests.kafka_fixture import wait_until

    settings = settings_factory()
    kafka = settings.kafka
    await ensure_topics(kafka, ["math"])
    producer = make_producer(kafka)
    await producer.start()
    try:
        before = [_dead(kafka, "audit", "usage_mismatch", i) for i in range(30)]
        before += [_dead(kafka, "reconstruct", "no_exact_encoding", 100 + i) for i in range(12)]
        before += [_truncated(kafka, "math", i) for i in range(7)] + [_truncated(kafka, "code", 50)]
        await publish_all(producer, before)
        budget = create_budget(settings, checkpoint_interval_s=0.2)
        await budget.start()
        task = asyncio.create_task(budget.run())

        async def tallied() -> bool:
            snap = (await read_budget_snapshots(settings)).get("global")
            return bool(snap and snap.dead_letters and sum(sum(r.values()) for r in snap.dead_letters.values()) == 42
                        and snap.accepted_truncated == {"math": 7, "code": 1})

        await wait_until(tallied, timeout=30.0, message="the budget's tally of 42 dead letters and 8 truncated")
        budget.stop()
        await asyncio.wait_for(task, 30)
        await budget.close()
        # After the budget's last checkpoint: read from the topics by status itself.
        await publish_all(producer, [_dead(kafka, "audit", "usage_mismatch", 200 + i) for i in range(5)])
        await publish_all(producer, [_truncated(kafka, "math", 300 + i) for i in range(2)])
    finally:
        await producer.stop()

    expected_dead = {("audit", "usage_mismatch"): 35, ("reconstruct", "no_exact_encoding"): 12}
    expected_truncated = {"math": 9, "code": 1}
    snap = await collect(settings)
    assert snap.dead_letters == expected_dead
    assert snap.accepted_truncated == expected_truncated

    # Delete what the tally covers: the counts must not change.
    covered = (await read_budget_snapshots(settings))["global"].offsets
    marks = {}
    for position, offset in covered.items():
        logical, _, partition = position.rpartition(":")
        if logical in ("dead-letter", "accepted"):
            marks[TopicPartition(kafka.topic(logical), int(partition))] = RecordsToDelete(before_offset=offset)
    assert sum(r.before_offset for r in marks.values()) == 50
    admin = make_admin(kafka)
    await admin.start()
    try:
        await admin.delete_records(marks, timeout_ms=10_000)
    finally:
        await admin.close()
    again = await collect(settings)
    assert again.dead_letters == expected_dead
    assert again.accepted_truncated == expected_truncated
