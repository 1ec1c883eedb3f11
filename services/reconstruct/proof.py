"""Proving a re-encoded output exact: the control-id checks, and what decides a lossy answer.

Under the rule (docs/fidelity.md, "The rule") a count never accepts: a re-encoded answer with a
place a tool parser may have changed, or a field edge nothing proves kept, is refused naming
it. What the count still does: refuse, and test a provider fact (``core._contradiction``). The
candidate search (``restore``) accepts only under the rules the fuzzer keeps to show what
trusting a count let through (``COUNT_TRUSTED``, ``TOOLS_COUNTED``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.records import DeadLetter
from services.profiles import ProfileLike
from services.reconstruct.plan import (
    LOSS_UNVERIFIABLE,
    SPECIAL_TOKEN_IN_TEXT,
    TOOL_ARGUMENTS_RESERIALIZED,
    TOOL_PLACES,
    TOOL_TEXT_LOST,
    TRUNCATED_TAIL_AMBIGUOUS,
    TRUNCATED_TAIL_LOST,
    WHERE_ARGS,
    WHERE_STRIP,
    WHITESPACE_AMBIGUOUS,
    WHITESPACE_STRIPPED,
    Layout,
)
from services.reconstruct.plan import Plan as _Plan
from services.reconstruct.restore import restore


def check_output_ids(plan: _Plan, ids: list[int], profile: ProfileLike) -> DeadLetter | None:
    """After re-encoding: no control id the text should not hold, and each special as laid out.

    Catches every control token of the vocabulary (special-flagged added tokens, declared
    and template markers), which a substring scan for the declared ones cannot; ordinary
    added tokens are text and pass.
    """
    layout = plan.layout or Layout(False, False, True)
    allowed = {profile.end_of_turn_id, *profile.tool_tokens.values()}
    if profile.think_end_id is not None and layout.think_end:
        allowed.add(profile.think_end_id)
    if profile.think_start_id is not None and layout.think_start:
        allowed.add(profile.think_start_id)
    # Set operations in C first; the first offending id in order only when there is one.
    if not profile.special_ids.isdisjoint(ids) and not (profile.special_ids.intersection(ids) <= allowed):
        for i in ids:
            if i in profile.special_ids and i not in allowed:
                (text,) = profile.token_strings([i])
                return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"the text contains the special token {text!r} (id {i})")
    expected = (
        (profile.think_start_id, int(layout.think_start), "think-start"),
        (profile.think_end_id, int(layout.think_end), "think-end"),
        (profile.end_of_turn_id, int(layout.end_of_turn), "end-of-turn"),
    )
    for token_id, count, what in expected:
        if token_id is not None and ids.count(token_id) != count:
            return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"the output holds {ids.count(token_id)} {what} tokens")
    return None


def check_truncated_tail(plan: _Plan, ids: list[int], profile: ProfileLike) -> DeadLetter | None:
    """A truncated output's end: a server holds back a trailing incomplete character.

    The model's last token may then be visible bytes plus part of a character. Either that
    shows in the count (a token of its own), or the visible bytes are one of the profile's
    partial-character prefixes and a re-encoding can match the count with another last id.
    """
    completion = plan.response.usage.completion_tokens
    if completion is None:
        return DeadLetter(
            LOSS_UNVERIFIABLE, "a truncated answer without a usage count: its last token cannot be checked"
        )
    if len(ids) != completion:
        return DeadLetter(
            TRUNCATED_TAIL_LOST,
            f"{len(ids)} ids rebuilt, usage.completion_tokens says {completion}: "
            "the cut answer's tail is not in the text",
        )
    data = (plan.output_text or "").encode("utf-8")
    tail = data[-16:]
    prefixes = profile.partial_char_prefixes()
    suffixes = [tail[start:] for start in range(len(tail)) if tail[start:] in prefixes]
    if not suffixes:
        return None
    # The other reading of such an end: the last token is the suffix plus a withheld partial character,
    # after the rest of the text's own ids. It fits the count only when the rest encodes to one id fewer
    # than the count (the rest re-encoded as everywhere here: a same-length non-canonical split stays
    # invisible). A suffix that does not end a whole character's text cannot be told apart: refused.
    rests: list[str] = []
    for suffix in suffixes:
        try:
            rests.append(data[: -len(suffix)].decode("utf-8"))
        except UnicodeDecodeError:
            return _tail_ambiguous(suffix)
    for suffix, rest_ids in zip(suffixes, profile.encode_batch(rests), strict=True):
        if len(rest_ids) + 1 == completion:
            return _tail_ambiguous(suffix)
    return None


def _tail_ambiguous(suffix: bytes) -> DeadLetter:
    return DeadLetter(
        TRUNCATED_TAIL_AMBIGUOUS,
        f"the cut answer ends with {suffix!r}, which a token can extend with part of a character the "
        "server would not show, and the count fits that reading too: the last id is not pinned",
    )


def _refusal(plan: _Plan, ids: list[int], matches: int, why: str = "", code: str | None = None) -> DeadLetter:
    """The dead letter of a lossy output the counts cannot pin to exactly one candidate."""
    kinds = {gap.where for gap in plan.gaps}
    args = WHERE_ARGS in kinds
    lost = "whitespace" if kinds == {WHERE_STRIP} else "text around structured tool calls"
    if args:
        lost += " and the model's exact tool-argument JSON (re-serialised)" if kinds - {WHERE_ARGS} else ""
        lost = lost if kinds - {WHERE_ARGS} else "the model's exact tool-argument JSON (re-serialised)"
    if code is None:
        if args:
            code = TOOL_ARGUMENTS_RESERIALIZED
        elif matches == 0 or len(ids) != plan.expected_count:
            code = WHITESPACE_STRIPPED if kinds == {WHERE_STRIP} else TOOL_TEXT_LOST
        else:
            code = WHITESPACE_AMBIGUOUS
    counted = f"{len(ids)} ids rebuilt, usage.completion_tokens says {plan.expected_count}"
    return DeadLetter(
        code,
        f"the provider may have lost {lost} at {len(plan.gaps)} place(s); {counted} (under the provider's "
        f"counting convention): {why or f'{matches} candidate(s) reproduce the count(s): the ids are not pinned'}",
    )


@dataclass(frozen=True)
class Rule:
    """What may accept a lossy answer (docs/fidelity.md, "The rule").

    ``count_restores_edges``: a usage count that singles out one whitespace candidate at an
    open field edge restores it. ``verify_conventions``: an upstream declared lossless is
    watched for answers that show it strips (verify.py). ``SOUND`` is the rule;
    ``COUNT_TRUSTED`` trusts a unique count and a declared convention, and exists so the
    fuzzer (tests/fuzz) can show that rule accepting wrong ids. ``count_restores_tools``: a
    unique count restores what a tool parser changed; ``TOOLS_COUNTED`` is the rule before tool
    blocks came under it (the fuzzer's tool tier shows it accepting wrong ids).
    """

    count_restores_edges: bool = False
    verify_conventions: bool = True
    # A unique count restores what a tool parser changed (wrapper whitespace, re-serialised arguments,
    # the text between and after calls): the behaviour before issue 53, for the fuzzer's tool tier.
    count_restores_tools: bool = False


SOUND = Rule()
COUNT_TRUSTED = Rule(count_restores_edges=True, verify_conventions=False, count_restores_tools=True)
TOOLS_COUNTED = Rule(count_restores_tools=True)


def prove(
    plans: list[tuple[int, _Plan, list[int]]], profile: ProfileLike, rule: Rule = SOUND
) -> dict[int, DeadLetter | list[int]]:
    """For lossy outputs: the restored ids when exactly one candidate fits and no open edge remains."""
    verdicts: dict[int, DeadLetter | list[int]] = {}
    for index, plan, ids in plans:
        if plan.tool_places and not rule.count_restores_tools:
            verdicts[index] = tool_unproven(plan)
            continue
        if plan.expected_count is None:
            kinds = {gap.where for gap in plan.gaps}
            lost = "whitespace" if kinds == {WHERE_STRIP} else "text around structured tool calls"
            verdicts[index] = DeadLetter(
                LOSS_UNVERIFIABLE,
                f"the provider may have lost {lost} at {len(plan.gaps)} place(s) and reported no usage count",
            )
            continue
        assert plan.output_text is not None  # noqa: S101 - reencode plans carry text
        if not rule.count_restores_edges and open_edges(plan):
            verdicts[index] = _unproven(plan, ids)
            continue
        reasoning_target = None
        if plan.expected_reasoning is not None and plan.think_end_at is not None and profile.think_end_id in ids:
            reasoning_target = plan.expected_reasoning - ids.index(profile.think_end_id or 0)
        outcome = restore(
            plan.output_text,
            plan.gaps,
            specials=profile.special_strings,
            encode_batch=profile.encode_batch,
            base_count=len(ids),
            target=plan.expected_count,
            reasoning_end=plan.think_end_at,
            reasoning_target=reasoning_target,
        )
        if outcome.not_additive:
            why = "the tokenizer does not split at its control tokens, so candidates cannot be counted"
            verdicts[index] = _refusal(plan, ids, 0, why, WHITESPACE_AMBIGUOUS)
        elif outcome.capped:
            why = f"the candidate search passed its cap ({outcome.searched} encodings) without deciding"
            verdicts[index] = _refusal(plan, ids, 0, why, WHITESPACE_AMBIGUOUS)
        elif outcome.arbitrary_room:
            why = (f"{outcome.matches} candidate(s) reproduce the count, and it leaves room for text after the tool "
                   "block, which the parser drops")
            # With argument forms in play, a shorter form plus a dropped tail fits too: the
            # re-serialisation is why the ids are not pinned; without a fitting form, text was lost.
            args = outcome.matches and any(gap.where == WHERE_ARGS for gap in plan.gaps)
            verdicts[index] = _refusal(plan, ids, outcome.matches, why,
                                       TOOL_ARGUMENTS_RESERIALIZED if args else TOOL_TEXT_LOST)
        elif outcome.text is None:
            verdicts[index] = _refusal(plan, ids, outcome.matches, "")
        else:
            (restored,) = profile.encode_batch([outcome.text])
            if len(restored) != plan.expected_count:  # the pieces did not add up for this candidate
                why = "the restored text does not encode to the counted length"
                verdicts[index] = _refusal(plan, ids, 1, why, WHITESPACE_AMBIGUOUS)
                continue
            plan.output_text = outcome.text
            verdicts[index] = restored
    return verdicts


def open_edges(plan: _Plan) -> list[str]:
    """The field edges a strip may have touched that nothing proves kept (the plan's open strip gaps)."""
    return sorted({p or "a field edge" for gap in plan.gaps if gap.where == WHERE_STRIP for p in gap.places or {""}})


def _unproven(plan: _Plan, ids: list[int]) -> DeadLetter:
    """The dead letter of an answer with an open edge, whatever its count says (docs/fidelity.md, "The rule").

    The whitespace a strip takes is unbounded (any run, U+00A0, ...) and may merge into the next
    word at no cost in ids, so no candidate that fits the count is proof, and none is searched.
    """
    counted = len(ids) == plan.expected_count
    code = WHITESPACE_AMBIGUOUS if counted else WHITESPACE_STRIPPED
    why = (f"nothing proves {', '.join(open_edges(plan))} kept (no native ids, logprobs, provider fact or "
           "whitespace shown there), and a count never accepts alone")
    return _refusal(plan, ids, int(counted), why, code)


def tool_unproven(plan: _Plan) -> DeadLetter:
    """The dead letter of re-encoded structured tool calls: the places a tool parser may have changed.

    A tool parser keeps the calls, not the text the model wrote: nothing in the fields shows the
    whitespace it consumed, the spelling it re-serialised, or what it dropped after the block, and
    a count that fits is still a guess (``}}\n\n`` and ``}}\n`` are one Qwen3 id each; ``5e0`` and
    ``5.0`` as many). Code ``tool_arguments_reserialized`` where the argument text is among them,
    else ``tool_call_text_lost``.
    """
    code = TOOL_ARGUMENTS_RESERIALIZED if "tool_arguments" in plan.tool_places else TOOL_TEXT_LOST
    named = "; ".join(TOOL_PLACES[p] for p in plan.tool_places)
    return DeadLetter(
        code,
        f"structured tool calls re-encoded without native ids or logprobs: nothing proves {named}; a count "
        "never accepts what a tool parser changed (use mode = \"completions\", raw tool text, or native ids)",
    )
