"""The offline route: a JSONL file of responses rebuilt in batches, in input order, facts accumulating."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from schemas import ResponseReceived, SampleReconstructed, SchemaError, decode, sample_key
from services.common.records import DeadLetter
from services.profiles import ProfileLike
from services.profiles.conventions import Convention
from services.reconstruct.facts import FactBook
from services.reconstruct.verify import reconstruct_with_facts

__all__ = ["LineResult", "Resolver", "reconstruct_lines"]

@dataclass
class LineResult:
    """The verdict on one line of an offline JSONL input (line numbers start at 1)."""

    line: int
    key: str
    verdict: SampleReconstructed | DeadLetter


Resolver = Callable[[ResponseReceived], "tuple[ProfileLike, Convention] | DeadLetter"]


def reconstruct_lines(
    lines: Iterable[bytes], resolve: Resolver, *, batch_size: int = 256, facts: FactBook | None = None
) -> Iterator[LineResult]:
    """Rebuild a JSONL stream of ``ResponseReceived``, in batches, in input order.

    ``resolve`` picks the profile and provider convention of a response (or a dead-letter
    verdict when they cannot be had). Blank lines are skipped; undecodable lines get their
    schema reason code. With ``facts``, the upstreams' facts accumulate over the file as
    they do over the stage's stream (facts.py).
    """
    pending: list[tuple[int, bytes]] = []
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            pending.append((number, raw))
        if len(pending) >= batch_size:
            yield from _reconstruct_chunk(pending, resolve, facts)
            pending = []
    if pending:
        yield from _reconstruct_chunk(pending, resolve, facts)


def _reconstruct_chunk(
    chunk: list[tuple[int, bytes]], resolve: Resolver, facts: FactBook | None
) -> Iterator[LineResult]:
    verdicts: dict[int, LineResult] = {}
    groups: dict[tuple[int, str], tuple[ProfileLike, Convention, list[tuple[int, ResponseReceived]]]] = {}
    for number, raw in chunk:
        try:
            response = decode(raw, ResponseReceived)
        except SchemaError as exc:
            verdicts[number] = LineResult(number, "", DeadLetter(exc.reason, exc.message))
            continue
        key = sample_key(response.dataset, response.sample_id)
        resolved = resolve(response)
        if isinstance(resolved, DeadLetter):
            verdicts[number] = LineResult(number, key, resolved)
            continue
        profile, convention = resolved
        groups.setdefault((id(profile), convention.name), (profile, convention, []))[2].append((number, response))
    for profile, convention, members in groups.values():
        batch, _ = reconstruct_with_facts([r for _, r in members], profile, convention, facts)
        for (number, response), verdict in zip(members, batch, strict=True):
            verdicts[number] = LineResult(number, sample_key(response.dataset, response.sample_id), verdict)
    for number, _ in chunk:
        yield verdicts[number]
