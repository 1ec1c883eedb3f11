"""Reading the status numbers from Kafka: end offsets, committed offsets, budget, dead letters.

Everything is read without joining a consumer group or committing anything: end and
beginning offsets through a group-less consumer, committed offsets of the stage groups
through the admin client, ``budget-state`` as its latest snapshot per scope,
``dead-letter`` and ``accepted`` (for the truncated answers accepted, a header) from the budget's
tallies on ``budget-state`` and only the records after the offsets those cover (the whole topic
when no budget tallied it), ``conversation-state`` (latest per conversation) and
``provider-facts`` (the ``strips_at_edges`` facts: upstreams whose answers showed they strip).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from aiokafka import ConsumerRecord, TopicPartition

from schemas import (
    ACCEPTED_TOPIC,
    CONVERSATIONS_TOPIC,
    DEAD_LETTER_TOPIC,
    DLQ_HEADERS,
    GLOBAL_SCOPE,
    PROVIDER_FACTS_TOPIC,
    BudgetSnapshot,
    ConversationProgressed,
    Halt,
    ProviderFactRecorded,
    SchemaError,
    decode,
    topology,
)
from services.budget.totals import copy_tally
from services.common import outcomes
from services.common.config import Settings
from services.common.kafka import header, make_admin, make_consumer
from services.common.topics import partitions_of, read_to_end
from services.control import read_budget_snapshots, read_control_state
from services.reconstruct.facts import STRIPS_PLACE
from services.status.core import (
    GROUP_INPUTS,
    STAGE_TOPICS,
    GroupLag,
    StatusSnapshot,
    rate_limits_from_metrics,
    stopped_conversations,
)


async def _committed(admin: Any, group: str) -> dict[TopicPartition, int]:
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    except Exception:  # noqa: BLE001 - an unknown or dead group simply has no offsets
        return {}
    return {tp: meta.offset for tp, meta in offsets.items() if meta is not None and meta.offset >= 0}


async def collect(
    settings: Settings,
    *,
    groups: Mapping[str, tuple[str, ...]] | None = None,
    clock: Callable[[], float] = time.time,
) -> StatusSnapshot:
    """Read one :class:`StatusSnapshot` from the cluster.

    Args:
        groups: logical consumer group (the topic prefix is prepended, as the services do) -> logical
            topics it reads; default the four stage groups.
    """
    groups = GROUP_INPUTS if groups is None else groups
    kafka = settings.kafka
    prefix = kafka.topic_prefix
    snapshot = StatusSnapshot(taken_at=clock(), topic_prefix=prefix, groups=tuple(groups))

    consumer = make_consumer(kafka, group_id=None)
    admin = make_admin(kafka)
    try:
        await consumer.start()
        await admin.start()
        existing = set(await admin.list_topics())
        logical_topics = {logical for _, logical in STAGE_TOPICS} | {
            t for inputs in groups.values() for t in inputs
        }
        ours = sorted(t for t in existing if any(topology.belongs_to(t, lg, prefix) for lg in logical_topics))
        partitions = await partitions_of(admin, ours)
        tps = [TopicPartition(topic, p) for topic in ours for p in partitions.get(topic, [])]
        end: dict[TopicPartition, int] = await consumer.end_offsets(tps) if tps else {}
        start: dict[TopicPartition, int] = await consumer.beginning_offsets(tps) if tps else {}
        for tp, offset in end.items():
            snapshot.topic_records[tp.topic] = snapshot.topic_records.get(tp.topic, 0) + offset

        for group, inputs in groups.items():
            committed = await _committed(admin, kafka.group(group))
            for tp in tps:
                if not any(topology.belongs_to(tp.topic, logical, prefix) for logical in inputs):
                    continue
                snapshot.lags.append(
                    GroupLag(
                        group=group,
                        topic=tp.topic,
                        partition=tp.partition,
                        end=end.get(tp, 0),
                        committed=committed.get(tp),
                        start=start.get(tp, 0),
                    )
                )
    finally:
        await admin.close()
        await consumer.stop()

    def unreadable(_key: bytes) -> None:
        snapshot.unreadable_budget_records += 1

    # One prompt, one outcome: dead letters counted by key, the latest one standing (services.common.outcomes).
    tally: outcomes.Tally = {}
    standing: outcomes.Standing = {}

    def dead(record: ConsumerRecord[bytes, bytes]) -> None:
        headers = list(record.headers or ())
        stage = header(headers, DLQ_HEADERS.STAGE) or "unknown"
        reason = header(headers, DLQ_HEADERS.REASON) or "unknown"
        outcomes.record_dead_letter(tally, standing, (record.key or b"").decode("utf-8", "replace"), stage, reason)

    def accepted(record: ConsumerRecord[bytes, bytes]) -> None:
        key = (record.key or b"").decode("utf-8", "replace")
        outcomes.record_accepted(tally, standing, key)
        if header(list(record.headers or ()), topology.TRUNCATED_HEADER) == "1":
            snapshot.accepted_truncated[key.split(":", 1)[0]] += 1

    budgets = await read_budget_snapshots(settings, on_unreadable=unreadable)
    dead_from, accepted_from = _tallied(budgets.get(GLOBAL_SCOPE), snapshot, tally, standing)
    await read_to_end(kafka, kafka.topic(DEAD_LETTER_TOPIC), dead, from_offsets=dead_from)
    await read_to_end(kafka, kafka.topic(ACCEPTED_TOPIC), accepted, from_offsets=accepted_from)
    for stage, reasons in tally.items():
        for reason, count in reasons.items():
            snapshot.dead_letters[(stage, reason)] += count
    await read_to_end(kafka, kafka.topic(CONVERSATIONS_TOPIC), lambda r: _conversation(snapshot, r))
    multi_turn = {name for name in settings.datasets if settings.dataset(name).turns == "all"}
    snapshot.stopped = stopped_conversations(snapshot.conversations, standing, multi_turn)
    await read_to_end(kafka, kafka.topic(PROVIDER_FACTS_TOPIC), lambda r: _strips_fact(snapshot, r))
    snapshot.budgets = list(budgets.values())
    snapshot.halts = [e for e in (await read_control_state(settings)).values() if isinstance(e, Halt)]
    await _rate_limits(settings, snapshot)
    return snapshot


def _partition_offsets(offsets: Mapping[str, int], logical: str) -> dict[int, int]:
    """Partition -> offset of ``logical`` among a checkpoint's ``"<topic>:<partition>"`` offsets."""
    marks = {}
    for position, offset in offsets.items():
        name, _, partition = position.rpartition(":")
        if name == logical and partition.isdigit():
            marks[int(partition)] = offset
    return marks


