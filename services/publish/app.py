"""Publishing dataset files to ``prompts.<dataset>``: validate everything, then produce.

Two passes over the files: the first normalises every row and collects the rejections
(so ``--strict`` can refuse the run before anything is sent, and the progress bar knows
its total), the second normalises again and sends. Memory holds one row plus the keys.

Keys are ``<dataset>:<sample_id>`` with a stable sample id. Between the passes the keys
already on the topic are read (every partition, to its end) and those rows are skipped,
so a publish interrupted by Ctrl-C is resumed by running the same command again, and a
re-publish sends nothing (``force`` sends everything again; downstream stages are
idempotent by key, and inference answers a request it has paid for from its store).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError

from schemas import PromptPublished, encode, sample_key
from services.common.acls import used_topics
from services.common.config import Settings
from services.common.kafka import ensure_topics, make_producer
from services.common.metrics import PROMPTS_PUBLISHED, PROMPTS_REJECTED
from services.common.topics import read_keys
from services.publish.adapters.files import FileError
from services.publish.core import NormaliseOptions
from services.publish.reading import PublishError, PublishReport, Rejection, check_arguments, iter_prompts

_SEND_WINDOW = 500  # records in flight before waiting for acknowledgements
_KEY_READ_DEADLINE_S = 3600.0  # reading a prompts topic of a few 100k records takes seconds, not hours


class PublishInterrupted(Exception):
    """The run was cancelled (Ctrl-C); ``report.published`` rows are on the topic."""

    def __init__(self, report: PublishReport) -> None:
        super().__init__(f"interrupted after {report.published} prompt(s) were sent to {report.topic}")
        self.report = report


class ProgressSink(Protocol):
    """Receives progress of the sending pass (a rich progress bar in the CLI)."""

    def start(self, total: int) -> None:
        """The number of prompts about to be sent."""

    def advance(self, n: int) -> None:
        """``n`` more prompts were acknowledged by the broker."""


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
    check_arguments(settings, paths, dataset, fmt)
    options = NormaliseOptions(
        dataset=dataset,
        fmt=fmt,
        system=system,
        tools_field=tools_field,
        max_prompt_chars=settings.provider.max_prompt_chars,
        turns=settings.dataset(dataset).turns,
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


async def _scan_cooperatively(
    paths: Sequence[Path], options: NormaliseOptions, report: PublishReport, *, limit: int | None
) -> list[str]:
    """The first pass: count into ``report`` and return the good rows' keys in file order.

    Yields to the event loop now and then, so a Ctrl-C during a long scan lands at once.
    """
    keys: list[str] = []
    for n, item in enumerate(iter_prompts(paths, options, limit=limit)):
        if n % 2000 == 1999:
            await asyncio.sleep(0)
        if item is None:
            report.duplicates += 1
        elif isinstance(item, Rejection):
            report.rejections.append(item)
        else:
            report.valid += 1
            keys.append(sample_key(options.dataset, item.sample_id))
    return keys


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
    force: bool = False,
    progress: ProgressSink | None = None,
    examine: Callable[[PromptPublished], None] | None = None,
    clock: Callable[[], float] = time.time,
) -> PublishReport:
    """Validate, then publish to ``prompts.<dataset>`` every good row not already there.

    The keys already on the topic (every partition, read to its end) are skipped unless
    ``force``, so running the same command again after an interruption sends only what is
    missing. With ``dry_run`` nothing is sent; the topic is still checked when the broker
    answers (``report.topic_checked``), and ``examine`` sees each prompt that would be sent.

    Raises :class:`PublishError` (nothing published) for a missing or unreadable file, an
    unknown format, a dataset name that cannot be a topic, or ``strict`` with bad rows;
    :class:`PublishInterrupted` (with the report of what was acknowledged) when cancelled.
    """
    paths = [Path(p) for p in paths]
    check_arguments(settings, paths, dataset, fmt)
    options = NormaliseOptions(
        dataset=dataset,
        fmt=fmt,
        system=system,
        tools_field=tools_field,
        max_prompt_chars=settings.provider.max_prompt_chars,
        turns=settings.dataset(dataset).turns,
    )
    report = PublishReport(dataset=dataset, topic=settings.kafka.prompts_topic(dataset), dry_run=dry_run)
    report.forced = force
    try:
        keys = await _scan_cooperatively(paths, options, report, limit=limit)
    except FileError as exc:
        raise PublishError(str(exc)) from None
    except asyncio.CancelledError:
        raise PublishInterrupted(report) from None
    if strict and report.rejections:
        raise PublishError(f"{len(report.rejections)} bad row(s) and --strict: nothing published", report)
    for rejection in report.rejections:
        PROMPTS_REJECTED.labels(dataset=dataset, reason=rejection.reason).inc()
    if report.valid == 0:
        return report

    try:
        present = set() if force else await _keys_on_topic(settings, report, tolerate_unreachable=dry_run)
        report.already_present = sum(1 for key in keys if key.encode() in present)
        report.to_send = report.valid - report.already_present
        if dry_run:
            if examine is not None:
                await _examine(paths, options, present, examine, limit=limit)
            return report
        if report.to_send == 0:
            return report
        await ensure_topics(settings.kafka, [dataset], needed=used_topics("publish"))
        producer = make_producer(settings.kafka)
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
    except asyncio.CancelledError:
        raise PublishInterrupted(report) from None
    if progress is not None:
        progress.start(report.to_send)
    await _send(producer, paths, options, report, present, limit=limit, progress=progress, clock=clock)
    return report


async def _examine(
    paths: Sequence[Path],
    options: NormaliseOptions,
    present: set[bytes],
    examine: Callable[[PromptPublished], None],
    *,
    limit: int | None,
) -> None:
    """Hand each prompt a run would send to ``examine`` (a dry run's cost estimate)."""
    for n, item in enumerate(iter_prompts(paths, options, limit=limit)):
        if n % 200 == 199:
            await asyncio.sleep(0)
        if item is None or isinstance(item, Rejection):
            continue
        if sample_key(options.dataset, item.sample_id).encode() not in present:
            examine(item)


async def _keys_on_topic(settings: Settings, report: PublishReport, *, tolerate_unreachable: bool) -> set[bytes]:
    """Keys already on the dataset's prompts topic; empty (unchecked) for a dry run without a broker."""
    try:
        keys = await read_keys(settings.kafka, report.topic, deadline_s=_KEY_READ_DEADLINE_S)
    except KafkaConnectionError:
        if not tolerate_unreachable:
            raise
        return set()
    report.topic_checked = True
    return keys


async def _send(
    producer: AIOKafkaProducer,
    paths: Sequence[Path],
    options: NormaliseOptions,
    report: PublishReport,
    present: set[bytes],
    *,
    limit: int | None,
    progress: ProgressSink | None,
    clock: Callable[[], float],
) -> None:
    """The second pass: send what is missing; on cancellation, flush and count what was acknowledged.

    ``asyncio.wait`` (not ``gather``) waits for the acknowledgements, so a cancellation
    never cancels the send futures: after ``producer.stop()`` has flushed, every future
    that resolved without error is a record on the topic, and ``report.published`` counts
    exactly those.
    """
    pending: list[asyncio.Future[object]] = []
    reported = 0

    def count_acknowledged() -> None:
        nonlocal reported
        first_error: BaseException | None = None
        for future in pending:
            if not future.done() or future.cancelled():
                continue
            error = future.exception()
            if error is None:
                report.published += 1
            elif first_error is None:
                first_error = error
        PROMPTS_PUBLISHED.labels(dataset=options.dataset).inc(report.published - reported)
        if progress is not None:
            progress.advance(report.published - reported)
        reported = report.published
        pending.clear()
        if first_error is not None:
            raise first_error

    interrupted = False
    try:
        for item in iter_prompts(paths, options, limit=limit):
            if item is None or isinstance(item, Rejection):
                continue
            key = sample_key(options.dataset, item.sample_id).encode()
            if key in present:
                continue
            prompt = msgspec.structs.replace(item, published_at=clock())
            pending.append(await producer.send(report.topic, encode(prompt), key=key))
            if len(pending) >= _SEND_WINDOW:
                await asyncio.wait(pending)
                count_acknowledged()
        if pending:
            await asyncio.wait(pending)
    except asyncio.CancelledError:
        interrupted = True
    except FileError as exc:  # the file changed between the two passes
        raise PublishError(str(exc), report) from None
    finally:
        # stop() flushes what was handed to the producer; a second Ctrl-C cuts it short.
        await producer.stop()
        count_acknowledged()
    if interrupted:
        report.interrupted = True
        raise PublishInterrupted(report)


__all__ = [
    "ProgressSink",
    "PublishError",
    "PublishInterrupted",
    "PublishReport",
    "Rejection",
    "check_arguments",
    "iter_prompts",
    "publish",
    "scan",
]
