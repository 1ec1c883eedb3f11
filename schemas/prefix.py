"""Prefix facts of a multi-turn conversation: does a turn's prompt extend the previous turn's sequence?

A trainer that packs a conversation into one sequence may merge turn k+1's row into turn k's only
when turn k+1's prompt ids begin with turn k's full sequence (``prompt_ids + output_ids``): an
append-only template. A template that drops reasoning from the history (DeepSeek-R1 and V3.1; Qwen3
before the last user query) rewrites the past, and the rows must stay apart. The continuation stage
carries the previous sequence's length and digest on the next prompt (``ConversationTurn``); the row
compares its own prompt ids against them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["extends", "ids_digest"]


def ids_digest(ids: Sequence[int]) -> str:
    """SHA-256 (hex) of a token id sequence, each id as 4 little-endian bytes."""
    return hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in ids)).hexdigest()


def extends(prompt_ids: Sequence[int], length: int, digest: str) -> bool:
    """Whether ``prompt_ids`` begin with the sequence of ``length`` ids whose :func:`ids_digest` is ``digest``."""
    return bool(digest) and 0 < length <= len(prompt_ids) and ids_digest(prompt_ids[:length]) == digest
