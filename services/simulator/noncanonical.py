"""Non-canonical token ids: the same bytes split into different tokens, as a sampler can produce.

The ``noncanonical_len`` and ``noncanonical_same`` content faults make the true ids such a split, so
reconstruction meets output ids that re-encoding the text does not give back.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from services.profiles import ProfileLike


def _special_ids(profile: ProfileLike) -> set[int]:
    ids = set(profile.tool_tokens.values()) | {profile.end_of_turn_id}
    ids.update(i for i in (profile.think_start_id, profile.think_end_id) if i is not None)
    return ids


def _plain_id(profile: ProfileLike, data: bytes, specials: set[int]) -> int | None:
    token_id = profile.id_of_bytes(data)
    if token_id is None or token_id in specials or profile.token_bytes(token_id) != data:
        return None
    return token_id


def noncanonical_split(profile: ProfileLike, ids: list[int], rng: random.Random) -> list[int] | None:
    """``ids`` with one token replaced by two smaller ones of the same bytes (one id longer)."""
    specials = _special_ids(profile)
    start = rng.randrange(len(ids)) if ids else 0
    for step in range(len(ids)):
        pos = (start + step) % len(ids)
        if ids[pos] in specials:
            continue
        data = profile.token_bytes(ids[pos])
        for cut in range(1, len(data)):
            left = _plain_id(profile, data[:cut], specials)
            right = _plain_id(profile, data[cut:], specials) if left is not None else None
            if left is not None and right is not None:
                return [*ids[:pos], left, right, *ids[pos + 1 :]]
    return None


def _resplit(profile: ProfileLike, ids: list[int], pos: int, width: int, specials: set[int]) -> list[int] | None:
    """Another split of ``ids[pos:pos+width]`` into ``width`` plain tokens with the same bytes."""
    window = ids[pos : pos + width]
    if any(i in specials for i in window):
        return None
    joined = b"".join(profile.token_bytes(i) for i in window)

    def splits(start: int, left: int) -> Iterator[list[int]]:
        if left == 1:
            last = _plain_id(profile, joined[start:], specials)
            if last is not None:
                yield [last]
            return
        for cut in range(start + 1, len(joined) - left + 2):
            head = _plain_id(profile, joined[start:cut], specials)
            if head is not None:
                for rest in splits(cut, left - 1):
                    yield [head, *rest]

    return next((split for split in splits(0, width) if split != window), None)


def noncanonical_same_length(profile: ProfileLike, ids: list[int], rng: random.Random) -> list[int] | None:
    """``ids`` with adjacent tokens re-split at other byte boundaries (same length, same text).

    Tries pairs first (one adjacent pair re-split), then triples.
    """
    specials = _special_ids(profile)
    for width in (2, 3):
        if len(ids) < width:
            return None
        start = rng.randrange(len(ids) - width + 1)
        for step in range(len(ids) - width + 1):
            pos = (start + step) % (len(ids) - width + 1)
            changed = _resplit(profile, ids, pos, width, specials)
            if changed is not None:
                return [*ids[:pos], *changed, *ids[pos + width :]]
    return None
