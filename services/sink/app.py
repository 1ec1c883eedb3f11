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

import logging
from collections.abc import Sequence
from pathlib import Path

from aiokafka import AIOKafkaProducer, ConsumerRecord

from schemas import SampleAudited, SchemaError, decode, topology
from services.common.config import Settings
from services.common.kafka import DeadLetter
from services.common.stage import Result, RunnerService, StageRunner
from services.sink.core import TrainingRow, training_row
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
    ) -> None:
        """Wire the stage; ``out_dir`` overrides settings.sink.out_dir."""
        self.settings = settings
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
            row = training_row(audited)
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


def create_app(
    settings: Settings, *, out_dir: str | Path | None = None, producer: AIOKafkaProducer | None = None
) -> SinkService:
    """The composition root of the sink."""
    return SinkService(settings, out_dir=out_dir, producer=producer)
