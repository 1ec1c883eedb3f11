"""``draftstream publish``: dataset files to ``prompts.<dataset>``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from services.common.config import Settings
from services.common.console import data_console, styled

if TYPE_CHECKING:
    from rich.console import Console

    from services.common.cli import DryRunPricing
    from services.publish.app import PublishReport

_MAX_LISTED = 20


def _print_rejections(console: Console, report: PublishReport) -> None:
    for rejection in report.rejections[:_MAX_LISTED]:
        console.print(styled("skipped", "yellow", f" {rejection}"), soft_wrap=True)
    extra = len(report.rejections) - _MAX_LISTED
    if extra > 0:
        console.print(styled(f"... and {extra} more bad row(s)", "yellow"))


def _summary(report: PublishReport) -> object:
    from rich.table import Table

    table = Table(title=f"publish {report.dataset} → {report.topic}", show_lines=False)
    table.add_column("outcome")
    table.add_column("rows", justify="right")
    if report.topic_checked:
        table.add_row("already on the topic", str(report.already_present))
    if report.dry_run:
        table.add_row("would send", str(report.to_send))
    else:
        table.add_row("sent", str(report.published))
    for reason, count in sorted(report.skipped.items()):
        table.add_row(f"skipped: {reason}", str(count))
    return table


def summary_line(report: PublishReport) -> str:
    """The last line of ``publish``: what was already there, what was sent, what was skipped."""
    skipped = sum(report.skipped.values())
    if report.dry_run:
        sent = f"{report.to_send} would be sent to {report.topic}"
    else:
        sent = f"{report.published} sent to {report.topic}"
    if report.topic_checked:
        already = f"{report.already_present} already on the topic, "
    elif report.forced:
        already = "every row sent again (--force): "
    elif report.valid and report.dry_run:
        already = "topic not checked (broker unreachable), "
    else:
        already = ""
    return f"{already}{sent}, skipped {skipped}"


def _preflight_profile(settings: Settings, dataset: str) -> None:
    """Refuse to publish prompts whose answers could never be rebuilt: the profile must load and verify."""
    from services.common.cli import fail
    from services.profiles import ProfileError, load_profile

    name = settings.dataset(dataset).profile
    try:
        load_profile(name, settings)
    except ProfileError as exc:
        fail(f"dataset {dataset}: profile {name!r} cannot be used ({exc.reason}): {exc.message}; nothing was published")


def publish_command(
    ctx: typer.Context,
    paths: Annotated[list[Path], typer.Argument(help="JSONL, JSON array or Parquet files")],
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Dataset name (topic prompts.<name>)")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="auto, messages, sharegpt or alpaca")] = "auto",
    limit: Annotated[int | None, typer.Option(help="Publish at most N prompts", min=1)] = None,
    system: Annotated[str | None, typer.Option(help="System prompt for rows that have none")] = None,
    tools_field: Annotated[
        str | None, typer.Option("--tools-field", help="Row field holding tool definitions (default: tools)")
    ] = None,
    strict: Annotated[bool, typer.Option(help="Any bad row aborts the run; nothing is published")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate, count and estimate the cost; publish nothing")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Send every row, even those already on the topic")
    ] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
) -> None:
    """Publish dataset files as prompts: normalise, give stable ids, skip bad rows and rows already sent.

    Ctrl-C stops at once and says how many rows were sent (exit 130); the same command
    again sends only the rest. Exits 1 when no row is usable.
    """
    import asyncio

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from services.common.cli import fail, hooks_of, settings_from
    from services.publish.app import PublishError, PublishInterrupted, publish

    settings = settings_from(config)
    dry_run_pricing = hooks_of(ctx).dry_run_pricing
    _preflight_profile(settings, dataset)
    console = data_console()
    columns = (
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}", style="cyan", markup=False),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )

    class _Sink:
        task: TaskID | None = None
        sent = 0

        def start(self, total: int) -> None:
            self.task = bar.add_task(f"publishing {dataset}", total=total, rate="")

        def advance(self, n: int) -> None:
            self.sent += n
            if self.task is None:
                return
            bar.advance(self.task, n)
            speed = bar.tasks[self.task].speed
            bar.update(self.task, rate=f"{speed:,.0f}/s" if speed else "")

    async def run() -> tuple[PublishReport, DryRunPricing | None]:
        if not dry_run:
            report = await publish(
                settings, paths, dataset=dataset, fmt=fmt, limit=limit, system=system, tools_field=tools_field,
                strict=strict, force=force, progress=sink,
            )  # fmt: skip
            return report, None
        # A dry run also prices what it would send: the profile loads first (a bad one fails here).
        pricing = dry_run_pricing() if dry_run_pricing is not None else None
        examine = await pricing.prepare(settings, dataset) if pricing is not None else None
        report = await publish(
            settings, paths, dataset=dataset, fmt=fmt, limit=limit, system=system, tools_field=tools_field,
            strict=strict, dry_run=True, force=force, examine=examine,
        )  # fmt: skip
        return report, pricing

    sink = _Sink()
    with Progress(*columns, console=console, transient=False) as bar:
        try:
            report, pricing = asyncio.run(run())
        except PublishError as exc:
            bar.stop()
            if exc.report is not None:
                _print_rejections(console, exc.report)
            fail(str(exc))
        except PublishInterrupted as exc:
            bar.stop()
            done = exc.report
            left = max(done.to_send - done.published, 0) if done.to_send else "the rest"
            console.print(
                f"interrupted: {done.published} prompt(s) sent to {done.topic}, {left} not sent; "
                "run the same command again to send only what is missing",
                soft_wrap=True,
            )
            raise typer.Exit(130) from None
        except KeyboardInterrupt:  # a second Ctrl-C while the producer was flushing
            bar.stop()
            console.print(
                f"interrupted twice: at least {sink.sent} prompt(s) were sent, more may have been; "
                "run the same command again to send only what is missing",
                soft_wrap=True,
            )
            raise typer.Exit(130) from None
    _print_rejections(console, report)
    console.print(_summary(report))
    if pricing is not None and report.to_send:
        pricing.show(console, settings)
    console.print(summary_line(report), soft_wrap=True)
    if report.valid == 0:
        fail(f"no usable prompt in {len(paths)} file(s): {len(report.rejections)} bad row(s)", 1)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``draftstream publish``."""
    app.command("publish")(publish_command)
