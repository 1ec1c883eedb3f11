"""The wire's building blocks: the schema version, bounded field types, the error a bad record raises."""

from __future__ import annotations

from typing import Annotated, Final

from msgspec import Meta

SCHEMA_VERSION: Final = 1

# Bounds that make absurd numbers a decode error instead of a silent corruption.
_MAX_TOKENS = 50_000_000
NonNegInt = Annotated[int, Meta(ge=0, le=_MAX_TOKENS)]
TokenId = Annotated[int, Meta(ge=0, le=10_000_000)]
NonNegFloat = Annotated[float, Meta(ge=0.0, le=1e9)]
# A record newer than this build (``schema_version`` above ``SCHEMA_VERSION``) is refused,
# at every level (a response's prompt too), rather than half-understood.
Version = Annotated[int, Meta(ge=1, le=SCHEMA_VERSION)]
Name = Annotated[str, Meta(min_length=1, max_length=200)]

Offset = Annotated[int, Meta(ge=0)]


class SchemaError(ValueError):
    """A record that does not decode as its schema; ``reason`` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
