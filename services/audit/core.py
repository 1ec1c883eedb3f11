"""Audit checks: pure functions over a reconstructed sample and its model profile.

Each check has a stable reason code (the dead-letter header value), a short message and
a threshold from :class:`AuditThresholds` (per dataset). A check returns ``None`` when it
does not apply (e.g. think checks on a profile without think tokens) and is then absent
from the results. No Kafka, no clock, no environment here: the learned usage offset is
state kept in an explicit :class:`OffsetLearner` the caller owns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from schemas import CheckResult, SampleAudited, SampleReconstructed
from services.common.config import AuditThresholds

# Stable reason codes, in the order checks run (the first failing one is the primary).
IDS_IN_VOCAB = "ids_in_vocab"
LOSS_MASK = "loss_mask_consistent"
ENDS_WITH_END_OF_TURN = "ends_with_end_of_turn"
ONE_END_OF_TURN = "one_end_of_turn"
ONE_THINK_END = "one_think_end"
THINK_END_BEFORE_END_OF_TURN = "think_end_before_end_of_turn"
NO_THINK_START = "no_think_start_in_output"
REASONING_NONEMPTY = "reasoning_nonempty"
CONTENT_NONEMPTY = "content_nonempty"
FINISH_STOP = "finish_stop"
USAGE_MATCHES = "usage_matches"
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
    TOOL_CALLS_WELL_FORMED,
    NO_REPLACEMENT_CHAR,
    ROUNDTRIP,
    NATIVE_IDS_DIFF,
)

# Codes that never fail a sample: they only report a measurement.
REPORT_ONLY: frozenset[str] = frozenset({NATIVE_IDS_DIFF})

REPLACEMENT_CHAR = "\ufffd"


class AuditProfile(Protocol):
    """What the audit needs from a model profile (services.profiles.Profile satisfies it)."""

    name: str
    end_of_turn: str
    end_of_turn_id: int
    think_start: str | None
    think_start_id: int | None
    think_end: str | None
    think_end_id: int | None
    tool_tokens: dict[str, int]
    tool_format: str
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode texts with special tokens parsed, no BOS."""
        ...

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Decode id sequences keeping special tokens."""
        ...


@dataclass
class OffsetLearner:
    """The provider's fixed counting offset (``completion_tokens - len(output_ids)``).

    Learned per (provider, upstream provider, model) from the first
    ``learn_offset_samples`` samples of a run whose gap is plausible (within
    ``max_learn_gap``); then the mode of those gaps is fixed and every later sample must
    match it exactly (plus ``usage_tolerance``). While learning, a sample passes when its
    gap is plausible.
    """

    max_learn_gap: int = 2
    observed: dict[str, list[int]] = field(default_factory=dict)
    fixed: dict[str, int] = field(default_factory=dict)
    implausible: dict[str, int] = field(default_factory=dict)

    def offset(self, key: str) -> int | None:
        """The learned offset for a provider key, or None while still learning."""
        return self.fixed.get(key)

    def observe(self, key: str, gap: int, needed: int) -> int | None:
        """Record one gap while learning; returns the offset once it is fixed."""
        if key in self.fixed:
            return self.fixed[key]
        if abs(gap) <= self.max_learn_gap:
            seen = self.observed.setdefault(key, [])
            seen.append(gap)
            if len(seen) >= needed:
                # Ties resolve to the smallest gap so the result never depends on order.
                counts = Counter(seen)
                best = max(counts.values())
                self.fixed[key] = min(g for g, c in counts.items() if c == best)
        else:
            self.implausible[key] = self.implausible.get(key, 0) + 1
        return self.fixed.get(key)

    def summary(self) -> dict[str, dict[str, object]]:
        """What was learned, for logs and reports."""
        keys = set(self.observed) | set(self.fixed) | set(self.implausible)
        return {
            k: {
                "offset": self.fixed.get(k),
                "samples": len(self.observed.get(k, ())),
                "implausible": self.implausible.get(k, 0),
                "gaps": dict(Counter(self.observed.get(k, ()))),
            }
            for k in sorted(keys)
        }


@dataclass(frozen=True)
class Prepared:
    """A sample plus what the batch tokenizer calls computed for it."""

    sample: SampleReconstructed
    thresholds: AuditThresholds
    decoded: str | None  # None when the ids could not be decoded (out of vocab)
    reencoded: list[int] | None


Check = Callable[[Prepared, AuditProfile, "OffsetLearner"], CheckResult | None]


def _ok(code: str, passed: bool, message: str = "", value: float | None = None) -> CheckResult:
    return CheckResult(code=code, passed=passed, message=message, value=value)


def provider_key(sample: SampleReconstructed) -> str:
    """The key under which a provider's counting offset is learned."""
    r = sample.response
    return f"{r.provider}/{r.upstream_provider or '-'}/{r.model}"


