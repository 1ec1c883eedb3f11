"""Dead-letter records: filtering, grouping and replay planning (pure: no Kafka, no clock).

A dead letter keeps the failed record's value byte for byte (a tombstone's null too, marked
by the ``VALUE_NULL`` header) and says in its headers (:class:`schemas.DeadLetterHeaders`)
which stage failed it, why, and where it came from.
Replay re-sends the value to that topic (or to a named stage's input topic) with the
replay count incremented and the first-failure time kept, so if it fails again the new
dead letter still shows its history. A record is identified by ``<partition>:<offset>``
on the dead-letter topic; the replay ledger remembers those ids so a second run does
not send the same record twice.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from schemas import (
    DLQ_HEADERS,
    PromptPublished,
    ResponseReceived,
    SampleAudited,
    SampleReconstructed,
    SchemaError,
    decode,
    encode,
    topology,
)

Headers = list[tuple[str, bytes]]

REPLAYED_TOPIC: Final = topology.DLQ_REPLAYED
ERROR_HEADER_PREFIX: Final = "draftstream.errors."
DEFAULT_MAX_REPLAYS: Final = 3
# The stages a dead letter can be replayed to: those that read a topic.
STAGES: Final[tuple[str, ...]] = tuple(s for s in topology.STAGES if s in topology.STAGE_INPUT)


class FilterError(ValueError):
    """A filter value that cannot be understood (e.g. a bad time)."""


def _header(headers: Sequence[tuple[str, bytes | None]], name: str) -> str | None:
    found: str | None = None
    for key, value in headers:
        if key == name and value is not None:
            found = value.decode("utf-8", "replace")
    return found


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


@dataclass(frozen=True)
class DeadLetterRecord:
    """One record read from the dead-letter topic, with its headers decoded on demand."""

    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()

    @property
    def id(self) -> str:
        """``<partition>:<offset>`` on the dead-letter topic: the replay ledger key."""
        return f"{self.partition}:{self.offset}"

    def header(self, name: str) -> str | None:
        """The last value of a header as text, or None."""
        return _header(self.headers, name)

    @property
    def key_text(self) -> str:
        """The record key as text ('' when there is none)."""
        return self.key.decode("utf-8", "replace") if self.key is not None else ""

    @property
    def stage(self) -> str:
        """The stage that dead-lettered the record."""
        return self.header(DLQ_HEADERS.STAGE) or "unknown"

    @property
    def reason(self) -> str:
        """The primary reason code."""
        return self.header(DLQ_HEADERS.REASON) or "unknown"

    @property
    def reasons(self) -> tuple[str, ...]:
        """Every reason code, the primary first."""
        listed = [r for r in (self.header(DLQ_HEADERS.REASONS) or "").split(",") if r]
        return (self.reason, *(r for r in listed if r != self.reason))

    @property
    def message(self) -> str:
        """The stage's error message."""
        return self.header(DLQ_HEADERS.MESSAGE) or ""

    @property
    def dataset(self) -> str:
        """The dataset, from the header or else the key's prefix."""
        named = self.header(DLQ_HEADERS.DATASET)
        if named:
            return named
        key = self.key_text
        return key.partition(":")[0] if ":" in key else ""

    @property
    def value_null(self) -> bool:
        """True when the failed record was a tombstone (its value null, not empty)."""
        return self.header(DLQ_HEADERS.VALUE_NULL) == "true"

    @property
    def original_topic(self) -> str | None:
        """The topic the failed record was read from."""
        return self.header(DLQ_HEADERS.TOPIC) or None

    @property
    def replay_count(self) -> int:
        """How many times this record was replayed before it failed this time."""
        return _int(self.header(DLQ_HEADERS.REPLAY_COUNT))

    @property
    def failed_at_ms(self) -> int:
        """When the stage failed the record (header, else the Kafka timestamp)."""
        return _int(self.header(DLQ_HEADERS.FAILED_AT), self.timestamp_ms)

    @property
    def first_failure_ms(self) -> int:
        """When the record first failed, across replays."""
        return _int(self.header(DLQ_HEADERS.FIRST_FAILURE), self.failed_at_ms)


@dataclass(frozen=True)
class Filters:
    """Which dead letters a command applies to; None means any."""

    stage: str | None = None
    reason: str | None = None
    dataset: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    key: str | None = None

    def matches(self, record: DeadLetterRecord) -> bool:
        """True when the record passes every filter that is set."""
        if self.stage is not None and record.stage != self.stage:
            return False
        if self.reason is not None and self.reason not in record.reasons:
            return False
        if self.dataset is not None and record.dataset != self.dataset:
            return False
        if self.key is not None and record.key_text != self.key:
            return False
        if self.since_ms is not None and record.failed_at_ms < self.since_ms:
            return False
        return not (self.until_ms is not None and record.failed_at_ms > self.until_ms)


