"""Rebuild the token ids of a response: pure functions over schema objects and a profile.

Output ids come, in order of trust, from the provider's native ids (``native``), from its
logprob tokens mapped to vocabulary ids (``logprobs``), else from re-encoding the text
(``reencode``). Re-encoding puts back only what every provider of the kind removes by
definition (a think-start the prompt did not open, the think-end, the native text of
structured tool calls, the end-of-turn) and never guesses what a lossy provider may have
dropped: where the provider's :class:`~services.profiles.conventions.Convention` says text
may be missing (a stripped field edge; anything a tool parser consumed, re-serialised or
dropped in and around a tool block), the ids are accepted only when evidence proves the
place kept — the text's own whitespace there, or a provider fact — and never on a count,
else the sample is a dead letter naming the place (docs/fidelity.md, "The rule"). What one
answer proves about its upstream (a field edge showing whitespace) closes that place in the
upstream's other answers: ``reconstruct_with_facts`` and ``services/reconstruct/facts.py``.

Prompt ids are the encoded chat template over the messages as sent; the loss mask is 0
over them and 1 over the output. Bad input is a :class:`DeadLetter` with a stable reason
code, never an exception.

This module judges a batch: ``reencode`` plans each answer, ``proof`` refuses a lossy one
with an unproven place, and the facts learned per upstream close places in the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from schemas import (
    ProviderFactRecorded,
    ResponseReceived,
    SampleReconstructed,
    sample_key,
)
from services.common.records import DeadLetter
from services.profiles import ProfileLike
from services.profiles.conventions import Convention
from services.reconstruct.facts import FACT_CONTRADICTED, PLACES, FactBook, fact_key, upstream_of
from services.reconstruct.plan import (
    EMPTY_RESPONSE,
    ID_OUT_OF_VOCAB,
    INVALID_TOOL_ARGUMENTS,
    LOGPROBS_UNMAPPABLE,
    SPECIAL_TOKEN_IN_TEXT,
    TOOL_TEXT_LOST,
    WHERE_STRIP,
    WHITESPACE_STRIPPED,
    output_layout,
)
from services.reconstruct.plan import Plan as _Plan
from services.reconstruct.proof import (
    COUNT_TRUSTED,
    SOUND,
    Rule,
    check_output_ids,
    check_truncated_tail,
    open_edges,
    prove,
)
from services.reconstruct.reencode import plan_chat, server_tools
from services.reconstruct.restore import restore

__all__ = [
    "EMPTY_RESPONSE",
    "ID_OUT_OF_VOCAB",
    "INVALID_TOOL_ARGUMENTS",
    "LOGPROBS_UNMAPPABLE",
    "SPECIAL_TOKEN_IN_TEXT",
    "COUNT_TRUSTED",
    "SOUND",
    "Rule",
    "judge",
    "output_layout",
    "reconstruct",
    "reconstruct_batch",
    "server_tools",
]

def _sample(
    plan: _Plan, profile: ProfileLike, prompt_ids: list[int], output_ids: list[int]
) -> SampleReconstructed:
    response = plan.response
    return SampleReconstructed(
        dataset=response.dataset,
        sample_id=response.sample_id,
        profile=profile.name,
        response=response,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(output_ids),
        method=plan.method,  # type: ignore[arg-type]  # one of the three literals above
        prompt_text=plan.prompt_text,
    )


def reconstruct_batch(
    responses: Sequence[ResponseReceived], profile: ProfileLike, convention: Convention, *,
    rule: Rule = SOUND,
) -> list[SampleReconstructed | DeadLetter]:
    """Rebuild many responses of one profile and provider convention, batching the tokenizer (no facts)."""
    return judge(responses, profile, convention, None, rule=rule)[0]


def _close_gaps(plan: _Plan, kept: frozenset[str]) -> None:
    """Move the strip gaps at places the upstream is proven to keep out of the search."""
    closed = [g for g in plan.gaps if g.where == WHERE_STRIP and g.places and g.places <= kept]
    if closed:
        plan.closed = closed
        plan.gaps = [g for g in plan.gaps if g not in closed]


def _establish(
    plans: Sequence[_Plan | DeadLetter], book: FactBook, convention: Convention, at: float
) -> list[ProviderFactRecorded]:
    """Facts from the whole batch first: each place an answer's field edge shows whitespace at."""
    if not convention.strips_whitespace:
        return []
    changes = []
    for plan in plans:
        if not isinstance(plan, _Plan) or not plan.shown:
            continue
        upstream = upstream_of(plan.response)
        if upstream is None or book.contradicted(upstream) is not None:
            continue
        for place in sorted(plan.shown & set(PLACES)):
            record = book.establish(upstream, place, sample_key(plan.response.dataset, plan.response.sample_id), at)
            if record is not None:
                changes.append(record)
    return changes


def _contradiction(
    plan: _Plan, ids: list[int], profile: ProfileLike, verdict: DeadLetter | list[int]
) -> bool:
    """Whether the count shows whitespace missing at a place the facts closed (with them open, a candidate fits)."""
    if not plan.closed or plan.expected_count is None or plan.output_text is None:
        return False
    if isinstance(verdict, DeadLetter) and (open_edges(plan) or plan.tool_places):
        # Refused for its open places without a search: what the search makes of the count decides.
        verdict = prove([(0, replace(plan), ids)], profile, COUNT_TRUSTED)[0]
    if isinstance(verdict, DeadLetter):
        if verdict.reason not in (WHITESPACE_STRIPPED, TOOL_TEXT_LOST):
            return False
    elif len(verdict) == plan.expected_count:
        return False
    outcome = restore(plan.output_text, [*plan.gaps, *plan.closed], specials=profile.special_strings,
                      encode_batch=profile.encode_batch, base_count=len(ids), target=plan.expected_count)  # fmt: skip
    return outcome.matches >= 1 and not outcome.arbitrary_room


