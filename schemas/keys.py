"""Record keys and dead-letter header names: how records are addressed on the topics."""

from __future__ import annotations

from typing import Final

from schemas.fields import SchemaError


class DeadLetterHeaders:
    """Header names on ``dead-letter`` records, in the style of Kafka Connect's DLQ."""

    STAGE: Final = "draftstream.errors.stage"
    REASON: Final = "draftstream.errors.reason"
    REASONS: Final = "draftstream.errors.reasons"
    MESSAGE: Final = "draftstream.errors.message"
    HTTP_STATUS: Final = "draftstream.errors.http.status"
    TOPIC: Final = "draftstream.errors.topic"
    PARTITION: Final = "draftstream.errors.partition"
    OFFSET: Final = "draftstream.errors.offset"
    DATASET: Final = "draftstream.errors.dataset"
    KEY: Final = "draftstream.errors.key"
    ATTEMPT: Final = "draftstream.errors.attempt"
    REPLAY_COUNT: Final = "draftstream.errors.replay.count"
    FIRST_FAILURE: Final = "draftstream.errors.first.failure.ms"
    FAILED_AT: Final = "draftstream.errors.failed.at.ms"
    # "true" when the failed record had no value (a tombstone): the dead letter's value is null
    # too, and a replay sends a tombstone again rather than an empty string.
    VALUE_NULL: Final = "draftstream.errors.value.null"


DLQ_HEADERS: Final = DeadLetterHeaders


def sample_key(dataset: str, sample_id: str) -> str:
    """The record key shared by every per-sample topic."""
    return f"{dataset}:{sample_id}"


def attempt_key(dataset: str, sample_id: str, attempt_id: str) -> str:
    """``<dataset>:<sample_id>#<attempt id>``: one attempt of a prompt, as the budget holds it."""
    return f"{sample_key(dataset, sample_id)}#{attempt_id}"


def split_key(key: str) -> tuple[str, str]:
    """Split a ``<dataset>:<sample_id>`` key; the sample id may itself contain colons."""
    dataset, sep, sample_id = key.partition(":")
    if not sep:
        raise SchemaError("invalid_key", f"key {key!r} is not '<dataset>:<sample_id>'")
    return dataset, sample_id


PROVIDER_SCOPE_PREFIX: Final = "provider:"
"""The control scope of one configured provider is ``provider:<name>``: a dataset name cannot hold ``:``."""


def provider_scope(name: str) -> str:
    """The halt scope of provider ``name`` (its outage and pre-flight halts pause its workers only)."""
    return f"{PROVIDER_SCOPE_PREFIX}{name}"


def provider_of_scope(scope: str) -> str | None:
    """The provider a control scope names, or None for ``global`` and dataset scopes."""
    return scope[len(PROVIDER_SCOPE_PREFIX):] if scope.startswith(PROVIDER_SCOPE_PREFIX) else None
