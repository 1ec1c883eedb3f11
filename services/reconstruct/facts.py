"""Provider facts from evidence: what one answer proves about its upstream holds for its other answers.

A stripping server (``.strip()``) can never return a field that begins or ends with
whitespace. So one answer of upstream U whose field shows whitespace at a place a strip
would have removed proves "U keeps whitespace at that place", and reconstruction under a
convention that *may* strip closes that gap in U's other answers too. A fact is discrete
and falsifiable, never a learned offset: a later answer of U whose own count shows
whitespace missing at a place U is said to keep withdraws the fact, and that answer and
U's later lossy answers are refused ``provider_fact_contradicted`` naming the fact and both
sample keys. Pure: the facts are :class:`~schemas.ProviderFactRecorded` records, which the
reconstruct shell keeps on the compacted ``provider-facts`` topic.

Places (where ``services.reconstruct.core`` puts a strip gap): ``reasoning_start``,
``reasoning_end`` (before the think-end), ``reasoning_cut`` (the end of a reasoning the
answer stopped inside), ``content_start`` / ``content_end`` (a content after a think block),
``text_start`` / ``text_end`` (a content with no think block: SGLang before 2026 stripped
only what its reasoning parser parsed, so the two are different places), ``before_tool``
(the content before a tool block: SGLang 2026 strips there and nowhere else, PARSERS.md).
No fact speaks for the inside of a tool block: what a tool parser changed there is proven by
native ids or logprob tokens only (docs/fidelity.md, "The rule"). Records of the retired place
``arguments`` (once established from argument text in a form ``json.dumps`` does not write) are
still read, and close nothing.

The opposite fact, ``strips_at_edges``: an upstream whose convention says it keeps
whitespace, caught losing it by one of its answers (``services/reconstruct/verify.py``).
From then on its answers are judged as a stripping upstream's; it is never withdrawn (a
server that strips sometimes is treated as one that may strip always).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import ProviderFactRecorded, ResponseReceived

__all__ = ["FACT_CONTRADICTED", "PLACES", "STRIPS_PLACE", "FactBook", "StripTally", "fact_key",
           "upstream_of"]

FACT_CONTRADICTED = "provider_fact_contradicted"

PLACES = ("reasoning_start", "reasoning_end", "reasoning_cut", "content_start", "content_end", "text_start",
          "text_end", "before_tool")  # fmt: skip

# The key place of the fact "this upstream loses whitespace at field edges its convention says it keeps".
STRIPS_PLACE = "strips_at_edges"

# Provider kinds that route one request to one of several upstreams: without the upstream's
# name an answer cannot be attributed, so it establishes nothing and no fact closes its gaps.
_ROUTERS = frozenset({"openrouter"})


def upstream_of(response: ResponseReceived) -> str | None:
    """Whose habits an answer shows: ``<upstream name>/<model>``, or None when it cannot be attributed.

    OpenRouter names the upstream in ``provider`` (``upstream_provider`` here); an upstream
    runs its own engine per model, so the model is part of the name. A provider that names no
    upstream is one anonymous upstream per provider kind and model (``<kind>/<model>``: one
    server behind one base URL), except a router, whose answers come from several.
    """
    if response.upstream_provider:
        return f"{response.upstream_provider}/{response.model}"
    if response.provider in _ROUTERS:
        return None
    return f"{response.provider}/{response.model}"


def fact_key(upstream: str, place: str) -> str:
    """The record key of a fact on ``provider-facts``."""
    return f"{upstream}|{place}"


@dataclass
class StripTally:
    """What one upstream's answers said about a convention that keeps whitespace (verify.py), not yet a fact."""

    seen: int = 0  # answers a count could test
    evidence: list[tuple[str, str]] = field(default_factory=list)  # (sample key, why) of those that missed it


