"""``draftstream estimate``: what publishing these files would cost, before paying anything."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from services.common.console import data_console

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from schemas import PromptPublished
    from services.common.config import Settings
    from services.estimate.app import Estimator
    from services.estimate.core import EstimateReport, Observed


def _int(value: float) -> str:
    return f"{round(value):,}"


def _usd(value: float | None) -> str:
    return "?" if value is None else f"${value:,.4f}"


def print_estimate(console: Console, settings: Settings, report: EstimateReport) -> None:
    """The per-dataset table, the cap checks, and what the numbers rest on."""
    from rich.table import Table

    # The terminal's own width: a number that does not fit folds onto the next line, never cut to "…".
    table = Table(title="cost estimate (nothing sent)")
    for name in ("dataset", "profile", "prompts", "prompt tok (exact)", "with tools"):
        table.add_column(name, justify="left" if name in ("dataset", "profile") else "right", overflow="fold")
    for name in ("completion tok: bound", "expected", "$ at the bound", "$ expected"):
        table.add_column(name, justify="right", overflow="fold")
    for est in report.datasets:
        usd_bound, usd_expected = report.usd[est.dataset]
        expected = _int(est.completion_expected) if est.has_observations else "= bound"
        table.add_row(
            est.dataset,
            est.profile,
            _int(est.prompts),
            _int(est.prompt_tokens),
            _int(est.tools_sent),
            _int(est.completion_bound),
            expected,
            _usd(usd_bound),
            _usd(usd_expected) if est.has_observations else "= bound",
        )
    if len(report.datasets) > 1:
        total = report.total
        table.add_row(
            "total", "", _int(total.prompts), _int(total.prompt_tokens), "", _int(total.completion_bound),
            _int(total.completion_expected), _usd(total.usd_bound), _usd(total.usd_expected),
        )  # fmt: skip
    console.print(table)
    for est in report.datasets:  # the rows publish would skip, for the same reasons
        if est.skipped:
            reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(est.skipped.items(), key=lambda kv: -kv[1]))
            console.print(
                f"skipped {sum(est.skipped.values()):,} row(s) of {est.dataset}, as publish would: {reasons}",
                soft_wrap=True,
            )
            for example in est.skipped_examples:
                console.print(f"  {example}", soft_wrap=True)
    from services.common.plan import plan_line
    from services.estimate.app import tool_lines

    for est in report.datasets:  # what the workers' pre-flight will log, value by value with its origin
        console.print(f"plan: {plan_line(settings, est.dataset)}", soft_wrap=True, markup=False, highlight=False)
        for line in tool_lines(settings, est):  # by which route the rows' tools travel; provable or not
            console.print(line, soft_wrap=True, markup=False, highlight=False)
    if report.checks:
        caps = Table(title="caps: spent so far + this estimate")
        for name in ("scope", "cap", "spent", "+ expected", "+ bound", "verdict"):
            caps.add_column(name, justify="right" if name in ("cap", "spent", "+ expected", "+ bound") else "left")
        for check in report.checks:
            fmt = _usd if check.measure == "USD" else _int
            caps.add_row(
                check.scope,
                f"{fmt(check.cap)}{'' if check.measure == 'USD' else ' tok'}",
                fmt(check.spent),
                "?" if check.expected is None else fmt(check.expected),
                "?" if check.bound is None else fmt(check.bound),
                check.verdict,
            )
        console.print(caps)
    else:
        console.print("no caps configured (cap_completion_tokens, cap_usd, [budget] global caps)")
    price = settings.budget.prices.get(report.model)
    if price is None:
        console.print(
            f"no price for model {report.model} in [budget] prices: dollars unknown")
    else:
        console.print(
            f"prices of {report.model}: ${price.get('prompt', 0.0)} prompt, "
            f"${price.get('completion', 0.0)} completion per million tokens"
        )
    if not report.observations_read:
        console.print("broker not reachable: expected completion = the max_tokens bound, spend so far unknown")
    elif not any(e.has_observations for e in report.datasets):
        console.print("no responses observed yet: expected completion = the max_tokens bound")


class DryRunPricing:
    """``publish --dry-run``'s pricing (``services.common.cli.DryRunPricing``), wired into publish by services.cli."""

    def __init__(self) -> None:
        self._estimator: Estimator | None = None
        self._spent: dict[str, Observed] | None = None

    async def prepare(self, settings: Settings, dataset: str) -> Callable[[PromptPublished], None]:
        """Read the budget's counts and load the dataset's profile; returns the per-prompt counter."""
        from services.estimate.app import Estimator, read_observed

        self._spent = await read_observed(settings)
        self._estimator = Estimator(settings, dataset, (self._spent or {}).get(dataset))
        return self._estimator.add

    def show(self, console: Console, settings: Settings) -> None:
        """Print the estimate of every prompt counted."""
        from services.estimate.app import report_for

        if self._estimator is None:
            raise RuntimeError("show() before prepare()")
        print_estimate(console, settings, report_for(settings, [self._estimator.flush()], self._spent))


def estimate_command(
    paths: Annotated[list[Path], typer.Argument(help="JSONL, JSON array or Parquet files")],
    dataset: Annotated[
        str | None,
        typer.Option("--dataset", "-d", help="Dataset of every file (default: each file is one, named by its stem)"),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="auto, messages, sharegpt or alpaca")] = "auto",
    limit: Annotated[int | None, typer.Option(help="Count at most N prompts per dataset", min=1)] = None,
    system: Annotated[str | None, typer.Option(help="System prompt for rows that have none")] = None,
    tools_field: Annotated[
        str | None, typer.Option("--tools-field", help="Row field holding tool definitions (default: tools)")
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
) -> None:
    """Estimate prompts, exact prompt tokens, completion tokens, dollars and caps, before paying."""
    import asyncio

    from services.common.cli import settings_from
    from services.estimate.app import DatasetFiles, estimate_files, read_observed, report_for

    settings = settings_from(config)
    if dataset is not None:
        groups = {dataset: list(paths)}
    else:
        groups = {}
        for path in paths:
            groups.setdefault(path.name.split(".")[0], []).append(path)
    spent = asyncio.run(read_observed(settings))
    estimates = [
        estimate_files(
            settings,
            DatasetFiles(name, files, fmt=fmt, limit=limit, system=system, tools_field=tools_field),
            (spent or {}).get(name),
        )
        for name, files in groups.items()
    ]
    print_estimate(data_console(), settings, report_for(settings, estimates, spent))


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``draftstream estimate``."""
    app.command("estimate")(estimate_command)
