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

Money: a request already paid for is never sent again. Every paid response is written
to the compacted ``response-store`` topic under its request key (dataset, sample id and
the hash of the exact request, :mod:`services.inference.store`); a prompt seen again (a
re-publish, a restart, a rebalance, a replay ``--to inference``) is answered from there
and re-published with ``reused=True``, which the budget does not count again. ``--repay``
(or the ``draftstream.inference.repay`` header on a prompt) pays again on purpose.
Before the first paid request every dataset's profile and the provider are checked
(pre-flight); a failure halts the scope on ``control`` instead of paying for answers
that cannot be used. An outage (``provider.outage_after`` connection errors, timeouts,
5xx or 404s in a row) halts every worker instead of draining the topic into dead
letters, and a probe resumes by itself when the provider answers again.
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
import msgspec
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
    Resume,
    SchemaError,
    decode_control,
    encode,
    sample_key,
)
from services.common.acls import used_topics
from services.common.config import DatasetSettings, Settings
from services.common.kafka import (
    AUTHORIZATION_ERRORS,
    access_denied,
    dead_letter_of,
    ensure_topics,
    make_consumer,
    make_producer,
    refused_as,
    report_lag,
)
from services.common.metrics import (
    DEAD_LETTERS,
    HALTED,
    INFLIGHT,
    PROVIDER_OUTAGES,
    REQUEST_LATENCY,
    REQUESTS,
    RESPONSES,
    RESPONSES_REUSED,
    RETRIES,
)
from services.common.records import DeadLetter
from services.common.topics import catch_up, ready_partitions
from services.inference.adapters.providers import Provider, make_http_client, make_provider
from services.inference.core import (
    GROUP_ID,
    OUTAGE_ACTOR,
    PREFLIGHT_ACTOR,
    STAGE,
    HaltState,
    NotSent,
    OffsetTracker,
    OutageDetector,
    ProviderCheck,
    ProviderFailure,
    ProviderResult,
    backoff_for,
    check_prompt,
    dataset_of_topic,
    dead_letter_for,
    is_outage_failure,
    outage_reason,
    request_hash,
    request_max_tokens,
    request_started,
    response_event,
    store_key,
    wants_repay,
)
from services.inference.store import ResponseStore

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
        """Resume where this worker left off, pause halted partitions again, catch up the store."""
        self._worker.on_assigned(set(assigned))
        # Responses another worker paid for just before handing these partitions over.
        await self._worker.store_catch_up()


