"""Reading dataset files: every row as a normalised prompt or a rejection, and the checks made
before any row is read. ``publish`` sends what this reads; ``estimate`` prices it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from schemas import PromptPublished
from services.common.config import ConfigError, Settings, check_dataset_name
from services.publish.adapters.files import FileError, check_file, iter_rows
from services.publish.core import DUPLICATE, FORMATS, NormaliseOptions, RowError, normalise


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
    already_present: int = 0
    """Good rows whose key was already on the topic (not sent again)."""
    to_send: int = 0
    """Good rows missing from the topic: what a run sends (or would, when ``dry_run``)."""
    topic_checked: bool = False
    """Whether the topic's keys were read (False with ``force``, or a dry run without a broker)."""
    forced: bool = False
    interrupted: bool = False

    @property
    def skipped(self) -> Counter[str]:
        """Skipped rows by reason code (duplicates included)."""
        counts = Counter(r.reason for r in self.rejections)
        if self.duplicates:
            counts[DUPLICATE] += self.duplicates
        return counts


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


def check_arguments(settings: Settings, paths: Sequence[Path], dataset: str, fmt: str) -> None:
    """Refuse a bad dataset name, format, or file before reading any row (:class:`PublishError`)."""
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
