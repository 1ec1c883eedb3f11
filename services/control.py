"""Halt and resume on the compacted ``control`` topic, and reading the budget's checkpoints.

Every writer of control events (the budget service, ``draftstream halt``/``resume``) goes
through :func:`publish_control`; every reader that needs the standing state (inference
workers at start, ``draftstream budget``, status) through :func:`read_control_state`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import msgspec

from schemas import (
    BUDGET_STATE_TOPIC,
    CONTROL_TOPIC,
    GLOBAL_SCOPE,
    BudgetSnapshot,
    Halt,
    Resume,
    SchemaError,
    decode,
    decode_control,
    encode,
)
from services.common.config import Settings
from services.common.kafka import ensure_topics, make_consumer, make_producer

log = logging.getLogger(__name__)

ControlState = dict[str, Halt | Resume]


async def publish_control(settings: Settings, event: Halt | Resume) -> None:
    """Publish a halt or resume keyed by its scope and wait for the broker's ack.

    ``at`` is stamped with the current time when the caller left it at 0.
    """
    if not event.at:
        event = msgspec.structs.replace(event, at=time.time())
    await ensure_topics(settings.kafka, needed=(CONTROL_TOPIC,))
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(settings.kafka.topic(CONTROL_TOPIC), encode(event), key=event.scope.encode())
    finally:
        await producer.stop()


async def read_compacted(settings: Settings, logical_topic: str) -> tuple[dict[bytes, bytes | None], dict[int, int]]:
    """The latest value per key of a topic, read from its beginning to its current end.

    Returns the values (``None`` for a tombstone) and the end offset of each partition, so
    a caller can go on consuming from exactly where this read stopped. A topic that does
    not exist reads as empty.
    """
    topic = settings.kafka.topic(logical_topic)
    # Checked first: subscribing to a missing topic would let the broker auto-create it
    # without compaction.
    probe = make_consumer(settings.kafka, group_id=None)
    try:
        await probe.start()  # inside the try: a broker that does not answer leaks no client
        exists = topic in await probe.topics()
    finally:
        await probe.stop()
    if not exists:
        return {}, {}
    # Without a group, a subscribed consumer is assigned every partition at start.
    consumer = make_consumer(settings.kafka, topic, group_id=None)
    latest: dict[bytes, bytes | None] = {}
    try:
        await consumer.start()  # inside the try: a failed start leaks no connection
        partitions = sorted(consumer.assignment(), key=lambda tp: tp.partition)
        if not partitions:
            return {}, {}
        ends = await consumer.end_offsets(partitions)
        await consumer.seek_to_beginning(*partitions)
        remaining = {tp for tp in partitions if ends[tp] > 0}
        for tp in partitions:
            if tp in remaining and await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)  # everything before the end was compacted away
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=1000)
            for tp, records in batches.items():
                for record in records:
                    if record.offset < ends[tp] and record.key is not None:
                        latest[record.key] = record.value
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        return latest, {tp.partition: ends[tp] for tp in partitions}
    finally:
        await consumer.stop()


def control_state_from(values: Mapping[bytes, bytes | None]) -> ControlState:
    """The standing event per scope; undecodable records are logged and ignored.

    A record that fails to decode is never taken as a resume: the scope keeps no entry
    from it (a halt is only lifted by a well-formed :class:`~schemas.Resume`).
    """
    state: ControlState = {}
    for key, value in values.items():
        if value is None:
            continue
        try:
            event = decode_control(value)
        except SchemaError as exc:
            log.warning(
                "control record with key %r ignored (%s): %s",
                key.decode("utf-8", "replace"),
                exc.reason,
                exc.message,
            )
            continue
        state[event.scope] = event
    return state


async def read_control_state(settings: Settings) -> ControlState:
    """The standing halt or resume per scope, read from the compacted control topic."""
    values, _ = await read_compacted(settings, CONTROL_TOPIC)
    return control_state_from(values)


async def read_budget_snapshots(settings: Settings) -> dict[str, BudgetSnapshot]:
    """The latest budget checkpoint per scope from ``budget-state``; bad records are skipped."""
    values, _ = await read_compacted(settings, BUDGET_STATE_TOPIC)
    snapshots: dict[str, BudgetSnapshot] = {}
    for key, value in values.items():
        if value is None:
            continue
        try:
            snap = decode(value, BudgetSnapshot)
        except SchemaError as exc:
            log.warning("budget-state record %r ignored (%s)", key.decode("utf-8", "replace"), exc.reason)
            continue
        snapshots[snap.scope] = snap
    return snapshots


def standing_halt(state: Mapping[str, Halt | Resume], dataset: str) -> Halt | None:
    """The halt that stops ``dataset``: the global one first, else the dataset's own."""
    for scope in (GLOBAL_SCOPE, dataset):
        event = state.get(scope)
        if isinstance(event, Halt):
            return event
    return None


__all__ = [
    "ControlState",
    "control_state_from",
    "publish_control",
    "read_budget_snapshots",
    "read_compacted",
    "read_control_state",
    "standing_halt",
]
