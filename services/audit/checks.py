"""Audit checks: pure functions over a reconstructed sample and its model profile.

Each check has a stable reason code (the dead-letter header value), a short message and
a threshold from :class:`Thresholds` (per dataset). A check returns ``None`` when it
does not apply (e.g. think checks on a profile without think tokens) and is then absent
from the results. No Kafka, no clock, no environment here.

The usage checks compare lengths with the provider's counting convention as configured
(``Thresholds.usage_offset``, default 0: every generated id counts, end-of-turn
included). Nothing is learned from the data: a learned "most common offset" absorbs any
constant reconstruction error (a newline lost on every sample becomes "the convention").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from schemas import CheckResult, SampleReconstructed
from services.audit.toolblocks import parse_dsml, parse_tool_tokens, tool_roles
from services.profiles import ProfileLike

# Stable reason codes, in the order checks run (the first failing one is the primary).
IDS_IN_VOCAB = "ids_in_vocab"
LOSS_MASK = "loss_mask_consistent"
ENDS_WITH_END_OF_TURN = "ends_with_end_of_turn"
ONE_END_OF_TURN = "one_end_of_turn"
ONE_THINK_END = "one_think_end"
THINK_END_BEFORE_END_OF_TURN = "think_end_before_end_of_turn"
NO_THINK_START = "think_start_placement"
REASONING_NONEMPTY = "reasoning_nonempty"
CONTENT_NONEMPTY = "content_nonempty"
FINISH_STOP = "finish_stop"
TRUNCATED_ACCEPTED = "truncated at the token limit: accepted (accept_truncated)"
USAGE_MATCHES = "usage_matches"
PROMPT_MATCHES = "prompt_matches"
TOOL_CALLS_WELL_FORMED = "tool_calls_well_formed"
NO_REPLACEMENT_CHAR = "no_replacement_char"
ROUNDTRIP = "roundtrip"
NATIVE_IDS_DIFF = "native_ids_reencode_diff"

CHECK_CODES: tuple[str, ...] = (
    IDS_IN_VOCAB,
    LOSS_MASK,
    ENDS_WITH_END_OF_TURN,
    ONE_END_OF_TURN,
    ONE_THINK_END,
    THINK_END_BEFORE_END_OF_TURN,
    NO_THINK_START,
    REASONING_NONEMPTY,
    CONTENT_NONEMPTY,
    FINISH_STOP,
    USAGE_MATCHES,
    PROMPT_MATCHES,
    TOOL_CALLS_WELL_FORMED,
    NO_REPLACEMENT_CHAR,
    ROUNDTRIP,
    NATIVE_IDS_DIFF,
)

# Codes that never fail a sample: they only report a measurement.
REPORT_ONLY: frozenset[str] = frozenset({NATIVE_IDS_DIFF})

REPLACEMENT_CHAR = "\ufffd"


class Thresholds(Protocol):
    """The per-dataset audit switches and tolerances the checks read.

    The configuration's ``AuditThresholds`` satisfies it; the core reads the values and
    never imports the configuration.
    """

    @property
    def disabled_checks(self) -> tuple[str, ...]:
        """Reason codes of checks that are skipped."""
        ...

    @property
    def roundtrip_tolerance(self) -> float:
        """The largest fraction of ids that may differ when the decoded text is re-encoded."""
        ...

    @property
    def usage_offset(self) -> int | None:
        """``usage.completion_tokens`` minus the output ids; None: the provider convention's 0."""
        ...

    @property
    def prompt_usage_offset(self) -> int | None:
        """``usage.prompt_tokens`` minus the prompt ids; None: 0."""
        ...

    @property
    def usage_tolerance(self) -> int:
        """How many tokens the usage gap may differ from the offset."""
        ...

    @property
    def require_reasoning(self) -> bool:
        """Whether a sample that thinks must have non-blank reasoning."""
        ...

    @property
    def require_stop(self) -> bool:
        """Whether the provider must have stopped by itself rather than at the token limit."""
        ...

    @property
    def accept_truncated(self) -> bool:
        """Whether an answer cut at the token limit (``length``) passes ``finish_stop``, flagged truncated."""
        ...