@dataclass
class FactBook:
    """The facts known now, by ``(upstream, place)``: established ones and withdrawn ones.

    A withdrawn fact stays withdrawn (it is never established again from a later answer):
    the upstream showed both habits under one name.
    """

    facts: dict[tuple[str, str], ProviderFactRecorded] = field(default_factory=dict, init=False)
    # The same records by upstream, so a batch's look-ups do not scan every upstream's facts.
    _by_upstream: dict[str, dict[str, ProviderFactRecorded]] = field(default_factory=dict, init=False, repr=False)
    # This worker's tallies towards a strips_at_edges fact (kept in memory: only the fact is shared).
    _tallies: dict[str, StripTally] = field(default_factory=dict, init=False, repr=False)

    def tally(self, upstream: str) -> StripTally:
        """The evidence gathered so far that ``upstream`` strips."""
        return self._tallies.setdefault(upstream, StripTally())

    def _put(self, record: ProviderFactRecorded) -> None:
        self.facts[(record.upstream, record.place)] = record
        self._by_upstream.setdefault(record.upstream, {})[record.place] = record

    @classmethod
    def of(cls, records: Iterable[ProviderFactRecorded]) -> FactBook:
        """A book from records read off the topic (the latest per key)."""
        book = cls()
        for record in records:
            book.apply(record)
        return book

    def apply(self, record: ProviderFactRecorded) -> None:
        """Take a record written by any worker (this one or another); a withdrawal is final."""
        known = self.facts.get((record.upstream, record.place))
        if known is not None and known.withdrawn and not record.withdrawn:
            return
        self._put(record)

    def kept(self, upstream: str | None) -> frozenset[str]:
        """The places where ``upstream`` is proven to keep whitespace."""
        if upstream is None:
            return frozenset()
        of_upstream = self._by_upstream.get(upstream, {})
        return frozenset(p for p, f in of_upstream.items() if not f.withdrawn and p != STRIPS_PLACE)

    def strips(self, upstream: str | None) -> ProviderFactRecorded | None:
        """The ``strips_at_edges`` fact of ``upstream``: its answers showed it loses edge whitespace."""
        if upstream is None:
            return None
        return self._by_upstream.get(upstream, {}).get(STRIPS_PLACE)

    def record_strips(self, upstream: str, evidence: str, reason: str, at: float = 0.0) -> ProviderFactRecorded | None:
        """Record that ``upstream`` loses edge whitespace (``evidence``: the sample key); None if known."""
        if (upstream, STRIPS_PLACE) in self.facts:
            return None
        record = ProviderFactRecorded(upstream=upstream, place=STRIPS_PLACE, evidence=evidence, reason=reason, at=at)
        self._put(record)
        return record

    def contradicted(self, upstream: str | None) -> ProviderFactRecorded | None:
        """A withdrawn fact of ``upstream``, if any: its lossy answers are no longer judged by facts."""
        if upstream is None:
            return None
        of_upstream = self._by_upstream.get(upstream, {})
        return next((of_upstream[p] for p in sorted(of_upstream) if of_upstream[p].withdrawn), None)

    def withdrawn(self, upstream: str) -> list[ProviderFactRecorded]:
        """The withdrawn facts of ``upstream``, by place."""
        of_upstream = self._by_upstream.get(upstream, {})
        return [of_upstream[p] for p in sorted(of_upstream) if of_upstream[p].withdrawn]

    def establish(self, upstream: str, place: str, evidence: str, at: float = 0.0) -> ProviderFactRecorded | None:
        """Record that ``upstream`` keeps whitespace at ``place``; the new record, or None if known."""
        if (upstream, place) in self.facts:
            return None
        record = ProviderFactRecorded(upstream=upstream, place=place, evidence=evidence, at=at)
        self._put(record)
        return record

    def withdraw(self, upstream: str, place: str, by: str, reason: str, at: float = 0.0) -> ProviderFactRecorded:
        """Withdraw a fact an answer contradicted; the withdrawal record."""
        known = self.facts[(upstream, place)]
        record = ProviderFactRecorded(upstream=upstream, place=place, evidence=known.evidence, withdrawn=True,
                                      contradicted_by=by, reason=reason, at=at)  # fmt: skip
        self._put(record)
        return record
