"""The budget service's Kafka wiring: feeds the :class:`Ledger`, publishes its halts.

Reads ``requests`` and ``responses`` (every partition, manual assignment, no consumer
group: one budget instance per deployment) plus ``control``, and the audit verdicts
(``accepted`` and the judging stages' ``dead-letter`` records) for the quality halt
(services.budget.quality); publishes halts/resumes on ``control`` and checkpoints on
``budget-state``. On start it rebuilds the ledger from
the latest checkpoints and seeks to the offsets they carry (see services.budget.core for
why that neither forgets nor double counts).

Written on aiokafka directly (like services.common.stage) because it needs manual
partition assignment and seeking to checkpointed offsets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas import (
    ACCEPTED_TOPIC,
    BUDGET_STATE_TOPIC,
    CONTROL_TOPIC,
    DEAD_LETTER_TOPIC,
    DLQ_HEADERS,
    GLOBAL_SCOPE,
    REQUESTS_TOPIC,
    RESPONSES_TOPIC,
    BudgetSnapshot,
    Halt,
    RequestStarted,
    ResponseReceived,
    Resume,
    SchemaError,
    decode,
    encode,
    provider_of_scope,
    topology,
)
from services.budget.adapters.key_usage import REPORTING_KINDS, KeyUsageReader
from services.budget.core import Ledger
from services.budget.lease_desk import LeaseDesk
from services.budget.quality import (
    QUALITY_ACTOR,
    QualityGate,
    Verdict,
    accepted_verdict,
    dead_letter_verdict,
    dollars_per_accepted,
)
from services.budget.totals import Caps, Counted
from services.common.acls import used_topics
from services.common.config import Settings
from services.common.halts import HaltFollower
from services.common.kafka import (
    FOLLOW_FETCH,
    DeadLetter,
    Outgoing,
    dead_letter_of,
    ensure_topics,
    existing_topics,
    header,
    make_admin,
    make_consumer,
    make_producer,
    publish_all,
)
from services.common.metrics import (
    BUDGET_CAP,
    BUDGET_PROJECTED,
    BUDGET_RATE,
    BUDGET_REMAINING,
    BUDGET_SOFT_LIMIT,
    BUDGET_SPENT,
    BUDGET_STATE,
    DEAD_LETTERS,
    DOLLARS,
    DOLLARS_PER_ACCEPTED,
    HALTS,
    QUALITY_DEAD_LETTERS,
    QUALITY_HALTED,
    QUALITY_VERDICTS,
    QUALITY_YIELD,
    RESPONSES_WITHOUT_USAGE,
    STAGE_RECORDS,
    TOKENS,
    TOKENS_KEPT,
)
from services.control import read_budget_snapshots

log = logging.getLogger(__name__)

STAGE = "budget"
# What the service consumes (schemas.topology's budget role), in the order a batch is applied:
# requests before responses, so an answer in the same batch closes its request.
CONSUMED = (REQUESTS_TOPIC, RESPONSES_TOPIC, DEAD_LETTER_TOPIC, ACCEPTED_TOPIC)
"""Read by the budget's own consumer; ``control`` is followed by its :class:`HaltFollower`."""
_ORDER = {topic: i for i, topic in enumerate(CONSUMED)}
_STATE_CODE = {"running": 0, "soft-limit": 1, "halted": 2}


def ledger_for(settings: Settings) -> Ledger:
    """A ledger configured from the settings: caps, prices, soft threshold, TTL."""
    budget = settings.budget

    def caps_for(scope: str) -> Caps:
        if scope == GLOBAL_SCOPE:
            return Caps(budget.global_cap_completion_tokens, budget.global_cap_usd)
        dataset = settings.dataset(scope)
        return Caps(dataset.cap_completion_tokens, dataset.cap_usd)

    provider = settings.provider
    completion_price = budget.prices.get(provider.model, {}).get("completion")
    # A request unanswered after every attempt's timeout and backoff (of the slowest provider) is not billing.
    ttl_s = max((p.timeout_s + p.backoff_max_s) * p.max_attempts for p in settings.all_providers().values())
    providers = settings.all_providers()
    per_token = {
        name: price / 1e6
        for name, p in providers.items()
        if (price := budget.prices.get(p.model, {}).get("completion"))
    }
    return Ledger(
        caps_for=caps_for,
        default_provider=next(iter(providers)) if len(providers) == 1 else "",
        provider_usd_per_token=per_token,
        soft_threshold=budget.soft_threshold,
        prices=budget.prices,
        include_inflight=budget.include_inflight,
        inflight_ttl_s=ttl_s,
        rate_window_s=budget.rate_window_s,
        inflight_usd_per_token=completion_price / 1e6 if completion_price else None,
    )