@dataclass(frozen=True)
class Prepared:
    """A sample plus what the batch tokenizer calls computed for it."""

    sample: SampleReconstructed
    thresholds: Thresholds
    decoded: str | None  # None when the ids could not be decoded (out of vocab)
    reencoded: list[int] | None


Check = Callable[[Prepared, ProfileLike], CheckResult | None]


def _ok(code: str, passed: bool, message: str = "", value: float | None = None) -> CheckResult:
    return CheckResult(code=code, passed=passed, message=message, value=value)


def ids_within(ids: Sequence[int], size: int) -> bool:
    """Every id in ``range(size)`` (min and max run in C; a sample holds up to tens of thousands)."""
    return not ids or (min(ids) >= 0 and max(ids) < size)


def check_ids_in_vocab(p: Prepared, profile: ProfileLike) -> CheckResult:
    """Every prompt and output id is inside the tokenizer's vocabulary."""
    if ids_within(p.sample.prompt_ids, profile.vocab_size) and ids_within(p.sample.output_ids, profile.vocab_size):
        return _ok(IDS_IN_VOCAB, True)
    bad = [i for i in (*p.sample.prompt_ids, *p.sample.output_ids) if not 0 <= i < profile.vocab_size]
    if bad:
        return _ok(IDS_IN_VOCAB, False, f"{len(bad)} id(s) outside vocab {profile.vocab_size}, e.g. {bad[0]}",
                   float(len(bad)))
    return _ok(IDS_IN_VOCAB, True)


def check_loss_mask(p: Prepared, _: ProfileLike) -> CheckResult:
    """loss_mask is 0 over the prompt and 1 over the output, one entry per input id."""
    s = p.sample
    expected = [0] * len(s.prompt_ids) + [1] * len(s.output_ids)
    if s.loss_mask != expected:
        return _ok(LOSS_MASK, False,
                   f"loss_mask ({len(s.loss_mask)}) does not mask {len(s.prompt_ids)} prompt + "
                   f"{len(s.output_ids)} output ids")
    return _ok(LOSS_MASK, True)


def check_ends_with_end_of_turn(p: Prepared, profile: ProfileLike) -> CheckResult:
    """A finished output ends with the end-of-turn id; a truncated one (``length``) holds none."""
    ids = p.sample.output_ids
    last = ids[-1] if ids else None
    if p.sample.response.finish_reason == "length":
        ok = profile.end_of_turn_id not in ids
        return _ok(ENDS_WITH_END_OF_TURN, ok, "" if ok else "a truncated output holds an end-of-turn id")
    if last != profile.end_of_turn_id:
        return _ok(ENDS_WITH_END_OF_TURN, False, f"last id {last}, expected {profile.end_of_turn_id}")
    return _ok(ENDS_WITH_END_OF_TURN, True)


def check_one_end_of_turn(p: Prepared, profile: ProfileLike) -> CheckResult | None:
    """The end-of-turn id occurs exactly once in a finished output (truncated: see above)."""
    if p.sample.response.finish_reason == "length":
        return None
    n = p.sample.output_ids.count(profile.end_of_turn_id)
    return _ok(ONE_END_OF_TURN, n == 1, "" if n == 1 else f"{n} end-of-turn ids", float(n))


def _layout(p: Prepared, profile: ProfileLike) -> tuple[bool, bool]:
    """(the model writes the think-start, a think block is in the output) under this prompt.

    A prompt that opens the think block leaves the model inside it; one that closes it
    (thinking off), or a model that does not think, leaves none; otherwise a thinking model
    opens the block itself, which its reasoning (or a think-end in the ids) shows.
    """
    state = profile.prompt_state(p.sample.prompt_text)
    if state == "open":
        return False, True
    if state == "closed" or not profile.thinks():
        return False, False
    if getattr(profile, "think_location", None) == "prompt":
        # A prompt that should open the block opened none (R1 after a tool result): which think
        # tokens the model wrote was decided by the usage count in reconstruction; check those.
        ids = p.sample.output_ids
        opened = bool(ids) and ids[0] == profile.think_start_id
        return opened, opened or profile.think_end_id in ids
    opened = bool(p.sample.response.reasoning) or profile.think_end_id in p.sample.output_ids
    return opened, opened


