"""The quality halt, pure: audit verdicts per dataset and per upstream, and when to stop paying.

The budget service follows the verdicts of the stages that judge a paid answer: a sample
on ``accepted`` is a usable answer; a dead letter of ``reconstruct`` or ``audit`` is an
answer paid for and thrown away (its primary reason code says why). Per dataset, and per
upstream serving it (OpenRouter names the upstream in the reply's ``provider``, kept as
``ResponseReceived.upstream_provider``), the last ``quality_window`` verdicts are kept.

The halt rule: a scope halts as soon as its accepted share over a full window *must* be
below ``min_yield``, i.e. when the dead letters among its last ``window`` verdicts exceed
``(1 - min_yield) * window``. Verdicts not seen yet count as accepted, so a young window
halts only on certainty (21 dead letters of the first 25 answers halt at once with the
defaults, 200 and 0.9, instead of paying for 175 more), and a full window halts exactly
when its accepted share is below the floor.

A resume of the dataset (after a fix of profile, convention, mode or routing) starts its
windows afresh, and answers received before that resume are left out of them: they were
paid for before the fix and say nothing about it. Totals (for metrics and ``status``) keep
counting everything.

No Kafka, no clock: the shell passes each record's bytes and dead-letter headers in (this
module decodes only the few fields a verdict needs) and publishes the :class:`~schemas.Halt`
built from the returned reason. After a budget restart the windows start empty (the
totals come back from the snapshots); a standing quality halt stays on ``control``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from schemas import BudgetSnapshot, YieldFigures, provider_of_scope

QUALITY_ACTOR = "budget-quality"
"""The ``by`` of a quality halt (a cap halt is ``budget``: raising a cap never lifts this one)."""

JUDGING_STAGES = ("reconstruct", "audit")
"""Stages whose dead letters are verdicts on a paid answer (inference's are unpaid failures)."""

TOP_REASONS = 3
"""How many dead-letter reasons a halt reason names."""


@dataclass(frozen=True)
class Verdict:
    """What became of one paid answer: accepted, or a dead letter with its primary reason."""

    dataset: str
    accepted: bool
    upstream: str = ""
    reason: str = ""
    received_at: float = 0.0
    completion_tokens: int = 0
    key: str = ""
    """The record key (``<dataset>:<sample_id>``): a later verdict of the same key supersedes this one."""
    provider: str = ""  # the configured provider that answered ("": a record from before names)


# Partial views of the wire records: only the fields a verdict needs are decoded (msgspec
# skips the rest, so a sample's ids are never built as Python lists here).
class _UsageView(msgspec.Struct):
    completion_tokens: int | None = None


class _ResponseView(msgspec.Struct):
    dataset: str
    provider: str = ""
    provider_name: str = ""
    upstream_provider: str | None = None
    received_at: float = 0.0
    usage: _UsageView = msgspec.field(default_factory=_UsageView)


class _SampleView(msgspec.Struct):
    dataset: str
    response: _ResponseView


class _AuditedView(msgspec.Struct):
    dataset: str
    passed: bool
    sample: _SampleView


_response_view = msgspec.json.Decoder(_ResponseView, strict=False)
_sample_view = msgspec.json.Decoder(_SampleView, strict=False)
_audited_view = msgspec.json.Decoder(_AuditedView, strict=False)


def _of_response(dataset: str, response: _ResponseView, *, accepted: bool, reason: str = "", key: str = "") -> Verdict:
    return Verdict(
        dataset=dataset,
        accepted=accepted,
        upstream=response.upstream_provider or "",
        reason=reason,
        received_at=response.received_at,
        completion_tokens=response.usage.completion_tokens or 0,
        key=key,
        provider=response.provider_name or response.provider,
    )


def accepted_verdict(value: bytes | None, key: str = "") -> Verdict | None:
    """The verdict of an ``accepted`` record; None for one that is no passed sample (the sink's concern)."""
    if not value:
        return None
    try:
        audited = _audited_view.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec checks UTF-8 only inside the strings it reads
        return None
    if not audited.passed:
        return None
    return _of_response(audited.dataset, audited.sample.response, accepted=True, key=key)


def dead_letter_verdict(stage: str | None, reason: str | None, value: bytes | None, key: str = "") -> Verdict | None:
    """The verdict a dead letter carries; None unless a judging stage refused a real answer.

    A dead letter whose value is no answer (a malformed record fed to the stage) judges no
    provider and is left out.
    """
    if stage not in JUDGING_STAGES or not value:
        return None
    try:
        if stage == "reconstruct":
            response = _response_view.decode(value)
        else:
            response = _sample_view.decode(value).response
    except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec checks UTF-8 only inside the strings it reads
        return None
    return _of_response(response.dataset, response, accepted=False, reason=reason or "unknown", key=key)


@dataclass
class _Window:
    """The last ``size`` verdicts of one scope, with running counts, and totals since the start.

    One prompt, one verdict: a verdict of a key whose latest verdict was a dead letter (a
    replay) replaces that one, in the totals and in the window, instead of adding a prompt.
    """

    size: int
    items: deque[Verdict] = field(default_factory=deque)
    rejected: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    verdicts: int = 0
    accepted: int = 0
    kept_completion_tokens: int = 0
    # Keys whose latest verdict is a dead letter: the only ones a replay judges again.
    standing: set[str] = field(default_factory=set)

    def add(self, verdict: Verdict, *, in_window: bool) -> None:
        again = bool(verdict.key) and verdict.key in self.standing
        if verdict.key:
            if verdict.accepted:
                self.standing.discard(verdict.key)
            else:
                self.standing.add(verdict.key)
        if not again:
            self.verdicts += 1
        if verdict.accepted:
            self.accepted += 1
            self.kept_completion_tokens += verdict.completion_tokens
        if not in_window:
            return
        if again:
            earlier = next((v for v in self.items if v.key == verdict.key), None)
            if earlier is not None:
                self.items.remove(earlier)
                self._forget(earlier)
        self.items.append(verdict)
        if not verdict.accepted:
            self.rejected += 1
            self.reasons[verdict.reason] += 1
        if len(self.items) > self.size:
            self._forget(self.items.popleft())

    def _forget(self, old: Verdict) -> None:
        """Take a verdict that left the window out of its counts."""
        if not old.accepted:
            self.rejected -= 1
            self.reasons[old.reason] -= 1
            if not self.reasons[old.reason]:
                del self.reasons[old.reason]

    def clear(self) -> None:
        self.items.clear()
        self.rejected = 0
        self.reasons.clear()

    def figures(self) -> YieldFigures:
        return YieldFigures(
            verdicts=self.verdicts,
            accepted=self.accepted,
            window_verdicts=len(self.items),
            window_accepted=len(self.items) - self.rejected,
            window_reasons=dict(self.reasons.most_common()),
            kept_completion_tokens=self.kept_completion_tokens,
        )

    def restore(self, figures: YieldFigures) -> None:
        self.verdicts = figures.verdicts
        self.accepted = figures.accepted
        self.kept_completion_tokens = figures.kept_completion_tokens


def must_halt(rejected: int, size: int, min_yield: float) -> bool:
    """Whether a window of ``size`` with ``rejected`` dead letters is below ``min_yield`` whatever comes next."""
    return min_yield > 0 and (size - rejected) < min_yield * size - 1e-9


class QualityGate:
    """Sliding windows of verdicts per dataset and per (dataset, upstream); says when to halt.

    Args:
        window: verdicts per window (``[budget] quality_window``).
        min_yield: the floor of the accepted share (``[budget] min_yield``; 0: never halt).
    """

    def __init__(self, *, window: int, min_yield: float) -> None:
        self.window = window
        self.min_yield = min_yield
        self._datasets: dict[str, _Window] = {}
        self._upstreams: dict[str, dict[str, _Window]] = {}
        self._providers: dict[str, _Window] = {}  # per configured provider: figures only, never a halt
        self._since: dict[str, float] = {}

    def _dataset(self, name: str) -> _Window:
        found = self._datasets.get(name)
        if found is None:
            found = self._datasets[name] = _Window(self.window)
        return found

    def _upstream(self, dataset: str, upstream: str) -> _Window:
        ups = self._upstreams.setdefault(dataset, {})
        found = ups.get(upstream)
        if found is None:
            found = ups[upstream] = _Window(self.window)
        return found

    def observe(self, verdict: Verdict) -> str | None:
        """Count one verdict; the halt reason when its dataset (or that upstream) must stop now."""
        since = self._since.get(verdict.dataset, 0.0)
        in_window = not (since and verdict.received_at and verdict.received_at < since)
        self._dataset(verdict.dataset).add(verdict, in_window=in_window)
        if verdict.upstream:
            self._upstream(verdict.dataset, verdict.upstream).add(verdict, in_window=in_window)
        if verdict.provider:
            self._providers.setdefault(verdict.provider, _Window(self.window)).add(verdict, in_window=True)
        return self.breach(verdict.dataset) if in_window else None

    def breach(self, dataset: str) -> str | None:
        """Why the dataset must stop (its window, else the worst of its upstreams'), or None."""
        scopes: list[tuple[str, _Window]] = []
        if dataset in self._datasets:
            scopes.append((f"dataset {dataset}", self._datasets[dataset]))
        for upstream, win in sorted(self._upstreams.get(dataset, {}).items()):
            scopes.append((f"dataset {dataset}, upstream {upstream}", win))
        for label, win in scopes:
            if must_halt(win.rejected, self.window, self.min_yield):
                return self._reason(label, win)
        return None

    def _reason(self, label: str, win: _Window) -> str:
        seen = len(win.items)
        best = (self.window - win.rejected) / self.window
        top = ", ".join(f"{code} {n}" for code, n in win.reasons.most_common(TOP_REASONS))
        return (
            f"quality: {label}: {win.rejected} of its last {seen} audit verdicts are dead letters, so its "
            f"accepted share over a {self.window}-verdict window is at most {best:.1%}, below min_yield "
            f"{self.min_yield:.0%}; top reasons: {top}"
        )

    def reset(self, dataset: str, since: float) -> None:
        """A resume of the dataset: fresh windows, and answers received before ``since`` left out."""
        self._since[dataset] = since
        if dataset in self._datasets:
            self._datasets[dataset].clear()
        for win in self._upstreams.get(dataset, {}).values():
            win.clear()

    def figures(self, dataset: str) -> tuple[YieldFigures | None, dict[str, YieldFigures]]:
        """The dataset's figures and its upstreams' (None before its first verdict)."""
        win = self._datasets.get(dataset)
        ups = {name: w.figures() for name, w in sorted(self._upstreams.get(dataset, {}).items())}
        return (win.figures() if win else None), ups

    def provider_figures(self, provider: str) -> YieldFigures | None:
        """The yield of one provider's answers over every dataset (None before its first verdict)."""
        win = self._providers.get(provider)
        return win.figures() if win else None

    def restore(self, snapshots: Iterable[BudgetSnapshot]) -> None:
        """Totals from checkpointed snapshots (the windows start empty after a restart).

        The keys whose latest outcome is a judging stage's dead letter (the ``global``
        snapshot's ``dead_letter_keys``) stand again, so a replay after the restart is still
        judged as the same prompt.
        """
        for snap in snapshots:
            provider = provider_of_scope(snap.scope)
            if provider is not None:
                if snap.quality is not None:
                    self._providers.setdefault(provider, _Window(self.window)).restore(snap.quality)
                continue
            if snap.quality is not None:
                self._dataset(snap.scope).restore(snap.quality)
            for upstream, figures in snap.upstreams.items():
                self._upstream(snap.scope, upstream).restore(figures)
            for key, (stage, _reason) in (snap.dead_letter_keys or {}).items():
                if stage in JUDGING_STAGES and ":" in key:
                    self._dataset(key.partition(":")[0]).standing.add(key)

    @property
    def datasets(self) -> list[str]:
        """Datasets with at least one verdict."""
        return sorted(self._datasets)


def _share(figures: YieldFigures) -> str:
    n = figures.window_verdicts
    return "-" if n == 0 else f"{figures.window_accepted / n:.0%} of {n}"


def yield_text(snapshot: BudgetSnapshot) -> str:
    """A dataset snapshot's yield for the tables: the window's accepted share, then each upstream's."""
    if snapshot.quality is None:
        return "-"
    parts = [_share(snapshot.quality), *(f"{name} {_share(f)}" for name, f in snapshot.upstreams.items())]
    return "; ".join(parts)


def dollars_per_accepted(snapshot: BudgetSnapshot) -> float | None:
    """What one accepted sample of the dataset cost: every dollar spent over every sample accepted."""
    if snapshot.quality is None or not snapshot.quality.accepted:
        return None
    return snapshot.cost_usd / snapshot.quality.accepted
