"""Kafka plumbing shared by every service and the CLI: clients, topics, dead letters.

This is the only module (with services.common.stage and the inference shell) that
builds aiokafka clients, so security settings (SASL PLAIN/SCRAM, TLS) apply everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import stamina
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    InvalidTopicError,
    KafkaConnectionError,
    NodeNotReadyError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)
from aiokafka.protocol.api import Request, Response
from aiokafka.protocol.metadata import MetadataRequest

from schemas import DLQ_HEADERS, topology
from services.common.config import KafkaSettings
from services.common.errors import AccessDenied
from services.common.records import DeadLetter, Headers, Outgoing

log = logging.getLogger(__name__)


def client_kwargs(kafka: KafkaSettings) -> dict[str, Any]:
    """Connection and security arguments common to producers, consumers and admins."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap_servers,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=kafka.ssl_cafile)
        context.check_hostname = kafka.ssl_check_hostname
        if kafka.ssl_certfile:
            context.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile)
        kwargs["ssl_context"] = context
    if kafka.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = kafka.sasl_mechanism or "PLAIN"
        kwargs["sasl_plain_username"] = kafka.sasl_username
        kwargs["sasl_plain_password"] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    return kwargs


def make_producer(kafka: KafkaSettings, **extra: Any) -> AIOKafkaProducer:
    """An idempotent producer able to carry the largest sample (not yet started)."""
    kwargs: dict[str, Any] = {
        "acks": "all",
        "enable_idempotence": True,
        "max_request_size": kafka.max_message_bytes,
        "compression_type": kafka.compression_type,
        "linger_ms": 5,
        # Many concurrent sends (1,000 requests in flight) retry when a small batch fills.
        "max_batch_size": 1024 * 1024,
        "request_timeout_ms": 60_000,
    }
    kwargs.update(extra)
    return AIOKafkaProducer(**client_kwargs(kafka), **kwargs)


STREAM_FETCH: dict[str, Any] = {"fetch_min_bytes": 1024 * 1024}
"""Fetch settings of the stages (reconstruct, audit, sink): the consumers on a sample's path.

The broker answers a fetch once 1 MiB is there or the stage's ``[stage] fetch_wait_ms`` has
passed (default 50). Every fetch costs the broker and the consumer a round of work whatever it
carries, and each one the stage takes is a batch it decides, publishes and commits: at one byte
(aiokafka's default) a consumer keeping up fetched a record or two at a time. The wait is paid
at every hop by the records that arrive while the stage is caught up (the first and last of a
burst). In benchmark 2 alone (rounds of two to three seconds), end to end was 0.911 and 0.990
at 100 ms, 0.964 and 1.019 at 50 ms, 0.990-1.121 at 25 ms. At the seeds' rates a fetch never
fills 1 MiB, so the wait sets how often each stage fetches: at 4,000 prompts of the seeds'
shape, 50 ms cost reconstruct, audit and sink 16.6 CPU s per 1,000 prompts against 14.2 at
100 ms. Figures: docs/bench-history.md (2026-12-03).
"""

FOLLOW_FETCH: dict[str, Any] = {"fetch_min_bytes": 1024 * 1024, "fetch_max_wait_ms": 100}
"""Fetch settings of the consumers that follow a stream off a sample's path: the budget and
the inference workers' response-store followers.

The broker answers once 1 MiB is there or 100 ms have passed. No sample waits for these, so
they fetch half as often as the stages: one seeds-sized sample (~100 KB, ~20 KB compressed)
never fills 1 MiB at the seeds' rates, and the follower fetched once per write at the default
of one byte. 250 ms cut the fetches further, but the budget's view of spend then lagged by
that much more.
"""