def check_ids_in_vocab(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult:
    """Every prompt and output id is inside the tokenizer's vocabulary."""
    bad = [i for i in (*p.sample.prompt_ids, *p.sample.output_ids) if not 0 <= i < profile.vocab_size]
    if bad:
        return _ok(IDS_IN_VOCAB, False, f"{len(bad)} id(s) outside vocab {profile.vocab_size}, e.g. {bad[0]}",
                   float(len(bad)))
    return _ok(IDS_IN_VOCAB, True)


def check_loss_mask(p: Prepared, _: AuditProfile, __: OffsetLearner) -> CheckResult:
    """loss_mask is 0 over the prompt and 1 over the output, one entry per input id."""
    s = p.sample
    expected = [0] * len(s.prompt_ids) + [1] * len(s.output_ids)
    if s.loss_mask != expected:
        return _ok(LOSS_MASK, False,
                   f"loss_mask ({len(s.loss_mask)}) does not mask {len(s.prompt_ids)} prompt + "
                   f"{len(s.output_ids)} output ids")
    return _ok(LOSS_MASK, True)


def check_ends_with_end_of_turn(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult:
    """The output ends with the end-of-turn id."""
    ids = p.sample.output_ids
    last = ids[-1] if ids else None
    if last != profile.end_of_turn_id:
        return _ok(ENDS_WITH_END_OF_TURN, False, f"last id {last}, expected {profile.end_of_turn_id}")
    return _ok(ENDS_WITH_END_OF_TURN, True)


def check_one_end_of_turn(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult:
    """The end-of-turn id occurs exactly once in the output."""
    n = p.sample.output_ids.count(profile.end_of_turn_id)
    return _ok(ONE_END_OF_TURN, n == 1, "" if n == 1 else f"{n} end-of-turn ids", float(n))


def _think_expected(p: Prepared) -> bool:
    return p.thresholds.require_reasoning or bool(p.sample.response.reasoning)


def check_one_think_end(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult | None:
    """Exactly one think-end (none allowed only when reasoning is neither required nor given)."""
    if profile.think_end_id is None:
        return None
    n = p.sample.output_ids.count(profile.think_end_id)
    ok = n == 1 or (n == 0 and not _think_expected(p))
    return _ok(ONE_THINK_END, ok, "" if ok else f"{n} think-end ids", float(n))


def check_think_end_before_end_of_turn(
    p: Prepared, profile: AuditProfile, _: OffsetLearner
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


def check_no_think_start(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult | None:
    """No think-start id in the output (the template puts it in the prompt, if anywhere)."""
    if profile.think_start_id is None:
        return None
    n = p.sample.output_ids.count(profile.think_start_id)
    return _ok(NO_THINK_START, n == 0, "" if n == 0 else f"{n} think-start ids in output", float(n))


def check_reasoning_nonempty(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult | None:
    """The text before the think-end is not blank (reasoning datasets only)."""
    if profile.think_end_id is None or not p.thresholds.require_reasoning:
        return None
    text = p.sample.response.reasoning
    if not text.strip() and p.decoded is not None and profile.think_end:
        text = p.decoded.split(profile.think_end, 1)[0] if profile.think_end in p.decoded else ""
    ok = bool(text.strip())
    return _ok(REASONING_NONEMPTY, ok, "" if ok else "reasoning is empty")


def _answer_text(p: Prepared, profile: AuditProfile) -> str:
    text = p.decoded if p.decoded is not None else p.sample.response.content
    if profile.think_end and profile.think_end in text:
        text = text.split(profile.think_end, 1)[1]
    return text.replace(profile.end_of_turn, "")


def check_content_nonempty(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult:
    """The answer (content or a tool call) after the reasoning is not blank."""
    ok = bool(_answer_text(p, profile).strip()) or bool(p.sample.response.tool_calls)
    return _ok(CONTENT_NONEMPTY, ok, "" if ok else "no content and no tool call")


def check_finish_stop(p: Prepared, _: AuditProfile, __: OffsetLearner) -> CheckResult | None:
    """The provider stopped by itself (``stop``, or ``tool_calls`` with tool calls), not truncated."""
    if not p.thresholds.require_stop:
        return None
    r = p.sample.response
    reason = r.finish_reason
    ok = reason == "stop" or (reason == "tool_calls" and bool(r.tool_calls or r.tools_sent or r.prompt.tools))
    return _ok(FINISH_STOP, ok, "" if ok else f"finish reason {reason!r}")


def check_usage_matches(p: Prepared, _: AuditProfile, learner: OffsetLearner) -> CheckResult:
    """len(output_ids) equals usage.completion_tokens up to the provider's fixed offset."""
    completion = p.sample.response.usage.completion_tokens
    if completion is None:
        return _ok(USAGE_MATCHES, True, "provider reported no completion_tokens: not checked")
    t = p.thresholds
    gap = completion - len(p.sample.output_ids)
    offset: int | None = t.usage_offset
    how = "configured"
    if offset is None:
        key = provider_key(p.sample)
        how = "learned"
        offset = learner.offset(key)
        if offset is None:
            offset = learner.observe(key, gap, t.learn_offset_samples)
    if offset is None:
        ok = abs(gap) <= learner.max_learn_gap
        return _ok(USAGE_MATCHES, ok,
                   f"learning offset: usage {completion} vs {len(p.sample.output_ids)} ids "
                   f"(gap {gap})", float(gap))
    ok = abs(gap - offset) <= t.usage_tolerance
    msg = f"usage {completion} vs {len(p.sample.output_ids)} ids: gap {gap}, {how} offset {offset}"
    return _ok(USAGE_MATCHES, ok, msg, float(gap))


# Tool-token roles, recognised from the token string so any profile's naming works.
_SECTION_OPEN, _SECTION_CLOSE, _CALL_OPEN, _CALL_CLOSE, _SEP = "S(", "S)", "C(", "C)", "|"


def tool_token_roles(tool_tokens: dict[str, int]) -> dict[int, str]:
    """Map each tool-token id to its role: section open/close, call open/close, separator."""
    roles: dict[int, str] = {}
    for name, token_id in tool_tokens.items():
        n = name.lower().replace("▁", "_").replace("｜", "|")
        if "argument_begin" in n or n.endswith("sep|>") or n.endswith("sep") or "_sep" in n:
            roles[token_id] = _SEP
        elif "calls_begin" in n or "section_begin" in n:
            roles[token_id] = _SECTION_OPEN
        elif "calls_end" in n or "section_end" in n:
            roles[token_id] = _SECTION_CLOSE
        elif "call_begin" in n or n == "<tool_call>":
            roles[token_id] = _CALL_OPEN
        elif "call_end" in n or n == "</tool_call>":
            roles[token_id] = _CALL_CLOSE
    return roles


def parse_tool_tokens(ids: Sequence[int], roles: dict[int, str]) -> tuple[int, str]:
    """Count the tool calls in ``ids``; returns (calls, error) with error '' when well formed."""
    has_section = _SECTION_OPEN in roles.values()
    has_sep = _SEP in roles.values()
    in_section = not has_section
    in_call = False
    seps = 0
    calls = 0
    for pos, token_id in enumerate(ids):
        role = roles.get(token_id)
        if role is None:
            continue
        if role == _SECTION_OPEN:
            if in_section or in_call:
                return calls, f"nested tool-call section at {pos}"
            in_section = True
        elif role == _SECTION_CLOSE:
            if not in_section or in_call:
                return calls, f"tool-call section closed at {pos} while not open or a call is open"
            in_section = False
        elif role == _CALL_OPEN:
            if not in_section or in_call:
                return calls, f"tool call opened at {pos} outside a section or inside a call"
            in_call, seps = True, 0
        elif role == _SEP:
            if not in_call:
                return calls, f"tool-call separator at {pos} outside a call"
            seps += 1
        elif role == _CALL_CLOSE:
            if not in_call:
                return calls, f"tool call closed at {pos} while none is open"
            if has_sep and seps != 1:
                return calls, f"tool call ending at {pos} has {seps} separators, expected 1"
            in_call = False
            calls += 1
    if in_call or (has_section and in_section):
        return calls, "tool-call tokens not closed"
    return calls, ""


def check_tool_calls_well_formed(p: Prepared, profile: AuditProfile, _: OffsetLearner) -> CheckResult | None:
    """Tool-call tokens balanced, well formed, matching the structured calls, only if tools offered."""
    roles = tool_token_roles(profile.tool_tokens)
    r = p.sample.response
    if not roles:
        if r.tool_calls:
            return _ok(TOOL_CALLS_WELL_FORMED, False,
                       f"{len(r.tool_calls)} tool call(s) but profile {profile.name} has no tool tokens")
        return None
    present = any(i in roles for i in p.sample.output_ids)
    if present and not r.prompt.tools:
        return _ok(TOOL_CALLS_WELL_FORMED, False,
                   "tool-call tokens in output but the prompt offered no tools")
    calls, error = parse_tool_tokens(p.sample.output_ids, roles)
    if error:
        return _ok(TOOL_CALLS_WELL_FORMED, False, error)
    if r.tool_calls and calls != len(r.tool_calls):
        return _ok(TOOL_CALLS_WELL_FORMED, False,
                   f"{calls} tool call(s) in ids, {len(r.tool_calls)} in the response", float(calls))
    return _ok(TOOL_CALLS_WELL_FORMED, True, "", float(calls))


def check_no_replacement_char(p: Prepared, _: AuditProfile, __: OffsetLearner) -> CheckResult | None:
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


def check_roundtrip(p: Prepared, _: AuditProfile, __: OffsetLearner) -> CheckResult | None:
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


def check_native_ids(p: Prepared, _: AuditProfile, __: OffsetLearner) -> CheckResult | None:
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
    (TOOL_CALLS_WELL_FORMED, check_tool_calls_well_formed),
    (NO_REPLACEMENT_CHAR, check_no_replacement_char),
    (ROUNDTRIP, check_roundtrip),
    (NATIVE_IDS_DIFF, check_native_ids),
)


def run_checks(p: Prepared, profile: AuditProfile, learner: OffsetLearner) -> list[CheckResult]:
    """Every enabled, applicable check on one prepared sample, in the fixed order."""
    disabled = set(p.thresholds.disabled_checks)
    results: list[CheckResult] = []
    for code, check in CHECKS:
        if code in disabled:
            continue
        result = check(p, profile, learner)
        if result is not None:
            results.append(result)
    return results


def verdict(
    sample: SampleReconstructed, results: list[CheckResult], audited_at: float = 0.0
) -> SampleAudited:
    """The SampleAudited for a sample and its check results."""
    reasons = [r.code for r in results if not r.passed and r.code not in REPORT_ONLY]
    return SampleAudited(
        dataset=sample.dataset,
        sample_id=sample.sample_id,
        sample=sample,
        passed=not reasons,
        results=results,
        reasons=reasons,
        audited_at=audited_at,
    )


ThresholdsFor = AuditThresholds | Callable[[str], AuditThresholds]


def _thresholds(t: ThresholdsFor, dataset: str) -> AuditThresholds:
    return t if isinstance(t, AuditThresholds) else t(dataset)


def _in_vocab(sample: SampleReconstructed, vocab_size: int) -> bool:
    return all(0 <= i < vocab_size for i in sample.output_ids)


def prepare_batch(
    samples: Sequence[SampleReconstructed], profile: AuditProfile, thresholds: ThresholdsFor
) -> list[Prepared]:
    """Decode every in-vocab output and re-encode the texts, one batch call each."""
    decodable = [i for i, s in enumerate(samples) if _in_vocab(s, profile.vocab_size)]
    texts = profile.decode_batch([list(samples[i].output_ids) for i in decodable]) if decodable else []
    reencoded = profile.encode_batch(list(texts)) if texts else []
    decoded_by: dict[int, tuple[str, list[int]]] = {
        i: (t, list(e)) for i, t, e in zip(decodable, texts, reencoded, strict=True)
    }
    out: list[Prepared] = []
    for i, s in enumerate(samples):
        got = decoded_by.get(i)
        out.append(Prepared(s, _thresholds(thresholds, s.dataset), got[0] if got else None,
                            got[1] if got else None))
    return out


def audit_batch(
    samples: Sequence[SampleReconstructed],
    profile: AuditProfile,
    thresholds: ThresholdsFor,
    learner: OffsetLearner,
    *,
    audited_at: float = 0.0,
) -> list[SampleAudited]:
    """Audit samples of one profile; tokenizer work is two batch calls for the whole batch.

    ``thresholds`` is one AuditThresholds or a function from dataset name to it. The
    learner is updated in sample order.
    """
    return [
        verdict(p.sample, run_checks(p, profile, learner), audited_at)
        for p in prepare_batch(samples, profile, thresholds)
    ]


def audit(
    sample: SampleReconstructed,
    profile: AuditProfile,
    thresholds: AuditThresholds,
    learner: OffsetLearner,
    *,
    audited_at: float = 0.0,
) -> SampleAudited:
    """Audit one sample against its profile."""
    return audit_batch([sample], profile, thresholds, learner, audited_at=audited_at)[0]


def failure_message(audited: SampleAudited) -> str:
    """One line naming every failing check and why, for the dead-letter message header."""
    return "; ".join(f"{r.code}: {r.message}" if r.message else r.code
                     for r in audited.results if not r.passed and r.code not in REPORT_ONLY)


__all__ = [
    "CHECKS",
    "CHECK_CODES",
    "REPORT_ONLY",
    "AuditProfile",
    "OffsetLearner",
    "OfflineReport",
    "Prepared",
    "audit",
    "audit_batch",
    "failure_message",
    "mismatch_fraction",
    "offline_audit",
    "parse_tool_tokens",
    "prepare_batch",
    "provider_key",
    "run_checks",
    "tool_token_roles",
    "verdict",
]


@dataclass
class OfflineReport:
    """Failures by code over a file of samples: counts and one example key each."""

    total: int = 0
    passed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)  # report-only codes with a difference

    def add_failure(self, code: str, key: str, message: str) -> None:
        """Count one failure of ``code`` for sample ``key``."""
        self.failures[code] = self.failures.get(code, 0) + 1
        self.examples.setdefault(code, key)
        self.messages.setdefault(code, message)

    @property
    def failed(self) -> int:
        """Samples that failed at least one check (or could not be read)."""
        return self.total - self.passed


def offline_audit(
    lines: Iterable[bytes],
    profiles: Callable[[str], AuditProfile],
    thresholds: ThresholdsFor,
    learner: OffsetLearner,
    *,
    profile_override: str | None = None,
    batch_size: int = 256,
) -> OfflineReport:
    """Run the checks over JSONL lines of SampleReconstructed, in batches per profile.

    ``profiles`` raises any exception for an unknown name; that sample counts under
    ``unknown_profile``. A line that does not decode counts under its SchemaError reason.
    """
    from schemas import SchemaError, decode

    report = OfflineReport()
    pending: dict[str, list[SampleReconstructed]] = {}

    def flush(name: str) -> None:
        batch = pending.pop(name, [])
        if not batch:
            return
        try:
            profile = profiles(name)
        except Exception as exc:  # noqa: BLE001 - reported per sample, the audit goes on
            for s in batch:
                report.add_failure("unknown_profile", f"{s.dataset}:{s.sample_id}", f"{name!r}: {exc}")
            return
        for result in audit_batch(batch, profile, thresholds, learner):
            key = f"{result.dataset}:{result.sample_id}"
            if result.passed:
                report.passed += 1
            for r in result.results:
                if not r.passed and r.code not in REPORT_ONLY:
                    report.add_failure(r.code, key, r.message)
                elif r.code in REPORT_ONLY and r.value:
                    report.notes[r.code] = report.notes.get(r.code, 0) + 1

    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        report.total += 1
        try:
            sample = decode(line, SampleReconstructed)
        except SchemaError as exc:
            report.add_failure(exc.reason, f"line {n}", exc.message)
            continue
        name = profile_override or sample.profile
        pending.setdefault(name, []).append(sample)
        if len(pending[name]) >= batch_size:
            flush(name)
    for name in list(pending):
        flush(name)
    return report
