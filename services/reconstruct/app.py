"""The reconstruct stage's shell: ``responses`` in, ``samples`` (or dead letters) out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from schemas import (
    PROVIDER_FACTS_TOPIC,
    SAMPLES_TOPIC,
    ProviderFactRecorded,
    ResponseReceived,
    SchemaError,
    decode,
    encode,
    encode_forwarding,
    sample_key,
)
from services.common.config import KafkaSettings, Settings
from services.common.kafka import DeadLetter, Outgoing, create_topics, make_consumer, publish_all
from services.common.metrics import RECONSTRUCTED
from services.common.stage import Result, RunnerService, StageRunner
from services.common.topics import Record, catch_up, follow, ready_partitions
from services.profiles import Profile, ProfileError, load_profile
from services.profiles.conventions import Convention, convention_for
from services.reconstruct.facts import STRIPS_PLACE, FactBook, fact_key
from services.reconstruct.verify import reconstruct_with_facts

log = logging.getLogger(__name__)

STAGE = "reconstruct"


class ProfileCache:
    """Profiles by name: injected ones first, others loaded once; load failures remembered."""

    def __init__(self, settings: Settings, profiles: Mapping[str, Profile] | None = None) -> None:
        self._settings = settings
        self._loaded: dict[str, Profile] = dict(profiles or {})
        self._failed: dict[str, ProfileError] = {}

    def get(self, name: str) -> Profile | ProfileError:
        """The profile, or the error that prevents loading it."""
        if name in self._loaded:
            return self._loaded[name]
        if name in self._failed:
            return self._failed[name]
        try:
            profile = load_profile(name, self._settings)
        except ProfileError as exc:
            log.error("profile %s cannot be loaded: %s", name, exc)
            self._failed[name] = exc
            return exc
        self._loaded[name] = profile
        return profile

    def profile_name(self, response: ResponseReceived) -> str:
        """The profile a response is rebuilt with: its dataset's configured one, else the one it names.

        The name a response carries is only a default, so a replay after a profile is
        corrected in the configuration uses the corrected one.
        """
        if response.dataset in self._settings.datasets:
            return self._settings.datasets[response.dataset].profile
        return response.profile or self._settings.defaults.profile

    def convention(self, response: ResponseReceived) -> Convention:
        """What the provider that answered dropped from its text (services.profiles.conventions)."""
        return convention_of(self._settings, response)


def convention_of(settings: Settings, response: ResponseReceived) -> Convention:
    """The provider convention of a response: configured for the provider that answered
    (its ``[providers.NAME]``, else ``[provider]``), else by the provider kind it came from."""
    configured = settings.all_providers().get(response.provider_name, settings.provider).convention
    convention = convention_for(response.provider, configured)
    offset = settings.dataset(response.dataset).audit.usage_offset
    if offset is not None and offset != convention.completion_offset:
        from dataclasses import replace

        convention = replace(convention, completion_offset=offset)
    return convention


class FactFollower:
    """The upstreams' facts (services/reconstruct/facts.py), shared by every reconstruct worker.

    ``provider-facts`` is read to its end at start and followed on the event loop; records
    read there wait in a queue until the next batch takes them (:meth:`book`, on the
    batch's thread), so the book is only ever touched by one thread. Facts this worker
    establishes or withdraws are published, acknowledged, before the batch's samples.
    """

    def __init__(self, kafka: KafkaSettings) -> None:
        self._kafka = kafka
        self.topic = kafka.topic(PROVIDER_FACTS_TOPIC)
        self._book = FactBook()
        self._incoming: deque[ProviderFactRecorded] = deque()  # thread-safe hand-over to the batch thread
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Create the topic when missing, read it to its end, then follow it."""
        await create_topics(self._kafka, [PROVIDER_FACTS_TOPIC], needed=(PROVIDER_FACTS_TOPIC,))
        tps = [TopicPartition(self.topic, p) for p in await ready_partitions(self._kafka, self.topic)]
        self._consumer = make_consumer(self._kafka, group_id=None)
        await self._consumer.start()
        self._consumer.assign(tps)
        await catch_up(self._consumer, tps, self._take, past_end=True)
        self.book()
        self._task = asyncio.create_task(self._follow())

    def book(self) -> FactBook:
        """The facts as known now: every record read so far applied."""
        while self._incoming:
            self._book.apply(self._incoming.popleft())
        return self._book

    async def publish(self, producer: AIOKafkaProducer | None, changes: Sequence[ProviderFactRecorded]) -> None:
        """Publish facts established or withdrawn here, and wait for the broker's acknowledgement."""
        records = [Outgoing(topic=self.topic, value=encode(f), key=fact_key(f.upstream, f.place).encode())
                   for f in changes]  # fmt: skip
        for fact in changes:
            if fact.withdrawn:
                log.warning("provider fact %s withdrawn (established by %s, contradicted by %s): %s",
                            fact_key(fact.upstream, fact.place), fact.evidence, fact.contradicted_by, fact.reason)
            elif fact.place == STRIPS_PLACE:
                log.warning("upstream %s loses whitespace its convention says it keeps (evidence %s: %s); its "
                            "answers are judged as a stripping upstream's from now on: set [provider] convention",
                            fact.upstream, fact.evidence, fact.reason)
            else:
                log.info("provider fact %s established (evidence %s)", fact_key(fact.upstream, fact.place),
                         fact.evidence)
        if producer is None:
            raise RuntimeError("start() the stage first")
        await publish_all(producer, records)

    async def close(self) -> None:
        """Stop following."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()

    async def _follow(self) -> None:
        assert self._consumer is not None  # noqa: S101 - start() first
        await follow(self._consumer, self._take, what="provider facts")

    def _take(self, record: Record) -> None:
        if record.value is None:
            return
        try:
            self._incoming.append(decode(record.value, ProviderFactRecorded))
        except SchemaError as exc:
            log.warning("provider-facts record at offset %s ignored: %s", record.offset, exc.message)


def decide(
    records: Sequence[ConsumerRecord[bytes, bytes]],
    profiles: ProfileCache,
    samples_topic: str,
    book: FactBook | None = None,
    changes: list[ProviderFactRecorded] | None = None,
) -> list[Result]:
    """Verdicts for a batch: decode, group by profile, rebuild each group in one batch call.

    With ``book``, the upstreams' facts close gaps and accumulate; facts established or
    withdrawn are appended to ``changes`` for the shell to publish.
    """
    results: list[Result | None] = [None] * len(records)
    groups: dict[tuple[str, Convention], list[tuple[int, ResponseReceived]]] = {}
    for index, record in enumerate(records):
        try:
            response = decode(record.value, ResponseReceived)
        except SchemaError as exc:
            results[index] = DeadLetter(exc.reason, exc.message)
            continue
        group = (profiles.profile_name(response), profiles.convention(response))
        groups.setdefault(group, []).append((index, response))
    for (name, convention), members in groups.items():
        profile = profiles.get(name)
        if isinstance(profile, ProfileError):
            for index, _ in members:
                results[index] = DeadLetter(profile.reason, profile.message)
            continue
        verdicts, found = reconstruct_with_facts([r for _, r in members], profile, convention, book, at=time.time())
        if changes is not None:
            changes += found
        for (index, response), verdict in zip(members, verdicts, strict=True):
            if isinstance(verdict, DeadLetter):
                results[index] = verdict
                continue
            RECONSTRUCTED.labels(dataset=response.dataset, method=verdict.method).inc()
            key = sample_key(response.dataset, response.sample_id).encode()
            raw = records[index].value
            # The response goes on inside the sample as the bytes it arrived as, not encoded again.
            forward = raw and verdict.response is response
            value = encode_forwarding(verdict, "response", raw) if forward else encode(verdict)
            results[index] = [Outgoing(topic=samples_topic, value=value, key=key)]
    return [r if r is not None else DeadLetter("internal_error", "no verdict") for r in results]


class ReconstructService(RunnerService):
    """The long-running reconstruct stage (a :class:`services.common.service.Service`)."""

    def __init__(self, settings: Settings, profiles: Mapping[str, Profile] | None = None) -> None:
        self.settings = settings
        self.profiles = ProfileCache(settings, profiles)
        self._samples_topic = settings.kafka.topic(SAMPLES_TOPIC)
        self.facts = FactFollower(settings.kafka)
        self.runner = StageRunner.of_stage(settings, STAGE, self._handle)

    async def _handle(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[Result]:
        # Tokenizing is CPU work: keep the event loop (and the consumer heartbeat) free.
        changes: list[ProviderFactRecorded] = []

        def run() -> list[Result]:
            return decide(records, self.profiles, self._samples_topic, self.facts.book(), changes)

        results = await asyncio.to_thread(run)
        if changes:  # before the samples that rely on them: a crash in between replays the batch
            await self.facts.publish(self.runner.producer, changes)
        return results

    async def start(self) -> None:
        """Load the configured profiles, read the upstreams' facts, then connect to Kafka."""
        names = {self.settings.defaults.profile, *(d.profile for d in self.settings.datasets.values())}
        for name in sorted(names):
            await asyncio.to_thread(self.profiles.get, name)
        await self.facts.start()
        await super().start()

    async def close(self) -> None:
        """Stop following the facts, then disconnect."""
        await self.facts.close()
        await super().close()



def create_app(settings: Settings, *, profiles: Mapping[str, Profile] | None = None) -> ReconstructService:
    """The composition root: a reconstruct service, with ``profiles`` injected when given."""
    return ReconstructService(settings, profiles)
