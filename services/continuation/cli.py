"""``draftstream run continuation``: accepted turns of multi-turn datasets to their next turn's prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.common.logs import LogLevelOption

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")]


def run_continuation(config: ConfigOpt = None, log_level: LogLevelOption = None) -> None:
    """Regenerate every turn of turns="all" datasets: each accepted turn publishes the next one."""
    from services.common.cli import settings_from
    from services.common.service import run_from_cli
    from services.continuation.app import create_app

    run_from_cli("continuation", create_app, settings=settings_from(config), log_level=log_level)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``run continuation`` to the root CLI."""
    run_app.command("continuation")(run_continuation)
