"""The ``budget`` command's table per provider: what each provider's workers spent, and its key's reading.

Read from the budget's ``provider:<name>`` checkpoints (services.budget.providers) and the
standing control events; the rows list every configured provider, answered or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from schemas import BudgetSnapshot, Halt, Resume, provider_of_scope, provider_scope
from services.common.console import Column, FittedTable

if TYPE_CHECKING:
    from services.common.config import Settings


def provider_snapshots(snapshots: Mapping[str, BudgetSnapshot]) -> dict[str, BudgetSnapshot]:
    """The ``provider:<name>`` checkpoints by provider name."""
    return {name: snap for scope, snap in snapshots.items() if (name := provider_of_scope(scope)) is not None}


def provider_names(snapshots: Mapping[str, BudgetSnapshot], settings: Settings) -> list[str]:
    """Every provider worth a row: the configured ones, and any a checkpoint names."""
    configured = list(settings.all_providers()) if settings.providers else []
    return sorted(set(configured) | set(provider_snapshots(snapshots)))


def workers_of(snap: BudgetSnapshot | None) -> str:
    """The workers with attempts of this provider held (in flight or lost)."""
    workers = sorted({held.worker or "unknown" for held in snap.attempts.values()}) if snap else []
    return ", ".join(workers) or "-"


def key_text(snap: BudgetSnapshot | None) -> str:
    """The provider key's last reading: dollars its answers do not explain, or why nothing is released."""
    if snap is None:
        return "-"
    if snap.unreconciled:
        return snap.unreconciled
    if snap.key_unexplained_usd is None:
        return "not read"
    return f"${snap.key_unexplained_usd:,.4f} unexplained"


def provider_state(name: str, control: Mapping[str, Halt | Resume]) -> tuple[str, str]:
    """(state, style) of a provider: halted by its workers' outage, pre-flight or account halt, else running."""
    event = control.get(provider_scope(name))
    if isinstance(event, Halt):
        return f"halted by {event.by}: {event.reason}", "red"
    return "running", "green"


PROVIDER_COLUMNS = (
    Column("provider"),
    Column("kind", view="wide"),
    Column("spent", "right", "compact", whole=True),
    Column("completion tok", "right", "wide"),
    Column("spent $", "right", "wide"),
    Column("answers", "right", "wide"),
    Column("yield (window)"),
    Column("rate", "right", whole=True),
    Column("in flight", "right"),
    Column("lost tok", "right", "wide"),
    Column("workers", view="wide"),
    Column("key", view="wide"),
    Column("state"),
)
"""The per-provider table's columns: the compact view by default, every column with ``--wide``."""


def provider_table(
    snapshots: Mapping[str, BudgetSnapshot],
    control: Mapping[str, Halt | Resume],
    settings: Settings,
    *,
    wide: bool = False,
) -> FittedTable | None:
    """One row per provider (None when a single provider is configured: the dataset rows say it all)."""
    from services.budget.quality import yield_text
    from services.common.console import styled

    names = provider_names(snapshots, settings)
    if len(names) < 2 and not settings.providers:
        return None
    by_name = provider_snapshots(snapshots)
    kinds = {name: p.kind for name, p in settings.all_providers().items()}
    fitted = FittedTable("per provider", PROVIDER_COLUMNS, wide=wide)
    for name in names:
        snap = by_name.get(name)
        rate = "-"
        if snap and (snap.rate_tokens_per_s or snap.rate_usd_per_s):
            rate = f"{snap.rate_tokens_per_s:,.0f} tok/s{', ' if wide else chr(10)}${snap.rate_usd_per_s * 3600:,.2f}/h"
        state, style = provider_state(name, control)
        tokens = snap.completion_tokens if snap else 0
        usd = snap.cost_usd if snap else 0.0
        fitted.add_row(
            {
                "provider": name,
                "kind": kinds.get(name, "?"),
                "spent": f"{tokens:,} tok\n${usd:,.2f}",
                "completion tok": f"{tokens:,}",
                "spent $": f"${usd:,.4f}",
                "answers": f"{snap.responses if snap else 0:,}",
                "yield (window)": yield_text(snap) if snap else "-",
                "rate": rate,
                "in flight": f"{snap.inflight_tokens if snap else 0:,}",
                "lost tok": f"{snap.lost_tokens if snap else 0:,}",
                "workers": workers_of(snap),
                "key": key_text(snap),
                "state": styled(state, style),
            }
        )
    return fitted
