"""The inference worker: prompts.* → provider → responses / dead-letter, stoppable by halts.

Written on aiokafka directly rather than FastStream: FastStream 0.7 refuses pattern
subscriptions with concurrent workers, processes a partition sequentially and has no
pause API, while this stage needs a thousand requests in flight across out-of-order
completions, per-partition pauses that survive rebalances, and commits of the completed
prefix only.

Delivery: a prompt's offset is committed only once its response (or dead letter) is
acknowledged by the broker; the committed offset of a partition is the lowest offset
still in flight (see :class:`~services.inference.core.OffsetTracker`). A crash replays
the unfinished prompts (at least once; downstream stages are idempotent by key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Iterable
from typing import Any, TypeAlias

import httpx
import stamina
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from schemas import (
    CONTROL_TOPIC,
    DEAD_LETTER_TOPIC,
    GLOBAL_SCOPE,
    PROMPTS_TOPIC_PREFIX,
    REQUESTS_TOPIC,
    RESPONSES_TOPIC,
    Halt,
    PromptPublished,
    ResponseReceived,
    SchemaError,
    decode_control,
    encode,
    sample_key,
)
from services.common.config import DatasetSettings, KafkaSettings, Settings
from services.common.kafka import (
    DeadLetter,
    dead_letter,
    ensure_topics,
    make_admin,
    make_consumer,
    make_producer,
    report_lag,
)
from services.common.metrics import (
    DEAD_LETTERS,
    HALTED,
    INFLIGHT,
    REQUEST_LATENCY,
    REQUESTS,
    RESPONSES,
    RETRIES,
)
from services.inference.adapters.providers import Provider, make_http_client, make_provider
from services.inference.core import (
    GROUP_ID,
    STAGE,
    HaltState,
    OffsetTracker,
    ProviderFailure,
    ProviderResult,
    backoff_for,
    check_prompt,
    dataset_of_topic,
    dead_letter_for,
    request_max_tokens,
    request_started,
    response_event,
)

log = logging.getLogger(__name__)

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"


class _Stopped(Exception):  # noqa: N818 - internal control flow, never escapes a task
    """The worker is stopping: do not start another request for this prompt."""


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Commits before partitions go, keeps in-flight state and re-applies pauses after."""

    def __init__(self, worker: InferenceWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        """Commit the completed prefix of the partitions being taken away."""
        await self._worker.commit(only=set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        """Resume where this worker left off and pause halted partitions again."""
        self._worker.on_assigned(set(assigned))


class InferenceWorker:
    """Consumes prompts, calls the provider with many requests in flight, publishes answers."""

    def __init__(
        self,
        settings: Settings,
        *,
        http_client: httpx.AsyncClient | None = None,
        provider: Provider | None = None,
        worker_id: str | None = None,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.settings = settings
        self._kafka = settings.kafka
        self._http: httpx.AsyncClient | None = http_client
        self._own_http = http_client is None
        self._provider = provider
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._drain_timeout_s = drain_timeout_s
        self._prompts_prefix = self._kafka.topic(PROMPTS_TOPIC_PREFIX)
        # The topic prefix namespaces a deployment, so it namespaces the group too.
        self.group_id = self._kafka.topic(GROUP_ID)
        self._topics = {
            name: self._kafka.topic(name)
            for name in (REQUESTS_TOPIC, RESPONSES_TOPIC, DEAD_LETTER_TOPIC, CONTROL_TOPIC)
        }
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._control: AIOKafkaConsumer | None = None
        self._control_task: asyncio.Task[None] | None = None
        self._tracker = OffsetTracker()
        self._halts = HaltState()
        self._state_changed = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._halt_published = False
        self._gauge_scopes: set[str] = set()
        self.completed = 0

    # --- lifecycle -------------------------------------------------------------------

    @property
    def provider(self) -> Provider:
        """The provider client (available after :meth:`start`)."""
        if self._provider is None:
            raise RuntimeError("start() the worker first")
        return self._provider

    @property
    def inflight(self) -> int:
        """Prompts taken and not yet finished (bounded by ``provider.concurrency``)."""
        return len(self._tasks)

    def assigned_partitions(self) -> set[TopicPartition]:
        """Prompt partitions this worker owns."""
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    def paused_partitions(self) -> set[TopicPartition]:
        """Prompt partitions paused by a halt."""
        return set(self._consumer.paused()) if self._consumer is not None else set()

    @property
    def halted_scopes(self) -> list[str]:
        """Scopes currently halted, as this worker sees them."""
        return self._halts.scopes()

    async def start(self) -> None:
        """Create topics, load the standing halts, then join the prompts consumer group."""
        await ensure_topics(self._kafka, self.settings.datasets)
        if self._http is None:
            self._http = make_http_client(self.settings)
        if self._provider is None:
            self._provider = make_provider(self.settings, self._http)
        self._producer = make_producer(self._kafka)
        await self._producer.start()
        await self._load_control()
        # The global halt gauge exists from the start (0 unless halted), so the "halt in
        # force" annotation and alert see a series on a run that never halts.
        HALTED.labels(scope=GLOBAL_SCOPE).set(1 if GLOBAL_SCOPE in self._halts.scopes() else 0)
        self._gauge_scopes.add(GLOBAL_SCOPE)
        self._control_task = asyncio.create_task(self._follow_control(), name="inference-control")
        # Pattern subscriptions discover new prompts.<dataset> topics on metadata refresh.
        self._consumer = make_consumer(self._kafka, group_id=self.group_id, metadata_max_age_ms=10_000)
        pattern = "^" + re.escape(self._prompts_prefix) + r"[A-Za-z0-9._-]+$"
        self._consumer.subscribe(pattern=pattern, listener=_Rebalance(self))
        await self._consumer.start()
        log.info("inference worker %s started (halted: %s)", self.worker_id, self._halts.scopes() or "none")

    def stop(self) -> None:
        """Stop taking prompts; requests in flight finish and are published."""
        self._stopping.set()
        self._signal_state_change()
        self._slot_freed.set()

    async def close(self) -> None:
        """Cancel what is left and release the Kafka and HTTP clients."""
        self._stopping.set()
        await self._cancel_tasks()
        if self._control_task is not None:
            self._control_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._control_task
        for client in (self._consumer, self._control):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()
        if self._http is not None and self._own_http:
            await self._http.aclose()

    async def run(self) -> None:
        """Fetch prompts while there is room in flight; commit the completed prefix."""
        consumer = self._require(self._consumer)
        concurrency = self.settings.provider.concurrency
        next_lag = 0.0
        try:
            while not self._stopping.is_set():
                if self._failure is not None:
                    raise self._failure
                free = concurrency - len(self._tasks)
                if free <= 0:
                    # Bounded memory: no fetch until a request finishes.
                    self._slot_freed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._slot_freed.wait(), timeout=0.5)
                    await self.commit()
                    continue
                # Cheap insurance beside the rebalance listener: halted partitions stay paused.
                self.apply_pauses()
                batches = await consumer.getmany(timeout_ms=200, max_records=free)
                for tp, records in batches.items():
                    for record in records:
                        self._tracker.take(tp, record.offset)
                        self._spawn(tp, record)
                await self.commit()
                if time.monotonic() >= next_lag:
                    await self._report_lag(consumer)
                    next_lag = time.monotonic() + 5.0
            if self._failure is not None:
                raise self._failure
        finally:
            await self._drain()
            await self.commit()

    # --- halts ------------------------------------------------------------------------

    async def _load_control(self) -> None:
        """Read the compacted control topic to its end before any prompt is fetched."""
        topic = self._topics[CONTROL_TOPIC]
        control = make_consumer(self._kafka, group_id=None)
        self._control = control
        await control.start()
        partitions = await topic_partitions(self._kafka, topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        control.assign(tps)
        await control.seek_to_beginning(*tps)
        end = await control.end_offsets(tps)
        deadline = time.monotonic() + 120.0
        while any([await control.position(tp) < end[tp] for tp in tps]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not read {topic} to its end within 120 s")
            batches = await control.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    self._apply_control(record)
        self._on_halts_changed()

    async def _follow_control(self) -> None:
        control = self._require(self._control)
        while True:
            try:
                batches = await control.getmany(timeout_ms=500)
            except KafkaError:
                log.exception("control consumer failed; retrying")
                await asyncio.sleep(1.0)
                continue
            changed = False
            for records in batches.values():
                for record in records:
                    changed |= self._apply_control(record)
            if changed:
                self._on_halts_changed()

    def _apply_control(self, record: Record) -> bool:
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
        changed = self._halts.apply(event)
        if changed:
            log.warning(
                "%s %s (by %s): %s", type(event).__name__.lower(), event.scope, event.by or "?", event.reason
            )
        return changed

    def _on_halts_changed(self) -> None:
        halted = set(self._halts.scopes())
        for scope in halted:
            HALTED.labels(scope=scope).set(1)
        for scope in self._gauge_scopes - halted:
            HALTED.labels(scope=scope).set(0)
        self._gauge_scopes = self._gauge_scopes | halted
        if GLOBAL_SCOPE not in halted:
            self._halt_published = False
        self.apply_pauses()
        self._signal_state_change()

    def _signal_state_change(self) -> None:
        old, self._state_changed = self._state_changed, asyncio.Event()
        old.set()

    def _dataset_of(self, topic: str) -> str:
        return dataset_of_topic(topic, self._prompts_prefix) or ""

    def apply_pauses(self) -> None:
        """Pause the assigned partitions of halted scopes and resume the others."""
        consumer = self._consumer
        if consumer is None:
            return
        assigned = consumer.assignment()
        paused = consumer.paused()
        halt = [tp for tp in assigned if self._halts.is_halted(self._dataset_of(tp.topic))]
        resume = [tp for tp in assigned if tp in paused and tp not in halt]
        if halt:
            consumer.pause(*halt)
        if resume:
            consumer.resume(*resume)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """After a rebalance: keep state of partitions still owned, skip their in-flight records."""
        consumer = self._require(self._consumer)
        lost = [tp for tp in self._tracker.partitions() if tp not in assigned]
        self._tracker.forget(lost)
        for tp in assigned:
            position = self._tracker.next_offset(tp)
            if position is not None:
                consumer.seek(tp, position)
        self.apply_pauses()

    async def _gate(self, *scopes: str) -> None:
        """Wait while a halt stands for any of ``scopes``; raise _Stopped when stopping."""
        while True:
            if self._stopping.is_set():
                raise _Stopped
            if not self._halts.is_halted(*scopes):
                return
            await self._state_changed.wait()

    async def _halt_globally(self, failure: ProviderFailure) -> None:
        """A 401/402 means no prompt can succeed: halt every worker until a person resumes."""
        halt = Halt(
            scope=GLOBAL_SCOPE,
            reason=f"provider HTTP {failure.http_status}: {failure.message[:300]}",
            by=STAGE,
            at=time.time(),
        )
        first = self._halts.apply(halt)
        if first:
            self._on_halts_changed()
        if self._halt_published:
            return
        self._halt_published = True
        log.error("provider refused the account (HTTP %s): halting globally", failure.http_status)
        producer = self._require(self._producer)
        await (await producer.send(self._topics[CONTROL_TOPIC], encode(halt), key=GLOBAL_SCOPE.encode()))

    # --- per prompt -------------------------------------------------------------------

    def _spawn(self, tp: TopicPartition, record: Record) -> None:
        task = asyncio.create_task(self._process(tp, record))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slot_freed.set()

    async def _process(self, tp: TopicPartition, record: Record) -> None:
        try:
            await self._handle(record)
        except _Stopped:
            return  # left uncommitted: the next worker takes it
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a Kafka failure: stop the worker, commit nothing more
            log.exception("inference failed on %s:%d@%d", record.topic, record.partition, record.offset)
            if self._failure is None:
                self._failure = exc
            self.stop()
            return
        self._tracker.done(tp, record.offset)
        self.completed += 1

    async def _handle(self, record: Record) -> None:
        verdict = check_prompt(
            record.value,
            max_prompt_chars=self.settings.provider.max_prompt_chars,
            topic_dataset=self._dataset_of(record.topic) or None,
        )
        if isinstance(verdict, DeadLetter):
            await self._dead_letter(record, verdict, dataset=self._dataset_of(record.topic))
            return
        prompt = verdict
        topic_dataset = self._dataset_of(record.topic)
        if topic_dataset and prompt.dataset != topic_dataset:
            # A prompt for another dataset would be answered and billed under the wrong budget.
            mismatch = DeadLetter(
                "dataset_mismatch", f"prompt of dataset {prompt.dataset!r} on the topic of {topic_dataset!r}"
            )
            await self._dead_letter(record, mismatch, dataset=topic_dataset)
            return
        dataset = self.settings.dataset(prompt.dataset)
        max_tokens = request_max_tokens(prompt, dataset.max_tokens)
        scopes = (prompt.dataset,)
        while True:
            try:
                result, attempt, latency = await self._call(prompt, dataset, max_tokens, scopes)
            except ProviderFailure as failure:
                if failure.fatal:
                    await self._halt_globally(failure)
                    continue  # waits at the gate until resumed, then starts over
                await self._dead_letter(record, failure_verdict(failure), dataset=prompt.dataset)
                return
            except _Stopped:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug in a provider adapter is one bad prompt
                log.exception("provider adapter failed on %s", sample_key(prompt.dataset, prompt.sample_id))
                verdict = DeadLetter("inference_internal_error", f"{type(exc).__name__}: {exc}")
                await self._dead_letter(record, verdict, dataset=prompt.dataset)
                return
            break
        event = self._response(prompt, dataset, result, max_tokens, latency, attempt)
        producer = self._require(self._producer)
        key = sample_key(prompt.dataset, prompt.sample_id).encode()
        await (await producer.send(self._topics[RESPONSES_TOPIC], encode(event), key=key))
        RESPONSES.labels(dataset=prompt.dataset).inc()

    def _response(
        self,
        prompt: PromptPublished,
        dataset: DatasetSettings,
        result: ProviderResult,
        max_tokens: int,
        latency: float,
        attempt: int,
    ) -> ResponseReceived:
        return response_event(
            prompt,
            result,
            provider=self.provider.name,
            model=self.settings.provider.model,
            profile=dataset.profile,
            tools_sent=self.provider.tools_sent(prompt, dataset),
            max_tokens=max_tokens,
            latency_s=latency,
            attempt=attempt,
            now=time.time(),
        )

    def _backoff_hook(self, exc: Exception) -> bool | float:
        if isinstance(exc, ProviderFailure):
            return backoff_for(exc, self.settings.provider.backoff_max_s)
        return False

    async def _call(
        self, prompt: PromptPublished, dataset: DatasetSettings, max_tokens: int, scopes: tuple[str, ...]
    ) -> tuple[ProviderResult, int, float]:
        """One provider call with retries (stamina: exponential backoff, jitter, Retry-After)."""
        cfg = self.settings.provider
        provider = self.provider
        producer = self._require(self._producer)
        number = 0
        async for attempt in stamina.retry_context(
            on=self._backoff_hook,
            attempts=cfg.max_attempts,
            timeout=None,
            wait_initial=cfg.backoff_initial_s,
            wait_max=cfg.backoff_max_s,
            wait_jitter=cfg.backoff_initial_s,
        ):
            with attempt:
                number = attempt.num
                key = sample_key(prompt.dataset, prompt.sample_id).encode()
                while True:
                    await self._gate(*scopes)
                    started = request_started(
                        prompt, max_tokens=max_tokens, worker=self.worker_id, attempt=number, now=time.time()
                    )
                    await (await producer.send(self._topics[REQUESTS_TOPIC], encode(started), key=key))
                    # A halt that arrived while the broker acknowledged must still stop this request.
                    if not self._halts.is_halted(*scopes):
                        break
                inflight = INFLIGHT.labels(dataset=prompt.dataset)
                inflight.inc()
                t0 = time.monotonic()
                try:
                    result = await provider.complete(prompt, dataset, max_tokens=max_tokens)
                except ProviderFailure as failure:
                    failure.attempt = number
                    REQUESTS.labels(provider=provider.name, outcome=failure.reason).inc()
                    if failure.retryable and number < cfg.max_attempts:
                        RETRIES.labels(provider=provider.name, reason=failure.reason).inc()
                    raise
                finally:
                    latency = time.monotonic() - t0
                    inflight.dec()
                    REQUEST_LATENCY.labels(provider=provider.name).observe(latency)
                REQUESTS.labels(provider=provider.name, outcome="ok").inc()
                return result, number, latency
        raise AssertionError("unreachable: stamina re-raises the last failure")  # pragma: no cover

    async def _dead_letter(self, record: Record, verdict: DeadLetter, *, dataset: str) -> None:
        out = dead_letter(
            dlq_topic=self._topics[DEAD_LETTER_TOPIC],
            stage=STAGE,
            verdict=verdict,
            value=record.value,
            key=record.key,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            in_headers=list(record.headers or ()),
            dataset=dataset or None,
        )
        producer = self._require(self._producer)
        await (await producer.send(out.topic, out.value, key=out.key, headers=out.headers))
        DEAD_LETTERS.labels(stage=STAGE, reason=verdict.reason).inc()

    # --- offsets ----------------------------------------------------------------------

    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        """Commit, per partition, the offset below which every prompt's output is durable."""
        consumer = self._consumer
        if consumer is None:
            return
        offsets: dict[Any, int] = {
            tp: off for tp, off in self._tracker.to_commit().items() if only is None or tp in only
        }
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # e.g. a rebalance in progress: the next commit carries it
            log.warning("commit of %d partition(s) failed: %s", len(offsets), exc)
            return
        self._tracker.committed(offsets)

    async def _drain(self) -> None:
        """Let requests in flight finish (bounded), then cancel the rest."""
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=self._drain_timeout_s)
            if pending:
                log.warning("cancelling %d request(s) still in flight at shutdown", len(pending))
        await self._cancel_tasks()

    async def _cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _report_lag(self, consumer: AIOKafkaConsumer) -> None:
        await report_lag(consumer, self.group_id)

    @staticmethod
    def _require(obj: Any) -> Any:
        if obj is None:
            raise RuntimeError("start() the worker first")
        return obj


async def topic_partitions(kafka: KafkaSettings, topic: str, timeout_s: float = 60.0) -> list[int]:
    """The partition numbers of ``topic``, waiting (bounded) until each has a leader."""
    admin = make_admin(kafka)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            (described,) = await admin.describe_topics([topic])
            found = described.get("partitions") or []
            if described.get("error_code") == 0 and found and all(p.get("leader", -1) >= 0 for p in found):
                return sorted(int(p["partition"]) for p in found)
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic} is not ready (no partitions with a leader)")
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


def failure_verdict(failure: ProviderFailure) -> DeadLetter:
    """The dead letter for a provider failure after the last attempt."""
    return dead_letter_for(failure, failure.attempt)


def create_app(
    settings: Settings,
    *,
    http_client: httpx.AsyncClient | None = None,
    provider: Provider | None = None,
    worker_id: str | None = None,
) -> InferenceWorker:
    """The inference worker, wired from settings (tests may inject an HTTP client)."""
    return InferenceWorker(settings, http_client=http_client, provider=provider, worker_id=worker_id)
