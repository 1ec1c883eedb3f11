"""Commands: ``run budget``, ``halt``, ``resume`` and the ``budget`` table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from services.common.console import Column, FittedTable
from services.common.logs import LogLevelOption

if TYPE_CHECKING:

    from schemas import BudgetSnapshot, Halt, Resume
    from services.common.config import Settings

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config file (default: ./draftstream.toml if present)"),
]
DatasetOption = Annotated[
    str | None, typer.Option("--dataset", "-d", help="Only this dataset (default: every dataset, global)")
]
ByOption = Annotated[str | None, typer.Option("--by", help="Who (default: $USER@hostname)")]
ProviderOption = Annotated[
    str | None, typer.Option("--provider", "-p", help="A provider's workers only (scope provider:NAME)")
]


def default_actor() -> str:
    """``user@hostname`` of the person running the command."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _scope(dataset: str | None, provider: str | None = None) -> str:
    from schemas import GLOBAL_SCOPE, provider_scope
    from services.common.cli import fail
    from services.common.config import ConfigError, check_dataset_name

    if provider is not None:
        if dataset is not None:
            fail("--dataset and --provider name two scopes: give one")
        return provider_scope(provider)
    if dataset is None:
        return GLOBAL_SCOPE
    if dataset == GLOBAL_SCOPE:
        fail(f"{GLOBAL_SCOPE!r} is the global scope, not a dataset: leave out --dataset")
    try:
        return check_dataset_name(dataset)
    except ConfigError as exc:
        fail(str(exc))


