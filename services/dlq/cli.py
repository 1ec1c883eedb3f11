"""``draftstream dlq list|show|replay``: look at dead letters and send them back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from services.common.console import data_console, styled

if TYPE_CHECKING:
    from services.dlq.core import Filters

dlq_app = typer.Typer(help="Dead letters: list, show, replay.", no_args_is_help=True)

StageOpt = Annotated[str | None, typer.Option("--stage", help="Only this stage (inference, audit, ...)")]
ReasonOpt = Annotated[str | None, typer.Option("--reason", help="Only records with this reason code")]
DatasetOpt = Annotated[str | None, typer.Option("--dataset", "-d", help="Only this dataset")]
SinceOpt = Annotated[
    str | None, typer.Option("--since", help="Failed at or after (ISO time or age: 30m, 1h, 2d)")
]
UntilOpt = Annotated[str | None, typer.Option("--until", help="Failed at or before (ISO time or age)")]
KeyOpt = Annotated[str | None, typer.Option("--key", help="Only this record key (<dataset>:<sample_id>)")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")]


def build_filters(
    stage: str | None,
    reason: str | None,
    dataset: str | None,
    since: str | None,
    until: str | None,
    key: str | None,
    now_ms: int,
) -> Filters:
    """Filters from command-line values; raises FilterError for an unreadable time."""
    from services.dlq.core import Filters, parse_time

    return Filters(
        stage=stage,
        reason=reason,
        dataset=dataset,
        since_ms=parse_time(since, now_ms) if since else None,
        until_ms=parse_time(until, now_ms) if until else None,
        key=key,
    )


def _filters_or_fail(
    stage: str | None,
    reason: str | None,
    dataset: str | None,
    since: str | None,
    until: str | None,
    key: str | None,
) -> Filters:
    import time

    from services.common.cli import fail
    from services.dlq.core import FilterError

    try:
        return build_filters(stage, reason, dataset, since, until, key, now_ms=int(time.time() * 1000))
    except FilterError as exc:
        fail(str(exc))


@dlq_app.command("list")
def dlq_list(
    stage: StageOpt = None,
    reason: ReasonOpt = None,
    dataset: DatasetOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    key: KeyOpt = None,
    history: Annotated[
        bool,
        typer.Option("--all", help="Every dead letter, also those a later replay of the same key superseded or passed"),
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Dead letters grouped by stage and reason, with counts and one example key each.

    One per key by default, as ``status`` counts them: the latest dead letter of each key (a
    replay that failed again supersedes the one before it), none for a key with a sample on
    ``accepted`` (a replay passed); --all counts every record on the topic.
    """
    from rich.table import Table

    from schemas import DEAD_LETTER_TOPIC
    from services.common.cli import settings_from
    from services.dlq.app import read_accepted_keys, read_dead_letters
    from services.dlq.core import group_by_reason, latest_per_key

    settings = settings_from(config)
    filters = _filters_or_fail(stage, reason, dataset, since, until, key)
    found = asyncio.run(read_dead_letters(settings))
    if not history:
        accepted = asyncio.run(read_accepted_keys(settings))
        found = [r for r in latest_per_key(found) if r.key is None or r.key_text not in accepted]
    # The latest per key first, then the filters: a key whose latest failure no longer matches is not listed.
    records = [r for r in found if filters.matches(r)]
    groups = group_by_reason(records)
    what = "dead letters" if history else "keys dead-lettered, not accepted (latest per key; --all for every record)"
    table = Table(title=f"{what} on {settings.kafka.topic(DEAD_LETTER_TOPIC)}: {len(records)}")
    table.add_column("stage")
    table.add_column("reason")
    table.add_column("count", justify="right")
    table.add_column("datasets")
    table.add_column("example key", overflow="fold")
    for group in groups:
        table.add_row(  # dead-letter text is data: the console shows it verbatim
            group.stage, group.reason, str(group.count), ", ".join(group.datasets), group.example_key
        )
    data_console().print(table)


