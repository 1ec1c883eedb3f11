"""``draftstream run inference``: the inference worker as a long-lived service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.common.logs import LogLevelOption


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add the inference commands to the CLI."""

    @run_app.command("inference")
    def run_inference(
        ctx: typer.Context,
        config: Annotated[
            Path | None,
            typer.Option("--config", "-c", help="TOML config file (default: ./draftstream.toml if present)"),
        ] = None,
        log_level: LogLevelOption = None,
        repay: Annotated[
            bool,
            typer.Option(
                "--repay",
                help="Send every request again, even those already answered and paid for (response store)",
            ),
        ] = False,
        provider: Annotated[
            str | None,
            typer.Option("--provider", "-p", help="Which [providers.NAME] this worker sends to (docs/providers.md)"),
        ] = None,
    ) -> None:
        """Consume prompts.*, call the provider with many requests in flight, publish responses."""
        from services.common.cli import fail, hooks_of, settings_from
        from services.common.config import ConfigError
        from services.common.service import run_from_cli
        from services.inference.app import create_app

        probe = hooks_of(ctx).worker_probe
        try:
            settings = settings_from(config).for_provider(provider)
        except ConfigError as exc:
            fail(str(exc))
        run_from_cli(
            "inference",
            lambda settings: create_app(settings, repay=repay, probe=probe),
            settings=settings,
            log_level=log_level,
        )