def check_one_think_end(p: Prepared, profile: ProfileLike) -> CheckResult | None:
    """Exactly one think-end where the model thinks (none if truncated inside it); none where it does not."""
    if profile.think_end_id is None:
        return None
    n = p.sample.output_ids.count(profile.think_end_id)
    _, thinking = _layout(p, profile)
    truncated = p.sample.response.finish_reason == "length"
    ok = (n == 1 or (n == 0 and truncated)) if thinking else n == 0
    return _ok(ONE_THINK_END, ok, "" if ok else f"{n} think-end ids ({'thinking' if thinking else 'no thinking'})",
               float(n))


def check_think_end_before_end_of_turn(
    p: Prepared, profile: ProfileLike
) -> CheckResult | None:
    """The think-end precedes the end-of-turn (skipped when either is absent)."""
    ids = p.sample.output_ids
    if profile.think_end_id is None or profile.think_end_id not in ids or profile.end_of_turn_id not in ids:
        return None
    think = ids.index(profile.think_end_id)
    eot = ids.index(profile.end_of_turn_id)
    ok = think < eot
    return _ok(THINK_END_BEFORE_END_OF_TURN, ok,
               "" if ok else f"think-end at {think} after end-of-turn at {eot}")


def check_no_think_start(p: Prepared, profile: ProfileLike) -> CheckResult | None:
    """A think-start only where the model writes it: first and once when the prompt left it to the model."""
    if profile.think_start_id is None:
        return None
    ids = p.sample.output_ids
    n = ids.count(profile.think_start_id)
    opened, _ = _layout(p, profile)
    ok = (n == 1 and ids[0] == profile.think_start_id) if opened else n == 0
    where = "the model opens the block itself" if opened else "the prompt holds it or the model does not think"
    return _ok(NO_THINK_START, ok, "" if ok else f"{n} think-start ids in the output ({where})", float(n))


def check_reasoning_nonempty(p: Prepared, profile: ProfileLike) -> CheckResult | None:
    """The text before the think-end is not blank (reasoning datasets, where the model thinks)."""
    if profile.think_end_id is None or not p.thresholds.require_reasoning:
        return None
    state = profile.prompt_state(p.sample.prompt_text)
    if state == "closed" or (state == "none" and not profile.thinks()):
        return None  # thinking is off for this prompt: there is no reasoning to require
    text = p.sample.response.reasoning
    if _blank(text) and p.decoded is not None and profile.think_end:
        text = p.decoded.split(profile.think_end, 1)[0] if profile.think_end in p.decoded else ""
        if profile.think_start:
            text = text.replace(profile.think_start, "")  # the block's own opener is not reasoning
    ok = not _blank(text)
    return _ok(REASONING_NONEMPTY, ok, "" if ok else "reasoning is empty")


def _blank(text: str) -> bool:
    """``not text.strip()`` without copying the text."""
    return not text or text.isspace()


def _answer_text(p: Prepared, profile: ProfileLike) -> str:
    text = p.decoded if p.decoded is not None else p.sample.response.content
    if profile.think_end and profile.think_end in text:
        text = text.split(profile.think_end, 1)[1]
    return text.replace(profile.end_of_turn, "")


def check_content_nonempty(p: Prepared, profile: ProfileLike) -> CheckResult | None:
    """The answer (content or a tool call) after the reasoning is not blank (truncation: finish_stop's job)."""
    if p.sample.response.finish_reason == "length":
        return None
    ok = not _blank(_answer_text(p, profile)) or bool(p.sample.response.tool_calls)
    return _ok(CONTENT_NONEMPTY, ok, "" if ok else "no content and no tool call")


