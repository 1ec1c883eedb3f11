"""The sink's rows and shard files: rotation, each key once across restarts, torn tails, I/O off the loop."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import ConsumerRecord

from schemas import SampleAudited, decode, encode
from services.demo.run import accepted_keys, sink_rows
from services.sink.app import create_app
from services.sink.core import TrainingRow, parse_line, part_number, row_line, torn_tail, training_row
from services.sink.shards import AsyncShardWriter, ShardWriter

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "payloads" / "v1_audited.json"


def audited(sample_id: str = "a1", dataset: str = "math") -> SampleAudited:
    """The v1 fixture, renamed."""
    base = decode(FIXTURE.read_bytes(), SampleAudited)
    sample = msgspec.structs.replace(base.sample, sample_id=sample_id, dataset=dataset)
    return msgspec.structs.replace(base, sample=sample, sample_id=sample_id, dataset=dataset)


def rows(*ids: str, dataset: str = "math") -> list[tuple[str, str, TrainingRow]]:
    out = []
    for i in ids:
        row = training_row(audited(i, dataset))
        out.append((dataset, row.id, row))
    return out


def read_ids(out: Path, dataset: str = "math") -> list[str]:
    ids: list[str] = []
    for part in sorted((out / dataset).glob("part-*.jsonl")):
        for line in part.read_bytes().splitlines():
            key = parse_line(line)
            if key is not None:
                ids.append(key)
    return ids


def test_training_row_has_specforge_and_speculators_fields() -> None:
    row = json.loads(row_line(training_row(audited())))
    assert row["id"] == "math:a1"
    assert row["input_ids"] == [5, 6, 7, 8]
    assert row["prompt_ids"] == [5, 6] and row["output_ids"] == [7, 8]
    assert row["loss_mask"] == [0, 0, 1, 1]
    assert [t["role"] for t in row["conversations"]] == ["system", "user", "assistant"]
    last = row["conversations"][-1]
    assert last["content"] == "4" and last["reasoning_content"] == "think"
    assert json.loads(last["tool_calls"])[0]["function"] == {"name": "add", "arguments": '{"a":2}'}
    assert row["tools"] == "[]"  # the v1 payload's request did not send them (tools_sent false)
    meta = row["metadata"]
    assert meta["provider"] == "openrouter" and meta["model"] == "deepseek/deepseek-v3"
    assert meta["usage"]["completion_tokens"] == 3
    assert meta["finish_reason"] == "stop" and meta["reconstruction_method"] == "native"
    assert meta["audit"]["checks"] == [{"code": "ends_with_end_of_turn", "passed": True, "message": ""}]


def test_training_row_holds_only_what_the_model_saw() -> None:
    """Tools the request did not send and earlier reasoning it never carries stay out of the row."""
    base = audited()
    sent_messages = base.sample.response.prompt.messages
    messages = [msgspec.structs.replace(m, reasoning_content="never sent") for m in sent_messages]
    prompt = msgspec.structs.replace(base.sample.response.prompt, messages=messages)
    for sent in (True, False):
        response = msgspec.structs.replace(base.sample.response, prompt=prompt, tools_sent=sent)
        sample = msgspec.structs.replace(base.sample, response=response)
        row = training_row(msgspec.structs.replace(base, sample=sample))
        assert (json.loads(row.tools) == base.sample.response.prompt.tools) == sent
        assert all(t.reasoning_content == "" for t in row.conversations[:-1])
        assert row.conversations[-1].reasoning_content == "think"


def test_pure_helpers() -> None:
    assert part_number("part-00012.jsonl") == 12
    assert part_number("part-1.jsonl") is None and part_number("notes.txt") is None
    assert torn_tail(b'{"id":"a"}\n{"id"') == 5
    assert torn_tail(b'{"id":"a"}\n') == 0
    assert parse_line(b"{not json") is None
    assert parse_line(b'{"id":"math:x"}') == "math:x"


def test_writes_rotates_and_skips_duplicates(tmp_path: Path) -> None:
    one_row = len(row_line(training_row(audited())))
    writer = ShardWriter(tmp_path, rotate_bytes=one_row * 2 + 10)
    writer.scan()
    assert writer.write(rows("a", "b", "c")) == 3
    assert writer.write(rows("b", "d", "d")) == 1  # b already written, d twice in the batch
    writer.close()
    parts = sorted((tmp_path / "math").glob("part-*.jsonl"))
    assert len(parts) == 2, parts
    assert sorted(read_ids(tmp_path)) == ["math:a", "math:b", "math:c", "math:d"]
    for part in parts:
        assert part.read_bytes().endswith(b"\n")


def test_restart_rebuilds_index_truncates_torn_tail_and_opens_a_new_part(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path)
    writer.scan()
    writer.write(rows("a", "b"))
    writer.close()
    part0 = tmp_path / "math" / "part-00000.jsonl"
    with part0.open("ab") as f:
        f.write(b'not json at all\n{"id": "math:c", "input_ids": [1, 2')  # corrupt line + torn tail
    restarted = ShardWriter(tmp_path)
    report = restarted.scan()
    assert report.keys == 2
    assert len(report.truncated) == 1 and len(report.corrupt_lines) == 1
    assert part0.read_bytes().endswith(b"not json at all\n")
    assert restarted.write(rows("a", "c")) == 1
    restarted.close()
    assert (tmp_path / "math" / "part-00001.jsonl").is_file()
    assert sorted(read_ids(tmp_path)) == ["math:a", "math:b", "math:c"]


def test_a_reader_beside_a_running_sink_takes_whole_lines_only(tmp_path: Path) -> None:
    """A part read while the sink writes may end in half a row: that tail is left for the next read."""
    writer = ShardWriter(tmp_path)
    writer.scan()
    writer.write(rows("a", "b"))
    part0 = tmp_path / "math" / "part-00000.jsonl"
    line = row_line(training_row(audited("c")))
    assert len(line) > 100
    with part0.open("ab") as f:
        f.write(line[:100])  # what a buffered write of a long row shows a reader mid-way
    assert [r["id"] for r in sink_rows(tmp_path)] == ["math:a", "math:b"]
    with part0.open("ab") as f:
        f.write(line[100:])
    assert [r["id"] for r in sink_rows(tmp_path)] == ["math:a", "math:b", "math:c"]
    assert accepted_keys(tmp_path) == {"math:a": 1, "math:b": 1, "math:c": 1}
    writer.close()


def test_datasets_get_their_own_folders(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path)
    writer.scan()
    writer.write([*rows("a", dataset="math"), *rows("a", dataset="code")])
    writer.close()
    assert read_ids(tmp_path, "math") == ["math:a"]
    assert read_ids(tmp_path, "code") == ["code:a"]


def test_parquet_parts_and_index(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    writer = ShardWriter(tmp_path, fmt="parquet")
    writer.scan()
    assert writer.write(rows("a", "b")) == 2
    (tmp_path / "math" / "part-00007.parquet.tmp").write_bytes(b"half a file")
    (tmp_path / "math" / "part-00003.parquet").write_bytes(b"garbage")
    restarted = ShardWriter(tmp_path, fmt="parquet")
    report = restarted.scan()
    assert report.keys == 2 and len(report.bad_files) == 1
    assert not (tmp_path / "math" / "part-00007.parquet.tmp").exists()
    assert restarted.write(rows("b", "c")) == 1
    table = pq.read_table(tmp_path / "math" / "part-00004.parquet")
    assert table.column("id").to_pylist() == ["math:c"]
    assert table.column("metadata").to_pylist()[0]["provider"] == "openrouter"


def accepted_records(*ids: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Records as the sink's consumer hands them over: key and audited value bytes."""
    return [
        ConsumerRecord(topic="accepted", partition=0, offset=n, timestamp=0, timestamp_type=0,
                       key=f"math:{i}".encode(), value=encode(audited(i)), checksum=None,
                       serialized_key_size=0, serialized_value_size=0, headers=())
        for n, i in enumerate(ids)
    ]  # fmt: skip


