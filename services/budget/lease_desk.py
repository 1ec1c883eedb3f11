"""The budget's side of the ``leases`` topic: announces the epoch, reads requests, publishes grants.

A thin shell around :class:`~services.budget.leases.LeaseBook`: its own group-less
consumer on ``leases`` (from the end: requests of an earlier epoch mean nothing now), the
budget's producer for the policy and the grants. A restarted budget starts a new epoch
and grants nothing until every grant of the previous one has expired at its worker.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import (
    DEAD_LETTER_TOPIC,
    LEASES_TOPIC,
    Halt,
    LeasePolicy,
    LeaseReleased,
    LeaseRequested,
    RequestStarted,
    SchemaError,
    decode_lease,
    encode,
    lease_key,
)
from services.budget.core import Ledger
from services.budget.leases import LeaseBook
from services.common.config import Settings
from services.common.kafka import DeadLetter, Outgoing, dead_letter_of, make_consumer, publish_all
from services.common.metrics import DEAD_LETTERS
from services.common.service import release
from services.common.topics import read_compacted, ready_partitions

log = logging.getLogger(__name__)

STAGE = "budget"


class LeaseDesk:
    """Hands out the headroom under the caps as leases (see services.budget.leases)."""

    def __init__(self, settings: Settings, ledger: Ledger, caught_up: Callable[[], Awaitable[bool]]) -> None:
        self._settings = settings
        self._caught_up = caught_up
        self._ledger = ledger
        self._topic = settings.kafka.topic(LEASES_TOPIC)
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self.book: LeaseBook | None = None
        self._releases: list[LeaseReleased] = []  # applied once every request was read

    async def start(self, producer: AIOKafkaProducer, now: float) -> None:
        """Announce a new epoch (after the previous one's grants can have expired), follow requests."""
        budget, kafka = self._settings.budget, self._settings.kafka
        self._producer = producer
        values, _ = await read_compacted(kafka, self._topic)
        previous = values.get(b"policy")
        grants_from = 0.0
        if previous is not None:
            try:
                old = decode_lease(previous)
            except SchemaError as exc:
                log.warning("ignoring the previous lease policy: %s (%s)", exc.reason, exc.message)
            else:
                if isinstance(old, LeasePolicy) and old.in_force:
                    grants_from = now + old.ttl_s + budget.lease_grace_s
        # Requests restored in flight from the checkpoint were sent under the previous epoch's
        # leases: they count against the caps, and never towards the early in-flight halt.
        for totals in self._ledger.scopes.values():
            totals.leased.update(totals.inflight)
        completion_price = budget.prices.get(self._settings.provider.model, {}).get("completion")
        self.book = LeaseBook(
            self._ledger,
            epoch=uuid.uuid4().hex[:16],
            ttl_s=budget.lease_ttl_s,
            grace_s=budget.lease_grace_s,
            max_tokens_for=lambda dataset: self._settings.dataset(dataset).max_tokens,
            usd_per_token=completion_price / 1e6 if completion_price else None,
            grants_from=grants_from,
        )
        consumer = self._consumer = make_consumer(kafka, group_id=None, fetch_max_wait_ms=50)
        await consumer.start()
        tps = [TopicPartition(self._topic, p) for p in await ready_partitions(kafka, self._topic)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)  # the end now: requests after the policy are read
        for tp in tps:
            consumer.seek(tp, ends[tp])
        policy = LeasePolicy(epoch=self.book.epoch, ttl_s=budget.lease_ttl_s, at=now)
        await publish_all(producer, [Outgoing(self._topic, encode(policy), lease_key(policy).encode())])
        log.info(
            "budget: lease epoch %s (ttl %.1f s)%s",
            policy.epoch,
            policy.ttl_s,
            f"; no grants for {grants_from - now:.1f} s while the previous epoch's expire" if grants_from else "",
        )

    def on_request(self, event: RequestStarted) -> None:
        """A request the ledger counted (its lease consumption)."""
        if self.book is not None:
            self.book.on_request(event)

    def on_answer(self, key: str, completion_tokens: int) -> None:
        """An answer the ledger counted (``key``: the attempt it answers)."""
        if self.book is not None:
            self.book.on_answer(key, completion_tokens)

    def on_failed(self, dataset: str, sample_id: str, reason: str) -> None:
        """A prompt that ended as a dead letter (``reason``: its last failure)."""
        if self.book is not None:
            self.book.on_failed(dataset, sample_id, reason)

    async def tick(self, now: float) -> list[Halt]:
        """Read new lease requests, publish the grants; the halts of scopes finished at their cap."""
        book, consumer, producer = self.book, self._consumer, self._producer
        if book is None or consumer is None or producer is None:
            return []
        batches = await consumer.getmany(timeout_ms=0, max_records=2000)
        dead: list[Outgoing] = []
        for records in batches.values():
            for record in records:
                try:
                    event = decode_lease(record.value)
                except SchemaError as exc:
                    DEAD_LETTERS.labels(stage=STAGE, reason=exc.reason).inc()
                    dlq = self._settings.kafka.topic(DEAD_LETTER_TOPIC)
                    verdict = DeadLetter(exc.reason, exc.message)
                    dead.append(dead_letter_of(record, dlq_topic=dlq, stage=STAGE, verdict=verdict))
                    continue
                if isinstance(event, LeaseRequested):
                    book.on_lease_request(event, now)
                elif isinstance(event, LeaseReleased):
                    self._releases.append(event)
        # A lease shrinks to what its worker consumed only once every request it announced was
        # read: a stopping worker's last request may still be on its way to this budget.
        if (self._releases or book.due(now)) and await self._caught_up():
            for release in self._releases:
                book.on_release(release)
            self._releases.clear()
            for lease in book.expire(now):
                requests, tokens = book.reserved_under(lease)
                log.warning("budget: lease of %s for %s expired: taken back%s", lease.worker, lease.dataset,
                            f"; {requests} attempt(s) lost with it stay counted at their worst case "
                            f"({tokens:,} tokens): the provider may have billed them" if requests else "")
        grants, finished = book.decide(now)
        dead.extend(Outgoing(self._topic, encode(g), lease_key(g).encode()) for g in grants)
        await publish_all(producer, dead)
        return [self._ledger.record_halt(scope, reason, now) for scope, reason in finished]

    async def close(self) -> None:
        """Release the consumer."""
        await release(self._consumer)
        self._consumer = None