class InferenceWorker:
    """Consumes prompts, calls the provider with many requests in flight, publishes answers."""

    def __init__(
        self,
        settings: Settings,
        *,
        http_client: httpx.AsyncClient | None = None,
        provider: Provider | None = None,
        worker_id: str | None = None,
        drain_timeout_s: float | None = None,
        repay: bool = False,
    ) -> None:
        self.settings = settings
        self._kafka = settings.kafka
        self._http: httpx.AsyncClient | None = http_client
        self._own_http = http_client is None
        self._provider = provider
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._drain_timeout_s = settings.inference.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.repay = repay
        self._prompts_prefix = self._kafka.topic(PROMPTS_TOPIC_PREFIX)
        # The topic prefix namespaces a deployment, so it namespaces the group too.
        self.group_id = self._kafka.group(GROUP_ID)
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
        self._store: ResponseStore | None = None
        self._pending: dict[str, asyncio.Future[None]] = {}
        self._outage = OutageDetector(settings.provider.outage_after)
        self._outage_published = False
        self._probe_task: asyncio.Task[None] | None = None
        self._checked: dict[str, bool] = {}
        self._check_lock = asyncio.Lock()
        self._abort = asyncio.Event()
        self._lag = 0
        self.completed = 0
        self.responded = 0
        self.reused = 0
        self.dead_lettered = 0
        self.preflight: dict[str, ProviderCheck] = {}

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
        await ensure_topics(self._kafka, self.settings.datasets, needed=used_topics(STAGE))
        if self._http is None:
            self._http = make_http_client(self.settings)
        if self._provider is None:
            self._provider = make_provider(self.settings, self._http)
        self._producer = make_producer(self._kafka)
        with refused_as(self._kafka, "WRITE"):
            await self._producer.start()
        with refused_as(self._kafka, "READ"):
            await self._load_control()
        # The global halt gauge exists from the start (0 unless halted), so the "halt in
        # force" annotation and alert see a series on a run that never halts.
        HALTED.labels(scope=GLOBAL_SCOPE).set(1 if GLOBAL_SCOPE in self._halts.scopes() else 0)
        self._gauge_scopes.add(GLOBAL_SCOPE)
        self._control_task = asyncio.create_task(self._follow_control(), name="inference-control")
        await self._preflight()
        if self.settings.inference.reuse_responses:
            store = ResponseStore(self._kafka, self._producer)
            self._store = store
            with refused_as(self._kafka, "READ"):
                partitions = await ready_partitions(self._kafka, store.topic)
                await store.start(partitions, self.settings.inference.store_load_timeout_s)
        self._probe_task = asyncio.create_task(self._probe_loop(), name="inference-probe")
        # Pattern subscriptions discover new prompts.<dataset> topics on metadata refresh.
        self._consumer = make_consumer(self._kafka, group_id=self.group_id, metadata_max_age_ms=10_000)
        pattern = "^" + re.escape(self._prompts_prefix) + r"[A-Za-z0-9._-]+$"
        self._consumer.subscribe(pattern=pattern, listener=_Rebalance(self))
        with refused_as(self._kafka, "READ"):
            await self._consumer.start()
        log.info(
            "inference worker %s started (halted: %s; %s)",
            self.worker_id,
            self._halts.scopes() or "none",
            "paying again for every request (--repay)"
            if self.repay
            else (f"{len(self._store)} paid response(s) in the store" if self._store is not None else "no store"),
        )

    def stop(self) -> None:
        """Stop taking prompts; requests in flight finish (bounded) and are published."""
        self._stopping.set()
        self._signal_state_change()
        self._slot_freed.set()

    def stop_now(self) -> None:
        """Stop without waiting for requests in flight (a second Ctrl-C): they are cancelled."""
        self._abort.set()
        self.stop()

    async def close(self) -> None:
        """Cancel what is left and release the Kafka and HTTP clients."""
        self._stopping.set()
        await self._cancel_tasks()
        for task in (self._control_task, self._probe_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._store is not None:
            await self._store.close()
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
        progress_every = self.settings.inference.progress_interval_s
        next_progress = time.monotonic() + progress_every
        last_progress = (time.monotonic(), 0)
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
                with refused_as(self._kafka, "READ"):
                    batches = await consumer.getmany(timeout_ms=200, max_records=free)
                for tp, records in batches.items():
                    for record in records:
                        self._tracker.take(tp, record.offset)
                        self._spawn(tp, record)
                await self.commit()
                if time.monotonic() >= next_lag:
                    await self._report_lag(consumer)
                    next_lag = time.monotonic() + 5.0
                if progress_every and time.monotonic() >= next_progress:
                    last_progress = self._log_progress(*last_progress)
                    next_progress = time.monotonic() + progress_every
            if self._failure is not None:
                raise self._failure
        finally:
            await self._drain()
            await self.commit()

    # --- halts ------------------------------------------------------------------------

    async def _load_control(self) -> None:
        """Read the compacted control topic to its end before any prompt is fetched.

        The same consumer then follows the topic (:meth:`_follow_control`).
        """
        topic = self._topics[CONTROL_TOPIC]
        control = make_consumer(self._kafka, group_id=None)
        self._control = control
        await control.start()
        tps = [TopicPartition(topic, p) for p in await ready_partitions(self._kafka, topic)]
        control.assign(tps)
        await catch_up(control, tps, self._apply_control, past_end=True)
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

    async def _publish_control(self, event: Halt | Resume) -> None:
        """Apply a control event here at once, then publish it for every worker (acknowledged)."""
        if self._halts.apply(event):
            self._on_halts_changed()
        if isinstance(event, Halt):
            log.error("halting %s (by %s): %s", event.scope, event.by, event.reason)
        else:
            log.warning("resuming %s (by %s): %s", event.scope, event.by, event.reason)
        producer = self._require(self._producer)
        await (await producer.send(self._topics[CONTROL_TOPIC], encode(event), key=event.scope.encode()))

    async def _resume_own(self, scope: str, actors: tuple[str, ...], reason: str, by: str) -> None:
        """Lift a standing halt of ``scope`` when one of ``actors`` published it (never a person's)."""
        standing = self._halts.halted.get(scope)
        if standing is not None and standing.by in actors:
            await self._publish_control(Resume(scope=scope, reason=reason, by=by, at=time.time()))

    # --- pre-flight, outages ------------------------------------------------------------

    async def _preflight(self) -> None:
        """Before the first paid request: every dataset's profile, then the provider itself.

        A dataset whose profile cannot be loaded (unknown name, missing tokenizer, special
        ids that disagree) is halted with the reason; the provider's reachability, key and
        model decide the global scope. A halt this check published earlier is lifted once
        the check passes (a corrected configuration needs no manual resume).
        """
        for name in sorted(self.settings.datasets):
            await self._check_dataset(name)
        check = await self.provider.check()
        self.preflight[GLOBAL_SCOPE] = check
        base = self.settings.provider.base_url
        if check.ok:
            log.info("pre-flight: provider %s at %s answers: %s", self.provider.name, base, check.detail or "ok")
            await self._resume_own(
                GLOBAL_SCOPE, (PREFLIGHT_ACTOR, OUTAGE_ACTOR), "pre-flight passed", PREFLIGHT_ACTOR
            )
            return
        log.error("pre-flight: provider %s at %s: %s", self.provider.name, base, check.message)
        standing = self._halts.halted.get(GLOBAL_SCOPE)
        by = OUTAGE_ACTOR if check.outage else PREFLIGHT_ACTOR
        if standing is not None and standing.by not in (PREFLIGHT_ACTOR, OUTAGE_ACTOR):
            return  # a person's or the budget's halt stands already; it is not replaced
        await self._publish_control(
            Halt(scope=GLOBAL_SCOPE, reason=f"pre-flight: {check.message}", by=by, at=time.time())
        )
        if check.outage:
            self._outage_published = True

    async def _check_dataset(self, name: str) -> bool:
        """Load and verify the dataset's profile once; halt the dataset when it cannot be used."""
        async with self._check_lock:
            if name in self._checked:
                return self._checked[name]
            from services.profiles import load_profile

            profile = self.settings.dataset(name).profile
            try:
                await asyncio.to_thread(load_profile, profile, self.settings)
            except Exception as exc:  # noqa: BLE001 - any failure to load means: do not pay for it
                code = getattr(exc, "reason", type(exc).__name__)
                message = f"pre-flight: dataset {name}: profile {profile!r} cannot be used ({code}): {exc}"
                self.preflight[name] = ProviderCheck(ok=False, reason=str(code), message=message)
                self._checked[name] = False
                standing = self._halts.halted.get(name)
                if standing is None or standing.by == PREFLIGHT_ACTOR:
                    await self._publish_control(Halt(scope=name, reason=message, by=PREFLIGHT_ACTOR, at=time.time()))
                return False
            self.preflight[name] = ProviderCheck(ok=True, detail=f"profile {profile} loaded")
            self._checked[name] = True
            await self._resume_own(
                name, (PREFLIGHT_ACTOR,), f"pre-flight passed: profile {profile} loads", PREFLIGHT_ACTOR
            )
            return True

    async def _halt_outage(self) -> None:
        """Enough outage-class failures in a row: halt every worker (the probe resumes)."""
        if self._outage_published:
            return
        standing = self._halts.halted.get(GLOBAL_SCOPE)
        self._outage_published = True
        reason = outage_reason(self._outage, self.settings.provider.base_url)
        PROVIDER_OUTAGES.labels(reason=self._outage.last.reason if self._outage.last else "unknown").inc()
        if standing is not None:
            log.error("provider outage while %s is halted already: %s", GLOBAL_SCOPE, reason)
            return
        await self._publish_control(Halt(scope=GLOBAL_SCOPE, reason=reason, by=OUTAGE_ACTOR, at=time.time()))

    async def _probe_loop(self) -> None:
        """While an outage halt stands, check the provider every few seconds; resume when it answers."""
        interval = self.settings.provider.probe_interval_s
        while True:
            await asyncio.sleep(interval)
            standing = self._halts.halted.get(GLOBAL_SCOPE)
            if standing is None or standing.by != OUTAGE_ACTOR:
                self._outage_published = False if standing is None else self._outage_published
                continue
            try:
                check = await self.provider.check()
            except Exception:  # noqa: BLE001 - a probe that crashes is a probe that failed
                log.exception("provider probe failed")
                continue
            if not check.ok:
                log.warning(
                    "provider still unavailable (%s): %s; next probe in %.0f s", check.reason, check.message, interval
                )
                continue
            # The probe's answer counts as one: a prompt that still fails after it fails
            # on its own (a dead letter), not because the provider is down.
            self._outage.success(self._outage.begin())
            self._outage_published = False
            try:
                await self._publish_control(
                    Resume(
                        scope=GLOBAL_SCOPE,
                        reason=f"provider answers again: {check.detail or 'ok'}",
                        by=OUTAGE_ACTOR,
                        at=time.time(),
                    )
                )
            except KafkaError:
                log.exception("could not publish the resume after the outage; retrying")

    async def store_catch_up(self) -> None:
        """Index every response written to the store so far (after partitions moved here)."""
        if self._store is not None:
            await self._store.catch_up()

    def _log_progress(self, since: float, done_before: int) -> tuple[float, int]:
        now = time.monotonic()
        done = self.responded + self.reused + self.dead_lettered
        rate = (done - done_before) / max(now - since, 1e-9)
        log.info(
            "inference progress: %.1f prompt(s)/s; %d paid response(s), %d reused, %d dead letter(s); "
            "%d in flight; lag %d; halted: %s",
            rate,
            self.responded,
            self.reused,
            self.dead_lettered,
            len(self._tasks),
            self._lag,
            ", ".join(self._halts.scopes()) or "none",
        )
        return now, done

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
        except AUTHORIZATION_ERRORS as exc:
            # Per prompt the worker writes (its reads were allowed at start). The prompt stays
            # uncommitted: once the ACLs allow the write, it is processed again.
            log.error("inference stopped on %s:%d@%d", record.topic, record.partition, record.offset)
            if self._failure is None:
                self._failure = access_denied(exc, self._kafka, "WRITE")
            self.stop()
            return
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
        dataset = self.settings.dataset(prompt.dataset)
        max_tokens = request_max_tokens(prompt, dataset.max_tokens)
        if prompt.dataset not in self._checked:
            await self._check_dataset(prompt.dataset)  # a dataset the configuration does not name
        digest = request_hash(self.provider.request_identity(prompt, dataset, max_tokens=max_tokens))
        key = store_key(prompt.dataset, prompt.sample_id, digest)
        repay = self.repay or wants_repay(record.headers)
        if self._store is not None and not repay:
            earlier = self._pending.get(key)
            if earlier is not None:
                await asyncio.shield(earlier)  # the same request is in flight here: wait for its answer
            stored = await self._store.get(key)
            if stored is not None:
                await self._reuse(stored)
                return
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[key] = mine
        try:
            await self._pay(record, prompt, dataset, max_tokens, digest, key)
        finally:
            if self._pending.get(key) is mine:
                del self._pending[key]
            mine.set_result(None)

    async def _provider_down(self, failure: ProviderFailure) -> bool:
        """After a prompt's last attempt failed with a connection error, timeout, 5xx or 404:
        is the provider down (wait for it), or is the failure this request's own (dead letter)?

        Down while the global halt stands. Up when a request sent after this prompt's first
        failure was answered. Otherwise a free check (``GET /models``, OpenRouter ``GET /key``)
        decides; a failed check counts towards the outage halt.
        """
        if self._halts.is_halted(GLOBAL_SCOPE):
            return True
        if not self._outage.nobody_answered_since(failure):
            return False
        seq = self._outage.begin()
        try:
            check = await self.provider.check()
        except Exception:  # noqa: BLE001 - a check that crashes says nothing about the provider
            log.exception("provider check failed")
            return False
        if check.ok:
            self._outage.success(seq)
            return False
        probe = ProviderFailure(reason=check.reason or "provider_connection", message=check.message, retryable=True)
        if check.outage and self._outage.failure(probe, seq):
            await self._halt_outage()
        return check.outage

    async def _reuse(self, stored: ResponseReceived) -> None:
        """Re-publish a response already paid for, marked so the budget does not count it again."""
        event = msgspec.structs.replace(stored, reused=True)
        producer = self._require(self._producer)
        key = sample_key(event.dataset, event.sample_id).encode()
        await (await producer.send(self._topics[RESPONSES_TOPIC], encode(event), key=key))
        RESPONSES_REUSED.labels(dataset=event.dataset).inc()
        self.reused += 1
        log.debug("%s answered from the response store (no new request)", key.decode())

    async def _pay(
        self,
        record: Record,
        prompt: PromptPublished,
        dataset: DatasetSettings,
        max_tokens: int,
        digest: str,
        key: str,
    ) -> None:
        """Send the request (retries, halts, outages) and publish the response or dead letter."""
        scopes = (prompt.dataset,)
        # The first outage-class failed request of this prompt (kept across restarts of its
        # attempts): no later request answered at its last attempt means nobody got through.
        mark: list[int | None] = [None]
        while True:
            try:
                result, attempt, latency = await self._call(prompt, dataset, max_tokens, scopes, mark)
            except ProviderFailure as failure:
                if failure.fatal:
                    await self._halt_globally(failure)
                    continue  # waits at the gate until resumed, then starts over
                if is_outage_failure(failure) and await self._provider_down(failure):
                    # Not this request's fault: the provider answers nobody. Start over (the
                    # outage halt, once published, holds it at the gate until the provider is back).
                    log.info(
                        "%s: %s after %d attempt(s) while the provider answers nobody; trying again",
                        sample_key(prompt.dataset, prompt.sample_id),
                        failure.reason,
                        failure.attempt,
                    )
                    continue
                await self._dead_letter(record, failure_verdict(failure), dataset=prompt.dataset)
                return
            except NotSent:
                continue  # a halt came before the request went out: back to the gate, nothing paid
            except _Stopped:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug in a provider adapter is one bad prompt
                log.exception("provider adapter failed on %s", sample_key(prompt.dataset, prompt.sample_id))
                verdict = DeadLetter("inference_internal_error", f"{type(exc).__name__}: {exc}")
                await self._dead_letter(record, verdict, dataset=prompt.dataset)
                return
            break
        event = self._response(prompt, dataset, result, max_tokens, latency, attempt)
        event = msgspec.structs.replace(event, request_hash=digest)
        producer = self._require(self._producer)
        acks = [
            await producer.send(
                self._topics[RESPONSES_TOPIC], encode(event), key=sample_key(prompt.dataset, prompt.sample_id).encode()
            )
        ]
        if self._store is not None:
            acks.append(await self._store.put(key, event))
        await asyncio.gather(*acks)
        RESPONSES.labels(dataset=prompt.dataset).inc()
        self.responded += 1

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
        self,
        prompt: PromptPublished,
        dataset: DatasetSettings,
        max_tokens: int,
        scopes: tuple[str, ...],
        mark: list[int | None],
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
                seq = self._outage.begin()
                try:
                    result = await provider.complete(
                        prompt,
                        dataset,
                        max_tokens=max_tokens,
                        may_send=lambda: not self._halts.is_halted(*scopes) and not self._stopping.is_set(),
                    )
                except ProviderFailure as failure:
                    failure.attempt = number
                    REQUESTS.labels(provider=provider.name, outcome=failure.reason).inc()
                    if failure.retryable and number < cfg.max_attempts:
                        RETRIES.labels(provider=provider.name, reason=failure.reason).inc()
                    if is_outage_failure(failure) and mark[0] is None:
                        mark[0] = seq
                    failure.answered_mark = mark[0]
                    if self._outage.failure(failure, seq):
                        await self._halt_outage()
                    raise
                finally:
                    latency = time.monotonic() - t0
                    inflight.dec()
                    REQUEST_LATENCY.labels(provider=provider.name).observe(latency)
                REQUESTS.labels(provider=provider.name, outcome="ok").inc()
                self._outage.success(seq)
                return result, number, latency
        raise AssertionError("unreachable: stamina re-raises the last failure")  # pragma: no cover

    async def _dead_letter(self, record: Record, verdict: DeadLetter, *, dataset: str) -> None:
        out = dead_letter_of(
            record, dlq_topic=self._topics[DEAD_LETTER_TOPIC], stage=STAGE, verdict=verdict, dataset=dataset or None
        )
        producer = self._require(self._producer)
        await (await producer.send(out.topic, out.value, key=out.key, headers=out.headers))
        DEAD_LETTERS.labels(stage=STAGE, reason=verdict.reason).inc()
        self.dead_lettered += 1

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
        """Let requests in flight finish and be published (bounded), then cancel the rest.

        :meth:`stop_now` (a second signal) ends the wait at once.
        """
        if self._tasks and not self._abort.is_set():
            log.info(
                "stopping: letting %d request(s) in flight finish (up to %.0f s; signal again to stop at once)",
                len(self._tasks),
                self._drain_timeout_s,
            )
            finished = asyncio.ensure_future(asyncio.wait(set(self._tasks), timeout=self._drain_timeout_s))
            aborted = asyncio.ensure_future(self._abort.wait())
            await asyncio.wait({finished, aborted}, return_when=asyncio.FIRST_COMPLETED)
            for waiter in (finished, aborted):
                waiter.cancel()
            await asyncio.gather(finished, aborted, return_exceptions=True)
        if self._tasks:
            log.warning("cancelling %d request(s) still in flight at shutdown", len(self._tasks))
        await self._cancel_tasks()

    async def _cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _report_lag(self, consumer: AIOKafkaConsumer) -> None:
        self._lag = sum((await report_lag(consumer, self.group_id)).values())

    @staticmethod
    def _require(obj: Any) -> Any:
        if obj is None:
            raise RuntimeError("start() the worker first")
        return obj


def failure_verdict(failure: ProviderFailure) -> DeadLetter:
    """The dead letter for a provider failure after the last attempt."""
    return dead_letter_for(failure, failure.attempt)


def create_app(
    settings: Settings,
    *,
    http_client: httpx.AsyncClient | None = None,
    provider: Provider | None = None,
    worker_id: str | None = None,
    repay: bool = False,
) -> InferenceWorker:
    """The inference worker, wired from settings (tests may inject an HTTP client).

    ``repay`` sends every request again even when its response was paid for already.
    """
    return InferenceWorker(settings, http_client=http_client, provider=provider, worker_id=worker_id, repay=repay)
