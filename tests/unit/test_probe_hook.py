"""The probe plugs into the inference worker through a hook: the worker never imports it, and a
worker asked to probe first without one refuses to be built rather than skip the probe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from services.common.errors import CommandError
from services.inference.app import create_app
from services.probe.app import probe_first


def test_a_worker_asked_to_probe_first_without_a_probe_is_refused(settings_factory: Callable[..., Any]) -> None:
    settings = settings_factory(inference={"probe_first": 5})
    with pytest.raises(CommandError, match="probe_first is set, but no probe is plugged into this worker"):
        create_app(settings)
    assert create_app(settings, probe=probe_first).settings is settings
    assert create_app(settings_factory()).settings.inference.probe_first == 0  # no probe needed


def test_the_root_command_wires_the_probe_and_the_dry_run_pricing() -> None:
    """services.cli puts the hooks on click's context; a stage command reads them from there."""
    from services.cli import _hooks
    from services.common.cli import Hooks, hooks_of
    from services.estimate.cli import DryRunPricing

    hooks = _hooks()
    assert hooks.dry_run_pricing is DryRunPricing and hooks.worker_probe is not None

    seen: list[Hooks] = []
    app = typer.Typer()

    @app.command()
    def show(ctx: typer.Context) -> None:
        seen.append(hooks_of(ctx))

    assert CliRunner().invoke(app, []).exit_code == 0
    assert seen == [Hooks()]  # outside the root command: no hooks, nothing wired by accident