def _tallied(
    budget: BudgetSnapshot | None, snapshot: StatusSnapshot, tally: outcomes.Tally, standing: outcomes.Standing
) -> tuple[dict[int, int], dict[int, int]]:
    """Start from the budget's tallies; the offsets of ``dead-letter`` and ``accepted`` they cover.

    A tally is exact up to the offsets of the same checkpoint, so only the records after
    them are read: bounded by what arrived since the last checkpoint, not by history. No
    tally (no budget ran, or its ledger began before tallies) reads the topic whole.
    The keys standing with a dead letter come along, so a later record of the same key
    supersedes its earlier outcome instead of adding one.
    """
    dead_from: dict[int, int] = {}
    accepted_from: dict[int, int] = {}
    if budget is not None and budget.dead_letters is not None:
        tally.update(copy_tally(budget.dead_letters) or {})
        standing.update(budget.dead_letter_keys or {})
        dead_from = _partition_offsets(budget.offsets, DEAD_LETTER_TOPIC)
    if budget is not None and budget.accepted_truncated is not None:
        snapshot.accepted_truncated.update(budget.accepted_truncated)
        accepted_from = _partition_offsets(budget.offsets, ACCEPTED_TOPIC)
    return dead_from, accepted_from


async def _rate_limits(settings: Settings, snapshot: StatusSnapshot) -> None:
    """Each provider's inference worker's rate-limit windows, from its metrics endpoint (when it serves one).

    A worker per provider serves on its ``[providers.NAME] metrics_port`` (else ``[metrics] inference_port``).
    """
    metrics = settings.metrics
    ports = sorted({p.metrics_port if p.metrics_port is not None else metrics.inference_port
                    for p in settings.all_providers().values()} - {0})
    urls = [f"http://{metrics.host}:{port}/metrics" for port in ports]
    snapshot.rate_limits_source = ", ".join(urls) or "[metrics] inference_port = 0"
    for url in urls:
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                response = await client.get(url)
                response.raise_for_status()
        except httpx.HTTPError:
            continue  # no worker there: the table says so when none answers
        snapshot.rate_limits = (snapshot.rate_limits or []) + rate_limits_from_metrics(response.text)


def _conversation(snapshot: StatusSnapshot, record: ConsumerRecord[bytes, bytes]) -> None:
    """Keep the latest state of a conversation (a record that does not decode is left out)."""
    try:
        state = decode(record.value, ConversationProgressed)
    except SchemaError:
        return
    snapshot.conversations[(record.key or b"").decode("utf-8", "replace")] = state


def _strips_fact(snapshot: StatusSnapshot, record: ConsumerRecord[bytes, bytes]) -> None:
    """Keep a ``strips_at_edges`` fact (the other provider facts are the reconstruct stage's business)."""
    if record.value is None:
        return
    try:
        fact = decode(record.value, ProviderFactRecorded)
    except SchemaError:
        return
    if fact.place == STRIPS_PLACE:
        snapshot.strips[fact.upstream] = fact


__all__ = ["collect"]