def make_consumer(kafka: KafkaSettings, *topics: str, group_id: str | None, **extra: Any) -> AIOKafkaConsumer:
    """A consumer with manual commits and fetch limits sized for large samples."""
    kwargs: dict[str, Any] = {
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": kafka.max_message_bytes + 1024 * 1024,
        "fetch_max_bytes": max(kafka.max_message_bytes * 2, 64 * 1024 * 1024),
        "isolation_level": "read_uncommitted",
        # A SIGKILLed member holds its partitions until the session times out: keep it short.
        "session_timeout_ms": int(kafka.session_timeout_s * 1000),
        "heartbeat_interval_ms": min(1_000, int(kafka.session_timeout_s * 1000) // 3),
        "max_poll_interval_ms": 600_000,
    }
    kwargs.update(extra)
    return AIOKafkaConsumer(*topics, **client_kwargs(kafka), **kwargs)


# What a request to a broker that is down (or just lost) raises in the admin client.
_BROKER_DOWN = (NodeNotReadyError, KafkaConnectionError, RequestTimedOutError, TimeoutError)


class _FailoverAdmin(AIOKafkaAdminClient):  # type: ignore[misc]  # aiokafka ships no type stubs
    """aiokafka's admin client sends each request to one broker of its cached metadata (a
    random one, or the one named controller) and fails when that broker is down, which in
    a cluster that just lost a node is one request in N. This one refreshes the metadata
    and asks again, so that admin calls survive the loss of a broker as clients do.
    """

    async def _failover(self, send: Callable[[], Awaitable[Response]]) -> Response:
        async for attempt in stamina.retry_context(
            on=_BROKER_DOWN, attempts=8, timeout=90.0, wait_initial=0.2, wait_max=3.0
        ):
            with attempt:
                if attempt.num > 1:
                    await self._client.force_metadata_update()
                return await send()
        raise AssertionError("unreachable: stamina re-raises the last failure")  # pragma: no cover

    async def _send_request(self, request: Request, node_id: int | None = None) -> Response:
        if node_id is not None:  # a request for that very broker (a group coordinator, ...)
            return await super()._send_request(request, node_id)
        return await self._failover(lambda: super(_FailoverAdmin, self)._send_request(request))

    async def _send_to_controller(self, request: Request) -> Response:
        return await self._failover(lambda: super(_FailoverAdmin, self)._send_to_controller(request))


def make_admin(kafka: KafkaSettings) -> AIOKafkaAdminClient:
    """An admin client (not yet started) that asks another broker when the one it picked is down."""
    # 15 s per request rather than 40: a broker that does not answer is tried again sooner.
    return _FailoverAdmin(**client_kwargs(kafka), request_timeout_ms=15_000)


def topic_configs(kafka: KafkaSettings, logical: str) -> dict[str, str]:
    """Per-topic configuration: large messages everywhere, compaction where the topology says."""
    configs = {"max.message.bytes": str(kafka.max_message_bytes + 1024 * 1024)}
    if topology.topic_for(logical).compacted:
        configs["cleanup.policy"] = "compact"
        configs["min.cleanable.dirty.ratio"] = "0.1"
        configs["segment.ms"] = "3600000"
    return configs


MAX_REPLICATION_FACTOR = 3
"""Copies of each partition on a cluster: with ``min.insync.replicas=2``, one broker can be
lost without losing an acknowledged write or stopping writes."""


def replication_for(brokers: int) -> int:
    """The replication factor a cluster of ``brokers`` live brokers affords (3 at most, 1 at least)."""
    return max(1, min(MAX_REPLICATION_FACTOR, brokers))


async def cluster_replication_factor(admin: AIOKafkaAdminClient) -> int:
    """The replication factor for new topics, from the number of brokers the cluster reports."""
    # An empty topic list: the brokers without any topic's metadata (describe_cluster asks for all).
    response = await admin._send_request(MetadataRequest([]))  # noqa: SLF001 - the client's own request path
    return replication_for(len(response.to_object().get("brokers") or ()))


_ABSENT = {UnknownTopicOrPartitionError.errno, TopicAuthorizationFailedError.errno, InvalidTopicError.errno}


async def existing_topics(admin: AIOKafkaAdminClient, names: Iterable[str]) -> set[str]:
    """Which of ``names`` exist and this principal may see, from the metadata of those topics only.

    ``list_topics`` asks for every topic of the cluster, which costs a client more the more
    topics the cluster holds (a second and more at a few thousand). The request never creates
    a topic, whatever the broker's ``auto.create.topics.enable``.
    """
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return set()
    request = MetadataRequest(wanted, allow_auto_topic_creation=False)
    response = await admin._send_request(request)  # noqa: SLF001 - the client's own request path
    return {t["topic"] for t in response.to_object()["topics"] if t["error_code"] not in _ABSENT}


def new_topic(kafka: KafkaSettings, logical: str, replication: int) -> NewTopic:
    """The creation request of a logical topic: partitions and configs from the topology."""
    declared = topology.topic_for(logical)
    return NewTopic(
        name=kafka.topic(logical),
        num_partitions=declared.partitions or kafka.partitions,
        replication_factor=replication,
        topic_configs=topic_configs(kafka, logical),
    )


AUTHORIZATION_ERRORS = (TopicAuthorizationFailedError, GroupAuthorizationFailedError, ClusterAuthorizationFailedError)
"""What aiokafka raises when the broker's authorizer refuses a request."""


def principal(kafka: KafkaSettings) -> str:
    """The principal the broker sees for these settings (what its ACLs name)."""
    if kafka.security_protocol.startswith("SASL") and kafka.sasl_username:
        return f"User:{kafka.sasl_username}"
    if kafka.security_protocol == "SSL" and kafka.ssl_certfile:
        return f"the principal of the client certificate {kafka.ssl_certfile}"
    return "User:ANONYMOUS"


def access_denied(exc: Exception, kafka: KafkaSettings, operation: str) -> AccessDenied:
    """One line for an authorization failure: who, which operation, on what, and the remedy.

    aiokafka puts the topic (or the set of topics) or the group id in the error's arguments.
    """
    names = exc.args[0] if exc.args else None
    if isinstance(names, set | frozenset | list | tuple):
        names = ", ".join(sorted(str(n) for n in names))
    if isinstance(exc, GroupAuthorizationFailedError):
        resource = f"group {names or '?'}"
    elif isinstance(exc, ClusterAuthorizationFailedError):
        # InitProducerId: since Kafka 2.8 WRITE on any topic lets an idempotent producer start.
        resource, operation = "the cluster", "IDEMPOTENT_WRITE (WRITE on no topic at all)"
    else:
        resource = f"topic {names or '?'}"
    return AccessDenied(
        f"Kafka refused {principal(kafka)} {operation} on {resource} ({type(exc).__name__}): "
        "the ACLs do not allow it; check the service's SASL user (DRAFTSTREAM_KAFKA__SASL_USERNAME) "
        "or grant the set with `draftstream acls apply`"
    )


@contextmanager
def refused_as(kafka: KafkaSettings, operation: str) -> Iterator[None]:
    """Turn an authorization failure inside the block into :class:`AccessDenied` (one line)."""
    try:
        yield
    except AUTHORIZATION_ERRORS as exc:
        raise access_denied(exc, kafka, operation) from exc


def _needs(logical: str, needed: Iterable[str] | None) -> bool:
    if needed is None:
        return True
    wanted = set(needed)
    return logical in wanted or (logical.startswith(topology.PROMPTS_PREFIX) and topology.PROMPTS in wanted)


async def ensure_topics(
    kafka: KafkaSettings, datasets: Iterable[str] = (), *, needed: Iterable[str] | None = None
) -> list[str]:
    """Create the fixed topics and ``prompts.<dataset>`` for each dataset; idempotent.

    Returns the physical names that were newly created. Under ACLs only the admin may
    create topics: a refused creation fails here (:class:`AccessDenied`) only for a topic
    in ``needed`` (logical names, ``prompts.*`` for every prompts topic; None: all), the
    ones this service uses; a topic it neither sees nor uses is none of its business.
    Replication is ``kafka.replication_factor`` when the configuration sets it, else what
    the cluster affords (:func:`cluster_replication_factor`).
    """
    wanted: list[str] = [*topology.fixed_topics(), *(topology.prompts_topic(d) for d in datasets)]
    return await create_topics(kafka, wanted, needed=needed)


async def create_topics(
    kafka: KafkaSettings, logical_names: Iterable[str], *, needed: Iterable[str] | None = None
) -> list[str]:
    """Create the logical topics that do not exist yet; returns the physical names created.

    A refused creation raises :class:`AccessDenied` only for a topic in ``needed`` (see
    :func:`ensure_topics`).
    """
    logical_of = {kafka.topic(name): name for name in logical_names}
    needed = None if needed is None else tuple(needed)
    admin = make_admin(kafka)
    await admin.start()
    try:
        existing = await existing_topics(admin, logical_of)
        missing = [name for physical, name in logical_of.items() if physical not in existing]
        if not missing:
            return []
        replication = kafka.explicit_replication_factor or await cluster_replication_factor(admin)
        new = [new_topic(kafka, name, replication) for name in missing]
        created: list[str] = []
        # One request for them all; the admin client reports each topic's error in the
        # response instead of raising.
        response = await admin.create_topics(new)
        for name, code, *rest in getattr(response, "topic_errors", ()):
            if code == TopicAlreadyExistsError.errno:
                continue
            if code == TopicAuthorizationFailedError.errno:
                if _needs(logical_of[name], needed):
                    raise AccessDenied(
                        f"topic {name} does not exist or {principal(kafka)} may not see it, and it may not "
                        "CREATE it: create the topics as the admin (`draftstream topics create`) and grant "
                        "the ACLs (`draftstream acls apply`)"
                    )
                log.debug("%s may not create %s, which it does not use", principal(kafka), name)
                continue
            if code:
                raise RuntimeError(f"could not create topic {name}: error {code} {rest[0] if rest else ''}")
            created.append(name)
        return created
    finally:
        await admin.close()


@dataclass(frozen=True)
class PartitionState:
    """Where one partition lives: its leader (-1 when it has none), replicas and in-sync replicas."""

    topic: str
    partition: int
    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]

    @property
    def under_replicated(self) -> bool:
        """Fewer in-sync replicas than replicas: a broker is down or behind."""
        return len(self.isr) < len(self.replicas)


