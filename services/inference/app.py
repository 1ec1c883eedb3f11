"""The inference worker: prompts.* → provider → responses / dead-letter, stoppable by halts.

:class:`InferenceWorker` coordinates; each job has one owner:

- :class:`~services.inference.halts.HaltFollower` — the halts in force (``control``,
  loaded before the first prompt, then followed) and the gate every request passes;
- :class:`~services.inference.guard.ProviderGuard` — pre-flight checks, outage halts and
  their probe, refused accounts;
- :class:`~services.inference.answers.Answerer` — one prompt record to its response
  (paid, or reused from :class:`~services.inference.store.ResponseStore`) or dead letter;
- :class:`~services.inference.calls.ProviderCall` — the paid request and its retry policy;
- :class:`~services.common.checkpoint.Checkpoint` — what may be committed (shared with the
  batch stages' :class:`~services.common.stage.StageRunner`).

Delivery: a prompt's offset is committed only once its response (or dead letter) is
acknowledged by the broker; the committed offset of a partition is the lowest offset
still in flight. A crash replays the unfinished prompts (at least once; downstream
stages are idempotent by key, and the response store keeps a replay from paying twice).

Intake: prompts are taken ``INTAKE_BATCH`` at a time, and only while the worker's event loop
keeps up (:class:`~services.common.looptime.LoopLateness`). A wave of answers comes first:
prompts taken while the loop is behind only wait in its queue, their slots idle at the
provider, and their answers come back as the next wave.

Written on aiokafka directly: the worker keeps a thousand requests in flight across
out-of-order completions, pauses halted partitions (and keeps them paused across
rebalances) and commits only the completed prefix; FastStream has no pause and
processes a partition sequentially.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable
from typing import Any, TypeVar

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from schemas import PROMPTS_TOPIC_PREFIX
from services.common.acls import used_topics
from services.common.checkpoint import Checkpoint
from services.common.config import KafkaSettings, Settings
from services.common.errors import CommandError
from services.common.halts import HaltFollower, Stopped
from services.common.kafka import (
    AUTHORIZATION_ERRORS,
    access_denied,
    ensure_topics,
    make_consumer,
    make_producer,
    refused_as,
    report_lag,
)
from services.common.looptime import LoopLateness
from services.common.metrics import HALTED
from services.common.service import release
from services.common.topics import Record
from services.inference.adapters.providers import Provider, make_provider
from services.inference.adapters.transport import make_http_client
from services.inference.answers import Answerer
from services.inference.calls import ProviderCall
from services.inference.core import GROUP_ID, STAGE, dataset_of_topic
from services.inference.guard import ProviderGuard
from services.inference.headroom import Headroom
from services.inference.store import ResponseStore, open_store

log = logging.getLogger(__name__)
T = TypeVar("T")

INTAKE_BATCH = 128
"""Prompts taken at most at once; the next batch only while the loop keeps up (:meth:`InferenceWorker.run`)."""
QUIET_INFLIGHT = 16
"""Requests at the provider at or below which the worker counts as quiet (or 1 % of its concurrency, if more)."""

ProbeHook = Callable[[Settings, Answerer, ResponseStore, Provider, HaltFollower], Awaitable[object]]
"""``[inference] probe_first``: probes each dataset through the worker's own parts before it consumes
(``services.probe.app.probe_first``, plugged in by whoever builds the worker, so this module never
imports the probe)."""


class InferenceWorker:
    """Consumes prompts, keeps up to ``provider.concurrency`` answers in flight, commits what is done."""

    def __init__(
        self,
        settings: Settings,
        *,
        http_client: httpx.AsyncClient | None = None,
        provider: Provider | None = None,
        worker_id: str | None = None,
        drain_timeout_s: float | None = None,
        repay: bool = False,
        probe: ProbeHook | None = None,
    ) -> None:
        self.settings, self._kafka = settings, settings.kafka
        if settings.inference.probe_first and settings.inference.reuse_responses and probe is None:
            raise CommandError("[inference] probe_first is set, but no probe is plugged into this worker")
        self._probe = probe
        self._http, self._own_http, self._provider = http_client, http_client is None, provider
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._drain_timeout_s = settings.inference.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.repay = repay
        self.group_id = self._kafka.group(GROUP_ID)  # the topic prefix namespaces the group too
        self._stopping, self._abort = asyncio.Event(), asyncio.Event()
        self.halts = HaltFollower(self._kafka, self._stopping, gauge=HALTED, provider=settings.provider.label)
        self.halts.listeners.append(self.apply_pauses)
        self.inflight = InFlight()
        self.lateness = LoopLateness()
        self.failure: BaseException | None = None
        self.guard: ProviderGuard | None = None
        self.answers: Answerer | None = None
        self.headroom: Headroom | None = None  # leases of headroom under the caps
        self._producer: AIOKafkaProducer | None = None
        self._announcer: AIOKafkaProducer | None = None  # RequestStarted records only
        self._consumer: AIOKafkaConsumer | None = None
        self.checkpoint: Checkpoint | None = None  # what may be committed
        self.in_group = False  # subscribed: out of the group while its provider is halted
        self.store: ResponseStore | None = None  # paid responses, by request

    @property
    def halted_scopes(self) -> list[str]:
        """Scopes currently halted, as this worker sees them."""
        return self.halts.scopes()

    def quiet(self) -> bool:
        """Whether few requests are at the provider (halted, idle, or between bursts): a full
        cycle collection is short now (``services.common.service.QuietCollector``). Prompts
        held at the halt gate keep only their task alive."""
        return self.inflight.at_provider <= max(QUIET_INFLIGHT, self.settings.provider.concurrency // 100)

    def assigned_partitions(self) -> set[TopicPartition]:
        """Prompt partitions this worker owns."""
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    def paused_partitions(self) -> set[TopicPartition]:
        """Prompt partitions paused by a halt."""
        return set(self._consumer.paused()) if self._consumer is not None else set()

    async def start(self) -> None:
        """Create topics, load the standing halts, check before paying, then join the group."""
        kafka, settings = self._kafka, self.settings
        await ensure_topics(kafka, settings.datasets, needed=used_topics(STAGE))
        self._http = self._http or make_http_client(settings)
        provider = self._provider = self._provider or make_provider(settings, self._http)
        # RequestStarted records go alone: aiokafka sends one request at a time per broker and
        # producer, and behind the responses' batches a request waited 80-150 ms for its ack.
        producer, announcer = self._producer, self._announcer = make_producer(kafka), make_producer(kafka)
        with refused_as(kafka, "WRITE"):
            await asyncio.gather(producer.start(), announcer.start())
        with refused_as(kafka, "READ"):
            await self.halts.start(producer)
        self.guard = ProviderGuard(settings, provider, self.halts)
        await self.guard.check_all()
        with refused_as(kafka, "READ"):
            self.store = await open_store(settings, producer)
        self.guard.start_probe()
        self.lateness.start()
        with refused_as(kafka, "READ"):
            self.headroom = Headroom(kafka, self.worker_id, self.halts, self.inflight, settings.provider.concurrency)
            self.headroom.listeners.append(self.inflight.wake)  # a dataset short of headroom may take prompts again
            await self.headroom.start(producer)
        call = ProviderCall(settings, provider, announcer, self.halts, self.guard, self.worker_id, self.headroom)
        self.answers = Answerer(settings, provider, producer, call, self.guard, self.store, repay=self.repay)
        if settings.inference.probe_first and self.store is not None and self._probe is not None:
            await self._probe(settings, self.answers, self.store, provider, self.halts)
        # Pattern subscriptions discover new prompts.<dataset> topics on metadata refresh.
        consumer = self._consumer = make_consumer(  # the group waits for a hand-over (_Rebalance)
            kafka, group_id=self.group_id, metadata_max_age_ms=10_000,
            rebalance_timeout_ms=int((settings.inference.handover_timeout_s + 10) * 1000))
        self.checkpoint = Checkpoint(consumer, label=STAGE, interval_s=settings.stage.commit_interval_ms / 1000)
        with refused_as(kafka, "READ"):
            await consumer.start()
        if not self.halts.provider_halted():  # else the group's prompts go to the other providers' workers
            self._join(consumer)
        store = "no store" if self.store is None else f"{len(self.store)} paid response(s) in the store"
        log.info("inference worker %s started (halted: %s; %s)", self.worker_id, self.halts.scopes() or "none",
                 "paying again for every request (--repay)" if self.repay else store)

    def stop(self) -> None:
        """Stop taking prompts; requests in flight finish (bounded) and are published."""
        self._stopping.set()
        self.halts.wake()
        self.inflight.wake()

    def stop_now(self) -> None:
        """Stop without waiting for requests in flight (a second Ctrl-C): they are cancelled."""
        self._abort.set()
        self.stop()

    async def close(self) -> None:
        """Cancel what is left and release the Kafka and HTTP clients."""
        self._stopping.set()
        await self.inflight.cancel()
        await self.lateness.close()
        if self.headroom is not None:
            await self.headroom.close()
        await release(self._consumer)  # leave the group first: no rebalance runs on meanwhile
        if self.guard is not None:
            await self.guard.close()
        await self.halts.close()
        if self.store is not None:
            await self.store.close()
        await release(self._announcer, self._producer, self._http if self._own_http else None)

    async def run(self) -> None:
        """Fetch prompts while there is room in flight and the loop keeps up; commit the completed prefix."""
        consumer, checkpoint = _started(self._consumer), _started(self.checkpoint)
        progress = _Progress(self)
        try:
            while not self._stopping.is_set():
                free = self.inflight.room(self.settings.provider.concurrency)
                if self.halts.provider_halted() != (not self.in_group):
                    if self.in_group and self.inflight.sending(self.halts.held):
                        # Its requests at the provider end first (answered, or back at the gate): a
                        # prompt given away while its request is out would be paid for twice.
                        await self.inflight.wait_for_room(0.2)
                    else:
                        await (self._leave(consumer) if self.in_group else self._rejoin(consumer))
                elif not self.in_group:  # its provider is halted: no partition is here
                    self.inflight.drop_held(set(), self.halts.held)  # a retry of a prompt given away
                    await self.inflight.wait_for_room(0.2)
                elif free <= 0:
                    await self.inflight.wait_for_room(0.5)  # bounded memory: no fetch until one finishes
                elif self.lateness.behind():
                    await asyncio.sleep(self.lateness.tick_s)  # answers first: no new prompt while behind
                else:
                    self.apply_pauses()  # cheap insurance beside the rebalance listener
                    partitions = self._fetchable(consumer)
                    if partitions is not None and not partitions:
                        await self.inflight.wait_for_room(0.2)  # every partition halted or short of headroom
                        continue
                    with refused_as(self._kafka, "READ"):
                        batches = await consumer.getmany(
                            *(partitions or ()), timeout_ms=200, max_records=min(free, INTAKE_BATCH)
                        )
                    for tp, records in batches.items():
                        for record in records:
                            checkpoint.take(tp, record.offset)
                            self.inflight.spawn(self._process(tp, record), tp)
                    await asyncio.sleep(0)  # the batch's first steps run (and count) before the next is taken
                await checkpoint.commit_due()
                await progress.tick(consumer)
            if self.failure is not None:
                raise self.failure
        finally:
            await self.inflight.drain(self._drain_timeout_s, self._abort)
            await checkpoint.commit()

    def _join(self, consumer: AIOKafkaConsumer) -> None:
        """Join the group: every prompts.<dataset> topic (a pattern finds new ones on metadata refresh)."""
        consumer.subscribe(pattern=f"^{re.escape(self._kafka.topic(PROMPTS_TOPIC_PREFIX))}[A-Za-z0-9._-]+$",
                           listener=_Rebalance(self))
        self.in_group = True

    async def _rejoin(self, consumer: AIOKafkaConsumer) -> None:
        """The provider answers again (its halt lifted): take a share of the group's partitions again."""
        log.warning("provider %s resumed: worker %s joins the group again", self.settings.provider.label,
                    self.worker_id)
        self.inflight.drop_held(set(), self.halts.held)
        self._join(consumer)  # the gate holds every request until the assignment (_Rebalance) says what is here
        await asyncio.sleep(0)

    async def _leave(self, consumer: AIOKafkaConsumer) -> None:
        """The provider is halted: hand every partition to the group (its other workers send meanwhile).

        As a revocation does (aiokafka calls no listener on unsubscribe): the requests at the
        provider are answered or reach the gate, the completed prefix is committed, then the
        group is left and the prompts held at the gate are dropped (their next owner sends them).
        The gate holds every request until the worker is in the group again and assigned.
        """
        gone, checkpoint = set(consumer.assignment()), _started(self.checkpoint)
        log.warning("provider %s halted: worker %s hands its %d partition(s) to the group until it answers again",
                    self.settings.provider.label, self.worker_id, len(gone))
        self.halts.hold_for_hand_over()  # ended by the assignment after _rejoin
        timeout_s = self.settings.inference.handover_timeout_s
        unanswered = await self.inflight.hand_over(gone, timeout_s, self.halts.held)
        if unanswered:
            log.warning("leaving the group with %d request(s) unanswered after %.0f s: "
                        "their next owner may pay for them again", unanswered, timeout_s)
        await checkpoint.commit(only=gone)
        consumer.unsubscribe()
        self.in_group = False
        self.inflight.drop_held(set(), self.halts.held)
        checkpoint.reassigned(set())

    async def _process(self, tp: TopicPartition, record: Record) -> None:
        try:
            await _started(self.answers).answer(record, answered=self.inflight.answered)
        except Stopped:
            return  # left uncommitted: the next worker takes it
        except Exception as exc:  # a Kafka failure: stop the worker, commit nothing more
            self.failure = self.failure or _failure_of(exc, record, self._kafka)
            self.stop()
            return
        _started(self.checkpoint).done(tp, record.offset)

    def _fetchable(self, consumer: AIOKafkaConsumer) -> list[TopicPartition] | None:
        """The partitions to take prompts from now; None: all of them (nothing assigned yet, or none short).

        A dataset with a request waiting for headroom is left out here, not paused. aiokafka
        drops a paused partition's fetched records (to fetch them again on resume), and the
        dropped record iterator is a reference cycle holding its decompressed batch until a
        full collection: the headroom's pauses, many a second near a cap, held 1.7 GiB at
        16,000 prompts. A partition left out keeps its one fetch buffered.
        """
        short = self.headroom.short() if self.headroom is not None else set()  # requests wait for room
        assigned = consumer.assignment()
        if not short or not assigned:
            return None
        prefix = self._kafka.topic(PROMPTS_TOPIC_PREFIX)
        paused = consumer.paused()
        return [tp for tp in assigned if tp not in paused and dataset_of_topic(tp.topic, prefix) not in short]

    def apply_pauses(self) -> None:
        """Pause the assigned partitions of halted scopes and resume the others."""
        consumer = self._consumer
        if consumer is None:
            return
        prefix = self._kafka.topic(PROMPTS_TOPIC_PREFIX)
        halt = [tp for tp in consumer.assignment() if self.halts.is_halted(dataset_of_topic(tp.topic, prefix) or "")]
        resume = [tp for tp in consumer.paused() if tp not in halt]
        if halt:
            consumer.pause(*halt)
        if resume:
            consumer.resume(*resume)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no type stubs
    """Commits before partitions go; after, resumes where the worker left off, pauses halted
    partitions again and catches up the response store."""

    def __init__(self, worker: InferenceWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        """Let their requests at the provider be answered, then commit the completed prefix.

        The next owner starts at the committed offset: a prompt still being answered here
        would be paid for again there. A request held at the halt gate sent nothing, and
        from here to the assignment none leaves the gate (a resume or a lease granted
        meanwhile would otherwise send a prompt the next owner sends again).
        """
        worker, gone = self._worker, set(revoked)
        worker.halts.hold_for_hand_over()  # until the assignment says which partitions stay here
        timeout_s = worker.settings.inference.handover_timeout_s
        unanswered = await worker.inflight.hand_over(gone, timeout_s, worker.halts.held)
        if unanswered:
            log.warning("giving up %d partition(s) with %d request(s) unanswered after %.0f s "
                        "([inference] handover_timeout_s): their next owner may pay for them again",
                        len(gone), unanswered, timeout_s)
        if worker.checkpoint is not None:
            await worker.checkpoint.commit(only=gone)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        """Keep the state of partitions still owned (skip their in-flight records), pause, catch up.

        A prompt of a partition gone elsewhere that waits at the halt gate (a halt, or the
        hold since the revocation) is dropped: its new owner reads it again, and both would
        pay for it otherwise.
        """
        owned, worker = set(assigned), self._worker
        try:
            worker.inflight.drop_held(owned, worker.halts.held)
            _started(worker.checkpoint).reassigned(owned)
            worker.apply_pauses()
            if worker.store is not None:
                # Responses another worker paid for just before handing these partitions over.
                await worker.store.catch_up()
        finally:
            worker.halts.end_hand_over()  # the held prompts of partitions still here go on


class InFlight:
    """The prompts being answered, one task each: counted, waited for, drained, cancelled.

    A task holds one of the provider's slots until its request is answered (or it needs
    none); it then publishes without one, so the next prompt's request need not wait for
    the broker's acknowledgements of the last one.
    """

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}  # each task's prompt partition
        self._holding: set[asyncio.Task[None]] = set()
        self._yielded: set[asyncio.Task[None]] = set()  # waiting without a slot (see yield_slot)
        self._freed = asyncio.Event()
        self._slot_event = asyncio.Event()

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def at_provider(self) -> int:
        """Tasks holding a provider slot: requests sent, or waiting to be."""
        return len(self._holding)

    def sending(self, held: Collection[asyncio.Task[Any]]) -> int:
        """Tasks not done and not ``held`` at the gate: a request out, about to go, or its answer being published."""
        return sum(1 for task in self._tasks if not task.done() and task not in held)

    def partitions(self) -> set[TopicPartition]:
        """The partitions of the prompts in flight."""
        return set(self._tasks.values())

    def room(self, slots: int) -> int:
        """How many more prompts may start with ``slots`` provider slots (and twice as many tasks)."""
        return min(slots - len(self._holding), 2 * slots - len(self._tasks))

    def spawn(self, work: Coroutine[Any, Any, None], partition: TopicPartition) -> None:
        """Run ``work`` (a prompt of ``partition``) as one task in flight, holding a slot."""
        task = asyncio.create_task(work)
        self._tasks[task] = partition
        self._holding.add(task)
        task.add_done_callback(self._finished)

    def answered(self) -> None:
        """The calling task's request is answered: its slot is free for the next prompt."""
        task = asyncio.current_task()
        if task in self._holding:
            self._holding.discard(task)
            self._freed.set()
            self._slot_freed()

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self._holding.discard(task)
        self._yielded.discard(task)
        self._freed.set()
        self._slot_freed()

    def yield_slot(self) -> None:
        """The calling task waits (a halt, no headroom): its slot goes to another prompt meanwhile."""
        task = asyncio.current_task()
        if task in self._holding:
            self._holding.discard(task)
            self._yielded.add(task)  # type: ignore[arg-type]
            self._freed.set()
            self._slot_freed()

    async def reclaim_slot(self, slots: int) -> None:
        """Take the calling task's slot back before its request goes out (waits for a free one)."""
        task = asyncio.current_task()
        while task in self._yielded:
            if len(self._holding) < slots:
                self._yielded.discard(task)  # type: ignore[arg-type]
                self._holding.add(task)  # type: ignore[arg-type]
                return
            await self._slot_event.wait()

    def _slot_freed(self) -> None:
        old, self._slot_event = self._slot_event, asyncio.Event()
        old.set()

    async def hand_over(self, partitions: Iterable[TopicPartition], timeout_s: float,
                        held: Collection[asyncio.Task[Any]]) -> int:
        """Let the requests of ``partitions`` be answered (up to ``timeout_s``); how many were not.

        A task ``held`` at the halt gate sent nothing and is not waited for.
        """
        gone = set(partitions)
        mine = {task for task, tp in self._tasks.items() if tp in gone}
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            busy = {task for task in mine if not task.done() and task not in held}
            left = deadline - asyncio.get_running_loop().time()
            if not busy or left <= 0:
                return len(busy)
            # Wake now and then: a request a halt holds back goes to the gate meanwhile.
            await asyncio.wait(busy, timeout=min(left, 0.25), return_when=asyncio.ALL_COMPLETED)

    def drop_held(self, owned: Collection[TopicPartition], held: Collection[asyncio.Task[Any]]) -> int:
        """Cancel the tasks ``held`` at the halt gate whose partition is not ``owned``; how many."""
        gone = [task for task, tp in self._tasks.items() if tp not in owned and task in held]
        for task in gone:
            task.cancel()
        if gone:
            log.info("dropped %d prompt(s) held at the gate: their partitions went to another worker", len(gone))
        return len(gone)

    def wake(self) -> None:
        """End a :meth:`wait_for_room` early (to see a stop)."""
        self._freed.set()

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until a task finishes, :meth:`wake` is called, or ``timeout_s`` passes."""
        self._freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._freed.wait(), timeout=timeout_s)

    async def drain(self, timeout_s: float, abort: asyncio.Event) -> None:
        """Let the tasks finish (up to ``timeout_s``, or until ``abort`` is set), then cancel the rest."""
        if self._tasks and not abort.is_set():
            log.info("stopping: letting %d request(s) in flight finish (up to %.0f s; signal again to stop at once)",
                     len(self._tasks), timeout_s)
            finished = asyncio.ensure_future(asyncio.wait(list(self._tasks), timeout=timeout_s))
            aborted = asyncio.ensure_future(abort.wait())
            await asyncio.wait({finished, aborted}, return_when=asyncio.FIRST_COMPLETED)
            for waiter in (finished, aborted):
                waiter.cancel()
            await asyncio.gather(finished, aborted, return_exceptions=True)
        if self._tasks:
            log.warning("cancelling %d request(s) still in flight at shutdown", len(self._tasks))
        await self.cancel()

    async def cancel(self) -> None:
        """Cancel every task and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class _Progress:
    """Consumer lag every 5 s and a progress line every ``inference.progress_interval_s``."""

    def __init__(self, worker: InferenceWorker) -> None:
        self._worker = worker
        self._every = worker.settings.inference.progress_interval_s
        self._next_lag = 0.0
        self._next_line = time.monotonic() + self._every
        self._since, self._done_before = time.monotonic(), 0
        self._lag = 0

    async def tick(self, consumer: AIOKafkaConsumer) -> None:
        """Report what is due."""
        now = time.monotonic()
        if now >= self._next_lag:
            self._lag = sum((await report_lag(consumer, self._worker.group_id)).values())
            self._next_lag = now + 5.0
        if self._every and now >= self._next_line:
            self._line(now)
            self._next_line = now + self._every

    def _line(self, now: float) -> None:
        worker, answers = self._worker, _started(self._worker.answers)
        done = answers.responded + answers.reused + answers.dead_lettered
        throttle = _started(worker.guard).throttle
        pace = f"{throttle.pace:.1f}/s" if throttle.pace is not None else "none"
        log.info(
            "inference progress: %.1f prompt(s)/s; %d paid response(s), %d reused, %d dead letter(s); "
            "%d in flight: %d open at the provider, %d waiting for the pace (%s, window %d); lag %d; halted: %s",
            (done - self._done_before) / max(now - self._since, 1e-9),
            answers.responded,
            answers.reused,
            answers.dead_lettered,
            len(worker.inflight),
            throttle.open,
            throttle.waiting,
            pace,
            throttle.window,
            self._lag,
            ", ".join(worker.halts.scopes()) or "none",
        )
        self._since, self._done_before = now, done


