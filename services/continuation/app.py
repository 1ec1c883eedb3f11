"""The continuation worker: ``accepted`` → the next turn on ``prompts.<dataset>``, its state on ``conversation-state``.

A StageRunner batch handler (consumer group ``draftstream-continuation``, beside the sink's
on the same topic): decode each accepted sample, ask the core what follows, publish the next
turn's prompt keyed ``<dataset>:<conversation_id>:<turn>`` and the conversation's state keyed
``<dataset>:<conversation_id>``, and only then commit. A crash before the commit replays the
batch: the same prompt under the same key, which inference answers from its response store
(the request is the same) and the sink writes once. A sample of a single-turn prompt is passed
over; a record that does not decode, or a turn its conversation lacks, is a dead letter. A
completions-mode turn is split by its profile's output format (the profile's declarations only:
no tokenizer is loaded here).

The next turn goes through ``prompts.<dataset>`` and the inference gate like any prompt, so a
halt holds it and the budget counts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from aiokafka import AIOKafkaProducer, ConsumerRecord

from schemas import CONVERSATIONS_TOPIC, SampleAudited, SchemaError, decode, encode, sample_key
from services.common.config import Settings
from services.common.kafka import DeadLetter, Outgoing
from services.common.stage import Result, RunnerService, StageRunner
from services.continuation.core import Continued, ConversationError, continue_conversation
from services.profiles import ProfileError, profile_spec
from services.profiles.split import OutputFormat

STAGE = "continuation"


class ContinuationService(RunnerService):
    """The continuation stage as a Service (start/run/stop/close)."""

    def __init__(
        self, settings: Settings, *, producer: AIOKafkaProducer | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        """Wire the stage on its input topic and consumer group from the topology."""
        self.settings = settings
        self.clock = clock
        self.conversations_topic = settings.kafka.topic(CONVERSATIONS_TOPIC)
        self.runner = StageRunner.of_stage(settings, STAGE, self.handle, producer=producer)
        self._formats: dict[str, OutputFormat] = {}

    def output_format(self, profile: str) -> OutputFormat:
        """The output format of a profile, from its declarations (cached; raises ProfileError)."""
        fmt = self._formats.get(profile)
        if fmt is None:
            fmt = self._formats[profile] = OutputFormat.of(profile_spec(profile, self.settings))
        return fmt

    async def handle(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[Result]:
        """The next prompt and the conversation's state per accepted turn; dead letters for bad records."""
        return [self._one(record) for record in records]

    def _one(self, record: ConsumerRecord[bytes, bytes]) -> Result:
        try:
            audited = decode(record.value, SampleAudited)
        except SchemaError as exc:
            return DeadLetter(exc.reason, f"accepted record does not decode: {exc.message}")
        if not audited.passed:
            return []  # the sink dead-letters it; nothing to continue
        try:
            response = audited.sample.response
            raw = response.mode == "completions" and response.prompt.conversation is not None
            fmt = self.output_format(audited.sample.profile) if raw else None
            verdict = continue_conversation(audited, at=self.clock(), output_format=fmt)
        except (ConversationError, ProfileError) as exc:
            return DeadLetter(exc.reason, exc.message)
        if verdict is None:
            return []
        progress = verdict.progress
        out = [
            Outgoing(
                topic=self.conversations_topic,
                value=encode(progress),
                key=sample_key(progress.dataset, progress.conversation_id).encode(),
            )
        ]
        if isinstance(verdict, Continued):
            prompt = verdict.prompt
            # The prompt first: a state "in_progress" is never ahead of the prompt it announces.
            out.insert(
                0,
                Outgoing(
                    topic=self.settings.kafka.prompts_topic(prompt.dataset),
                    value=encode(prompt),
                    key=sample_key(prompt.dataset, prompt.sample_id).encode(),
                ),
            )
        return out


def create_app(settings: Settings, *, producer: AIOKafkaProducer | None = None) -> ContinuationService:
    """The composition root of the continuation worker."""
    return ContinuationService(settings, producer=producer)


__all__ = ["STAGE", "ContinuationService", "create_app"]
