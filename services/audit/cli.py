"""``draftstream run audit`` (the worker) and ``draftstream audit FILE`` (offline checks)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.common.logs import LogLevelOption

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")]


def run_audit(config: ConfigOpt = None, log_level: LogLevelOption = None) -> None:
    """Audit samples: passing ones to accepted, failing ones to dead-letter with every reason."""
    from services.audit.app import create_app
    from services.common.cli import settings_from
    from services.common.service import run_from_cli

    run_from_cli("audit", create_app, settings=settings_from(config), log_level=log_level)


def audit_file(
    file: Annotated[Path, typer.Argument(help="JSONL file, one SampleReconstructed per line")],
    profile: Annotated[
        str | None, typer.Option("--profile", "-p", help="Audit every sample with this profile")
    ] = None,
    strict: Annotated[
        bool, typer.Option("--strict", help="Exit 1 when any sample failed (default: exit 0)")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write DIR/verdicts.jsonl: one verdict per sample (accepted / dead_lettered)"),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Run the audit checks over a JSONL of samples and print failures by code.

    With ``--out DIR`` every sample's verdict is written to ``DIR/verdicts.jsonl`` in input
    order, so two offline runs can be compared sample by sample. Exit status: 0 after
    printing the table, whatever it shows; 1 with --strict when any sample failed; 2 when
    the file or the configuration cannot be used.
    """
    from rich.table import Table

    from services.audit.app import default_profile_loader
    from services.audit.offline import offline_audit
    from services.common.cli import fail, settings_from
    from services.common.console import data_console

    settings = settings_from(config)
    if not file.is_file():
        fail(f"{file} is not a file")
    with file.open("rb") as f:
        report = offline_audit(
            f, default_profile_loader(settings), lambda ds: settings.dataset(ds).audit, profile_override=profile
        )
    if out is not None:
        import json

        out.mkdir(parents=True, exist_ok=True)
        with (out / "verdicts.jsonl").open("w", encoding="utf-8") as sink:
            for line, key, passed, reasons, message in report.verdicts:
                verdict = "accepted" if passed else "dead_lettered"  # topology: not a topic
                row = {"line": line, "key": key, "verdict": verdict,
                       "reasons": reasons, "message": message}
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
    console = data_console()
    table = Table(title=f"audit {file}: {report.passed}/{report.total} passed, {report.failed} failed")
    table.add_column("code")
    table.add_column("failures", justify="right")
    table.add_column("example key")
    table.add_column("example message", overflow="fold")
    for code, count in sorted(report.failures.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(code, str(count), report.examples[code], report.messages[code])
    console.print(table)
    for code, count in sorted(report.notes.items()):
        console.print(f"note: {code}: {count} sample(s) with a difference (reported, not failed)")
    if out is not None:
        console.print(f"verdicts of {len(report.verdicts)} sample(s): {out / 'verdicts.jsonl'}")
    if strict and report.failed:
        raise typer.Exit(1)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``run audit`` and ``audit`` to the root CLI."""
    run_app.command("audit")(run_audit)
    app.command("audit")(audit_file)