def check_finish_stop(p: Prepared, _: ProfileLike) -> CheckResult | None:
    """The provider stopped by itself (``stop``, or ``tool_calls`` with tool calls), not truncated.

    With ``accept_truncated`` an answer cut at the token limit passes, saying so: its ids are
    exact up to the cut (the other checks already hold a ``length`` output to that shape).
    """
    if not p.thresholds.require_stop:
        return None
    r = p.sample.response
    reason = r.finish_reason
    if reason == "length" and p.thresholds.accept_truncated:
        return _ok(FINISH_STOP, True, TRUNCATED_ACCEPTED)
    ok = reason == "stop" or (reason == "tool_calls" and bool(r.tool_calls or r.tools_sent or r.prompt.tools))
    return _ok(FINISH_STOP, ok, "" if ok else f"finish reason {reason!r}")


def check_usage_matches(p: Prepared, _: ProfileLike) -> CheckResult:
    """len(output_ids) equals usage.completion_tokens under the configured counting convention."""
    completion = p.sample.response.usage.completion_tokens
    if completion is None:
        return _ok(USAGE_MATCHES, True, "provider reported no completion_tokens: not checked")
    t = p.thresholds
    offset = t.usage_offset or 0
    gap = completion - len(p.sample.output_ids)
    ok = abs(gap - offset) <= t.usage_tolerance
    msg = f"usage {completion} vs {len(p.sample.output_ids)} ids: gap {gap}, configured offset {offset}"
    return _ok(USAGE_MATCHES, ok, msg, float(gap))


def check_prompt_matches(p: Prepared, _: ProfileLike) -> CheckResult:
    """prompt_ids equal the server's prompt ids, else their count equals usage.prompt_tokens.

    The prompt ids are rendered by our template from the messages as sent; a template that
    differs from the server's (a missing generation prompt, a dropped system message,
    reasoning the request never carried) shows up here.
    """
    s = p.sample
    native = s.response.native_prompt_ids
    if native is not None:
        ok = list(native) == list(s.prompt_ids)
        frac = mismatch_fraction(native, s.prompt_ids)
        return _ok(PROMPT_MATCHES, ok, "" if ok else (
            f"the server's {len(native)} prompt ids differ from the {len(s.prompt_ids)} rendered ({frac:.1%} window)"),
            frac)
    counted = s.response.usage.prompt_tokens
    if counted is None:
        return _ok(PROMPT_MATCHES, True, "provider reported no prompt_tokens: not checked")
    offset = p.thresholds.prompt_usage_offset or 0
    gap = counted - len(s.prompt_ids)
    ok = gap == offset
    return _ok(PROMPT_MATCHES, ok, "" if ok else (
        f"usage.prompt_tokens {counted} vs {len(s.prompt_ids)} rendered prompt ids (gap {gap}, offset {offset})"),
        float(gap))


def check_tool_calls_well_formed(p: Prepared, profile: ProfileLike) -> CheckResult | None:
    """Tool-call tokens balanced, well formed, matching the structured calls, only if tools offered."""
    r = p.sample.response
    if profile.tool_format == "dsml" and p.decoded is not None:
        calls, error = parse_dsml(p.decoded)
        present = bool(calls or error)
    else:
        roles = tool_roles(tuple(profile.tool_tokens.items()))  # read only: shared between samples
        if not roles:
            if r.tool_calls:
                return _ok(TOOL_CALLS_WELL_FORMED, False,
                           f"{len(r.tool_calls)} tool call(s) but profile {profile.name} has no tool tokens")
            return None
        present = not roles.keys().isdisjoint(p.sample.output_ids)
        # Without any tool token the parse has nothing to look at: no calls, well formed.
        calls, error = parse_tool_tokens(p.sample.output_ids, roles) if present else (0, "")
    if present and not r.prompt.tools:
        return _ok(TOOL_CALLS_WELL_FORMED, False,
                   "tool-call tokens in output but the prompt offered no tools")
    if error:
        return _ok(TOOL_CALLS_WELL_FORMED, False, error)
    if r.tool_calls and calls != len(r.tool_calls):
        return _ok(TOOL_CALLS_WELL_FORMED, False,
                   f"{calls} tool call(s) in ids, {len(r.tool_calls)} in the response", float(calls))
    return _ok(TOOL_CALLS_WELL_FORMED, True, "", float(calls))


