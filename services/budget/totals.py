"""The running totals of one budget scope (a dataset or ``global``), its caps, and how a snapshot restores them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec

from schemas import BudgetSnapshot, HeldAttempt


@dataclass(frozen=True)
class Caps:
    """The caps of one scope; ``None`` means uncapped in that unit."""

    completion_tokens: int | None = None
    usd: float | None = None


@dataclass(frozen=True)
class Counted:
    """What one response added to its dataset, for metrics."""

    dataset: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost_usd: float
    estimated: bool
    priced: bool


def copy_tally(tally: dict[str, dict[str, int]] | None) -> dict[str, dict[str, int]] | None:
    """A copy of a stage -> reason -> count tally (None stays None: never tallied)."""
    return None if tally is None else {stage: dict(reasons) for stage, reasons in tally.items()}


@dataclass
class ScopeTotals:
    """Running totals of one scope (a dataset or ``global``)."""

    scope: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0
    requests: int = 0
    responses: int = 0
    responses_without_usage: int = 0
    # Attempts sent and not answered, by their attempt key; only kept on dataset scopes.
    inflight: dict[str, HeldAttempt] = field(default_factory=dict)
    # Lost attempts whose prompt a later attempt answered (each counted once).
    repaid: set[str] = field(default_factory=set)
    lost_repaid: int = 0
    # Keys of the lost attempts (an index into ``inflight``; a key no longer there was answered).
    lost: set[str] = field(default_factory=set)

    def lost_items(self) -> list[tuple[str, HeldAttempt]]:
        """The lost attempts still held, by key (the index is pruned of answered ones as it goes)."""
        gone = [k for k in self.lost if k not in self.inflight or not self.inflight[k].lost]
        self.lost.difference_update(gone)
        return [(k, self.inflight[k]) for k in self.lost]
    # Keys of requests admitted under a lease (services.budget.leases bounds those, not a halt).
    leased: set[str] = field(default_factory=set)
    # Offsets below which this scope already counted records (from its snapshot).
    floor: dict[str, int] = field(default_factory=dict)
    # Caps recorded in the last snapshot (to tell a raised cap at restart).
    previous_caps: Caps | None = None
    # Only on ``global``: dead letters read (stage -> reason -> count), truncated answers accepted
    # per dataset; None when restored from a snapshot written before tallies (never tallied then).
    dead_letters: dict[str, dict[str, int]] | None = field(default_factory=dict)
    # Only on ``global``: key -> (stage, reason) of the keys whose latest outcome is a dead letter.
    dead_letter_keys: dict[str, tuple[str, str]] = field(default_factory=dict)
    accepted_truncated: dict[str, int] | None = field(default_factory=dict)
    window: deque[tuple[float, float, int]] = field(default_factory=deque)
    first_event_at: float | None = None

    def counts(self, position: str, offset: int) -> bool:
        """Whether a record at ``position``/``offset`` is new to this scope."""
        return offset >= self.floor.get(position, 0)


def counted_snapshot(totals: ScopeTotals) -> BudgetSnapshot:
    """A snapshot of what a scope counted (tokens, dollars, requests, answers); the rest left at defaults."""
    return BudgetSnapshot(
        scope=totals.scope,
        prompt_tokens=totals.prompt_tokens,
        completion_tokens=totals.completion_tokens,
        reasoning_tokens=totals.reasoning_tokens,
        cost_usd=totals.cost_usd,
        requests=totals.requests,
        responses=totals.responses,
        responses_without_usage=totals.responses_without_usage,
    )


def restored_attempts(snap: BudgetSnapshot, now: float) -> dict[str, HeldAttempt]:
    """A snapshot's held attempts (older snapshots carry only ``inflight``: started now, by nobody known)."""
    if snap.attempts:
        return {k: msgspec.structs.replace(held) for k, held in snap.attempts.items()}
    return {k: HeldAttempt(max_tokens=v, started_at=now) for k, v in snap.inflight.items()}


def caps_raised(previous: Caps, current: Caps) -> bool:
    """Whether ``current`` allows more than ``previous`` in some unit."""

    def more(old: float | None, new: float | None) -> bool:
        if old is None:
            return False
        return new is None or new > old

    return more(previous.completion_tokens, current.completion_tokens) or more(previous.usd, current.usd)


def totals_from_snapshot(snap: BudgetSnapshot, now: float) -> ScopeTotals:
    """A scope's totals as a checkpoint left them, counting on from its offsets."""
    return ScopeTotals(
        scope=snap.scope,
        prompt_tokens=snap.prompt_tokens,
        completion_tokens=snap.completion_tokens,
        reasoning_tokens=snap.reasoning_tokens,
        cost_usd=snap.cost_usd,
        requests=snap.requests,
        responses=snap.responses,
        responses_without_usage=snap.responses_without_usage,
        inflight=restored_attempts(snap, now),
        lost={k for k, held in snap.attempts.items() if held.lost},
        lost_repaid=snap.lost_repaid,
        floor=dict(snap.offsets),
        previous_caps=Caps(snap.cap_completion_tokens, snap.cap_usd),
        dead_letters=copy_tally(snap.dead_letters),
        dead_letter_keys=dict(snap.dead_letter_keys or {}),
        accepted_truncated=None if snap.accepted_truncated is None else dict(snap.accepted_truncated),
    )
