"""``draftstream publish``: dataset files to ``prompts.<dataset>``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from services.publish.app import PublishReport

_MAX_LISTED = 20


def _print_rejections(console: Console, report: PublishReport) -> None:
    for rejection in report.rejections[:_MAX_LISTED]:
        console.print(f"[yellow]skipped[/] {rejection}", highlight=False, soft_wrap=True, markup=True)
    extra = len(report.rejections) - _MAX_LISTED
    if extra > 0:
        console.print(f"[yellow]... and {extra} more bad row(s)[/]")


def _summary(report: PublishReport) -> object:
    from rich.table import Table

    table = Table(title=f"publish {report.dataset} → {report.topic}", show_lines=False)
    table.add_column("outcome")
    table.add_column("rows", justify="right")
    if report.dry_run:
        table.add_row("would publish", str(report.valid))
    else:
        table.add_row("published", str(report.published))
    for reason, count in sorted(report.skipped.items()):
        table.add_row(f"skipped: {reason}", str(count))
    return table


def publish_command(
    paths: Annotated[list[Path], typer.Argument(help="JSONL, JSON array or Parquet files")],
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Dataset name (topic prompts.<name>)")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="auto, messages, sharegpt or alpaca")] = "auto",
    limit: Annotated[int | None, typer.Option(help="Publish at most N prompts", min=1)] = None,
    system: Annotated[str | None, typer.Option(help="System prompt for rows that have none")] = None,
    tools_field: Annotated[
        str | None, typer.Option("--tools-field", help="Row field holding tool definitions (default: tools)")
    ] = None,
    strict: Annotated[bool, typer.Option(help="Any bad row aborts the run; nothing is published")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and count; publish nothing")] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
) -> None:
    """Publish dataset files as prompts: normalise, give stable ids, skip bad rows."""
    import asyncio

    from rich.console import Console
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

    from services.cli import fail, settings_from
    from services.publish.app import PublishError, publish

    settings = settings_from(config)
    console = Console()
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("[cyan]{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )

    with Progress(*columns, console=console, transient=False) as bar:

        class _Sink:
            task: TaskID | None = None

            def start(self, total: int) -> None:
                self.task = bar.add_task(f"publishing {dataset}", total=total, rate="")

            def advance(self, n: int) -> None:
                if self.task is None:
                    return
                bar.advance(self.task, n)
                speed = bar.tasks[self.task].speed
                bar.update(self.task, rate=f"{speed:,.0f}/s" if speed else "")

        try:
            report = asyncio.run(
                publish(
                    settings,
                    paths,
                    dataset=dataset,
                    fmt=fmt,
                    limit=limit,
                    system=system,
                    tools_field=tools_field,
                    strict=strict,
                    dry_run=dry_run,
                    progress=_Sink(),
                )
            )
        except PublishError as exc:
            bar.stop()
            if exc.report is not None:
                _print_rejections(console, exc.report)
            fail(str(exc))
    _print_rejections(console, report)
    console.print(_summary(report))
    skipped = sum(report.skipped.values())
    verb = "would publish" if report.dry_run else "published"
    count = report.valid if report.dry_run else report.published
    console.print(
        f"{verb} {count} prompt(s) to {report.topic}, skipped {skipped}", highlight=False, soft_wrap=True
    )


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``draftstream publish``."""
    app.command("publish")(publish_command)