@dlq_app.command("show")
def dlq_show(
    stage: StageOpt = None,
    reason: ReasonOpt = None,
    dataset: DatasetOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    key: KeyOpt = None,
    limit: Annotated[int, typer.Option(help="Show at most N records", min=1)] = 20,
    preview_chars: Annotated[int, typer.Option("--preview", help="Characters of value to show", min=0)] = 300,
    config: ConfigOpt = None,
) -> None:
    """Print matching dead letters: their headers and a preview of the value."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from services.common.cli import settings_from
    from services.dlq.app import read_dead_letters
    from services.dlq.core import format_ms, preview

    settings = settings_from(config)
    filters = _filters_or_fail(stage, reason, dataset, since, until, key)
    records = asyncio.run(read_dead_letters(settings, filters))
    console = data_console()
    for record in records[:limit]:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold")
        grid.add_column(overflow="fold")
        grid.add_row("key", record.key_text)
        grid.add_row("failed at", format_ms(record.failed_at_ms))
        for name, value in record.headers:
            grid.add_row(name, value.decode("utf-8", "replace"))
        grid.add_row("value", preview(record.value, preview_chars))
        # A Panel reads a str title as markup whatever the console says: the title is a Text.
        title = Text(f"{record.id}  {record.stage}/{record.reason}")
        console.print(Panel(grid, title=title, title_align="left"), soft_wrap=False)
    shown = min(limit, len(records))
    console.print(f"{shown} of {len(records)} matching dead letter(s) shown")


@dlq_app.command("replay")
def dlq_replay(
    stage: StageOpt = None,
    reason: ReasonOpt = None,
    dataset: DatasetOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    key: KeyOpt = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help=(
                "Send to this stage's input instead (inference, reconstruct, audit, sink). --to inference reuses "
                "the answer already paid for (the inference worker's response store): no new charge"
            ),
        ),
    ] = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="With --to inference: ask the provider for a new answer (paid again, counted under the cap), "
            "for when the answer itself was the problem",
        ),
    ] = False,
    max_replays: Annotated[
        int, typer.Option("--max-replays", help="Refuse records replayed this often", min=1)
    ] = 3,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be replayed; send nothing")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Re-send matching dead letters to their original topic (each at most once)."""
    from rich.table import Table

    from services.common.cli import fail, settings_from
    from services.dlq.app import replay
    from services.dlq.core import STAGES, FilterError

    if to is not None and to not in STAGES:
        fail(f"unknown stage {to!r} for --to; use one of: {', '.join(STAGES)}")
    if fresh and to != "inference":
        fail("--fresh asks the provider for a new answer: use it with --to inference")
    settings = settings_from(config)
    filters = _filters_or_fail(stage, reason, dataset, since, until, key)
    try:
        report = asyncio.run(
            replay(settings, filters, to=to, max_replays=max_replays, dry_run=dry_run, fresh=fresh)
        )
    except FilterError as exc:
        fail(str(exc))
    console = data_console()
    verb = "would replay" if dry_run else "replayed"
    table = Table(title=f"{verb} {len(report.replayed)} of {report.matched} matching dead letter(s)")
    table.add_column("dlq id")
    table.add_column("key", overflow="fold")
    table.add_column("stage/reason", overflow="fold")
    table.add_column("to topic", overflow="fold")
    table.add_column("replay #", justify="right")
    for p in report.replayed:
        r = p.record
        table.add_row(r.id, r.key_text, f"{r.stage}/{r.reason}", p.topic, str(r.replay_count + 1))
    console.print(table)
    if to == "inference" and report.replayed:
        console.print(
            f"paid again: {len(report.replayed)} prompt(s), counted under the cap"
            if fresh
            else "the inference worker answers these from its response store (the answers already paid for, "
            "no new charge); add --fresh to pay for new answers"
        )
    if report.already_replayed:
        console.print(f"skipped {len(report.already_replayed)} already replayed record(s)")
    for record in report.over_max_replays:
        why = f"replayed {record.replay_count} time(s) (--max-replays {max_replays})"
        console.print(styled("refused", "yellow", f" {record.id} {record.key_text}: {why}"))
    for record, topic in report.missing_topic:
        console.print(styled("skipped", "yellow", f" {record.id} {record.key_text}: topic {topic} does not exist"))
    for record in report.wrong_kind:
        why = f"value holds nothing the {to} stage reads"
        console.print(styled("skipped", "yellow", f" {record.id} {record.key_text}: {why}"))
    for record in report.no_target:
        why = "no target topic (no original topic or dataset)"
        console.print(styled("skipped", "yellow", f" {record.id} {record.key_text}: {why}"))


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``draftstream dlq ...``."""
    app.add_typer(dlq_app, name="dlq")
