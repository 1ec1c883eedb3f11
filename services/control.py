"""Halt and resume on the compacted ``control`` topic, and reading the budget's checkpoints.

Every writer of control events (the budget service, ``draftstream halt``/``resume``) goes
through :func:`publish_control`; every reader that needs the standing state
(``draftstream budget``, status) through :func:`read_control_state`. Both topics are read
with :func:`services.common.topics.read_compacted`; the budget service and the inference
workers, which go on following ``control``, read it through the same module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

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
from services.common.kafka import ensure_topics, make_producer
from services.common.topics import read_compacted

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


def control_state_from(values: Mapping[bytes, bytes]) -> ControlState:
    """The standing event per scope; undecodable records are logged and ignored.

    A record that fails to decode is never taken as a resume: the scope keeps no entry
    from it (a halt is only lifted by a well-formed :class:`~schemas.Resume`).
    """
    state: ControlState = {}
    for key, value in values.items():
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
    values, _ = await read_compacted(settings.kafka, settings.kafka.topic(CONTROL_TOPIC))
    return control_state_from(values)


async def read_budget_snapshots(
    settings: Settings, *, on_unreadable: Callable[[bytes], object] | None = None
) -> dict[str, BudgetSnapshot]:
    """The latest budget checkpoint per scope from ``budget-state``; bad records are skipped.

    ``on_unreadable`` is called with the key of each latest record that does not decode
    (``status`` counts them).
    """
    values, _ = await read_compacted(settings.kafka, settings.kafka.topic(BUDGET_STATE_TOPIC))
    snapshots: dict[str, BudgetSnapshot] = {}
    for key, value in values.items():
        try:
            snap = decode(value, BudgetSnapshot)
        except SchemaError as exc:
            log.warning("budget-state record %r ignored (%s)", key.decode("utf-8", "replace"), exc.reason)
            if on_unreadable is not None:
                on_unreadable(key)
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
    "read_control_state",
    "standing_halt",
]
