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
    import asyncio

    from services.cli import settings_from
    from services.common.logs import setup_logging
    from services.common.service import run_service
    from services.sink.app import create_app

    settings = settings_from(config)
    setup_logging(settings, log_level)
    asyncio.run(run_service(lambda: create_app(settings, out_dir=out), name="sink",
                            metrics_port=settings.metrics.sink_port, metrics_host=settings.metrics.host))


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``run sink`` to the root CLI."""
    run_app.command("sink")(run_sink)
