"""``draftstream probe``: a few paid answers per dataset, what they prove, and the forecast."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def probe_command(
    dataset: Annotated[
        list[str] | None, typer.Option("--dataset", "-d", help="Only these datasets (default: every configured one)")
    ] = None,
    n: Annotated[int, typer.Option("--n", "-n", help="Answers paid for per dataset, at most", min=1)] = 20,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
    wide: Annotated[
        bool, typer.Option("--wide", help="Every column: answers, every fact per edge, the forecast's tokens")
    ] = False,
) -> None:
    """Pay for at most N answers per dataset, rebuild and audit them, print what they prove; exit 1 below min_yield."""
    import asyncio

    from services.common.cli import fail, settings_from
    from services.common.console import data_console
    from services.common.errors import CommandError
    from services.probe.app import run_probe
    from services.probe.core import render

    settings = settings_from(config)
    names = list(dataset or sorted(settings.datasets))
    if not names:
        fail("no dataset to probe: name one with --dataset or configure [datasets.NAME]")
    try:
        run = asyncio.run(run_probe(settings, names, n))
    except CommandError as exc:
        fail(str(exc))
    min_yield = settings.budget.min_yield
    data_console().print(render(run, min_yield, wide=wide))  # the terminal's own width: cells wrap to fit
    for report in run.reports:
        for line in report.tools:
            print(line)
        if report.tokenizer_mismatch:
            print(f"{report.dataset}: {report.tokenizer_mismatch}")
    if run.failed(min_yield):
        print(f"forecast below min_yield {min_yield:.0%} (or a dataset not probed): fix before the spend")
        raise typer.Exit(1)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``draftstream probe``."""
    del run_app
    app.command("probe")(probe_command)
