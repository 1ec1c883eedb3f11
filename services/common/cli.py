"""What every ``draftstream`` command shares: loading the settings, the one-line error, the ``run`` group.

The root command (``services.cli``) and each stage's ``cli.py`` import these from here, below
both, so no stage's commands import the root command that registers them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Protocol

import typer

from services.common.config import ConfigError, Settings, load_settings
from services.common.console import data_console, styled

if TYPE_CHECKING:
    from rich.console import Console

    from schemas import PromptPublished

run_app = typer.Typer(help="Run one long-lived service.", no_args_is_help=True)
"""``draftstream run``: each stage adds its long-lived service to this group."""

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (default: ./draftstream.toml if present)")
]

err = data_console(stderr=True)

# The bootstrap servers of the settings this command loaded, so a Kafka error can say
# which broker did not answer (one command per process, or per CliRunner call).
_bootstrap: list[str | None] = [None]


def loaded_bootstrap() -> str | None:
    """The bootstrap servers of the settings the running command loaded, if it loaded any."""
    return _bootstrap[0]


def settings_from(config: Path | None) -> Settings:
    """Load settings or exit with a one-line error."""
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        fail(str(exc))
    _bootstrap[0] = settings.kafka.bootstrap_servers
    return settings


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one clear error line (the message verbatim: no Rich markup) and exit non-zero."""
    err.print(styled("error:", "bold red", f" {message}"), soft_wrap=True)
    raise typer.Exit(code)


class DryRunPricing(Protocol):
    """Prices what ``publish --dry-run`` would send; the estimate stage provides it."""

    async def prepare(self, settings: Settings, dataset: str) -> Callable[[PromptPublished], None]:
        """Read what was spent so far; returns the callback that counts each prompt a run would send."""
        ...

    def show(self, console: Console, settings: Settings) -> None:
        """Print the estimate of the prompts counted."""
        ...


@dataclass(frozen=True)
class Hooks:
    """What one stage's command takes from another stage.

    The root command builds it and puts it on click's context object, so a stage's command
    reaches another stage's code without importing it.
    """

    dry_run_pricing: Callable[[], DryRunPricing] | None = None
    """Makes ``publish --dry-run``'s pricing; None: a dry run validates and counts, and prices nothing."""
    worker_probe: Callable[..., Awaitable[object]] | None = None
    """``run inference``'s ``[inference] probe_first`` (``services.inference.app.ProbeHook``)."""


def hooks_of(ctx: typer.Context) -> Hooks:
    """The hooks the root command wired, or none when the command runs outside it."""
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Hooks) else Hooks()
