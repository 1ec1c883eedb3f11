"""``draftstream run reconstruct`` (the worker) and ``draftstream reconstruct FILE`` (offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.common.logs import LogLevelOption

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")]


def run_reconstruct(config: ConfigOpt = None, log_level: LogLevelOption = None) -> None:
    """Rebuild token ids: responses in, samples (or dead letters) out."""
    from services.common.cli import settings_from
    from services.common.service import run_from_cli
    from services.reconstruct.app import create_app

    run_from_cli("reconstruct", create_app, settings=settings_from(config), log_level=log_level)


def reconstruct_file(
    file: Annotated[Path, typer.Argument(help="JSONL file, one ResponseReceived per line")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write samples here (JSONL; default: stdout)")] = None,
    profile: Annotated[
        str | None, typer.Option("--profile", "-p", help="Rebuild every response with this profile")
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when any line failed")] = False,
    config: ConfigOpt = None,
) -> None:
    """Rebuild a JSONL of responses offline; bad lines are reported with their line numbers.

    Exit status: 0 after the summary; 1 with --strict when a line failed; 2 when the file,
    the profile or the configuration cannot be used.
    """
    import sys
    from collections import Counter

    from rich.table import Table

    from schemas import ResponseReceived, encode
    from services.common.cli import fail, settings_from
    from services.common.console import data_console
    from services.common.kafka import DeadLetter
    from services.profiles import Profile, ProfileError, load_profile
    from services.profiles.conventions import Convention
    from services.reconstruct.app import convention_of
    from services.reconstruct.facts import FactBook
    from services.reconstruct.offline import reconstruct_lines

    settings = settings_from(config)
    if not file.is_file():
        fail(f"{file} is not a file")
    if profile is not None:
        try:
            load_profile(profile, settings)
        except ProfileError as exc:
            fail(f"{exc.reason}: {exc.message}")

    def resolve(response: ResponseReceived) -> tuple[Profile, Convention] | DeadLetter:
        name = profile or response.profile or settings.dataset(response.dataset).profile
        try:
            loaded = load_profile(name, settings)  # cached, a failure too
        except ProfileError as exc:
            return DeadLetter(exc.reason, exc.message)
        return loaded, convention_of(settings, response)

    err = data_console(stderr=True)
    methods: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    total = 0
    sink = out.open("wb") if out is not None else sys.stdout.buffer
    try:
        with file.open("rb") as f:
            for result in reconstruct_lines(f, resolve, facts=FactBook()):
                total += 1
                if isinstance(result.verdict, DeadLetter):
                    failures[result.verdict.reason] += 1
                    err.print(
                        f"{file}:{result.line}: {result.verdict.reason}: {result.verdict.message}", soft_wrap=True
                    )
                    continue
                methods[result.verdict.method] += 1
                sink.write(encode(result.verdict) + b"\n")
    finally:
        if out is not None:
            sink.close()
        else:
            sink.flush()
    ok = sum(methods.values())
    table = Table(title=f"reconstruct {file}: {ok}/{total} rebuilt, {total - ok} failed")
    table.add_column("outcome")
    table.add_column("lines", justify="right")
    for method, count in sorted(methods.items()):
        table.add_row(f"rebuilt ({method})", str(count))
    for reason, count in sorted(failures.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(f"failed: {reason}", str(count))
    err.print(table)
    if strict and failures:
        raise typer.Exit(1)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``run reconstruct`` and ``reconstruct`` to the root CLI."""
    run_app.command("reconstruct")(run_reconstruct)
    app.command("reconstruct")(reconstruct_file)
