"""``draftstream export --to hf|speculators|specforge --from SINK_DIR OUT_DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.common.console import data_console, styled

_MAX_LISTED = 20


def export_command(
    out_dir: Annotated[Path, typer.Argument(help="New (or empty) folder for the exported parts")],
    to: Annotated[str, typer.Option("--to", help="hf, speculators or specforge")],
    source: Annotated[Path, typer.Option("--from", help="The sink's output folder (its out_dir)")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="jsonl or parquet (parquet: --to hf only)")] = "jsonl",
    merge: Annotated[
        bool, typer.Option("--merge", help="--to speculators: every row in one OUT_DIR/speculators.jsonl (SpecForge)")
    ] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config (user profiles)")] = None,
    dead_letters: Annotated[
        bool, typer.Option("--dead-letters", help="Count the datasets' dead letters (configured Kafka) into the card")
    ] = False,
    provider: Annotated[
        str | None, typer.Option("--provider", "-p", help="Only the rows this provider answered ([providers.NAME])")
    ] = None,
) -> None:
    """Write SINK_DIR's rows as OUT_DIR/<dataset>/part-NNNNN.* for a trainer; exit 1 when a row is refused.

    --to specforge (and --to speculators --merge) writes one OUT_DIR/<target>.jsonl: SpecForge takes one file.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from services.common.cli import settings_from
    from services.export.app import count_rows, export, sink_parts

    settings = settings_from(config)
    console = data_console(stderr=True)
    letters = None
    if dead_letters:
        import asyncio

        from services.export.dead_letters import dead_letter_counts

        letters = asyncio.run(dead_letter_counts(settings))
    total = sum(count_rows(p) for p in sink_parts(source))
    with Progress(
        TextColumn(f"export --to {to}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task("rows", total=total)
        report = export(
            to,  # type: ignore[arg-type]  # checked by export()
            source, out_dir, fmt=fmt, merge=merge, settings=settings,
            progress=lambda n: progress.advance(task, n), dead_letters=letters, provider=provider,
        )  # fmt: skip
    for line in report.refused[:_MAX_LISTED]:
        console.print(styled("refused", "red", f" {line}"), soft_wrap=True)
    if len(report.refused) > _MAX_LISTED:
        console.print(styled(f"... and {len(report.refused) - _MAX_LISTED} more refused row(s)", "red"))
    per_dataset = ", ".join(f"{d} {n}" for d, n in sorted(report.per_dataset.items())) or "-"
    written_to = report.files[0] if report.merged and report.files else out_dir
    print(
        f"exported {report.rows_written} of {report.rows_read} row(s) from {report.parts_read} part(s) to "
        f"{written_to} ({per_dataset}); refused {len(report.refused)}"
        + (f"; {report.left_out} row(s) of other providers left out (--provider {provider})" if provider else "")
    )
    for (profile, template, last_only), matched in sorted(report.mask_matches.items()):
        rule = "last assistant turn only" if last_only else "every assistant turn"
        print(f"SpecForge template {template} ({rule}) reproduces the loss mask of {matched}/"
              f"{report.mask_rows[profile]} {profile} row(s)")
    if report.refused:
        raise typer.Exit(1)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``export`` to the root CLI."""
    app.command("export")(export_command)
