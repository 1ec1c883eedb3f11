"""The training-data sink: ``accepted`` → ``DIR/<dataset>/part-NNNNN.jsonl`` (or ``.parquet``).

Durability and exactly-once rows, in the order the StageRunner gives us:

1. the handler writes the batch's rows and flushes + fsyncs every touched part (and the
   directory when a part was created) before it returns;
2. only then does the runner commit the batch's offsets.

A crash before the commit replays the batch; rows already on disk are recognised by
their ``id`` in the key index and skipped (``SINK_DUPLICATES``). At start the index is
rebuilt from every existing part. Restart policy (decided): the bytes after the last
newline of a JSONL part are a torn write and are truncated (reported), and writing
always continues in a NEW part, never appending to one written before the restart. A
corrupt complete line in an old part is reported and skipped, the file left as is.
Parquet parts are written whole, one per batch and dataset, to a temporary name then
renamed, so they are never torn; leftover temporary files are removed at start.

The file I/O (``services/sink/shards.py``) runs on one dedicated thread, awaited by the
handler: the event loop stays free while a batch is fsynced, and step 2 still waits for
step 1.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from aiokafka import AIOKafkaProducer, ConsumerRecord

from schemas import SampleAudited, SchemaError, decode, topology
from services.common.config import Settings
from services.common.kafka import DeadLetter
from services.common.stage import Result, RunnerService, StageRunner
from services.sink.core import RowProvenance, TrainingRow, training_row
from services.sink.shards import AsyncShardWriter, OutputLock, ScanReport, ShardWriter

log = logging.getLogger(__name__)

STAGE = "sink"
GROUP_ID = topology.GROUPS[STAGE]


class SinkService(RunnerService):
    """The sink stage as a Service (start/run/stop/close)."""

    def __init__(
        self,
        settings: Settings,
        *,
        out_dir: str | Path | None = None,
        producer: AIOKafkaProducer | None = None,
        provenance: Callable[[str], RowProvenance] | None = None,
    ) -> None:
        """Wire the stage; ``out_dir`` overrides settings.sink.out_dir; ``provenance`` maps a profile
        name to its rows' provenance (default: the profile loaded from the settings, once)."""
        self.settings = settings
        self._provenance_of = provenance or (lambda name: profile_row_provenance(name, settings))
        self._provenance: dict[str, RowProvenance] = {}
        self.writer = ShardWriter(
            out_dir if out_dir is not None else settings.sink.out_dir,
            fmt=settings.sink.format,
            rotate_bytes=settings.sink.rotate_bytes,
        )
        self.io = AsyncShardWriter(self.writer)
        self.lock = OutputLock(self.writer.out_dir)
        self.scan_report: ScanReport | None = None
        self.runner = StageRunner.of_stage(settings, STAGE, self.handle, producer=producer)

    async def handle(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[Result]:
        """Write the batch's rows durably; dead-letter what is not an accepted sample."""
        results: list[Result] = []
        rows: list[tuple[str, str, TrainingRow]] = []
        for record in records:
            try:
                audited = decode(record.value, SampleAudited)
            except SchemaError as exc:
                results.append(DeadLetter(exc.reason, f"accepted record does not decode: {exc.message}"))
                continue
            if not audited.passed:
                results.append(DeadLetter("not_accepted", "record on accepted did not pass the audit",
                                          reasons=tuple(audited.reasons)))
                continue
            row = training_row(audited, await self._row_provenance(audited.sample.profile))
            rows.append((audited.dataset, row.id, row))
            results.append([])
        try:
            await self.io.write(rows)
        except OSError as exc:
            # Disk trouble: these records go to dead-letter (replayable) rather than being lost.
            log.error("sink: write failed: %s", exc)
            return [DeadLetter("sink_write_failed", f"{type(exc).__name__}: {exc}")
                    if isinstance(r, list) else r for r in results]
        return results

    async def _row_provenance(self, profile: str) -> RowProvenance:
        if profile not in self._provenance:
            self._provenance[profile] = await asyncio.to_thread(self._provenance_of, profile)
        return self._provenance[profile]

    async def start(self) -> None:
        """Lock the output folder, rebuild the key index, then connect to Kafka."""
        await self.io.run(self.lock.acquire)
        self.scan_report = await self.io.scan()
        log.info("sink: %d key(s) in %d existing part(s)", self.scan_report.keys, self.scan_report.parts)
        await super().start()

    async def close(self) -> None:
        """Close the parts and the Kafka clients, then release the folder."""
        try:
            await self.io.close()
            await super().close()
        finally:
            self.lock.release()


def profile_row_provenance(name: str, settings: Settings) -> RowProvenance:
    """The digests of profile ``name`` as the settings load it, and this draftstream's version.

    A profile that cannot be loaded here (its tokenizer is not on the sink's machine) gives
    empty digests, logged: the row is still exact, the audit passed it, and it is written.
    """
    from services.profiles import load_profile
    from services.profiles.provenance import draftstream_version, profile_provenance

    try:
        found = profile_provenance(load_profile(name, settings))
    except Exception as exc:  # noqa: BLE001 - any failure: the rows are written, without digests, and it is logged
        log.warning("sink: profile %s cannot be loaded for its digests (%s): rows carry none", name, exc)
        return RowProvenance(draftstream_version=draftstream_version())
    return RowProvenance(
        tokenizer_sha256=found.tokenizer_sha256,
        chat_template_sha256=found.chat_template_sha256,
        draftstream_version=draftstream_version(),
    )


def create_app(
    settings: Settings, *, out_dir: str | Path | None = None, producer: AIOKafkaProducer | None = None
) -> SinkService:
    """The composition root of the sink."""
    return SinkService(settings, out_dir=out_dir, producer=producer)
