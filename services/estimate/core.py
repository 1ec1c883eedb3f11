"""What a dataset will cost before anything is paid (pure: no I/O, no Kafka, no settings).

Prompt tokens are exact (the shell renders each prompt with the dataset's profile and
counts its ids). Completion tokens cannot be known in advance: the **bound** is the sum
of every request's ``max_tokens`` (no answer can be longer), and where the budget has
seen responses of the dataset, the **expected** count is, per prompt, the smaller of its
``max_tokens`` and the mean completion length observed so far. Dollars follow from the
configured price per million tokens; caps are checked against what is already spent
plus the estimate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from services.budget.core import price_usd

Measure = Literal["completion tokens", "USD"]


@dataclass(frozen=True)
class Observed:
    """What the budget has counted for one scope so far (from its checkpoint)."""

    responses: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    @property
    def mean_completion(self) -> float | None:
        """Mean completion tokens per response, or None before the first response."""
        return self.completion_tokens / self.responses if self.responses > 0 else None


def expected_completion(max_tokens: int, observed: Observed | None) -> float:
    """A prompt's expected completion tokens: the observed mean, never above its ``max_tokens``."""
    mean = observed.mean_completion if observed is not None else None
    return float(max_tokens) if mean is None else min(float(max_tokens), mean)


@dataclass
class DatasetEstimate:
    """Counts of one dataset's prompts: exact prompt tokens, completion bound and expectation."""

    dataset: str
    profile: str
    observed: Observed | None = None
    prompts: int = 0
    prompt_tokens: int = 0
    # Requests whose prompt offers tools (each reaches the model once: services/inference/tool_route.py),
    # and of those, the rows whose own system text carries them (Glaive style).
    tools_sent: int = 0
    tools_in_text: int = 0
    completion_bound: int = 0
    completion_expected: float = 0.0
    # Whether the profile can write its tool block into system text (raw tool text in chat mode).
    tools_in_prompt: bool = False
    # Rows left out, by reason code (``publish``'s: the same rows it would skip), and the first few by file:line.
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str | None = None, *, examples: int = 3) -> None:
        """Count one row left out for ``reason``; keep its ``file:line: reason: message`` among the first few."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if where is not None and len(self.skipped_examples) < examples:
            self.skipped_examples.append(where)

    def add(self, prompt_tokens: int, max_tokens: int, *, tools_sent: bool = False, in_text: bool = False) -> None:
        """Count one prompt of ``prompt_tokens`` ids whose request allows ``max_tokens``."""
        self.prompts += 1
        self.prompt_tokens += prompt_tokens
        self.tools_sent += int(tools_sent)
        self.tools_in_text += int(tools_sent and in_text)
        self.completion_bound += max_tokens
        self.completion_expected += expected_completion(max_tokens, self.observed)

    @property
    def has_observations(self) -> bool:
        """Whether the expectation rests on observed responses (else it equals the bound)."""
        return self.observed is not None and self.observed.mean_completion is not None


def dollars(
    prices: Mapping[str, Mapping[str, float]], model: str, prompt_tokens: int, completion_tokens: float
) -> float | None:
    """Dollars at the configured per-million prices of ``model``; None when it has no price."""
    return price_usd(prices, model, prompt_tokens, round(completion_tokens))


@dataclass(frozen=True)
class CapCheck:
    """Whether one cap of one scope would be reached by what is spent plus the estimate."""

    scope: str
    measure: Measure
    cap: float
    spent: float
    expected: float | None
    bound: float | None
    observed: bool

    @property
    def verdict(self) -> str:
        """One phrase: not reached, reached at the bound only, reached, or unknown."""
        if self.spent >= self.cap:
            return "already reached"
        if self.bound is None or self.expected is None:
            return "unknown (no price for the model)"
        if self.spent + self.bound <= self.cap:
            return "not reached, even at the bound"
        if not self.observed:
            return "reached at the bound (no responses observed yet)"
        if self.spent + self.expected > self.cap:
            return "reached at the observed mean"
        return "reached only at the bound"

    @property
    def reached(self) -> bool:
        """Whether the cap is reached by the spend plus the expected count."""
        if self.expected is None:
            return self.spent >= self.cap
        return self.spent + self.expected > self.cap or self.spent >= self.cap


@dataclass(frozen=True)
class Caps:
    """A scope's caps (None: no cap)."""

    completion_tokens: int | None = None
    usd: float | None = None


