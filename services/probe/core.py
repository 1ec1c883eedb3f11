"""The probe's findings, pure: a few paid answers per dataset, what they prove, and the forecast.

The shell (services.probe.app) pays for at most ``n`` answers per dataset through the
inference worker's own path (response store, ``requests``, ``responses``, so the budget
counts them and the run reuses them), rebuilds and audits them with the reconstruct and
audit cores, and hands each answer here as a :class:`ProbeAnswer`. This module says, per
dataset and per upstream (OpenRouter's ``provider``):

- the accepted share, and the reasons of the rest;
- dollars per accepted sample, tokens paid and tokens kept;
- what the answers prove about the upstream, from evidence only: whether logprobs came
  back (``present``, ``null``, or ``not asked``); whether the whitespace at each edge of the
  reasoning and the content was kept or stripped (from the logprob tokens, which carry
  the model's own text: an edge without whitespace there proves nothing); whether
  ``usage.completion_tokens`` counts the end-of-turn (against exact ids only: native ids
  or logprob tokens); on how many answers the prompt count agrees with the rebuilt prompt;
- the forecast for the whole dataset at that accepted share.

A fact that no answer could establish is ``unproven``; answers that disagree make it ``mixed``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rich.text import Text

from schemas import ResponseReceived, SampleAudited, SampleReconstructed
from services.common.console import Column, FittedTable, styled

EDGES = ("reasoning_start", "reasoning_end", "content_start", "content_end")
"""The separators whose whitespace a parser may strip: both ends of the reasoning and of the content."""


@dataclass(frozen=True)
class ProbeAnswer:
    """One paid (or reused) answer of the probe, rebuilt and audited, or the reason it was not."""

    response: ResponseReceived
    sample: SampleReconstructed | None = None
    audited: SampleAudited | None = None
    dead_reason: str = ""
    # How many ids the request's prompt renders to with the dataset's profile, whatever the output's verdict.
    prompt_length: int | None = None

    @property
    def accepted(self) -> bool:
        """Whether the audit passed it."""
        return self.audited is not None and self.audited.passed

    @property
    def reason(self) -> str:
        """The primary reason it is not usable ('' when accepted)."""
        if self.accepted:
            return ""
        if self.audited is not None and self.audited.reasons:
            return self.audited.reasons[0]
        return self.dead_reason or "unknown"

    @property
    def upstream(self) -> str:
        """The upstream that answered (``unknown`` when the provider does not say)."""
        return self.response.upstream_provider or "unknown"


@dataclass
class Findings:
    """What the answers of one scope (a dataset, or one upstream of it) showed."""

    answers: int = 0
    accepted: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    dollars: float = 0.0
    tokens_paid: int = 0
    tokens_kept: int = 0
    logprobs: str = "unproven"
    whitespace: dict[str, str] = field(default_factory=dict)
    end_of_turn: str = "unproven"
    usage_wrong: int = 0
    prompt_agrees: int = 0
    prompt_compared: int = 0
    # usage.prompt_tokens minus the rendered prompt ids, over the answers off the configured offset.
    prompt_gaps: Counter[int] = field(default_factory=Counter)

    @property
    def share(self) -> float:
        """Accepted answers over all answers (0 without any)."""
        return self.accepted / self.answers if self.answers else 0.0

    @property
    def dollars_per_accepted(self) -> float | None:
        """Dollars of every answer over the accepted ones (None when none was accepted)."""
        return self.dollars / self.accepted if self.accepted else None


@dataclass(frozen=True)
class Forecast:
    """The whole dataset at the probe's rates."""

    prompts: int
    accepted: int
    dollars: float
    tokens_paid: int
    tokens_kept: int


def _verdict(values: Iterable[str]) -> str:
    seen = set(values)
    if not seen:
        return "unproven"
    return seen.pop() if len(seen) == 1 else "mixed"


