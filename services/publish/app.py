"""Publishing dataset files to ``prompts.<dataset>``: validate everything, then produce.

Two passes over the files: the first normalises every row and collects the rejections
(so ``--strict`` can refuse the run before anything is sent, and the progress bar knows
its total), the second normalises again and sends. Memory stays bounded by one row.

Keys are ``<dataset>:<sample_id>`` with a stable sample id, so publishing a file twice
sends the same keys again; downstream stages are idempotent by key (the sink writes each
key once), so a re-publish creates no new training rows.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from schemas import PromptPublished, encode, sample_key
from services.common.config import ConfigError, Settings, check_dataset_name
from services.common.kafka import ensure_topics, make_producer
from services.common.metrics import PROMPTS_PUBLISHED, PROMPTS_REJECTED
from services.publish.adapters.files import FileError, check_file, iter_rows
from services.publish.core import DUPLICATE, FORMATS, NormaliseOptions, RowError, normalise

_SEND_WINDOW = 500  # records in flight before waiting for acknowledgements


class PublishError(Exception):
    """The run cannot go ahead (bad file, name, format, or --strict with bad rows)."""

    def __init__(self, message: str, report: PublishReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class Rejection:
    """One skipped row: where it is and why."""

    path: str
    line: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}: {self.message}"


@dataclass
class PublishReport:
    """What a publish run did: counts, skipped rows by reason, and the target topic."""

    dataset: str
    topic: str
    valid: int = 0
    published: int = 0
    rejections: list[Rejection] = field(default_factory=list)
    duplicates: int = 0
    dry_run: bool = False

    @property
    def skipped(self) -> Counter[str]:
        """Skipped rows by reason code (duplicates included)."""
        counts = Counter(r.reason for r in self.rejections)
        if self.duplicates:
            counts[DUPLICATE] += self.duplicates
        return counts


class ProgressSink(Protocol):
    """Receives progress of the sending pass (a rich progress bar in the CLI)."""

    def start(self, total: int) -> None:
        """The number of prompts about to be sent."""

    def advance(self, n: int) -> None:
        """``n`` more prompts were acknowledged by the broker."""


def iter_prompts(
    paths: Sequence[Path], options: NormaliseOptions, *, limit: int | None = None
) -> Iterator[PromptPublished | Rejection | None]:
    """Every row of every file as a prompt, a :class:`Rejection`, or None for a duplicate."""
    seen: set[str] = set()
    produced = 0
    for path in paths:
        for line, record in iter_rows(path):
            if limit is not None and produced >= limit:
                return
            if isinstance(record, RowError):
                yield Rejection(str(path), line, record.reason, record.message)
                continue
            try:
                prompt = normalise(record, options, source=f"{path.name}:{line}")
            except RowError as exc:
                yield Rejection(str(path), line, exc.reason, exc.message)
                continue
            if prompt.sample_id in seen:
                yield None
                continue
            seen.add(prompt.sample_id)
            produced += 1
            yield prompt


def _validate_args(settings: Settings, paths: Sequence[Path], dataset: str, fmt: str) -> None:
    try:
        check_dataset_name(dataset)
    except ConfigError as exc:
        raise PublishError(str(exc)) from None
    if fmt not in FORMATS:
        raise PublishError(f"unknown format {fmt!r}; use one of: {', '.join(FORMATS)}")
    if not paths:
        raise PublishError("no input files given")
    topic = settings.kafka.prompts_topic(dataset)
    if len(topic) > 249:
        raise PublishError(f"dataset name {dataset!r} makes the topic name {topic!r} too long")
    try:
        for path in paths:
            check_file(path)
    except FileError as exc:
        raise PublishError(str(exc)) from None


def scan(
    settings: Settings,
    paths: Sequence[Path],
    *,
    dataset: str,
    fmt: str = "auto",
    limit: int | None = None,
    system: str | None = None,
    tools_field: str | None = None,
) -> PublishReport:
    """Validate every row without publishing; raises :class:`PublishError` for a bad file."""
    _validate_args(settings, paths, dataset, fmt)
    options = NormaliseOptions(
        dataset=dataset,
        fmt=fmt,
        system=system,
        tools_field=tools_field,
        max_prompt_chars=settings.provider.max_prompt_chars,
    )
    report = PublishReport(dataset=dataset, topic=settings.kafka.prompts_topic(dataset))
    try:
        for item in iter_prompts(paths, options, limit=limit):
            if item is None:
                report.duplicates += 1
            elif isinstance(item, Rejection):
                report.rejections.append(item)
            else:
                report.valid += 1
    except FileError as exc:
        raise PublishError(str(exc)) from None
    return report


async def publish(
    settings: Settings,
    paths: Sequence[Path],
    *,
    dataset: str,
    fmt: str = "auto",
    limit: int | None = None,
    system: str | None = None,
    tools_field: str | None = None,
    strict: bool = False,
    dry_run: bool = False,
    progress: ProgressSink | None = None,
    clock: Callable[[], float] = time.time,
) -> PublishReport:
    """Validate, then publish every good row to ``prompts.<dataset>`` with a stable key.

    Raises :class:`PublishError` (nothing published) for a missing or unreadable file, an
    unknown format, a dataset name that cannot be a topic, or ``strict`` with bad rows.
    """
    paths = [Path(p) for p in paths]
    report = scan(
        settings, paths, dataset=dataset, fmt=fmt, limit=limit, system=system, tools_field=tools_field
    )
    if strict and report.rejections:
        raise PublishError(f"{len(report.rejections)} bad row(s) and --strict: nothing published", report)
    for rejection in report.rejections:
        PROMPTS_REJECTED.labels(dataset=dataset, reason=rejection.reason).inc()
    if dry_run or report.valid == 0:
        report.dry_run = dry_run
        return report

    options = NormaliseOptions(
        dataset=dataset,
        fmt=fmt,
        system=system,
        tools_field=tools_field,
        max_prompt_chars=settings.provider.max_prompt_chars,
    )
    await ensure_topics(settings.kafka, [dataset])
    if progress is not None:
        progress.start(report.valid)
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        pending: list[asyncio.Future[object]] = []

        async def drain() -> None:
            if pending:
                await asyncio.gather(*pending)
                PROMPTS_PUBLISHED.labels(dataset=dataset).inc(len(pending))
                report.published += len(pending)
                if progress is not None:
                    progress.advance(len(pending))
                pending.clear()

        for item in iter_prompts(paths, options, limit=limit):
            if item is None or isinstance(item, Rejection):
                continue
            prompt = msgspec.structs.replace(item, published_at=clock())
            key = sample_key(dataset, prompt.sample_id).encode()
            pending.append(await producer.send(report.topic, encode(prompt), key=key))
            if len(pending) >= _SEND_WINDOW:
                await drain()
        await drain()
    except FileError as exc:  # the file changed between the two passes
        raise PublishError(str(exc), report) from None
    finally:
        await producer.stop()
    return report


__all__ = ["ProgressSink", "PublishError", "PublishReport", "Rejection", "iter_prompts", "publish", "scan"]