def check_no_replacement_char(p: Prepared, _: ProfileLike) -> CheckResult | None:
    """The decoded output has no U+FFFD (ids that split a UTF-8 character or garbage ids)."""
    if p.decoded is None:
        return None
    n = p.decoded.count(REPLACEMENT_CHAR)
    return _ok(NO_REPLACEMENT_CHAR, n == 0, "" if n == 0 else f"{n} U+FFFD in decoded text", float(n))


def mismatch_fraction(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of the longer sequence inside the window where ``a`` and ``b`` differ.

    Linear time: strip the common prefix and suffix; what remains is the differing window.
    """
    if list(a) == list(b):
        return 0.0
    n = max(len(a), len(b))
    prefix = 0
    limit = min(len(a), len(b))
    while prefix < limit and a[prefix] == b[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and a[len(a) - 1 - suffix] == b[len(b) - 1 - suffix]:
        suffix += 1
    return (n - prefix - suffix) / n if n else 0.0


def check_roundtrip(p: Prepared, _: ProfileLike) -> CheckResult | None:
    """decode→encode gives the same ids within the tolerance; the message says if exact."""
    if p.reencoded is None:
        return None
    frac = mismatch_fraction(p.sample.output_ids, p.reencoded)
    ok = frac <= p.thresholds.roundtrip_tolerance
    if frac == 0.0:
        msg = "exact"
    else:
        msg = (f"not exact: {frac:.1%} differs ({len(p.sample.output_ids)} ids, re-encoded "
               f"{len(p.reencoded)}; tolerance {p.thresholds.roundtrip_tolerance:.1%})")
    return _ok(ROUNDTRIP, ok, msg, frac)


def check_native_ids(p: Prepared, _: ProfileLike) -> CheckResult | None:
    """Report (never fail) how far the provider's native ids are from a re-encoding of their text."""
    native = p.sample.response.native_output_ids
    if not native or p.reencoded is None:
        return None
    frac = mismatch_fraction(native, p.reencoded)
    msg = "native ids equal the re-encoding" if frac == 0.0 else (
        f"native ids differ from the re-encoding: {frac:.1%} window, "
        f"{len(native)} vs {len(p.reencoded)} ids")
    return _ok(NATIVE_IDS_DIFF, True, msg, frac)


CHECKS: tuple[tuple[str, Check], ...] = (
    (IDS_IN_VOCAB, check_ids_in_vocab),
    (LOSS_MASK, check_loss_mask),
    (ENDS_WITH_END_OF_TURN, check_ends_with_end_of_turn),
    (ONE_END_OF_TURN, check_one_end_of_turn),
    (ONE_THINK_END, check_one_think_end),
    (THINK_END_BEFORE_END_OF_TURN, check_think_end_before_end_of_turn),
    (NO_THINK_START, check_no_think_start),
    (REASONING_NONEMPTY, check_reasoning_nonempty),
    (CONTENT_NONEMPTY, check_content_nonempty),
    (FINISH_STOP, check_finish_stop),
    (USAGE_MATCHES, check_usage_matches),
    (PROMPT_MATCHES, check_prompt_matches),
    (TOOL_CALLS_WELL_FORMED, check_tool_calls_well_formed),
    (NO_REPLACEMENT_CHAR, check_no_replacement_char),
    (ROUNDTRIP, check_roundtrip),
    (NATIVE_IDS_DIFF, check_native_ids),
)
