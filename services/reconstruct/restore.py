"""Unique-candidate restoration: put back what a lossy provider may have dropped, when the counts pin it.

A re-encoded output has *slots*: places where the provider's convention says text may be
missing (stripped whitespace, whitespace a tool parser consumed, text after a tool block) or
where the text is one of several candidates (re-serialised tool arguments). Every joint
choice of candidates is a candidate output; it is accepted only when **exactly one**
reproduces ``usage.completion_tokens`` (and the reasoning count, where its convention is
established). Pure: the tokenizer comes in as a function.

The search is exact and bounded. The tokenizer splits its input at control tokens before
anything else, so the ids of a text are the ids of its pieces between control tokens plus
the control ids: slots in different pieces add up exactly (checked on every call), and only
slots in the same piece are enumerated together. Candidates that would overshoot the count
are pruned; a search larger than ``SEARCH_CAP`` encodings is refused, not guessed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ARBITRARY", "CHOICE", "SEARCH_CAP", "WHITESPACE", "WHITESPACE_CANDIDATES", "Outcome", "Slot", "restore"]

WHITESPACE = "whitespace"  # the provider may have dropped a whitespace string here
ARBITRARY = "arbitrary"  # it may have dropped any text here (after a tool block): only provable empty
CHOICE = "choice"  # the text here is one of ``alternatives`` (re-serialised tool arguments)

SEARCH_CAP = 20_000  # encodings per sample


def _whitespace_candidates() -> tuple[str, ...]:
    # Every mix of space, newline and tab up to four characters, longer runs of one of them,
    # and CRLF: the whitespace a model writes at a field's edge. A whitespace string outside
    # this set that a stripping server removed is caught only when the count shows it.
    chars = (" ", "\n", "\t")
    out = [""]
    for length in range(1, 5):
        out += ["".join(p) for p in itertools.product(chars, repeat=length)]
    out += [c * n for c in chars for n in range(5, 17)]
    out += ["\r\n", "\r\n\r\n"]
    return tuple(dict.fromkeys(out))


WHITESPACE_CANDIDATES: tuple[str, ...] = _whitespace_candidates()


@dataclass(frozen=True)
class Slot:
    """A place in the output text: ``[start, end)`` holds the text there now (empty for an insertion)."""

    start: int
    end: int
    kind: str  # WHITESPACE | ARBITRARY | CHOICE
    alternatives: tuple[str, ...] = ()  # CHOICE: every candidate text, the current one included
    where: str = ""  # for messages: "strip", "tool", "arguments"
    # For a strip gap: the places it stands for (services/reconstruct/facts.py PLACES); two
    # places that meet make one slot, which a provider fact closes only when it covers both.
    places: frozenset[str] = frozenset()

    def candidates(self) -> tuple[str, ...]:
        """The texts this slot may stand for."""
        if self.kind == WHITESPACE:
            return WHITESPACE_CANDIDATES
        if self.kind == CHOICE:
            return self.alternatives
        return ("",)


@dataclass(frozen=True)
class Outcome:
    """The search's verdict: how many joint candidates reproduce the counts, and the one if unique."""

    matches: int
    text: str | None  # the restored text when matches == 1
    searched: int
    capped: bool = False
    # The count leaves tokens unaccounted for that an ARBITRARY slot could hold.
    arbitrary_room: bool = False
    not_additive: bool = False  # the tokenizer does not split at the control tokens (no search made)


Encoder = Callable[[list[str]], list[list[int]]]


def _pieces(text: str, specials: Sequence[str]) -> list[tuple[int, int]]:
    """Spans of the text between control-token occurrences (empty spans included)."""
    ordered = sorted((s for s in specials if s), key=len, reverse=True)
    spans: list[tuple[int, int]] = []
    pos = 0
    if ordered:
        for m in re.finditer("|".join(re.escape(s) for s in ordered), text):
            spans.append((pos, m.start()))
            pos = m.end()
    spans.append((pos, len(text)))
    return spans


WINDOW = 256  # characters of context each side of a slot in a long piece of text


Unit = tuple[int, int, list[Slot]]


def _units(text: str, slots: Sequence[Slot], specials: Sequence[str]) -> tuple[list[Unit], list[str]]:
    """The spans searched (each with its slots) and the rest of the text, cut so that ids add up.

    A piece between control tokens is one span, unless it is long: then each cluster of
    slots gets a window of ``WINDOW`` characters each side (a change at a slot moves the
    tokenizer's pre-token boundaries only near it), so a long reasoning is not re-encoded
    per candidate and far-apart slots are searched apart. The caller checks that the base
    text's ids add up over these cuts; the restored text is encoded whole at the end.
    """
    units: list[Unit] = []
    fillers: list[str] = []
    for start, end in _pieces(text, specials):
        members = sorted((s for s in slots if start <= s.start and s.end <= end), key=lambda s: s.start)
        if not members:
            fillers.append(text[start:end])
            continue
        if end - start <= 4 * WINDOW:
            units.append((start, end, members))
            continue
        windows: list[Unit] = []
        for slot in members:
            low, high = max(start, slot.start - WINDOW), min(end, slot.end + WINDOW)
            if windows and low <= windows[-1][1]:
                windows[-1] = (windows[-1][0], max(high, windows[-1][1]), [*windows[-1][2], slot])
            else:
                windows.append((low, high, [slot]))
        cut = start
        for low, high, inside in windows:
            fillers.append(text[cut:low])
            units.append((low, high, inside))
            cut = high
        fillers.append(text[cut:end])
    return units, [f for f in fillers if f]