def _failure_of(exc: Exception, record: Record, kafka: KafkaSettings) -> BaseException:
    """Why the worker stops on a prompt: a refused write (the reads were allowed at start)
    becomes an :class:`AccessDenied` naming the ACL; the prompt stays uncommitted either way."""
    if isinstance(exc, AUTHORIZATION_ERRORS):
        log.error("inference stopped on %s:%d@%d", record.topic, record.partition, record.offset)
        return access_denied(exc, kafka, "WRITE")
    log.exception("inference failed on %s:%d@%d", record.topic, record.partition, record.offset)
    return exc


def _started(obj: T | None) -> T:
    if obj is None:
        raise RuntimeError("start() the worker first")
    return obj


def create_app(
    settings: Settings,
    *,
    http_client: httpx.AsyncClient | None = None,
    provider: Provider | None = None,
    worker_id: str | None = None,
    repay: bool = False,
    probe: ProbeHook | None = None,
) -> InferenceWorker:
    """The inference worker, wired from settings (tests may inject an HTTP client).

    ``repay`` sends every request again even when its response was paid for already; ``probe``
    runs ``[inference] probe_first`` (required when that setting is on).
    """
    return InferenceWorker(
        settings, http_client=http_client, provider=provider, worker_id=worker_id, repay=repay, probe=probe
    )
