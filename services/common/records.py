"""What a stage decides about a record, free of any Kafka import so pure cores can use it."""

from __future__ import annotations

from dataclasses import dataclass, field

Headers = list[tuple[str, bytes]]


@dataclass(frozen=True)
class DeadLetter:
    """A stage's verdict that a record cannot go on: why, with the first reason primary."""

    reason: str
    message: str
    reasons: tuple[str, ...] = ()
    http_status: int | None = None
    attempt: int = 1

    @property
    def all_reasons(self) -> tuple[str, ...]:
        """Every reason code, the primary first."""
        return (self.reason, *(r for r in self.reasons if r != self.reason))


@dataclass(frozen=True)
class Outgoing:
    """One record to publish; ``value`` None is a tombstone."""

    topic: str
    value: bytes | None
    key: bytes | None = None
    headers: Headers = field(default_factory=list)
