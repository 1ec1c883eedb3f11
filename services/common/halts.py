"""The halts in force: the compacted ``control`` topic, read to its end, then followed.

Each inference worker and the budget service hold one. A worker reads ``control`` to its
end before the first prompt is fetched (a standing halt holds from the start) and follows
it with its own consumer, so a halt reaches a worker while every request slot is busy;
its requests wait at :meth:`HaltFollower.gate`. Its own control events (the pre-flight's,
the outage probe's, a refused account's) are applied here at once and then published for
every other worker. The budget listens to every event (``event_listeners``) to know
which halts are its own and which a person published.

The following runs on a thread of its own (its own event loop and consumer). A worker
with thousands of requests in flight keeps its event loop saturated, and a halt read
there waited seconds behind them; on its own thread the halt lands in the shared
:class:`HaltState` within a GIL switch, where the provider client asks it before writing
each request (``may_send``). The rest of a change (listeners, gauges, waking the gate)
is handed to the main event loop, in topic order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from prometheus_client import Gauge

from schemas import CONTROL_TOPIC, GLOBAL_SCOPE, Halt, Resume, SchemaError, decode_control, encode, provider_scope
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

    def __init__(
        self, kafka: KafkaSettings, stopping: asyncio.Event, *, gauge: Gauge | None = None, provider: str = ""
    ) -> None:
        self._kafka = kafka
        # A worker's provider scope holds every request it sends, beside the global one and its dataset's.
        self.provider_scope = provider_scope(provider) if provider else ""
        self._own: tuple[str, ...] = (self.provider_scope,) if provider else ()
        self._gauge = gauge
        self._topic = kafka.topic(CONTROL_TOPIC)
        self._stopping = stopping
        self.state = HaltState()
        self.listeners: list[Callable[[], None]] = []
        """Called after every change of the halted scopes (pauses, flags of the callers)."""
        self.event_listeners: list[Callable[[Halt | Resume], None]] = []
        """Called with every well-formed event read from the topic, in topic order."""
        self._changed = asyncio.Event()
        self.held: set[asyncio.Task[Any]] = set()  # tasks waiting at the gate
        self._gauge_scopes: set[str] = {GLOBAL_SCOPE}
        self._producer: AIOKafkaProducer | None = None
        self._lock = threading.Lock()  # the state is written by the follower thread and the loop
        self._applied = 0  # events the follower thread applied (see _observe)
        self._observed = 0  # ...as the main loop last saw that count
        self._observed_at: deque[tuple[int, float]] = deque()  # (that count, when the loop first saw it)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live = False  # the standing state is read
        self._handing_over = False  # a rebalance is on: no request leaves the gate (hold_for_hand_over)

    async def start(self, producer: AIOKafkaProducer) -> None:
        """Read ``control`` to its end, then go on following it, on a thread of its own.

        Returns once the standing state is read (and every event of it delivered here).
        """
        self._producer = producer
        self._loop = loop = asyncio.get_running_loop()
        tps = [TopicPartition(self._topic, p) for p in await ready_partitions(self._kafka, self._topic)]
        caught_up: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._follow(tps, caught_up),), name="control-follower", daemon=True
        )
        self._thread.start()
        await caught_up
        self._live = True  # events from now on arrive as they are issued (their delay is worth a log)
        # The global gauge exists from the start (0 unless halted), so the "halt in force"
        # annotation and alert see a series on a run that never halts.
        self._changed_now()

    async def close(self) -> None:
        """Stop following (the thread ends within one poll) and wait for it."""
        self._closing.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
            self._thread = None

    def is_halted(self, *scopes: str) -> bool:
        """True when a global halt stands, this worker's provider is halted, or any of ``scopes`` is."""
        return self.state.is_halted(*scopes, *self._own)

    def provider_halted(self) -> bool:
        """Whether this worker's own provider stands halted (its partitions belong to other workers meanwhile)."""
        return bool(self.provider_scope) and self.provider_scope in self.state.halted

    @property
    def stopping(self) -> bool:
        """Whether the owner is stopping (no request should start)."""
        return self._stopping.is_set()

    def held_back(self, *scopes: str) -> bool:
        """Whether the gate holds a request of ``scopes`` now: a halt of one, or a hand-over."""
        return self._handing_over or self.state.is_halted(*scopes, *self._own)

    def may_go(self, *scopes: str) -> bool:
        """Whether a request of ``scopes`` may leave now: not held back, and the owner not stopping
        (asked on the main loop at the last moment before a request is written)."""
        self._observe()
        return not self.held_back(*scopes) and not self._stopping.is_set()

    def hold_for_hand_over(self) -> None:
        """Hold every request not yet sent at the gate until :meth:`end_hand_over`.

        From the moment a rebalance takes partitions away until it says which come back, a
        request that leaves the gate (a resume, a lease granted meanwhile) may be of a
        partition whose next owner reads it again from the committed offset: both would pay.
        Held here, it is in :attr:`held`: not waited for, and dropped if its partition went.
        """
        self._handing_over = True

    def end_hand_over(self) -> None:
        """The rebalance is over: the requests held for it go on (those of partitions gone were dropped)."""
        self._handing_over = False
        self.wake()

    def standing(self, scope: str) -> Halt | None:
        """The halt standing for ``scope`` exactly (not counting the global one), if any."""
        return self.state.halted.get(scope)

    def scopes(self) -> list[str]:
        """The halted scopes, sorted."""
        return self.state.scopes()

    async def gate(self, *scopes: str) -> None:
        """Wait while a halt stands for any of ``scopes`` or a rebalance hands partitions over;
        raise :class:`Stopped` when stopping.

        The tasks waiting here are in :attr:`held` meanwhile.
        """
        task = asyncio.current_task()
        while True:
            if self._stopping.is_set():
                raise Stopped
            if not self.held_back(*scopes):
                return
            if task is not None:
                self.held.add(task)
            try:
                await self._changed.wait()
            finally:
                if task is not None:
                    self.held.discard(task)

    def wake(self) -> None:
        """Wake every request waiting at the gate (to see a stop)."""
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    def apply(self, event: Halt | Resume) -> bool:
        """Apply an event here at once; True when the halted scopes changed."""
        with self._lock:
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

    async def _follow(self, tps: list[TopicPartition], caught_up: asyncio.Future[None]) -> None:
        """The follower thread: read to the end (then ``caught_up``), follow until closed."""
        consumer = make_consumer(self._kafka, group_id=None)
        try:
            await consumer.start()
            consumer.assign(tps)
            await catch_up(consumer, tps, self._take, past_end=True)
        except Exception as exc:  # noqa: BLE001 - handed to start(), which raises it
            await release(consumer)
            self._call_main(_settle, caught_up, exc)
            return
        self._call_main(_settle, caught_up, None)
        positions = {tp: await consumer.position(tp) for tp in tps}
        while not self._closing.is_set():
            try:
                if consumer is None:
                    consumer = make_consumer(self._kafka, group_id=None)
                    await consumer.start()
                    consumer.assign(tps)
                    for tp, offset in positions.items():
                        consumer.seek(tp, offset)
                batches = await consumer.getmany(timeout_ms=200)
            except Exception:  # noqa: BLE001 - the follower must outlive any broker trouble
                log.exception("control follower failed; retrying")
                await release(consumer)
                consumer = None
                await asyncio.sleep(1.0)
                continue
            for tp, records in batches.items():
                for record in records:
                    positions[tp] = record.offset + 1
                    self._take(record)
        await release(consumer)

    def _take(self, record: Record) -> None:
        """On the follower thread: the state at once, the rest handed to the main loop."""
        event = self._decode(record)
        if event is None:
            return
        with self._lock:
            changed = self.state.apply(event)
            self._applied += 1  # (after the state: the loop reads it changed once it sees this)
            applied = self._applied
        self._call_main(self._deliver, event, changed, applied)

    def _call_main(self, callback: Callable[..., object], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the main loop is closed: the process is ending
            self._closing.set()

    def _observe(self) -> None:
        """On the main loop: the first read of the state since the follower thread changed it.

        A request is written by the main loop right after its ``may_send`` said yes, with no
        turn of the loop between: one that said yes just before the follower thread applied a
        halt may still be written after that, until the loop runs its next line of anything
        else. From this first read on, every request that asks sees the change: the moment a
        halt is in force here (the follower thread's own clock would be a GIL switch early).
        """
        applied = self._applied
        if applied != self._observed:
            self._observed = applied
            self._observed_at.append((applied, time.time()))

    def _deliver(self, event: Halt | Resume, changed: bool, applied: int) -> None:
        """On the main loop: what event number ``applied`` read by the follower thread means beyond the state."""
        self._observe()
        in_force_at = next(at for number, at in self._observed_at if number >= applied)
        while self._observed_at and self._observed_at[0][0] <= applied:
            self._observed_at.popleft()
        for listener in self.event_listeners:
            listener(event)
        if changed:
            self._log_change(event, in_force_at if self._live else None)
            self._changed_now()

    @staticmethod
    def _decode(record: Record) -> Halt | Resume | None:
        try:
            return decode_control(record.value)
        except SchemaError as exc:
            log.warning(
                "ignoring control record at %s:%d offset %d: %s (%s)",
                record.topic,
                record.partition,
                record.offset,
                exc.reason,
                exc.message,
            )
            return None

    @staticmethod
    def _log_change(event: Halt | Resume, applied_at: float | None) -> None:
        """The change, and how long after it was issued it reached this process (a live event with its ``at``)."""
        lag = ""
        if applied_at is not None and event.at:
            lag = f"; in force here {(applied_at - event.at) * 1000:.0f} ms after it was issued"
        log.warning(
            "%s %s (by %s): %s%s", type(event).__name__.lower(), event.scope, event.by or "?", event.reason, lag
        )

    def _changed_now(self) -> None:
        halted = set(self.state.scopes())
        if self._gauge is not None:
            for scope in self._gauge_scopes | halted:
                self._gauge.labels(scope=scope).set(1 if scope in halted else 0)
            self._gauge_scopes |= halted
        for listener in self.listeners:
            listener()
        self.wake()


def _settle(future: asyncio.Future[None], exc: Exception | None) -> None:
    if future.done():  # start() was cancelled meanwhile
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
