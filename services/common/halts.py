"""The halts in force: the compacted ``control`` topic, read to its end, then followed.

Each inference worker and the budget service hold one. A worker reads ``control`` to its
end before the first prompt is fetched (a standing halt holds from the start) and follows
it with its own consumer, so a halt reaches a worker while every request slot is busy;
its requests wait at :meth:`HaltFollower.gate`. Its own control events (the pre-flight's,
the outage probe's, a refused account's) are applied here at once and then published for
every other worker. The budget listens to every event (``event_listeners``) to know
which halts are its own and which a person published.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from prometheus_client import Gauge

from schemas import CONTROL_TOPIC, GLOBAL_SCOPE, Halt, Resume, SchemaError, decode_control, encode
from services.common.config import KafkaSettings
from services.common.kafka import make_consumer
from services.common.service import release
from services.common.topics import Record, catch_up, ready_partitions

log = logging.getLogger(__name__)


@dataclass
class HaltState:
    """Which scopes stand halted, built by applying control events in topic order."""

    halted: dict[str, Halt] = field(default_factory=dict)

    def apply(self, event: Halt | Resume) -> bool:
        """Apply one control event; True when the set of halted scopes changed."""
        if isinstance(event, Halt):
            changed = event.scope not in self.halted
            self.halted[event.scope] = event
            return changed
        return self.halted.pop(event.scope, None) is not None

    def is_halted(self, *datasets: str) -> bool:
        """True when a global halt stands or any of ``datasets`` is halted."""
        if GLOBAL_SCOPE in self.halted:
            return True
        return any(d in self.halted for d in datasets)

    def scopes(self) -> list[str]:
        """The halted scopes, sorted."""
        return sorted(self.halted)


class Stopped(Exception):  # noqa: N818 - control flow: the worker is stopping, not an error
    """The worker is stopping: do not start another request for this prompt."""


class HaltFollower:
    """Which scopes stand halted here, kept current from ``control``; the gate requests pass."""

    def __init__(self, kafka: KafkaSettings, stopping: asyncio.Event, *, gauge: Gauge | None = None) -> None:
        self._kafka = kafka
        self._gauge = gauge
        self._topic = kafka.topic(CONTROL_TOPIC)
        self._stopping = stopping
        self.state = HaltState()
        self.listeners: list[Callable[[], None]] = []
        """Called after every change of the halted scopes (pauses, flags of the callers)."""
        self.event_listeners: list[Callable[[Halt | Resume], None]] = []
        """Called with every well-formed event read from the topic, in topic order."""
        self._changed = asyncio.Event()
        self._gauge_scopes: set[str] = {GLOBAL_SCOPE}
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, producer: AIOKafkaProducer) -> None:
        """Read ``control`` to its end, then follow it in the background."""
        self._producer = producer
        consumer = make_consumer(self._kafka, group_id=None)
        self._consumer = consumer
        await consumer.start()
        tps = [TopicPartition(self._topic, p) for p in await ready_partitions(self._kafka, self._topic)]
        consumer.assign(tps)
        await catch_up(consumer, tps, self._apply_record, past_end=True)
        # The global gauge exists from the start (0 unless halted), so the "halt in force"
        # annotation and alert see a series on a run that never halts.
        self._changed_now()
        self._task = asyncio.create_task(self._follow(), name="inference-control")

    async def close(self) -> None:
        """Stop following and release the consumer."""
        await release(self._task, self._consumer)
        self._task = self._consumer = None

    def is_halted(self, *scopes: str) -> bool:
        """True when a global halt stands or any of ``scopes`` is halted."""
        return self.state.is_halted(*scopes)

    def standing(self, scope: str) -> Halt | None:
        """The halt standing for ``scope`` exactly (not counting the global one), if any."""
        return self.state.halted.get(scope)

    def scopes(self) -> list[str]:
        """The halted scopes, sorted."""
        return self.state.scopes()

    async def gate(self, *scopes: str) -> None:
        """Wait while a halt stands for any of ``scopes``; raise :class:`Stopped` when stopping."""
        while True:
            if self._stopping.is_set():
                raise Stopped
            if not self.state.is_halted(*scopes):
                return
            await self._changed.wait()

    def wake(self) -> None:
        """Wake every request waiting at the gate (to see a stop)."""
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    def apply(self, event: Halt | Resume) -> bool:
        """Apply an event here at once; True when the halted scopes changed."""
        changed = self.state.apply(event)
        if changed:
            self._changed_now()
        return changed

    async def publish(self, event: Halt | Resume) -> None:
        """Apply ``event`` here, then publish it for every worker (acknowledged)."""
        self.apply(event)
        if isinstance(event, Halt):
            log.error("halting %s (by %s): %s", event.scope, event.by, event.reason)
        else:
            log.warning("resuming %s (by %s): %s", event.scope, event.by, event.reason)
        await self.send(event)

    async def send(self, event: Halt | Resume) -> None:
        """Publish ``event`` on ``control`` and wait for the broker's acknowledgement."""
        if self._producer is None:
            raise RuntimeError("start() the halt follower first")
        await (await self._producer.send(self._topic, encode(event), key=event.scope.encode()))

    async def _follow(self) -> None:
        consumer = self._consumer
        assert consumer is not None  # noqa: S101 - start() assigned it
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=500)
            except KafkaError:
                log.exception("control consumer failed; retrying")
                await asyncio.sleep(1.0)
                continue
            changed = False
            for records in batches.values():
                for record in records:
                    changed |= self._apply_record(record)
            if changed:
                self._changed_now()

    def _apply_record(self, record: Record) -> bool:
        try:
            event = decode_control(record.value)
        except SchemaError as exc:
            log.warning(
                "ignoring control record at %s:%d offset %d: %s (%s)",
                record.topic,
                record.partition,
                record.offset,
                exc.reason,
                exc.message,
            )
            return False
        for listener in self.event_listeners:
            listener(event)
        changed = self.state.apply(event)
        if changed:
            log.warning("%s %s (by %s): %s", type(event).__name__.lower(), event.scope, event.by or "?", event.reason)
        return changed

    def _changed_now(self) -> None:
        halted = set(self.state.scopes())
        if self._gauge is not None:
            for scope in self._gauge_scopes | halted:
                self._gauge.labels(scope=scope).set(1 if scope in halted else 0)
            self._gauge_scopes |= halted
        for listener in self.listeners:
            listener()
        self.wake()
