"""Reading dataset files row by row: JSONL (optionally gzipped), JSON arrays and Parquet.

Each row comes with its 1-based line number (JSONL, JSON arrays) or row number (Parquet)
so a bad row can be reported precisely. A row that is not valid JSON is yielded as a
:class:`~services.publish.core.RowError` and reading goes on; a file that cannot be read
at all (missing, unreadable Parquet, a malformed JSON array) raises :class:`FileError`.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from services.publish.core import INVALID_JSON, RowError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class FileError(Exception):
    """A whole input file cannot be read; the message is one line naming the file."""


Row = tuple[int, Any]  # (line or row number, parsed record or RowError)


def _base_suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def check_file(path: Path) -> None:
    """Refuse a path that does not exist or whose type is not a supported dataset file."""
    if not path.exists():
        raise FileError(f"{path}: no such file")
    if not path.is_file():
        raise FileError(f"{path}: not a regular file")
    suffix = _base_suffix(path)
    if suffix not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise FileError(
            f"{path}: unsupported file type {suffix or '(none)'!r}; use .jsonl, .json or .parquet"
        )


def _open_text(path: Path) -> IO[str]:
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _iter_json_text(path: Path) -> Iterator[Row]:
    try:
        with _open_text(path) as fh:
            first = ""
            head: list[str] = []
            for line in fh:
                head.append(line)
                if line.strip():
                    first = line.lstrip()[0]
                    break
            if first == "[":
                text = "".join(head) + fh.read()
                yield from _iter_json_array(path, text)
                return
            for lineno, line in enumerate(itertools.chain(head, fh), start=1):
                row = _parse_line(line, lineno)
                if row is not None:
                    yield row
    except UnicodeDecodeError as exc:
        raise FileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        raise FileError(f"{path}: cannot read: {exc}") from None


def _parse_line(line: str, lineno: int) -> Row | None:
    if not line.strip():
        return None
    try:
        return lineno, json.loads(line)
    except json.JSONDecodeError as exc:
        return lineno, RowError(INVALID_JSON, f"invalid JSON: {exc.msg} (column {exc.colno})")


def _iter_json_array(path: Path, text: str) -> Iterator[Row]:
    """Elements of a JSON array with the line each starts on (one pass, no second parse)."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    line = 1 + text.count("\n", 0, pos)
    last = pos

    def skip_ws(p: int) -> int:
        while p < n and text[p] in " \t\r\n":
            p += 1
        return p

    pos = skip_ws(pos)
    if pos < n and text[pos] == "]":
        return
    while True:
        line += text.count("\n", last, pos)
        last = pos
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise FileError(
                f"{path}: not a valid JSON array: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        yield line, obj
        pos = skip_ws(pos)
        if pos < n and text[pos] == ",":
            pos = skip_ws(pos + 1)
            continue
        if pos < n and text[pos] == "]":
            if text[pos + 1 :].strip():
                raise FileError(f"{path}: not a valid JSON array: trailing data after ']'")
            return
        line += text.count("\n", last, pos)
        raise FileError(f"{path}: not a valid JSON array: expected ',' or ']' at line {line}")


def _iter_parquet(path: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FileError(
            f"{path}: reading Parquet needs pyarrow; install it with: pip install 'draftstream[parquet]'"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
        rowno = 0
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                rowno += 1
                yield rowno, record
    except FileError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a bad file
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FileError(f"{path}: unreadable Parquet file: {message}") from None


def iter_rows(path: Path) -> Iterator[Row]:
    """Every row of one dataset file as ``(line, record_or_RowError)``."""
    check_file(path)
    if _base_suffix(path) in PARQUET_SUFFIXES:
        yield from _iter_parquet(path)
    else:
        yield from _iter_json_text(path)


__all__ = ["FileError", "Row", "check_file", "iter_rows"]
