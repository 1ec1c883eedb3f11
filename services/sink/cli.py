"""``draftstream run sink``: accepted samples to training shards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.common.logs import LogLevelOption


def run_sink(
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output folder (default: [sink] out_dir)")
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
    log_level: LogLevelOption = None,
) -> None:
    """Write accepted samples to DIR/<dataset>/part-NNNNN.jsonl, each key once, fsynced before commit."""
    from services.common.cli import settings_from
    from services.common.service import run_from_cli
    from services.sink.app import create_app

    run_from_cli(
        "sink", lambda settings: create_app(settings, out_dir=out), settings=settings_from(config), log_level=log_level
    )


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``run sink`` to the root CLI."""
    run_app.command("sink")(run_sink)