class GatedFsync:
    """``os.fsync`` held at its first call until the test opens the gate: a disk that stalls.

    The real fsync runs once the gate opens. A gate never opened (because the thread that
    should open it is the one stalled) fails the call with a message instead of hanging.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.threads: set[str] = set()
        self._real = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise RuntimeError("fsync was never released: the event loop did not run while it was in flight")
        self._real(fd)

    async def wait_entered(self) -> None:
        """Yield to the loop until a write has reached fsync (or fail after a bounded number of tries)."""
        for _ in range(3000):
            if self.entered.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no write reached fsync")


async def test_event_loop_keeps_running_while_a_batch_is_fsynced(
    settings_factory: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other coroutines run while the sink's handler waits on a stalled fsync; it returns only after it."""
    service = create_app(settings_factory(), out_dir=tmp_path / "out")
    await service.io.scan()
    ids = [f"r{i}" for i in range(1000)]
    fsync = GatedFsync(monkeypatch)
    handling = asyncio.create_task(service.handle(accepted_records(*ids)))
    await fsync.wait_entered()
    # Here the batch's fsync is in flight, so this coroutine ran while it was: count a few more
    # turns of the loop to show it is not merely between two blocking calls.
    turns = 0
    for _ in range(5):
        await asyncio.sleep(0)
        turns += 1
    assert turns == 5 and not handling.done(), "the handler returned before its rows were fsynced"
    assert threading.current_thread().name not in fsync.threads, "fsync ran on the event loop's thread"
    fsync.gate.set()
    results = await handling
    await service.io.close()
    assert results == [[]] * len(ids)
    assert sorted(read_ids(tmp_path / "out")) == sorted(f"math:{i}" for i in ids)
    assert fsync.threads == {"sink-io_0"}


async def test_writes_run_one_at_a_time_in_call_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second write waits for the first: it sees the first's keys and lands after its rows."""
    writer = AsyncShardWriter(ShardWriter(tmp_path))
    await writer.scan()
    fsync = GatedFsync(monkeypatch)
    first = asyncio.create_task(writer.write(rows("a", "b")))
    await fsync.wait_entered()
    second = asyncio.create_task(writer.write(rows("b", "c")))  # "b" is the first write's, not yet indexed
    for _ in range(5):
        await asyncio.sleep(0)
    assert not first.done() and not second.done()
    fsync.gate.set()
    assert (await first, await second) == (2, 1)
    await writer.close()
    assert read_ids(tmp_path) == ["math:a", "math:b", "math:c"]