@dataclass(frozen=True)
class ClusterLayout:
    """The live brokers of a cluster and where the partitions of its topics are."""

    brokers: tuple[int, ...]
    partitions: tuple[PartitionState, ...]

    def leaders_per_broker(self, topics: Iterable[str] | None = None) -> dict[int, int]:
        """How many partitions (of ``topics``, default all) each broker leads; 0 for a live
        broker that leads none; -1 counts the partitions without a leader."""
        wanted = None if topics is None else set(topics)
        counts = Counter(p.leader for p in self.partitions if wanted is None or p.topic in wanted)
        return {broker: counts.get(broker, 0) for broker in self.brokers} | {
            leader: n for leader, n in counts.items() if leader not in self.brokers
        }

    @property
    def under_replicated(self) -> tuple[PartitionState, ...]:
        """The partitions with fewer in-sync replicas than replicas."""
        return tuple(p for p in self.partitions if p.under_replicated)


async def describe_layout(kafka: KafkaSettings, topics: Iterable[str] | None = None) -> ClusterLayout:
    """The live brokers and every partition of ``topics`` (default: every topic, internal ones too)."""
    admin = make_admin(kafka)
    await admin.start()
    try:
        cluster = await admin.describe_cluster()
        names = sorted(set(await admin.list_topics()) if topics is None else set(topics))
        described = await admin.describe_topics(names) if names else []
    finally:
        await admin.close()
    partitions = [
        PartitionState(
            topic=t["topic"],
            partition=p["partition"],
            leader=p["leader"],
            replicas=tuple(p["replicas"]),
            isr=tuple(p["isr"]),
        )
        for t in described
        if not t.get("error_code")
        for p in t["partitions"]
    ]
    return ClusterLayout(
        brokers=tuple(sorted(b["node_id"] for b in cluster.get("brokers") or ())),
        partitions=tuple(sorted(partitions, key=lambda p: (p.topic, p.partition))),
    )


