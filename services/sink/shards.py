"""Shard files on disk: the sink's key index, part files, fsyncs and output-folder lock.

:class:`ShardWriter` does the blocking file I/O (write, flush, fsync, Parquet, the
start-up scan) synchronously; :class:`AsyncShardWriter` runs every call of it on one
dedicated thread, so the event loop keeps serving Kafka heartbeats, fetches and metrics
while a batch is fsynced, and calls still run one at a time in the order they were made
(a write never overlaps the scan, another write or the final close). The durability
contract is the sink's (``services/sink/app.py``): a write returns only after its rows
are fsynced, and the awaiting handler returns (and the offsets are committed) only after
that. The pure bookkeeping (part names, torn tails, row bytes) is in ``core.py``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from services.common.errors import DirectoryLocked
from services.common.metrics import SINK_BYTES, SINK_DUPLICATES, SINK_FILES, SINK_ROWS
from services.sink.core import (
    TrainingRow,
    parse_line,
    part_name,
    part_number,
    row_arrow_schema,
    row_builtins,
    row_line,
    torn_tail,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

@dataclass
class ScanReport:
    """What the start-up scan of existing parts found."""

    keys: int = 0
    parts: int = 0
    corrupt_lines: list[str] = field(default_factory=list)  # "path:line"
    truncated: list[str] = field(default_factory=list)  # "path: N bytes"
    bad_files: list[str] = field(default_factory=list)


def fsync_file(f: IO[bytes]) -> None:
    """Push a file's buffered bytes to the kernel, then to the disk."""
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


LOCK_FILE = ".draftstream-sink.lock"