@dataclass
class ScopeTotals:
    """Sums over the datasets of a scope, for its cap checks and the table's totals."""

    prompts: int = 0
    prompt_tokens: int = 0
    completion_bound: int = 0
    completion_expected: float = 0.0
    usd_bound: float | None = 0.0
    usd_expected: float | None = 0.0
    observed: bool = True

    def add(self, estimate: DatasetEstimate, usd_bound: float | None, usd_expected: float | None) -> None:
        """Add one dataset's counts (an unpriced dataset makes the dollar totals unknown)."""
        self.prompts += estimate.prompts
        self.prompt_tokens += estimate.prompt_tokens
        self.completion_bound += estimate.completion_bound
        self.completion_expected += estimate.completion_expected
        self.usd_bound = None if self.usd_bound is None or usd_bound is None else self.usd_bound + usd_bound
        self.usd_expected = (
            None if self.usd_expected is None or usd_expected is None else self.usd_expected + usd_expected
        )
        self.observed = self.observed and estimate.has_observations


def cap_checks(scope: str, caps: Caps, totals: ScopeTotals, spent: Observed | None) -> list[CapCheck]:
    """The checks of a scope's caps against its spend plus the estimate (none without caps)."""
    spent = spent or Observed()
    checks: list[CapCheck] = []
    if caps.completion_tokens is not None:
        checks.append(
            CapCheck(
                scope=scope,
                measure="completion tokens",
                cap=caps.completion_tokens,
                spent=spent.completion_tokens,
                expected=totals.completion_expected,
                bound=totals.completion_bound,
                observed=totals.observed,
            )
        )
    if caps.usd is not None:
        checks.append(
            CapCheck(
                scope=scope,
                measure="USD",
                cap=caps.usd,
                spent=spent.cost_usd,
                expected=totals.usd_expected,
                bound=totals.usd_bound,
                observed=totals.observed,
            )
        )
    return checks


@dataclass
class EstimateReport:
    """Per-dataset estimates, their totals and every cap check, at one price table."""

    model: str
    priced: bool
    datasets: list[DatasetEstimate] = field(default_factory=list)
    usd: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # dataset -> (bound, expected)
    total: ScopeTotals = field(default_factory=ScopeTotals)
    checks: list[CapCheck] = field(default_factory=list)
    observations_read: bool = False


def build_report(
    estimates: Iterable[DatasetEstimate],
    *,
    model: str,
    prices: Mapping[str, Mapping[str, float]],
    caps: Mapping[str, Caps],
    global_caps: Caps,
    spent: Mapping[str, Observed],
    global_scope: str = "global",
    observations_read: bool = False,
) -> EstimateReport:
    """Dollars, totals and cap checks for the datasets' estimates.

    Args:
        caps: each dataset's caps.
        spent: what the budget counted so far per scope (datasets and ``global_scope``).
    """
    report = EstimateReport(model=model, priced=model in prices, observations_read=observations_read)
    for estimate in estimates:
        usd_bound = dollars(prices, model, estimate.prompt_tokens, estimate.completion_bound)
        usd_expected = dollars(prices, model, estimate.prompt_tokens, estimate.completion_expected)
        report.datasets.append(estimate)
        report.usd[estimate.dataset] = (usd_bound, usd_expected)
        report.total.add(estimate, usd_bound, usd_expected)
        totals = ScopeTotals()
        totals.add(estimate, usd_bound, usd_expected)
        own_caps = caps.get(estimate.dataset, Caps())
        report.checks += cap_checks(estimate.dataset, own_caps, totals, spent.get(estimate.dataset))
    report.checks += cap_checks(global_scope, global_caps, report.total, spent.get(global_scope))
    return report


__all__ = [
    "CapCheck",
    "Caps",
    "DatasetEstimate",
    "EstimateReport",
    "Observed",
    "ScopeTotals",
    "build_report",
    "cap_checks",
    "dollars",
    "expected_completion",
]