def header(headers: Sequence[tuple[str, bytes]] | None, name: str) -> str | None:
    """The last value of a header as text, or None."""
    found: str | None = None
    for key, value in headers or ():
        if key == name and value is not None:
            found = value.decode("utf-8", "replace")
    return found


_MAX_HEADER_TEXT = 4000


def dead_letter(
    *,
    dlq_topic: str,
    stage: str,
    verdict: DeadLetter,
    value: bytes | None,
    key: bytes | None,
    topic: str,
    partition: int,
    offset: int,
    in_headers: Sequence[tuple[str, bytes]] | None = None,
    dataset: str | None = None,
    now_ms: int | None = None,
) -> Outgoing:
    """The dead letter for a failed record: its value byte for byte plus error headers.

    A record without a value (a tombstone) gives a dead letter without a value and the header
    ``DLQ_HEADERS.VALUE_NULL``, so a replay sends a tombstone again, not an empty string.

    Replay and first-failure headers carried by a replayed record are kept, so a record
    that fails again still shows how often it was replayed and when it first failed.
    Every dead letter is logged at WARNING with its key, stage and reason (what Kafka
    Connect's ``errors.log.enable`` does), whichever stage writes it.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    replay_count = header(in_headers, DLQ_HEADERS.REPLAY_COUNT) or "0"
    first_failure = header(in_headers, DLQ_HEADERS.FIRST_FAILURE) or str(now)
    key_text = key.decode("utf-8", "replace") if key is not None else ""
    if dataset is None:
        dataset = key_text.partition(":")[0] if ":" in key_text else ""
    message = verdict.message
    if len(message) > _MAX_HEADER_TEXT:
        message = message[:_MAX_HEADER_TEXT] + "…"
    out: Headers = [
        (DLQ_HEADERS.STAGE, stage.encode()),
        (DLQ_HEADERS.REASON, verdict.reason.encode()),
        (DLQ_HEADERS.REASONS, ",".join(verdict.all_reasons).encode()),
        (DLQ_HEADERS.MESSAGE, message.encode("utf-8", "replace")),
        (DLQ_HEADERS.TOPIC, topic.encode()),
        (DLQ_HEADERS.PARTITION, str(partition).encode()),
        (DLQ_HEADERS.OFFSET, str(offset).encode()),
        (DLQ_HEADERS.DATASET, dataset.encode("utf-8", "replace")),
        (DLQ_HEADERS.KEY, key_text.encode("utf-8", "replace")),
        (DLQ_HEADERS.ATTEMPT, str(verdict.attempt).encode()),
        (DLQ_HEADERS.REPLAY_COUNT, replay_count.encode()),
        (DLQ_HEADERS.FIRST_FAILURE, first_failure.encode()),
        (DLQ_HEADERS.FAILED_AT, str(now).encode()),
    ]
    if verdict.http_status is not None:
        out.append((DLQ_HEADERS.HTTP_STATUS, str(verdict.http_status).encode()))
    if value is None:
        out.append((DLQ_HEADERS.VALUE_NULL, b"true"))
    log.warning(
        "dead letter: stage=%s key=%s reason=%s%s (from %s:%d@%d, attempt %d): %s",
        stage,
        key_text or "-",
        verdict.reason,
        f" http={verdict.http_status}" if verdict.http_status is not None else "",
        topic,
        partition,
        offset,
        verdict.attempt,
        message[:300],
    )
    return Outgoing(topic=dlq_topic, value=value, key=key, headers=out)



def dead_letter_of(
    record: ConsumerRecord[bytes, bytes], *, dlq_topic: str, stage: str, verdict: DeadLetter, dataset: str | None = None
) -> Outgoing:
    """:func:`dead_letter` for a consumed record: its value, key, place and headers as read."""
    return dead_letter(
        dlq_topic=dlq_topic,
        stage=stage,
        verdict=verdict,
        value=record.value,
        key=record.key,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        in_headers=list(record.headers or ()),
        dataset=dataset,
    )

async def report_lag(consumer: AIOKafkaConsumer, group_id: str) -> dict[str, int]:
    """Set the consumer-lag gauge of each assigned topic: high-water mark minus position.

    Returns the lag per topic (for progress lines).
    """
    from services.common.metrics import CONSUMER_LAG

    lag: dict[str, int] = {}
    for tp in consumer.assignment():
        highwater = consumer.highwater(tp)
        if highwater is None:
            continue
        position = await consumer.position(tp)
        lag[tp.topic] = lag.get(tp.topic, 0) + max(0, highwater - position)
    for topic, value in lag.items():
        CONSUMER_LAG.labels(group=group_id, topic=topic).set(value)
    return lag


async def publish_all(producer: AIOKafkaProducer, records: Iterable[Outgoing]) -> None:
    """Send records and wait until the broker has acknowledged every one of them."""
    futures = [await producer.send(r.topic, r.value, key=r.key, headers=r.headers or None) for r in records]
    if futures:
        await asyncio.gather(*futures)


__all__ = [
    "AUTHORIZATION_ERRORS",
    "MAX_REPLICATION_FACTOR",
    "AccessDenied",
    "ClusterLayout",
    "DeadLetter",
    "Headers",
    "Outgoing",
    "PartitionState",
    "access_denied",
    "client_kwargs",
    "cluster_replication_factor",
    "create_topics",
    "dead_letter",
    "dead_letter_of",
    "describe_layout",
    "ensure_topics",
    "existing_topics",
    "header",
    "make_admin",
    "make_consumer",
    "make_producer",
    "new_topic",
    "principal",
    "publish_all",
    "refused_as",
    "replication_for",
    "report_lag",
    "topic_configs",
]