class OutputLock:
    """An exclusive lock on a sink's output folder, held while the sink runs.

    Two sinks writing one folder would number their parts alike and each rebuild its key
    index without the other's rows. ``fcntl.flock`` is released by the kernel when the
    holder dies, so a crashed sink never leaves a stale lock; the file names the holder.
    """

    def __init__(self, out_dir: str | Path) -> None:
        """Point at the folder to lock (created when missing)."""
        self.path = Path(out_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`DirectoryLocked` naming the running holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "an unknown process"
            os.close(fd)
            raise DirectoryLocked(
                f"sink output folder {self.path.parent} is in use by another sink ({holder}); "
                "give each sink its own --out (or [sink] out_dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (closing the file releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ShardWriter:
    """Writes rows to rotating part files per dataset, each key once."""

    def __init__(self, out_dir: str | Path, *, fmt: str = "jsonl", rotate_bytes: int = 256 * 1024 * 1024):
        """Point at an output folder (created if missing); call :meth:`scan` before writing."""
        self.out_dir = Path(out_dir)
        self.fmt = fmt
        self.rotate_bytes = rotate_bytes
        self.keys: set[str] = set()
        self._next_part: dict[str, int] = {}
        self._open: dict[str, tuple[IO[bytes], Path]] = {}

    def scan(self) -> ScanReport:
        """Rebuild the key index from existing parts; truncate torn JSONL tails."""
        report = ScanReport()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for ds_dir in sorted(p for p in self.out_dir.iterdir() if p.is_dir()):
            highest = -1
            for path in sorted(ds_dir.iterdir()):
                if path.name.endswith(".tmp"):
                    path.unlink()
                    continue
                number = part_number(path.name)
                if number is None:
                    continue
                highest = max(highest, number)
                report.parts += 1
                if path.suffix == ".jsonl":
                    self._scan_jsonl(path, report)
                else:
                    self._scan_parquet(path, report)
            self._next_part[ds_dir.name] = highest + 1
        report.keys = len(self.keys)
        for where in report.truncated:
            log.warning("sink: truncated a torn write at the end of %s", where)
        for where in report.corrupt_lines:
            log.warning("sink: corrupt line skipped at %s", where)
        for where in report.bad_files:
            log.warning("sink: unreadable part skipped: %s", where)
        return report

    def _scan_jsonl(self, path: Path, report: ScanReport) -> None:
        data = path.read_bytes()
        torn = torn_tail(data)
        if torn:
            with path.open("r+b") as f:
                f.truncate(len(data) - torn)
                fsync_file(f)
            report.truncated.append(f"{path}: {torn} bytes")
            data = data[: len(data) - torn]
        for n, line in enumerate(data.splitlines(), start=1):
            if not line.strip():
                continue
            key = parse_line(line)
            if key is None:
                report.corrupt_lines.append(f"{path}:{n}")
            else:
                self.keys.add(key)

    def _scan_parquet(self, path: Path, report: ScanReport) -> None:
        try:
            import pyarrow.parquet as pq

            ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
        except Exception as exc:  # noqa: BLE001 - an unreadable part is reported, not fatal
            report.bad_files.append(f"{path}: {exc}")
            return
        self.keys.update(str(k) for k in ids if k)

    def _new_part(self, dataset: str) -> Path:
        ds_dir = self.out_dir / dataset
        created = not ds_dir.exists()
        ds_dir.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(self.out_dir)
        number = self._next_part.get(dataset, 0)
        self._next_part[dataset] = number + 1
        SINK_FILES.labels(dataset=dataset).inc()
        return ds_dir / part_name(number, self.fmt)

    def write(self, rows: Sequence[tuple[str, str, TrainingRow]]) -> int:
        """Write (dataset, key, row) rows not yet written, durably; returns how many were new.

        Returns only after every touched file (and new directory entry) is fsynced.
        """
        fresh: list[tuple[str, str, TrainingRow]] = []
        seen: set[str] = set()
        for dataset, key, row in rows:
            if key in self.keys or key in seen:
                SINK_DUPLICATES.labels(dataset=dataset).inc()
                continue
            seen.add(key)
            fresh.append((dataset, key, row))
        if self.fmt == "parquet":
            self._write_parquet(fresh)
        else:
            self._write_jsonl(fresh)
        for dataset, key, _ in fresh:
            self.keys.add(key)
            SINK_ROWS.labels(dataset=dataset).inc()
        return len(fresh)

    def _write_jsonl(self, rows: list[tuple[str, str, TrainingRow]]) -> None:
        touched: dict[str, IO[bytes]] = {}
        new_dirs: set[Path] = set()
        for dataset, _, row in rows:
            line = row_line(row)
            current = self._open.get(dataset)
            size = current[0].tell() if current is not None else 0
            if current is not None and size > 0 and size + len(line) > self.rotate_bytes:
                fsync_file(current[0])
                current[0].close()
                touched.pop(dataset, None)
                current = None
            if current is None:
                path = self._new_part(dataset)
                # "xb": a part is never reopened, so a fresh file can never follow a torn line.
                current = (path.open("xb"), path)
                self._open[dataset] = current
                new_dirs.add(path.parent)
            current[0].write(line)
            touched[dataset] = current[0]
            SINK_BYTES.labels(dataset=dataset).inc(len(line))
        for f in touched.values():
            fsync_file(f)
        for d in new_dirs:
            fsync_dir(d)

    def _write_parquet(self, rows: list[tuple[str, str, TrainingRow]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = row_arrow_schema()  # every part gets the identical schema
        by_dataset: dict[str, list[TrainingRow]] = {}
        for dataset, _, row in rows:
            by_dataset.setdefault(dataset, []).append(row)
        for dataset, batch in by_dataset.items():
            path = self._new_part(dataset)
            tmp = path.with_name(path.name + ".tmp")
            table = pa.Table.from_pylist([row_builtins(r) for r in batch], schema=schema)
            pq.write_table(table, tmp)
            with tmp.open("rb") as f:
                fsync_file(f)
            tmp.rename(path)
            fsync_dir(path.parent)
            SINK_BYTES.labels(dataset=dataset).inc(path.stat().st_size)

    def close(self) -> None:
        """Flush, fsync and close every open part."""
        for f, _ in self._open.values():
            fsync_file(f)
            f.close()
        self._open.clear()


class AsyncShardWriter:
    """A :class:`ShardWriter` whose calls run on one dedicated thread, awaited in order.

    One worker thread, not ``asyncio.to_thread``'s shared pool: the writer's key index and
    open parts are touched by one thread only, and a call made after another (the close
    after a write whose awaiting handler was cancelled) runs after it, never beside it.
    """

    def __init__(self, writer: ShardWriter) -> None:
        """Wrap ``writer``; the thread starts on the first call."""
        self.writer = writer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sink-io")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the writer's thread, after every call made before it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def scan(self) -> ScanReport:
        """:meth:`ShardWriter.scan` off the event loop."""
        return await self.run(self.writer.scan)

    async def write(self, rows: Sequence[tuple[str, str, TrainingRow]]) -> int:
        """:meth:`ShardWriter.write` off the event loop: returns once the rows are fsynced."""
        return await self.run(self.writer.write, rows)

    async def close(self) -> None:
        """Flush, fsync and close every part (after any write still in flight), then stop the thread."""
        try:
            await self.run(self.writer.close)
        finally:
            self._executor.shutdown(wait=False)


__all__ = [
    "LOCK_FILE",
    "AsyncShardWriter",
    "OutputLock",
    "ScanReport",
    "ShardWriter",
    "fsync_dir",
    "fsync_file",
]