def _product(lists: Sequence[Sequence[str]]) -> int:
    size = 1
    for items in lists:
        size *= len(items)
    return size


def _splice(text: str, base: int, slots: Sequence[Slot], choice: Sequence[str]) -> str:
    out = text
    for slot, chosen in sorted(zip(slots, choice, strict=True), key=lambda sc: -sc[0].start):
        out = out[: slot.start - base] + chosen + out[slot.end - base :]
    return out


def restore(
    text: str,
    slots: Sequence[Slot],
    *,
    specials: Sequence[str],
    encode_batch: Encoder,
    base_count: int,
    target: int,
    reasoning_end: int | None = None,
    reasoning_target: int | None = None,
    cap: int = SEARCH_CAP,
) -> Outcome:
    """Count the joint candidates of ``slots`` whose ids number ``target`` (see module doc).

    Args:
        text: the output text as rebuilt, each slot holding its current text.
        base_count: the number of ids of ``text``.
        target: the number of ids the provider counted.
        reasoning_end: offset of the think-end in ``text``; with ``reasoning_target``, the
            number of ids before it must be that too.
    """
    units, fillers = _units(text, slots, specials)
    spans = [(a, b) for a, b, _ in units]
    by_piece = {i: members for i, (_, _, members) in enumerate(units)}
    order = list(range(len(units)))
    bases = [text[a:b] for a, b in spans]
    encoded = encode_batch(bases + fillers)
    controls = sum(1 for _ in _pieces(text, specials)) - 1
    if sum(map(len, encoded)) + controls != base_count:
        return Outcome(0, None, 0, not_additive=True)
    base_len = {i: len(encoded[i]) for i in order}
    searched = len(encoded)
    # Phase 1: each slot alone.
    singles: dict[Slot, list[int]] = {}
    texts: list[str] = []
    owners: list[Slot] = []
    for piece, base in zip(order, bases, strict=True):
        for slot in by_piece[piece]:
            for cand in slot.candidates():
                texts.append(_splice(base, spans[piece][0], [slot], [cand]))
                owners.append(slot)
    searched += len(texts)
    if searched > cap:
        return Outcome(0, None, searched, capped=True)
    for slot, ids in zip(owners, encode_batch(texts), strict=True):
        piece = next(i for i in order if slot in by_piece[i])
        singles.setdefault(slot, []).append(len(ids) - base_len[piece])
    room = target - base_count
    least = {slot: min(deltas) for slot, deltas in singles.items()}
    spare = sum(least.values())
    # Phase 2: joint options per piece, as (count delta, choice).
    options: list[list[tuple[int, tuple[str, ...]]]] = []
    for piece, base in zip(order, bases, strict=True):
        members = sorted(by_piece[piece], key=lambda s: s.start)
        if len(members) == 1:
            (slot,) = members
            options.append([(d, (c,)) for c, d in zip(slot.candidates(), singles[slot], strict=True)])
            continue
        # Slots in one piece interact: all their combinations, unless that is beyond the cap;
        # then only candidates that, by their own effect, leave the count reachable.
        kept = [list(s.candidates()) for s in members]
        if searched + _product(kept) > cap:
            kept = [
                [c for c, d in zip(s.candidates(), singles[s], strict=True) if d + spare - least[s] <= room]
                for s in members
            ]
        combos = list(itertools.product(*kept))
        searched += len(combos)
        if searched > cap:
            return Outcome(0, None, searched, capped=True)
        encoded = encode_batch([_splice(base, spans[piece][0], members, combo) for combo in combos])
        options.append([(len(e) - base_len[piece], combo) for e, combo in zip(encoded, combos, strict=True)])
    # Phase 3: combine the pieces (counts add up exactly across pieces).
    in_reasoning = [reasoning_end is not None and spans[p][1] <= reasoning_end for p in order]
    states: dict[tuple[int, int], tuple[int, tuple[tuple[str, ...], ...]]] = {(0, 0): (1, ())}
    for opts, reasoning_side in zip(options, in_reasoning, strict=True):
        grouped: dict[int, tuple[int, tuple[str, ...]]] = {}
        for delta, combo in opts:
            count, first = grouped.get(delta, (0, combo))
            grouped[delta] = (count + 1, first)
        nxt: dict[tuple[int, int], tuple[int, tuple[tuple[str, ...], ...]]] = {}
        for (total, rdelta), (count, chosen) in states.items():
            for delta, (n, combo) in grouped.items():
                key = (total + delta, rdelta + (delta if reasoning_side else 0))
                have, example = nxt.get(key, (0, (*chosen, combo)))
                nxt[key] = (have + count * n, example)
        states = nxt
    wanted = [
        (key, value)
        for key, value in states.items()
        if key[0] == room and (reasoning_target is None or key[1] == reasoning_target)
    ]
    matches = sum(count for _, (count, _) in wanted)
    arbitrary = any(s.kind == ARBITRARY for s in slots)
    arbitrary_room = arbitrary and any(
        total < room and (reasoning_target is None or rdelta == reasoning_target) for total, rdelta in states
    )
    if matches != 1 or arbitrary_room:
        return Outcome(matches, None, searched, arbitrary_room=arbitrary_room)
    (_, (_, chosen)) = wanted[0]
    members_all = [sorted(by_piece[p], key=lambda s: s.start) for p in order]
    flat_slots = [s for members in members_all for s in members]
    flat_choice = [c for combo in chosen for c in combo]
    return Outcome(1, _splice(text, 0, flat_slots, flat_choice), searched)
