"""Conventions verified by the answers: an upstream said to keep whitespace, caught losing it.

A convention is a claim about a server (declared in ``[provider] convention``, or the
default of its kind), and every answer tests it. Under a convention that keeps whitespace
(``vllm``, ``sglang``) a re-encoded answer that stopped by itself holds every id the model
wrote, so its ids number ``usage.completion_tokens``. An answer that misses its count where
the convention's own losses cannot explain the gap (it has no tool calls, whose parser's
losses may), but whitespace put back at the field edges that show none can, is evidence
that the upstream strips: the fact ``strips_at_edges`` is recorded for it (facts.py), and
from then on — this batch included, since evidence is gathered from the whole batch before
its answers stand — its answers are judged under the same convention made stripping: every
field edge that shows no whitespace is a place text may be missing, closed only by a
provider fact that the upstream keeps it there, and otherwise a dead letter
(docs/fidelity.md, "The rule").

The fact needs ``MIN_EVIDENCE`` such answers making up ``STRIP_SHARE`` of the upstream's
answers a count can test (without tool calls): a lossless server's answers miss their count now and then for other
reasons (a non-canonical split the model sampled), a stripping server's on nearly every one. A
count that misses for another reason often enough (a misconfigured ``usage_offset``) can still
make an upstream look stripping: that costs yield, never exactness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from schemas import ProviderFactRecorded, ResponseReceived, SampleReconstructed, sample_key
from services.common.records import DeadLetter
from services.profiles import ProfileLike
from services.profiles.conventions import CONVENTIONS, Convention
from services.reconstruct.core import judge
from services.reconstruct.facts import FactBook, upstream_of
from services.reconstruct.plan import WHERE_STRIP
from services.reconstruct.plan import Plan as _Plan
from services.reconstruct.proof import SOUND, Rule
from services.reconstruct.reencode import plan_chat

__all__ = ["EDGE_IDS", "MIN_EVIDENCE", "STRIP_SHARE", "stripping", "verified"]

# A count off by more than this many ids per unproven edge is a wrong count, not a strip.
EDGE_IDS = 16
# The fact needs this many answers of evidence, and that share of the upstream's testable answers (no tool
# calls, stopped by themselves, a count, no native ids or logprobs): a
# lossless server's answers miss their count now and then for other reasons (a non-canonical split the
# model sampled), a stripping server's on nearly every answer.
MIN_EVIDENCE = 2
STRIP_SHARE = 1 / 4

Verdicts = list[SampleReconstructed | DeadLetter]



def reconstruct_with_facts(
    responses: Sequence[ResponseReceived],
    profile: ProfileLike,
    convention: Convention,
    book: FactBook | None,
    *,
    at: float = 0.0,
    rule: Rule = SOUND,
) -> tuple[list[SampleReconstructed | DeadLetter], list[ProviderFactRecorded]]:
    """Rebuild a batch with the upstreams' facts (facts.py): the verdicts, and the facts established or withdrawn.

    ``book`` is updated in place. Facts are established from the whole batch before any
    sample is judged; then, in batch order, a gap at a place the answer's upstream is proven
    to keep is closed, and an answer whose count shows whitespace missing at such a place
    withdraws the fact (refused ``provider_fact_contradicted``, as are the upstream's later
    answers that would have needed it). Under a convention that keeps whitespace, an upstream
    whose answers show it strips gets a ``strips_at_edges`` fact and is judged as stripping
    (below). ``book=None``: no facts, each answer on its own evidence.
    """
    if book is not None and rule.verify_conventions and not convention.strips_whitespace:
        return verified(responses, profile, convention, book, at=at, rule=rule)
    return judge(responses, profile, convention, book, at=at, rule=rule)

def stripping(convention: Convention) -> Convention:
    """``convention`` for an upstream its answers contradicted: it may lose what any known upstream loses.

    Any field edge, or the whole text's, may have been stripped, and arguments re-serialised or
    trimmed wherever some engine does (``openrouter``'s losses, added to the declared ones).
    """
    if convention.strips_whitespace:
        return convention
    unknown = CONVENTIONS["openrouter"]
    return replace(
        convention,
        name=f"{convention.name}+strips",
        strips_whitespace=True,
        strip_patterns=unknown.strip_patterns,
        reserialized_tool_formats=convention.reserialized_tool_formats | unknown.reserialized_tool_formats,
        trimmed_argument_formats=convention.trimmed_argument_formats | unknown.trimmed_argument_formats,
        strips_before_tool=convention.strips_before_tool | unknown.strips_before_tool,
    )


def verified(
    responses: Sequence[ResponseReceived],
    profile: ProfileLike,
    convention: Convention,
    book: FactBook,
    *,
    at: float = 0.0,
    rule: Rule = SOUND,
) -> tuple[Verdicts, list[ProviderFactRecorded]]:
    """Judge a batch under a convention that keeps whitespace, upstreams caught stripping as stripping ones."""
    out: list[SampleReconstructed | DeadLetter | None] = [None] * len(responses)
    changes: list[ProviderFactRecorded] = []
    kept = [i for i, r in enumerate(responses) if book.strips(upstream_of(r)) is None]
    suspects: list[tuple[_Plan, list[int]]] = []
    verdicts, found = judge([responses[i] for i in kept], profile, convention, book, at=at, rule=rule,
                            suspects=suspects)  # fmt: skip
    changes += found
    for i, verdict in zip(kept, verdicts, strict=True):
        out[i] = verdict
    for i in kept:  # every answer a count can test counts towards the share
        if _testable(responses[i]) and (upstream := upstream_of(responses[i])) is not None:
            book.tally(upstream).seen += 1
    prompts = iter(profile.encode_prompt_batch([plan.prompt_text for plan, _ in suspects]))
    for plan, ids in suspects:
        response = plan.response
        upstream = upstream_of(response)
        prompt_count = len(next(prompts))
        if upstream is None or book.strips(upstream) is not None:
            continue
        if response.usage.prompt_tokens is not None and response.usage.prompt_tokens != prompt_count:
            # The prompt was not rendered as the model's server counts it: the profile is not the
            # model's, and its output counts say nothing about what the server strips.
            continue
        why = _strip_evidence(plan, ids, profile, convention) if _testable(response) else None
        if why is None:
            continue
        tally = book.tally(upstream)
        tally.evidence.append((sample_key(response.dataset, response.sample_id), why))
        if len(tally.evidence) >= MIN_EVIDENCE and len(tally.evidence) >= STRIP_SHARE * tally.seen:
            key, first = tally.evidence[-1]
            reason = f"{len(tally.evidence)} of {tally.seen} answers miss their count at unproven edges; {key}: {first}"
            record = book.record_strips(upstream, key, reason, at)
            if record is not None:
                changes.append(record)
    flagged = [i for i, r in enumerate(responses) if out[i] is None or book.strips(upstream_of(r)) is not None]
    if flagged:
        verdicts, found = judge([responses[i] for i in flagged], profile, stripping(convention), book, at=at,
                                rule=rule)  # fmt: skip
        changes += found
        for i, verdict in zip(flagged, verdicts, strict=True):
            out[i] = verdict
    return [v if v is not None else DeadLetter("internal_error", "no verdict") for v in out], changes


def _testable(response: ResponseReceived) -> bool:
    """An answer whose count can test the convention: re-encoded chat text that stopped by itself, with a count."""
    return (response.mode != "completions" and not response.native_output_ids and not response.logprobs
            and not response.tool_calls  # the text dropped after a tool block may explain any miss
            and response.finish_reason != "length" and response.usage.completion_tokens is not None)  # fmt: skip


def _strip_evidence(plan: _Plan, ids: list[int], profile: ProfileLike, convention: Convention) -> str | None:
    """Why this answer shows whitespace lost at a field edge its convention says is kept, or None."""
    response = plan.response
    count = response.usage.completion_tokens
    if count is None:
        return None
    target = count - convention.completion_offset
    if any(gap.where == WHERE_STRIP for gap in plan.gaps):
        return None  # an edge the convention itself loses (a reasoning parser's .rstrip()) may explain the miss
    # A testable answer has no tool calls, so nothing else the convention admits losing explains the count.
    # Blamed on the edges that show no whitespace (the whitespace a strip takes is not bounded to a
    # candidate list, so no candidate has to fit): a wrong blame only makes the upstream's later
    # answers refused where nothing proves them.
    strip_plan = plan_chat(response, profile, stripping(convention))
    if isinstance(strip_plan, DeadLetter):
        return None
    edges = sorted({p for gap in strip_plan.gaps if gap.where == WHERE_STRIP for p in gap.places})
    if not edges or abs(target - len(ids)) > EDGE_IDS * len(edges):
        return None  # more than whitespace at those edges could cost: a wrong count, which the audit refuses
    return (f"{len(ids)} ids rebuilt under {convention.name}, usage.completion_tokens says {target}, and nothing "
            f"{convention.name} loses explains it: whitespace may be missing at {', '.join(edges)}")