def _edges(raw: str) -> tuple[str, str]:
    """The leading and the trailing whitespace of ``raw``."""
    return raw[: len(raw) - len(raw.lstrip())], raw[len(raw.rstrip()) :]


def _whitespace_evidence(
    response: ResponseReceived, think_start: str | None, think_end: str | None, end_of_turn: str
) -> dict[str, str]:
    """Per edge: ``kept`` / ``stripped`` where the logprob tokens show whitespace the text had to keep."""
    if not response.logprobs:
        return {}
    raw = "".join(t.token for t in response.logprobs)
    if end_of_turn and raw.endswith(end_of_turn):
        raw = raw[: -len(end_of_turn)]
    if think_start and raw.startswith(think_start):
        raw = raw[len(think_start) :]
    if not think_end or think_end not in raw or response.tool_calls:
        return {}
    raw_reasoning, raw_content = raw.split(think_end, 1)
    out: dict[str, str] = {}
    for (start, end), raw_part, text in (
        (("reasoning_start", "reasoning_end"), raw_reasoning, response.reasoning),
        (("content_start", "content_end"), raw_content, response.content),
    ):
        lead, trail = _edges(raw_part)
        for edge, white, kept in ((start, lead, text.startswith(lead)), (end, trail, text.endswith(trail))):
            if white and raw_part.strip():
                out[edge] = "kept" if kept else "stripped"
    return out


def _end_of_turn(answer: ProbeAnswer, end_of_turn_id: int) -> str | None:
    """``counted`` / ``not counted`` / ``wrong`` from exact ids; None without them."""
    sample = answer.sample
    completion = answer.response.usage.completion_tokens
    if sample is None or sample.method == "reencode" or completion is None:
        return None
    ids = sample.output_ids
    if completion == len(ids):
        return "counted"
    if ids and ids[-1] == end_of_turn_id and completion == len(ids) - 1:
        return "not counted"
    return "wrong"


def summarize(
    answers: Sequence[ProbeAnswer],
    *,
    think_start: str | None,
    think_end: str | None,
    end_of_turn: str,
    end_of_turn_id: int,
    logprobs_asked: bool,
    prompt_offset: int = 0,
) -> Findings:
    """The findings of a set of answers (a dataset's, or one upstream's).

    ``prompt_offset``: the dataset's configured ``usage.prompt_tokens`` minus prompt ids.
    """
    found = Findings(answers=len(answers))
    edges: dict[str, list[str]] = {}
    counts: list[str] = []
    logprobs: list[str] = []
    for answer in answers:
        response = answer.response
        usage = response.usage
        found.dollars += 0.0 if response.reused else usage.cost or 0.0
        found.tokens_paid += usage.completion_tokens or 0
        if answer.accepted:
            found.accepted += 1
            found.tokens_kept += usage.completion_tokens or 0
        else:
            found.reasons[answer.reason] += 1
        if logprobs_asked:
            logprobs.append("present" if response.logprobs else "null")
        for edge, seen in _whitespace_evidence(response, think_start, think_end, end_of_turn).items():
            edges.setdefault(edge, []).append(seen)
        counted = _end_of_turn(answer, end_of_turn_id)
        if counted is not None:
            counts.append(counted)
        prompt_length = len(answer.sample.prompt_ids) if answer.sample is not None else answer.prompt_length
        if prompt_length is not None and usage.prompt_tokens is not None:
            found.prompt_compared += 1
            gap = usage.prompt_tokens - prompt_length
            found.prompt_agrees += int(gap == prompt_offset)
            if gap != prompt_offset:
                found.prompt_gaps[gap] += 1
    found.logprobs = _verdict(logprobs) if logprobs_asked else "not asked"
    found.whitespace = {edge: _verdict(edges.get(edge, ())) for edge in EDGES}
    found.usage_wrong = counts.count("wrong")
    found.end_of_turn = _verdict(c for c in counts if c != "wrong")
    return found


