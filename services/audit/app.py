"""The audit worker: ``samples`` → checks → ``accepted`` or ``dead-letter``.

A StageRunner batch handler: decode each record, group by profile, run the checks with
one decode and one encode call per group, publish passing samples to ``accepted`` and
turn failing ones into dead letters carrying every failing code (the first primary).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from aiokafka import AIOKafkaProducer, ConsumerRecord

from schemas import (
    ACCEPTED_TOPIC,
    SampleAudited,
    SampleReconstructed,
    SchemaError,
    decode,
    encode,
    encode_forwarding,
    topology,
)
from services.audit.core import audit_batch, failure_message
from services.common.config import AuditThresholds, Settings
from services.common.kafka import DeadLetter, Outgoing
from services.common.metrics import ACCEPTED, AUDIT_CHECKS
from services.common.stage import Result, RunnerService, StageRunner
from services.profiles import ProfileError, ProfileLike, load_profile

log = logging.getLogger(__name__)

STAGE = "audit"

ProfileLoader = Callable[[str], ProfileLike]


class UnknownProfile(Exception):
    """The sample names a profile that cannot be loaded."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def default_profile_loader(settings: Settings) -> ProfileLoader:
    """Load profiles through services.profiles (whose cache keeps each profile, or its load error, once)."""

    def load(name: str) -> ProfileLike:
        try:
            return load_profile(name, settings)
        except ProfileError as exc:
            raise UnknownProfile(exc.reason, str(exc)) from None

    return load


class AuditService(RunnerService):
    """The audit stage as a Service (start/run/stop/close)."""

    def __init__(
        self,
        settings: Settings,
        *,
        profiles: ProfileLoader | None = None,
        producer: AIOKafkaProducer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Wire the stage; ``profiles`` maps a profile name to a loaded profile."""
        self.settings = settings
        self.profiles = profiles or default_profile_loader(settings)
        self.clock = clock
        self.accepted_topic = settings.kafka.topic(ACCEPTED_TOPIC)
        self.runner = StageRunner.of_stage(settings, STAGE, self.handle, producer=producer)

    async def handle(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[Result]:
        """Decide every record of a batch: outputs for passing samples, dead letters otherwise."""
        results: list[Result | None] = [None] * len(records)
        checks: Counter[tuple[str, str, str]] = Counter()  # (dataset, check, result): one inc per batch
        groups: dict[str, list[tuple[int, SampleReconstructed]]] = {}
        for i, record in enumerate(records):
            try:
                sample = decode(record.value, SampleReconstructed)
            except SchemaError as exc:
                results[i] = DeadLetter(exc.reason, f"sample does not decode: {exc.message}")
                continue
            groups.setdefault(sample.profile, []).append((i, sample))
        for name, members in groups.items():
            try:
                profile = self.profiles(name)
            except UnknownProfile as exc:
                for i, _ in members:
                    results[i] = DeadLetter("unknown_profile", f"profile {name!r}: {exc} ({exc.reason})")
                continue
            samples = [s for _, s in members]
            audited: list[SampleAudited | None]
            try:
                audited = list(await asyncio.to_thread(
                    audit_batch, samples, profile, self.settings_thresholds,
                    audited_at=self.clock(),
                ))
            except Exception as exc:  # noqa: BLE001 - a tokenizer that chokes is a dead letter
                log.warning("audit of %d %s sample(s) failed: %s; auditing one by one",
                            len(samples), name, exc)
                audited = []
                for i, s in members:
                    try:
                        audited.extend(audit_batch([s], profile, self.settings_thresholds,
                                                   audited_at=self.clock()))
                    except Exception as one:  # noqa: BLE001
                        results[i] = DeadLetter("decode_failed", f"{type(one).__name__}: {one}")
                        audited.append(None)
            for (i, sample), verdict in zip(members, audited, strict=True):
                if verdict is None:
                    continue
                checks.update((verdict.dataset, r.code, "pass" if r.passed else "fail") for r in verdict.results)
                results[i] = self._route(records[i], verdict, forward=verdict.sample is sample)
        # Counted per batch: a labels() lookup per check and sample cost more than the checks.
        for (dataset, code, outcome), n in checks.items():
            AUDIT_CHECKS.labels(dataset=dataset, check=code, result=outcome).inc(n)
        return [r if r is not None else DeadLetter("internal_error", "no verdict") for r in results]

    def settings_thresholds(self, dataset: str) -> AuditThresholds:
        """The audit thresholds of a dataset."""
        return self.settings.dataset(dataset).audit

    def _route(self, record: ConsumerRecord[bytes, bytes], verdict: SampleAudited, *, forward: bool) -> Result:
        """Dead letter or ``accepted`` record; ``forward``: the verdict's sample is the one decoded from ``record``."""
        if not verdict.passed:
            return DeadLetter(verdict.reasons[0], failure_message(verdict), reasons=tuple(verdict.reasons))
        ACCEPTED.labels(dataset=verdict.dataset).inc()
        key = record.key if record.key is not None else f"{verdict.dataset}:{verdict.sample_id}".encode()
        # The sample goes on inside the verdict as the bytes it arrived as, not encoded again.
        value = encode_forwarding(verdict, "sample", record.value) if forward and record.value else encode(verdict)
        # A truncated answer accepted (accept_truncated) says so in a header: status counts them.
        headers = [(topology.TRUNCATED_HEADER, b"1")] if verdict.sample.response.finish_reason == "length" else []
        return [Outgoing(topic=self.accepted_topic, value=value, key=key, headers=headers)]



def create_app(
    settings: Settings,
    *,
    profiles: ProfileLoader | None = None,
    producer: AIOKafkaProducer | None = None,
) -> AuditService:
    """The composition root of the audit worker."""
    return AuditService(settings, profiles=profiles, producer=producer)