class BudgetService:
    """Counts spend per dataset and in total, halts scopes over their caps, checkpoints."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        checkpoint_interval_s: float = 1.0,
        prompts_refresh_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.checkpoint_interval_s = checkpoint_interval_s
        self.prompts_refresh_s = prompts_refresh_s
        self.ledger = ledger_for(settings)
        self.quality = QualityGate(window=settings.budget.quality_window, min_yield=settings.budget.min_yield)
        self.leases = LeaseDesk(settings, self.ledger, self._requests_read) if settings.budget.leases else None
        self.published_control: list[Halt | Resume] = []
        self._stopping = asyncio.Event()
        # The standing halt or resume of every scope, as control events arrive (its own too).
        self.control = HaltFollower(settings.kafka, self._stopping)
        self.control.event_listeners.append(self.ledger.apply_control)
        self.control.event_listeners.append(self._on_control)
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._logical = {settings.kafka.topic(n): n for n in CONSUMED}
        self._waiting_prompts: dict[str, int] = {}  # per dataset: prompts not yet consumed by inference
        self._last_checkpoint = 0.0
        self._last_prompts_refresh = 0.0
        self._unpriced_models: set[str] = set()
        self._http: httpx.AsyncClient | None = None
        self._admin: AIOKafkaAdminClient | None = None  # the prompts topics' metadata, from the first refresh
        self._key_usage: dict[str, KeyUsageReader] = {}  # per provider whose key reports its usage
        self._next_key_read: dict[str, float] = {}
        self.started = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Create topics, rebuild the ledger from checkpoints and control, seek, resume."""
        kafka = self.settings.kafka
        await ensure_topics(kafka, self.settings.datasets, needed=used_topics(STAGE))
        self._producer = make_producer(kafka)
        await self._producer.start()
        await self.control.start(self._producer)
        snapshots = await read_budget_snapshots(self.settings)
        now = self.clock()
        seek = self.ledger.restore(sorted(snapshots.values(), key=lambda s: s.scope == GLOBAL_SCOPE), now)
        self.quality.restore(snapshots.values())
        consumer = make_consumer(kafka, group_id=None, **FOLLOW_FETCH)
        await consumer.start()
        self._consumer = consumer
        partitions: list[TopicPartition] = []
        for physical in self._logical:
            for p in sorted(await self._producer.partitions_for(physical)):
                partitions.append(TopicPartition(physical, p))
        consumer.assign(partitions)
        # Seeks to known offsets: seek_to_beginning() would wait, partition by partition, for
        # the fetch in flight since assign() (the broker's whole wait on an empty partition).
        beginnings = await consumer.beginning_offsets(partitions) if partitions else {}
        for tp in partitions:
            consumer.seek(tp, seek.get(f"{self._logical[tp.topic]}:{tp.partition}", beginnings[tp]))
        log.info(
            "budget: restored %d scope(s), seeking %s",
            len(snapshots),
            ", ".join(f"{k}@{v}" for k, v in sorted(seek.items())) or "from the beginning",
        )
        await self._publish_control(self.ledger.startup_resumes(now))
        reporting = {n: p for n, p in self.settings.all_providers().items() if p.kind in REPORTING_KINDS}
        for name, provider in self.settings.all_providers().items():
            if name not in reporting:
                self.ledger.book.unreadable[name] = (
                    f"provider kind {provider.kind!r} reports no key usage: the worst case stands")
        if self.settings.budget.key_usage_interval_s and reporting:
            # A busy provider answers /key slowly: a read gets the time a request gets to connect.
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(15.0, connect=5.0))
            self._key_usage = {name: KeyUsageReader(p, self._http) for name, p in reporting.items()}
            await self._read_key_usage(now)  # a fresh ledger's first reading is its base
        if self.leases is not None:
            await self.leases.start(self._producer, now)
        self.started.set()

    async def run(self) -> None:
        """Consume and account until :meth:`stop`; checkpoint every interval."""
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("BudgetService.run() before start()")
        while not self._stopping.is_set():
            batches = await consumer.getmany(timeout_ms=200, max_records=500)
            records = [r for part in batches.values() for r in part]
            records.sort(key=lambda r: _ORDER[self._logical[r.topic]])
            decisions: list[Halt | Resume] = []
            dead: list[Outgoing] = []
            for record in records:
                decisions.extend(self._handle(record, dead))
            if records:
                STAGE_RECORDS.labels(stage=STAGE).inc(len(records))
            assert self._producer is not None  # noqa: S101 - set in start()
            await publish_all(self._producer, dead)
            await self._publish_control(decisions)
            if self.leases is not None:
                await self._publish_control(await self.leases.tick(self.clock()))
            await self._tick()

    async def _requests_read(self) -> bool:
        """Whether every request announced until now was read (before a lease is taken back)."""
        consumer = self._consumer
        if consumer is None:
            return False
        topic = self.settings.kafka.topic(REQUESTS_TOPIC)
        parts = [tp for tp in consumer.assignment() if tp.topic == topic]
        ends = await consumer.end_offsets(parts)
        return all([await consumer.position(tp) >= end for tp, end in ends.items()])

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current batch."""
        self._stopping.set()

    async def close(self) -> None:
        """Write a final checkpoint and release the Kafka clients."""
        try:
            if self._producer is not None and self._consumer is not None:
                await self._checkpoint(self.clock(), everything=True)
        finally:
            await self.abort()

    async def abort(self) -> None:
        """Release the clients without a final checkpoint (what a crash leaves behind)."""
        await self.control.close()
        if self.leases is not None:
            await self.leases.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._admin is not None:
            await self._admin.close()
            self._admin = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    # ------------------------------------------------------------------ records
    def _handle(self, record: ConsumerRecord[bytes, bytes], dead: list[Outgoing]) -> list[Halt | Resume]:
        logical = self._logical[record.topic]
        position = f"{logical}:{record.partition}"
        now = self.clock()
        try:
            if logical == ACCEPTED_TOPIC:
                # A verdict only; a record that is no passed sample is the sink's to dead-letter.
                if header(record.headers, topology.TRUNCATED_HEADER) == "1":
                    dataset = (record.key or b"").decode("utf-8", "replace").split(":", 1)[0]
                    self.ledger.tally_truncated(position, record.offset, dataset)
                key = (record.key or b"").decode("utf-8", "replace")
                self.ledger.tally_accepted(position, record.offset, key)
                self.ledger.skip(position, record.offset)
                return self._judge(accepted_verdict(record.value, key))
            if logical == DEAD_LETTER_TOPIC:
                # To learn which requests ended without a response (their failed attempts
                # cost nothing the provider reported) and which paid answers were thrown
                # away (the quality halt); never dead-lettered again.
                key = (record.key or b"").decode("utf-8", "replace")
                stage = header(record.headers, DLQ_HEADERS.STAGE)
                reason = header(record.headers, DLQ_HEADERS.REASON)
                self.ledger.tally_dead_letter(position, record.offset, stage or "unknown", reason or "unknown", key)
                if stage == "inference" and ":" in key:
                    dataset, _, sample_id = key.partition(":")
                    self.ledger.on_request_failed(dataset, sample_id, position, record.offset, reason=reason or "")
                    if self.leases is not None:
                        self.leases.on_failed(dataset, sample_id, reason or "")
                    return []
                self.ledger.skip(position, record.offset)
                return self._judge(dead_letter_verdict(stage, reason, record.value, key))
            if logical == REQUESTS_TOPIC:
                request = decode(record.value, RequestStarted)
                self._check_dataset(request.dataset)
                halts = self.ledger.on_request(request, position, record.offset, now)
                if self.leases is not None:
                    self.leases.on_request(request)
                return list(halts)
            response = decode(record.value, ResponseReceived)
            self._check_dataset(response.dataset)
            replayed = int(header(record.headers, DLQ_HEADERS.REPLAY_COUNT) or "0") > 0
            # A reused response re-sends one already paid for (the inference worker's
            # response store): the provider billed it once, so it is counted once.
            again = replayed or response.reused
            counted, halts = self.ledger.on_response(response, position, record.offset, now, replay=again)
            if counted is not None:
                self._count_metrics(counted, response.model)
                if self.leases is not None:
                    self.leases.on_answer(response.attempt_key, counted.completion_tokens)
            return list(halts)
        except SchemaError as exc:
            verdict = DeadLetter(exc.reason, exc.message)
            DEAD_LETTERS.labels(stage=STAGE, reason=exc.reason).inc()
            dead.append(
                dead_letter_of(
                    record, dlq_topic=self.settings.kafka.topic(DEAD_LETTER_TOPIC), stage=STAGE, verdict=verdict
                )
            )
            # Keep the offsets moving so a checkpoint never replays a dead letter.
            self.ledger.skip(position, record.offset)
            return []

    def _judge(self, verdict: Verdict | None) -> list[Halt | Resume]:
        """Feed one verdict to the quality gate; the quality halt it calls for, if any."""
        if verdict is None or verdict.dataset == GLOBAL_SCOPE:
            return []
        reason = self.quality.observe(verdict)
        self.ledger.touch(verdict.dataset)
        if verdict.provider:
            self.ledger.touch_provider(verdict.provider)
        ds = verdict.dataset
        outcome = "accepted" if verdict.accepted else "dead_letter"  # topology: not a topic
        QUALITY_VERDICTS.labels(dataset=ds, upstream=verdict.upstream or "unknown", outcome=outcome).inc()
        if verdict.accepted:
            TOKENS_KEPT.labels(dataset=ds).inc(verdict.completion_tokens)
        else:
            QUALITY_DEAD_LETTERS.labels(dataset=ds, reason=verdict.reason).inc()
        if reason is None or isinstance(self.ledger.control.get(verdict.dataset), Halt):
            return []
        halt = Halt(scope=verdict.dataset, reason=reason, by=QUALITY_ACTOR, at=self.clock())
        self.ledger.apply_control(halt)
        return [halt]

    def _on_control(self, event: Halt | Resume) -> None:
        """A resume of a dataset starts its quality windows afresh (the fix is judged by new answers)."""
        if isinstance(event, Resume) and event.scope != GLOBAL_SCOPE and provider_of_scope(event.scope) is None:
            self.quality.reset(event.scope, event.at)

    def _with_quality(self, snap: BudgetSnapshot) -> BudgetSnapshot:
        """A dataset's snapshot with its quality figures (per dataset and per upstream)."""
        if snap.scope == GLOBAL_SCOPE:
            return snap
        provider = provider_of_scope(snap.scope)
        if provider is not None:
            return msgspec.structs.replace(snap, quality=self.quality.provider_figures(provider))
        figures, upstreams = self.quality.figures(snap.scope)
        return msgspec.structs.replace(snap, quality=figures, upstreams=upstreams)

    @staticmethod
    def _check_dataset(dataset: str) -> None:
        if dataset == GLOBAL_SCOPE:
            raise SchemaError("reserved_dataset_name", f"dataset name {GLOBAL_SCOPE!r} is the global scope")

    def _count_metrics(self, counted: Counted, model: str) -> None:
        ds = counted.dataset
        TOKENS.labels(dataset=ds, kind="prompt").inc(counted.prompt_tokens)
        TOKENS.labels(dataset=ds, kind="completion").inc(counted.completion_tokens)
        TOKENS.labels(dataset=ds, kind="reasoning").inc(counted.reasoning_tokens)
        DOLLARS.labels(dataset=ds).inc(counted.cost_usd)
        if counted.estimated:
            RESPONSES_WITHOUT_USAGE.labels(dataset=ds).inc()
        if not counted.priced and model not in self._unpriced_models:
            self._unpriced_models.add(model)
            log.warning("model %r reports no usage.cost and has no [budget.prices] entry: counted as $0", model)

    # ------------------------------------------------------------------ periodic
    async def _tick(self) -> None:
        now = self.clock()
        if now - self._last_prompts_refresh >= self.prompts_refresh_s:
            self._last_prompts_refresh = now
            await self._refresh_waiting_prompts()
        if self._key_usage and now >= min(self._next_key_read.values(), default=0.0):
            await self._read_key_usage(now)
        if now - self._last_checkpoint >= self.checkpoint_interval_s:
            self.ledger.expire_inflight(now)
            await self._publish_control(self.ledger.evaluate(now))
            await self._checkpoint(now)

    async def _read_key_usage(self, now: float) -> None:
        """Reconcile with each provider key's usage (what its lost attempts really cost, once settled).

        Each key is read every ``[budget] key_usage_interval_s``; a read that failed (a busy
        provider's ``/key`` timing out) is tried again after a second, not a whole interval.
        """
        interval = self.settings.budget.key_usage_interval_s
        due = [name for name in self._key_usage if now >= self._next_key_read.get(name, 0.0)]
        readings = await asyncio.gather(*(self._key_usage[name].read() for name in due))
        for name, usage in zip(due, readings, strict=True):
            if usage is None:
                self._next_key_read[name] = now + min(1.0, interval)
                self.ledger.book.unreadable[name] = "the last read of its key's usage failed: retrying"
                continue
            self._next_key_read[name] = now + interval
            self.ledger.reconcile(usage, now, name)

    async def _refresh_waiting_prompts(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        physical_of = {dataset: self.settings.kafka.prompts_topic(dataset) for dataset in self.ledger.datasets}
        try:
            if self._admin is None:
                admin = make_admin(self.settings.kafka)
                await admin.start()
                self._admin = admin
            # The metadata of these topics only: the cluster's whole list grows with every topic on it.
            topics = await existing_topics(self._admin, physical_of.values())
            # Prompts still waiting: written and not yet consumed by the inference group (a replay
            # already answered is neither; a prompt published twice is one prompt waiting once).
            committed = await self._inference_committed()
            for dataset, physical in physical_of.items():
                if physical not in topics or self._producer is None:
                    continue
                parts = [TopicPartition(physical, p) for p in await self._producer.partitions_for(physical)]
                ends = await consumer.end_offsets(parts)
                starts = await consumer.beginning_offsets(parts)
                waiting = sum(max(0, end - committed.get(tp, starts.get(tp, 0))) for tp, end in ends.items())
                # The group commits in order, so a prompt answered behind an unanswered one is still
                # uncommitted: the records written less the answers bound it from the other side.
                waiting = min(waiting, max(0, sum(ends.values()) - self.ledger.scopes[dataset].responses))
                if self._waiting_prompts.get(dataset) != waiting:
                    self._waiting_prompts[dataset] = waiting
                    self.ledger.touch(dataset)  # the next checkpoint carries the new projection
        except Exception:  # noqa: BLE001 - a projection is not worth stopping the budget for
            log.warning("could not read the end offsets of the prompts topics", exc_info=True)

    async def _inference_committed(self) -> dict[TopicPartition, int]:
        """The inference group's committed offsets (none when it has not committed yet)."""
        if self._admin is None:
            return {}
        try:
            group = self.settings.kafka.group(topology.GROUPS["inference"])
            offsets = await self._admin.list_consumer_group_offsets(group)
        except Exception:  # noqa: BLE001 - an unknown group simply has no offsets
            return {}
        return {tp: meta.offset for tp, meta in offsets.items() if meta is not None and meta.offset >= 0}

    def remaining_prompts(self) -> dict[str, int | None]:
        """Prompts not yet answered per dataset: expected_prompts less the answers, else those still waiting."""
        out: dict[str, int | None] = {}
        for dataset in self.ledger.datasets:
            expected = self.settings.dataset(dataset).expected_prompts
            if expected is not None:
                out[dataset] = max(0, expected - self.ledger.scopes[dataset].responses)
            else:
                out[dataset] = self._waiting_prompts.get(dataset)
        return out

    async def _checkpoint(self, now: float, *, everything: bool = False) -> None:
        self._last_checkpoint = now
        snaps = [
            self._with_quality(s) for s in self.ledger.checkpoint(now, self.remaining_prompts(), everything=everything)
        ]
        if not snaps or self._producer is None:
            return
        topic = self.settings.kafka.topic(BUDGET_STATE_TOPIC)
        # Global goes last and after the others were acknowledged (see core's docstring).
        *scopes, total = snaps
        await publish_all(self._producer, [Outgoing(topic, encode(s), s.scope.encode()) for s in scopes])
        await publish_all(self._producer, [Outgoing(topic, encode(total), total.scope.encode())])
        for snap in snaps:
            if provider_of_scope(snap.scope) is not None:
                continue  # a provider's figures: no caps, no yield of its own
            self._gauges(snap.scope, snap.state, snap.rate_usd_per_s, snap.projected_usd)
            if snap.scope != GLOBAL_SCOPE:
                self._quality_gauges(snap)

    def _quality_gauges(self, snap: BudgetSnapshot) -> None:
        """Yield (dataset and upstreams), dollars per accepted sample, and whether a quality halt stands."""
        event = self.ledger.control.get(snap.scope)
        QUALITY_HALTED.labels(dataset=snap.scope).set(int(isinstance(event, Halt) and event.by == QUALITY_ACTOR))
        scopes = {"all": snap.quality, **snap.upstreams}
        for upstream, figures in scopes.items():
            if figures is not None and figures.window_verdicts:
                QUALITY_YIELD.labels(dataset=snap.scope, upstream=upstream).set(
                    figures.window_accepted / figures.window_verdicts
                )
        per_sample = dollars_per_accepted(snap)
        if per_sample is not None:
            DOLLARS_PER_ACCEPTED.labels(dataset=snap.scope).set(per_sample)

    def _gauges(self, scope: str, state: str, rate: float, projected: float | None) -> None:
        totals = self.ledger.scopes[scope]
        caps = self.ledger.caps(scope)
        for unit, cap, spent in (
            ("completion_tokens", caps.completion_tokens, float(totals.completion_tokens)),
            ("dollars", caps.usd, totals.cost_usd),
        ):
            BUDGET_SPENT.labels(dataset=scope, unit=unit).set(spent)
            if cap is not None:
                BUDGET_CAP.labels(dataset=scope, unit=unit).set(cap)
                BUDGET_REMAINING.labels(dataset=scope, unit=unit).set(max(0.0, cap - spent))
        BUDGET_STATE.labels(dataset=scope).set(_STATE_CODE[state])
        BUDGET_SOFT_LIMIT.labels(dataset=scope).set(1 if self.ledger.soft_limit(scope) else 0)
        BUDGET_RATE.labels(dataset=scope).set(rate)
        if projected is not None:
            BUDGET_PROJECTED.labels(dataset=scope).set(projected)

    async def _publish_control(self, events: Sequence[Halt | Resume]) -> None:
        if not events or self._producer is None:
            return
        topic = self.settings.kafka.topic(CONTROL_TOPIC)
        await publish_all(self._producer, [Outgoing(topic, encode(e), e.scope.encode()) for e in events])
        for event in events:
            self.published_control.append(event)
            if isinstance(event, Halt):
                HALTS.labels(scope=event.scope, by=event.by).inc()
            log.warning("budget: %s %s: %s", type(event).__name__.lower(), event.scope, event.reason)


def create_app(
    settings: Settings, *, checkpoint_interval_s: float = 1.0, prompts_refresh_s: float = 5.0
) -> BudgetService:
    """The budget service (composition root)."""
    return BudgetService(settings, checkpoint_interval_s=checkpoint_interval_s, prompts_refresh_s=prompts_refresh_s)