def forecast(findings: Findings, prompts: int) -> Forecast:
    """The dataset's ``prompts`` at the probe's accepted share, cost and tokens per answer."""
    n = findings.answers or 1
    return Forecast(
        prompts=prompts,
        accepted=round(prompts * findings.share),
        dollars=prompts * findings.dollars / n,
        tokens_paid=round(prompts * findings.tokens_paid / n),
        tokens_kept=round(prompts * findings.tokens_kept / n),
    )


def by_upstream(answers: Sequence[ProbeAnswer]) -> dict[str, list[ProbeAnswer]]:
    """The answers grouped by the upstream that gave them, in name order."""
    groups: dict[str, list[ProbeAnswer]] = {}
    for answer in sorted(answers, key=lambda a: a.upstream):
        groups.setdefault(answer.upstream, []).append(answer)
    return groups


@dataclass(frozen=True)
class DatasetReport:
    """One dataset's probe: its findings, its upstreams', the forecast."""

    dataset: str
    findings: Findings
    upstreams: dict[str, Findings]
    forecast: Forecast
    requests_sent: int
    profile: str = ""
    prompt_offset: int = 0
    # Upstreams whose answers showed they strip whitespace their convention says they keep (strips_at_edges).
    strips: tuple[str, ...] = ()
    # By which route the probed prompts' tools travel (services/inference/tool_route.py), and
    # whether one of those routes is the server's parser (calls that cannot be proven).
    tools: tuple[str, ...] = ()
    tools_unproven: bool = False

    def below(self, min_yield: float) -> bool:
        """Whether the forecast yield is under the floor (the probe exits 1)."""
        return self.findings.answers > 0 and self.findings.share < min_yield

    @property
    def tokenizer_mismatch(self) -> str | None:
        """Why the profile's tokenizer is not the provider's, when most answers say so; else None.

        The provider counts ``usage.prompt_tokens`` with the model's own tokenizer and template;
        when the prompt rendered and encoded with the dataset's profile is off that count by other
        than the configured offset on most answers, the profile is not the model's (a Gemma model
        under the ``qwen3`` profile): every answer would be rebuilt with the wrong vocabulary.
        """
        f = self.findings
        off = f.prompt_compared - f.prompt_agrees
        if f.prompt_compared == 0 or off * 2 <= f.prompt_compared:
            return None
        gaps = ", ".join(f"{gap:+d} on {n}" for gap, n in f.prompt_gaps.most_common(3))
        return (
            f"probe: profile {self.profile!r} does not match the provider's prompt-token count: {off} of "
            f"{f.prompt_compared} answers off by other than the configured offset {self.prompt_offset} "
            f"(usage.prompt_tokens minus the ids rendered with {self.profile}: {gaps}); set [datasets.{self.dataset}] "
            "profile to the model's own"
        )


@dataclass
class ProbeRun:
    """What the probe found: a report per probed dataset, and the datasets it could not probe."""

    reports: list[DatasetReport] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # dataset -> why

    def failed(self, min_yield: float) -> bool:
        """Exit 1: a forecast below ``min_yield``, a profile the provider's counts refute, or a dataset not probed."""
        return bool(self.skipped) or any(r.below(min_yield) or r.tokenizer_mismatch for r in self.reports)


def _money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}"


def _reasons(findings: Findings, *, most: int | None = None) -> str:
    """The reasons of the answers not accepted, commonest first (``most``: that many, then how many more)."""
    common = findings.reasons.most_common()
    shown = ", ".join(f"{code} {n}" for code, n in common[:most]) or "-"
    rest = sum(n for _, n in common[most:]) if most is not None else 0
    return f"{shown}, +{rest} more" if rest else shown