def _publish(settings: Settings, event: Halt | Resume) -> None:
    import asyncio

    from services.common.cli import fail
    from services.control import publish_control

    try:
        asyncio.run(asyncio.wait_for(publish_control(settings, event), timeout=60))
    except (TimeoutError, OSError) as exc:
        fail(f"could not publish to {settings.kafka.bootstrap_servers}: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - aiokafka's errors share no useful base
        fail(f"could not publish to {settings.kafka.bootstrap_servers}: {type(exc).__name__}: {exc}")


def halt_command(
    reason: Annotated[str, typer.Option("--reason", "-r", help="Why (recorded on the control topic)")],
    dataset: DatasetOption = None,
    by: ByOption = None,
    config: ConfigOption = None,
    provider: ProviderOption = None,
) -> None:
    """Stop every inference worker for a dataset, a provider's workers, or everything (global)."""
    from schemas import Halt
    from services.common.cli import fail, settings_from

    if not reason.strip():
        fail("--reason must say why")
    settings = settings_from(config)
    scope = _scope(dataset, provider)
    event = Halt(scope=scope, reason=reason, by=by or default_actor())
    _publish(settings, event)
    print(f"halted {scope} (by {event.by}: {reason})")


def resume_command(
    dataset: DatasetOption = None,
    reason: Annotated[str, typer.Option("--reason", "-r", help="Why")] = "resumed by hand",
    by: ByOption = None,
    config: ConfigOption = None,
    provider: ProviderOption = None,
) -> None:
    """Lift the halt of a dataset, of a provider, or the global halt."""
    from schemas import Resume
    from services.common.cli import settings_from

    settings = settings_from(config)
    scope = _scope(dataset, provider)
    event = Resume(scope=scope, reason=reason, by=by or default_actor())
    _publish(settings, event)
    print(f"resumed {scope} (by {event.by}: {reason})")
    print(
        "note: if the budget halted this scope because a cap was reached, it halts it again; "
        "raise the cap in the config and restart the budget service instead. After a quality halt "
        "(by budget-quality) the dataset's window starts afresh: resume once the cause is fixed."
    )


def _fmt_int(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _fmt_usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}"


def _short(value: float) -> str:
    """A count in a few characters (``950``, ``12.3k``, ``4.5M``, ``1.2B``): the compact view's figures."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.1f}".removesuffix(".0") + unit
    return f"{value:,.0f}"


def _short_usd(value: float) -> str:
    return f"${value:,.2f}" if value < 10_000 else f"${_short(value)}"


def _amounts(tokens: int | None, usd: float | None, *, wide: bool) -> str:
    """Tokens and dollars as one cell ("12.3M tok / $1,234.57" compact, every digit wide); "" for neither."""
    parts = []
    if tokens is not None:
        parts.append(f"{tokens:,} tok" if wide else f"{_short(tokens)} tok")
    if usd is not None:
        parts.append(f"${usd:,.2f}" if wide else _short_usd(usd))
    return (" / " if wide else "\n").join(parts)


BUDGET_COLUMNS = (
    Column("scope"),
    Column("spent", "right", "compact", whole=True),
    Column("completion tok", "right", "wide"),
    Column("prompt tok", "right", "wide"),
    Column("reasoning tok", "right", "wide"),
    Column("spent $", "right", "wide"),
    Column("cap", "right", whole=True),
    Column("remaining", "right", whole=True),
    Column("in flight", "right", "wide"),
    Column("rate", "right", whole=True),
    Column("projection", "right", "wide"),
    Column("yield (window; per upstream)", "left", "wide"),
    Column("yield", "left", "compact", whole=True),
    Column("$/accepted", "right", "wide"),
    Column("state"),
)
"""The budget table's columns: the compact view by default, every column with ``--wide``."""


def budget_table(
    snapshots: dict[str, BudgetSnapshot], control: dict[str, Halt | Resume], settings: Settings, *, wide: bool = False
) -> FittedTable:
    """The budget table: one row per dataset and one for the global scope (compact unless ``wide``)."""
    from schemas import GLOBAL_SCOPE, PROVIDER_SCOPE_PREFIX, Halt
    from services.budget.core import BUDGET_ACTOR
    from services.budget.leases import capped_summary
    from services.budget.quality import dollars_per_accepted, yield_text
    from services.common.console import styled

    fitted = FittedTable("draftstream budget", BUDGET_COLUMNS, wide=wide)
    scopes = sorted(set(snapshots) | {s for s in control if s != GLOBAL_SCOPE} | set(settings.datasets))
    scopes = [s for s in scopes if not s.startswith(PROVIDER_SCOPE_PREFIX)]  # provider_table's rows
    scopes = [s for s in scopes if s != GLOBAL_SCOPE] + [GLOBAL_SCOPE]
    global_halt = control.get(GLOBAL_SCOPE)
    notes: list[Text] = []
    for scope in scopes:
        snap = snapshots.get(scope)
        if scope == GLOBAL_SCOPE:
            cap_tokens = settings.budget.global_cap_completion_tokens
            cap_usd = settings.budget.global_cap_usd
        else:
            cap_tokens = settings.dataset(scope).cap_completion_tokens
            cap_usd = settings.dataset(scope).cap_usd
        tokens = snap.completion_tokens if snap else 0
        usd = snap.cost_usd if snap else 0.0
        caps = _amounts(cap_tokens or None, cap_usd or None, wide=wide)
        remaining = _amounts(
            max(0, cap_tokens - tokens) if cap_tokens else None,
            max(0.0, cap_usd - usd) if cap_usd else None,
            wide=wide,
        )
        rate = "-"
        if snap and (snap.rate_tokens_per_s or snap.rate_usd_per_s):
            per_s = f"{snap.rate_tokens_per_s:,.0f}" if wide else _short(snap.rate_tokens_per_s)
            per_h = f"${snap.rate_usd_per_s * 3600:,.2f}" if wide else _short_usd(snap.rate_usd_per_s * 3600)
            rate = f"{per_s} tok/s{', ' if wide else chr(10)}{per_h}/h"
        projection = "-"
        if snap and snap.projected_completion_tokens is not None:
            projection = (
                f"{snap.projected_completion_tokens:,} tok, {_fmt_usd(snap.projected_usd)}"
                f" ({_fmt_int(snap.remaining_prompts)} prompts left)"
            )
        event = control.get(scope)
        capped = None
        if snap is not None and isinstance(event, Halt) and event.by == BUDGET_ACTOR:
            capped = capped_summary(snap, event.reason)
        if capped is not None:
            state, label = styled(capped, "red"), styled("capped", "red")
        elif isinstance(event, Halt):
            state = styled("halted", "red", f" by {event.by}: {event.reason}")
            label = styled("halted", "red", f" by {event.by}")
        elif scope != GLOBAL_SCOPE and isinstance(global_halt, Halt):
            state = styled("halted", "red", f" (global) by {global_halt.by}: {global_halt.reason}")
            label = styled("halted", "red", f" (global) by {global_halt.by}")
        elif snap and snap.state == "soft-limit":
            state = label = styled("soft-limit", "yellow")
        else:
            state = label = styled("running", "green")
        if not wide and state is not label:
            # The compact row says what; why (a halt's reason, a cap's summary) is a line below the table.
            notes.append(Text.assemble(f"{scope}: ", state))
        yields = yield_text(snap) if snap else "-"
        fitted.add_row(
            {
                "scope": Text(scope),
                "spent": f"{_short(tokens)} tok\n{_short_usd(usd)}",
                "completion tok": f"{tokens:,}",
                "prompt tok": _fmt_int(snap.prompt_tokens if snap else 0),
                "reasoning tok": _fmt_int(snap.reasoning_tokens if snap else 0),
                "spent $": _fmt_usd(usd),
                "cap": caps or "none",
                "remaining": remaining or "-",
                "in flight": _fmt_int(snap.inflight_tokens if snap else 0),
                "rate": rate,
                "projection": projection,
                "yield (window; per upstream)": yields,
                "yield": yields.split("; ", 1)[0],  # the dataset's share; its upstreams' with --wide
                "$/accepted": _fmt_usd(dollars_per_accepted(snap) if snap else None),
                "state": state if wide else label,
            }
        )
    if notes:
        fitted.table.caption = Text("\n").join(notes)
        fitted.table.caption_justify = "left"
    return fitted


WideOption = Annotated[
    bool, typer.Option("--wide", help="Every column (tokens by kind, in flight, projection, $/accepted)")
]


def budget_command(config: ConfigOption = None, wide: WideOption = False) -> None:
    """Print spend, caps, remaining, rate, yield and state per dataset (from Kafka); --wide for every column."""
    import asyncio

    from services.common.cli import fail, settings_from
    from services.common.console import data_console
    from services.control import read_budget_snapshots, read_control_state

    settings = settings_from(config)

    async def read() -> tuple[dict[str, BudgetSnapshot], dict[str, Halt | Resume]]:
        return await read_budget_snapshots(settings), await read_control_state(settings)

    try:
        snapshots, control = asyncio.run(asyncio.wait_for(read(), timeout=60))
    except Exception as exc:  # noqa: BLE001 - one line, whatever aiokafka raised
        fail(f"could not read from {settings.kafka.bootstrap_servers}: {type(exc).__name__}: {exc}")
    from services.budget.lost import lost_attempt_lines

    console = data_console()  # the terminal's own width: the table wraps its cells to fit
    console.print(budget_table(snapshots, control, settings, wide=wide))
    from services.budget.provider_table import provider_table

    providers = provider_table(snapshots, control, settings, wide=wide)
    if providers is not None:
        console.print(providers)
    for line in lost_attempt_lines(snapshots.values()):
        console.print(line, style="yellow", markup=False)


def run_budget(config: ConfigOption = None, log_level: LogLevelOption = None) -> None:
    """Run the budget service: count spend, halt scopes over their caps."""
    from services.budget.app import create_app
    from services.common.cli import settings_from
    from services.common.service import run_from_cli

    run_from_cli("budget", create_app, settings=settings_from(config), log_level=log_level)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``halt``, ``resume``, ``budget`` and ``run budget`` to the CLI."""
    app.command("halt")(halt_command)
    app.command("resume")(resume_command)
    app.command("budget")(budget_command)
    run_app.command("budget")(run_budget)
