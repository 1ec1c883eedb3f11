"""``draftstream status``: budget, throughput, consumer lag and dead letters on one screen."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def status_command(
    watch: Annotated[
        bool,
        typer.Option("--watch", "-w", help="Refresh until Ctrl-C (not on a terminal: one snapshot per interval)"),
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", "-n", help="Seconds between refreshes", min=0.5)
    ] = 2.0,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
) -> None:
    """Show the budget table, records per stage, consumer lag and dead letters by reason."""
    import asyncio

    from rich.live import Live

    from services.common.cli import settings_from
    from services.common.console import data_console
    from services.status.app import collect
    from services.status.core import StatusSnapshot, render

    settings = settings_from(config)
    console = data_console()

    async def once() -> StatusSnapshot:
        # A broker that does not answer is one line on stderr (the root command's error printer).
        return await collect(settings)

    async def snapshots() -> None:
        """Not on a terminal (a pipe, a file, a log): one whole snapshot per interval, each flushed."""
        previous: StatusSnapshot | None = None
        while True:
            current = await once()
            console.print(render(current, previous))
            console.file.flush()
            previous = current
            await asyncio.sleep(interval)

    async def loop() -> None:
        if not console.is_terminal:
            await snapshots()
            return
        previous = await once()
        with Live(render(previous), console=console, auto_refresh=False, screen=False) as live:
            while True:
                await asyncio.sleep(interval)
                current = await once()
                live.update(render(current, previous), refresh=True)
                previous = current

    if not watch:
        console.print(render(asyncio.run(once())))
        return
    try:
        asyncio.run(loop())
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``draftstream status``."""
    app.command("status")(status_command)