def _facts(findings: Findings) -> str:
    white = ", ".join(f"{edge} {seen}" for edge, seen in findings.whitespace.items())
    wrong = f"; usage wrong on {findings.usage_wrong}" if findings.usage_wrong else ""
    return (
        f"logprobs {findings.logprobs}; whitespace: {white}; end-of-turn {findings.end_of_turn}{wrong}; "
        f"prompt count agrees {findings.prompt_agrees}/{findings.prompt_compared}"
    )


_WORST_FIRST = ("stripped", "mixed", "kept", "unproven")


def _short_facts(findings: Findings) -> str:
    """The facts in a few words: of the whitespace, the worst any edge showed (``--wide`` has every edge)."""
    seen = set(findings.whitespace.values())
    white = next((v for v in _WORST_FIRST if v in seen), "unproven")
    wrong = f", usage wrong {findings.usage_wrong}" if findings.usage_wrong else ""
    return (
        f"logprobs {findings.logprobs}, whitespace {white}, end-of-turn {findings.end_of_turn}{wrong}, "
        f"prompt {findings.prompt_agrees}/{findings.prompt_compared}"
    )


PROBE_COLUMNS = (
    Column("dataset", view="wide"),
    Column("upstream", view="wide"),
    Column("dataset / upstream", view="compact"),
    Column("answers", "right", "wide", whole=True),
    Column("accepted (share)", "right", whole=True),
    Column("$/accepted", "right", "wide", whole=True),
    Column("reasons of the rest"),
    Column("proved", view="compact"),
    Column("what the answers proved", view="wide"),
    Column("forecast", view="compact", whole=True),
    Column("forecast (whole dataset)", view="wide"),
    Column("verdict"),
)
"""The probe table's columns: the compact view by default, every column (and every fact) with ``--wide``."""


def render(run: ProbeRun, min_yield: float, *, wide: bool = False) -> FittedTable:
    """The probe's table: per dataset and upstream, yield and reasons, facts, forecast (compact unless ``wide``)."""
    fitted = FittedTable("draftstream probe", PROBE_COLUMNS, wide=wide, title_justify="left")
    for report in run.reports:
        f, fc = report.findings, report.forecast
        verdict = styled("below min_yield", "red") if report.below(min_yield) else styled("ok", "green")
        outlook = (
            f"{fc.accepted:,} of {fc.prompts:,} accepted, {_money(fc.dollars)}, "
            f"tokens kept {fc.tokens_kept:,} of {fc.tokens_paid:,} paid"
        )
        rows = [("all", f, True), *((name, u, False) for name, u in report.upstreams.items())]
        for upstream, found, whole in rows:
            # An upstream caught stripping: its name here, the evidence with --wide.
            caught = [styled(f"strips_at_edges: {s if wide else s.split(' (', 1)[0]}", "yellow")
                      for s in report.strips if whole]  # fmt: skip
            fitted.add_row(
                {
                    "dataset": report.dataset,
                    "upstream": upstream,
                    "dataset / upstream": report.dataset if whole else f"· {upstream}",
                    "answers": f"{found.answers}",
                    "accepted (share)": f"{found.accepted} ({found.share:.0%})",
                    "$/accepted": _money(found.dollars_per_accepted),
                    "reasons of the rest": _reasons(found) if wide else _reasons(found, most=1),
                    "proved": Text("; ").join([Text(_short_facts(found)), *caught]),
                    "what the answers proved": Text("; ").join([Text(_facts(found)), *caught]),
                    "forecast": f"{fc.accepted:,} of\n{fc.prompts:,}\n${fc.dollars:,.2f}" if whole else "",
                    "forecast (whole dataset)": outlook if whole else "",
                    "verdict": verdict if whole else "",
                }
            )
    for dataset, why in run.skipped.items():
        not_probed = f"not probed: {why}"
        fitted.add_row({"dataset": dataset, "dataset / upstream": dataset, "answers": "0", "proved": not_probed,
                        "what the answers proved": not_probed, "verdict": styled("not probed", "red")})  # fmt: skip
    return fitted
