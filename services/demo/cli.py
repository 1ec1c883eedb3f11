"""Registers ``draftstream demo``."""

from __future__ import annotations

from typing import Annotated

import typer


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add the demo command."""

    @app.command("demo")
    def demo(
        keep: Annotated[bool, typer.Option(help="Leave the services running afterwards")] = False,
        timeout: Annotated[float, typer.Option(help="Seconds to wait for every prompt")] = 600.0,
    ) -> None:
        """Run the whole pipeline locally on the bundled datasets, then replay its dead letters."""
        from services.demo.run import run_demo

        raise typer.Exit(run_demo(keep=keep, timeout=timeout))
