"""The reconstruct stage's shell: ``responses`` in, ``samples`` (or dead letters) out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from aiokafka import ConsumerRecord

from schemas import (
    SAMPLES_TOPIC,
    ResponseReceived,
    SchemaError,
    decode,
    encode,
    encode_forwarding,
    sample_key,
)
from services.common.config import Settings
from services.common.kafka import DeadLetter, Outgoing
from services.common.metrics import RECONSTRUCTED
from services.common.stage import Result, RunnerService, StageRunner
from services.profiles import Profile, ProfileError, load_profile
from services.profiles.conventions import Convention, convention_for
from services.reconstruct.core import reconstruct_batch

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
    """The provider convention of a response: configured, else by the provider kind it came from."""
    convention = convention_for(response.provider, settings.provider.convention)
    offset = settings.dataset(response.dataset).audit.usage_offset
    if offset is not None and offset != convention.completion_offset:
        from dataclasses import replace

        convention = replace(convention, completion_offset=offset)
    return convention


def decide(records: Sequence[ConsumerRecord[bytes, bytes]], profiles: ProfileCache, samples_topic: str) -> list[Result]:
    """Verdicts for a batch: decode, group by profile, rebuild each group in one batch call."""
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
        verdicts = reconstruct_batch([r for _, r in members], profile, convention)
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
        self.runner = StageRunner.of_stage(settings, STAGE, self._handle)

    async def _handle(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[Result]:
        # Tokenizing is CPU work: keep the event loop (and the consumer heartbeat) free.
        return await asyncio.to_thread(decide, records, self.profiles, self._samples_topic)

    async def start(self) -> None:
        """Load the configured profiles, then connect to Kafka."""
        names = {self.settings.defaults.profile, *(d.profile for d in self.settings.datasets.values())}
        for name in sorted(names):
            await asyncio.to_thread(self.profiles.get, name)
        await super().start()



def create_app(settings: Settings, *, profiles: Mapping[str, Profile] | None = None) -> ReconstructService:
    """The composition root: a reconstruct service, with ``profiles`` injected when given."""
    return ReconstructService(settings, profiles)