_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)\s*(?:ago)?\s*$", re.IGNORECASE)
_UNIT_S: Final[Mapping[str, float]] = {
    "s": 1,
    "sec": 1,
    "m": 60,
    "min": 60,
    "h": 3600,
    "d": 86400,
    "w": 604800,
}


def parse_time(text: str, now_ms: int) -> int:
    """Epoch milliseconds from an ISO 8601 time or a relative age like ``90s``, ``15m``, ``1h``, ``2d``.

    A time without a zone is taken as UTC.
    """
    match = _RELATIVE.match(text)
    if match:
        amount, unit = float(match.group(1)), match.group(2).lower()
        return now_ms - int(amount * _UNIT_S[unit] * 1000)
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise FilterError(
            f"cannot read time {text!r}: use ISO 8601 (2026-01-31T12:00) or an age like 30m, 1h, 2d"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


@dataclass(frozen=True)
class ReasonGroup:
    """Dead letters sharing a stage and primary reason: a count and one example key."""

    stage: str
    reason: str
    count: int
    example_key: str
    datasets: tuple[str, ...]


def group_by_reason(records: Iterable[DeadLetterRecord]) -> list[ReasonGroup]:
    """Dead letters grouped by (stage, reason), largest group first."""
    counts: Counter[tuple[str, str]] = Counter()
    examples: dict[tuple[str, str], str] = {}
    datasets: dict[tuple[str, str], set[str]] = {}
    for record in records:
        group = (record.stage, record.reason)
        counts[group] += 1
        examples.setdefault(group, record.key_text)
        datasets.setdefault(group, set()).add(record.dataset)
    return [
        ReasonGroup(stage, reason, count, examples[(stage, reason)], tuple(sorted(datasets[(stage, reason)])))
        for (stage, reason), count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


def latest_per_key(records: Iterable[DeadLetterRecord]) -> list[DeadLetterRecord]:
    """The latest dead letter of each key (a replay that failed again supersedes the one before), in order.

    A key's records share a partition, so the latest is the one at the highest offset. A record
    without a key stands alone.
    """
    latest: dict[str, DeadLetterRecord] = {}
    alone: list[DeadLetterRecord] = []
    for record in records:
        if record.key is None:
            alone.append(record)
            continue
        seen = latest.get(record.key_text)
        if seen is None or (record.replay_count, record.partition, record.offset) > (
            seen.replay_count, seen.partition, seen.offset
        ):
            latest[record.key_text] = record
    return sorted([*latest.values(), *alone], key=lambda r: (r.partition, r.offset))


def replay_headers(record: DeadLetterRecord, *, repay: bool = False) -> Headers:
    """Headers of the re-sent record: its own, the replay count plus one, the first failure.

    The error headers of the dead letter are dropped (they describe the failure, not the
    record), except the two that carry its history across failures.
    """
    kept: Headers = [(k, v) for k, v in record.headers if not k.startswith(ERROR_HEADER_PREFIX)]
    kept.append((DLQ_HEADERS.REPLAY_COUNT, str(record.replay_count + 1).encode()))
    kept.append((DLQ_HEADERS.FIRST_FAILURE, str(record.first_failure_ms).encode()))
    if repay:
        kept.append((topology.REPAY_HEADER, b"1"))
    return kept


def target_topic(record: DeadLetterRecord, topic_prefix: str, to: str | None = None) -> str | None:
    """Where a replay goes: ``to``'s input topic when given, else the original topic.

    ``topic_prefix`` is the deployment's ``kafka.topic_prefix``, put before logical names
    as ``KafkaSettings.topic`` does.
    """
    if to is None:
        return record.original_topic
    if to not in STAGES:
        raise FilterError(f"unknown stage {to!r} for --to; use one of: {', '.join(STAGES)}")
    if topology.STAGE_INPUT[to] == topology.PROMPTS:
        return topic_prefix + topology.prompts_topic(record.dataset) if record.dataset else None
    return topic_prefix + topology.STAGE_INPUT[to]


Event = PromptPublished | ResponseReceived | SampleReconstructed | SampleAudited
# What each stage reads; a later event carries the earlier ones inside it.
_STAGE_EVENT: Final[Mapping[str, type[Event]]] = {
    "inference": PromptPublished,
    "reconstruct": ResponseReceived,
    "audit": SampleReconstructed,
    "sink": SampleAudited,
}


def _decode_event(value: bytes) -> Event | None:
    types: tuple[type[Event], ...] = (SampleAudited, SampleReconstructed, ResponseReceived, PromptPublished)
    for type_ in types:
        try:
            return decode(value, type_)
        except SchemaError:
            continue
    return None


def _earlier(event: Event, wanted: type[Event]) -> Event | None:
    """Walk back from a later event to the one ``wanted`` (a sample holds its response...)."""
    current: Event | None = event
    while current is not None and not isinstance(current, wanted):
        if isinstance(current, SampleAudited):
            current = current.sample
        elif isinstance(current, SampleReconstructed):
            current = current.response
        elif isinstance(current, ResponseReceived):
            current = current.prompt
        else:
            current = None
    return current


def value_for_stage(value: bytes | None, to: str | None) -> bytes | None:
    """The value to send to ``to``'s input: the original bytes, or the earlier event inside it.

    Replaying an audit failure ``--to inference`` sends the sample's prompt, so the model
    answers it again. Returns None when the value holds no event that stage reads.
    """
    if to is None or value is None:
        return value
    wanted = _STAGE_EVENT[to]
    event = _decode_event(value)
    if event is None:
        return None
    if isinstance(event, wanted):
        return value  # byte for byte
    inner = _earlier(event, wanted)
    return encode(inner) if inner is not None else None


@dataclass(frozen=True)
class PlannedReplay:
    """One record to re-send: to which topic, with which value and headers."""

    record: DeadLetterRecord
    topic: str
    headers: Headers
    value: bytes | None = None

    @property
    def payload(self) -> bytes | None:
        """The bytes to send: a converted value, else the dead letter's own; None for a tombstone."""
        if self.value is not None:
            return self.value
        if self.record.value_null:
            return None
        return self.record.value or b""


@dataclass
class ReplayPlan:
    """What a replay will do with each matching dead letter."""

    send: list[PlannedReplay] = field(default_factory=list)
    already_replayed: list[DeadLetterRecord] = field(default_factory=list)
    over_max_replays: list[DeadLetterRecord] = field(default_factory=list)
    missing_topic: list[tuple[DeadLetterRecord, str]] = field(default_factory=list)
    no_target: list[DeadLetterRecord] = field(default_factory=list)
    wrong_kind: list[DeadLetterRecord] = field(default_factory=list)


def plan_replay(
    records: Iterable[DeadLetterRecord],
    *,
    topic_prefix: str,
    existing_topics: Iterable[str],
    replayed_ids: Iterable[str],
    to: str | None = None,
    max_replays: int = DEFAULT_MAX_REPLAYS,
    fresh: bool = False,
) -> ReplayPlan:
    """Decide, per dead letter, whether to re-send it and where; pure over its inputs.

    ``fresh`` (only with ``to="inference"``) marks each prompt to be paid for again rather than
    answered from the response store.
    """
    if to is not None and to not in STAGES:
        raise FilterError(f"unknown stage {to!r} for --to; use one of: {', '.join(STAGES)}")
    if fresh and to != "inference":
        raise FilterError("--fresh asks the provider for a new answer: use it with --to inference")
    topics = set(existing_topics)
    done = set(replayed_ids)
    plan = ReplayPlan()
    for record in records:
        if record.id in done:
            plan.already_replayed.append(record)
            continue
        if record.replay_count >= max_replays:
            plan.over_max_replays.append(record)
            continue
        topic = target_topic(record, topic_prefix, to)
        if topic is None:
            plan.no_target.append(record)
        elif topic not in topics:
            plan.missing_topic.append((record, topic))
        elif to is None:
            plan.send.append(PlannedReplay(record, topic, replay_headers(record)))
        else:
            value = value_for_stage(record.value, to)
            if value is None:
                plan.wrong_kind.append(record)
            else:
                converted = None if value == record.value else value
                plan.send.append(PlannedReplay(record, topic, replay_headers(record, repay=fresh), converted))
    return plan


def preview(value: bytes | None, limit: int = 400) -> str:
    """A short, printable rendering of a record value."""
    if value is None:
        return "(no value)"
    text = value[: limit * 4].decode("utf-8", "replace")
    text = text.replace("\n", "\\n")
    return (
        text if len(text) <= limit and len(value) <= limit * 4 else text[:limit] + f"… ({len(value)} bytes)"
    )


def format_ms(ms: int) -> str:
    """Epoch milliseconds as a UTC ISO time to the second."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = [
    "DEFAULT_MAX_REPLAYS",
    "REPLAYED_TOPIC",
    "STAGES",
    "DeadLetterRecord",
    "FilterError",
    "Filters",
    "PlannedReplay",
    "ReasonGroup",
    "ReplayPlan",
    "format_ms",
    "group_by_reason",
    "latest_per_key",
    "parse_time",
    "plan_replay",
    "preview",
    "replay_headers",
    "target_topic",
    "value_for_stage",
]
