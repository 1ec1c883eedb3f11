"""How lost attempts read in ``status``, ``budget`` and the halt of a scope finished at its cap: pure.

A lost attempt was sent and never answered to us, and its worker died (or its answer is
overdue): the provider may have billed it, so the budget keeps it counted (see
services.budget.reconcile).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from schemas import GLOBAL_SCOPE, BudgetSnapshot, HeldAttempt, provider_of_scope


class _LostView(Protocol):
    def lost_attempts(self, scope: str) -> list[HeldAttempt]: ...
    def lost_tokens(self, scope: str) -> int: ...

    @property
    def inflight_usd_per_token(self) -> float | None: ...


def lost_lines(attempts: Iterable[HeldAttempt], held: int, usd_per_token: float | None, repaid: int = 0) -> list[str]:
    """``N attempts lost with worker W, counted at X tokens / $Y (the provider may have billed them)``, per worker.

    ``held``: what the lost attempts hold in all (their worst case, or less once reconciled
    with the provider key's usage); ``repaid``: their prompts answered by a later attempt.
    """
    count: Counter[str] = Counter()
    worst: Counter[str] = Counter()
    for attempt in attempts:
        if attempt.lost:
            count[attempt.worker or "unknown"] += 1
            worst[attempt.worker or "unknown"] += attempt.max_tokens
    lines: list[str] = []
    for worker in sorted(count):
        tokens = worst[worker]
        usd = "" if usd_per_token is None else f" / ${tokens * usd_per_token:,.2f}"
        lines.append(
            f"{count[worker]:,} attempts lost with worker {worker}, counted at {tokens:,} tokens{usd} "
            "(the provider may have billed them)"
        )
    total = sum(worst.values())
    if lines and held < total:
        usd = "" if usd_per_token is None else f" / ${held * usd_per_token:,.2f}"
        lines.append(f"the provider's key usage released them to {held:,} tokens{usd} (what it was charged)")
    if repaid:
        lines.append(f"{repaid:,} prompts of lost attempts paid again by a later attempt")
    return lines


def snapshot_lost_lines(snapshot: BudgetSnapshot, usd_per_token: float | None = None) -> list[str]:
    """:func:`lost_lines` of a checkpointed scope (dollars from its own figures when it has them)."""
    if usd_per_token is None and snapshot.lost_usd is not None and snapshot.lost_tokens:
        usd_per_token = snapshot.lost_usd / snapshot.lost_tokens
    return lost_lines(snapshot.attempts.values(), snapshot.lost_tokens, usd_per_token, snapshot.lost_repaid)


def lost_summary(ledger: _LostView, scope: str) -> str:
    """The lost attempts' part of a capped halt's reason ("" when none)."""
    attempts = ledger.lost_attempts(scope)
    if not attempts:
        return ""
    held = ledger.lost_tokens(scope)
    worst = sum(a.max_tokens for a in attempts)
    workers = ", ".join(sorted({a.worker or "unknown" for a in attempts}))
    released = "" if held >= worst else f", released to {held} by the provider's key usage"
    return (
        f"{held} of them held for {len(attempts)} attempt(s) lost with worker(s) {workers} "
        f"(worst case {worst}{released}; the provider may have billed them: raise the cap by as much if it did not)"
    )


def lost_attempt_lines(snapshots: Iterable[BudgetSnapshot]) -> list[str]:
    """``<dataset>: N attempts lost with worker W, ...`` for every dataset scope that has lost attempts,
    and ``provider:<name>: its lost attempts cannot be reconciled: <why>`` for a provider whose key cannot say."""
    lines: list[str] = []
    for snap in sorted(snapshots, key=lambda s: s.scope):
        if provider_of_scope(snap.scope) is not None:
            if snap.unreconciled:
                lines.append(f"{snap.scope}: its lost attempts cannot be reconciled: {snap.unreconciled}")
        elif snap.scope != GLOBAL_SCOPE:
            lines.extend(f"{snap.scope}: {line}" for line in snapshot_lost_lines(snap))
    return lines