def _withdrawn_places(plan: _Plan, book: FactBook, upstream: str | None) -> list[ProviderFactRecorded]:
    """The withdrawn facts of ``upstream`` at places this answer may have lost whitespace."""
    if upstream is None or book.contradicted(upstream) is None:
        return []
    places = {p for g in (*plan.gaps, *plan.closed) for p in g.places}
    return [f for f in book.withdrawn(upstream) if f.place in places]



def judge(
    responses: Sequence[ResponseReceived],
    profile: ProfileLike,
    convention: Convention,
    book: FactBook | None,
    *,
    at: float = 0.0,
    rule: Rule = SOUND,
    suspects: list[tuple[_Plan, list[int]]] | None = None,
) -> tuple[list[SampleReconstructed | DeadLetter], list[ProviderFactRecorded]]:
    """:func:`reconstruct_with_facts` under one convention; ``suspects`` collects re-encoded answers off their count."""
    plans: list[_Plan | DeadLetter] = [plan_chat(r, profile, convention) for r in responses]
    changes = _establish(plans, book, convention, at) if book is not None else []
    if book is not None:
        for plan in plans:
            upstream = upstream_of(plan.response) if isinstance(plan, _Plan) else None
            if isinstance(plan, _Plan) and plan.gaps and book.contradicted(upstream) is None:
                _close_gaps(plan, book.kept(upstream))
    live = [p for p in plans if isinstance(p, _Plan)]
    prompt_ids = iter(profile.encode_prompt_batch([p.prompt_text for p in live]))
    output_ids = iter(profile.encode_batch([p.output_text for p in live if p.output_text is not None]))
    out: list[SampleReconstructed | DeadLetter] = []
    lossy: list[tuple[int, _Plan, list[int]]] = []
    for plan in plans:
        if isinstance(plan, DeadLetter):
            out.append(plan)
            continue
        prompt = next(prompt_ids)
        ids = next(output_ids) if plan.output_text is not None else plan.output_ids or []
        if not ids:
            out.append(DeadLetter(EMPTY_RESPONSE, "the rebuilt output has no tokens"))
            continue
        if plan.output_text is not None:
            bad = check_output_ids(plan, ids, profile)
            if bad is None and plan.response.finish_reason == "length":
                bad = check_truncated_tail(plan, ids, profile)
            if bad is not None:
                out.append(bad)
                continue
            if suspects is not None and _off_count(plan, ids, convention):
                suspects.append((plan, ids))
            if plan.gaps or plan.closed:
                lossy.append((len(out), plan, ids))
        out.append(_sample(plan, profile, prompt, ids))
    for index, plan, ids in lossy:  # in batch order: a contradiction bears on the answers after it
        upstream = upstream_of(plan.response)
        key = sample_key(plan.response.dataset, plan.response.sample_id)
        withdrawn = _withdrawn_places(plan, book, upstream) if book is not None else []
        if withdrawn:
            out[index] = _contradicted(withdrawn, key)
            continue
        verdict = prove([(index, plan, ids)], profile, rule)[index] if plan.gaps else ids
        if book is not None and upstream is not None and _contradiction(plan, ids, profile, verdict):
            places = sorted({p for g in plan.closed for p in g.places})
            why = f"{key}'s usage count shows whitespace missing at {', '.join(places)}"
            withdrawals = [book.withdraw(upstream, p, key, why, at) for p in places]
            changes += withdrawals
            out[index] = _contradicted(withdrawals, key)
            continue
        if isinstance(verdict, DeadLetter):
            out[index] = verdict
            continue
        previous = out[index]
        assert isinstance(previous, SampleReconstructed)  # noqa: S101 - lossy entries are samples
        out[index] = _sample(plan, profile, list(previous.prompt_ids), verdict)
    return out, changes


def _off_count(plan: _Plan, ids: list[int], convention: Convention) -> bool:
    """A re-encoded answer that stopped by itself and whose ids miss its usage count."""
    count = plan.response.usage.completion_tokens
    return (plan.method == "reencode" and plan.response.finish_reason != "length" and count is not None
            and len(ids) != count - convention.completion_offset)  # fmt: skip


def _contradicted(facts: Sequence[ProviderFactRecorded], key: str) -> DeadLetter:
    """The dead letter of an answer whose upstream's fact (at a place it may have lost text) was contradicted."""
    named = "; ".join(
        f"fact {fact_key(f.upstream, f.place)} (whitespace kept, established by {f.evidence}) "
        f"contradicted by {f.contradicted_by}" for f in facts
    )
    return DeadLetter(
        FACT_CONTRADICTED,
        f"{key}: {named}: the upstream shows both habits under one name, so its facts no longer stand; "
        "replay after pinning one upstream",
    )


def reconstruct(
    response: ResponseReceived, profile: ProfileLike, convention: Convention, *, rule: Rule = SOUND
) -> SampleReconstructed | DeadLetter:
    """Rebuild one response: prompt ids, output ids, loss mask, or a dead-letter verdict."""
    return reconstruct_batch([response], profile, convention, rule=rule)[0]
