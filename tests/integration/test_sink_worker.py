"""The sink on a real broker: rows on disk, each key once, across a SIGKILL and restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from schemas import ACCEPTED_TOPIC, DEAD_LETTER_TOPIC, DLQ_HEADERS, encode
from services.common.config import Settings
from services.common.kafka import ensure_topics, header, make_producer
from services.sink.app import GROUP_ID, create_app
from services.sink.core import parse_line
from tests.kafka_fixture import read_records, wait_until
from tests.unit.test_sink import audited

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]


def keys_on_disk(out: Path) -> list[str]:
    """Every row id in every JSONL part (duplicates included); corrupt lines ignored."""
    found: list[str] = []
    for part in sorted(out.glob("*/part-*.jsonl")):
        for line in part.read_bytes().splitlines():
            key = parse_line(line)
            if key is not None:
                found.append(key)
    return found


async def produce(settings: Settings, items: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for key, value in items:
            await producer.send(settings.kafka.topic(ACCEPTED_TOPIC), value, key=key)
        await producer.flush()
    finally:
        await producer.stop()


def accepted_records(ids: range | list[int], dataset: str = "math") -> list[tuple[bytes, bytes]]:
    return [(f"{dataset}:s{i}".encode(), encode(audited(f"s{i}", dataset))) for i in ids]


async def test_sink_writes_each_key_once_and_dead_letters_poison(
    settings_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = settings_factory(stage={"batch_max": 4, "batch_timeout_ms": 50})
    await ensure_topics(settings.kafka)
    items = accepted_records(range(6)) + accepted_records([1, 2]) + [(b"math:bad", b"{")]
    items += accepted_records(range(2), dataset="code")
    await produce(settings, items)
    out = tmp_path / "shards"
    service = create_app(settings, out_dir=out)
    await service.start()
    task = asyncio.create_task(service.run())
    try:
        dead = await read_records(settings, settings.kafka.topic(DEAD_LETTER_TOPIC), 1)
        await wait_until(lambda: service.runner.processed >= len(items), timeout=60, message="all consumed")
    finally:
        service.stop()
        await asyncio.wait_for(task, 60)
        await service.close()
    on_disk = keys_on_disk(out)
    assert sorted(on_disk) == sorted({*(f"math:s{i}" for i in range(6)), "code:s0", "code:s1"})
    assert header(dead[0].headers, DLQ_HEADERS.REASON) == "invalid_json"
    assert dead[0].value == b"{"


async def committed_everything(settings: Settings) -> bool:
    """True when the sink group has committed the end of every accepted partition."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    topic = settings.kafka.topic(ACCEPTED_TOPIC)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    probe = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await admin.start()
    await probe.start()
    try:
        committed = await admin.list_consumer_group_offsets(settings.kafka.group(GROUP_ID))
        parts = range(settings.kafka.partitions)  # ensure_topics created them so
        ends = await probe.end_offsets([TopicPartition(topic, p) for p in parts])
        return bool(ends) and all(
            tp in committed and committed[tp].offset == end for tp, end in ends.items()
        )
    finally:
        await probe.stop()
        await admin.close()


def start_sink(settings: Settings, out: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """``draftstream run sink --out`` in a child process configured through the environment."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "DRAFTSTREAM_METRICS__SINK_PORT": "0",
        "DRAFTSTREAM_STAGE__BATCH_MAX": "5",
        "DRAFTSTREAM_STAGE__BATCH_TIMEOUT_MS": "50",
        "DRAFTSTREAM_SINK__ROTATE_BYTES": "20000",
    }
    code = "from services.cli import main; main()"
    with (cwd / "sink.log").open("ab") as log:
        return subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-c", code, "run", "sink", "--out", str(out)],
            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log,
        )


@pytest.mark.long
async def test_sink_killed_mid_run_and_restarted_loses_and_duplicates_nothing(
    settings_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = settings_factory()
    await ensure_topics(settings.kafka)
    out = tmp_path / "shards"
    first = accepted_records(range(120))
    await produce(settings, first)

    child = start_sink(settings, out, tmp_path)
    try:
        await wait_until(lambda: len(keys_on_disk(out)) >= 10 or child.poll() is not None,
                         timeout=90, interval=0.02, message="first rows written")
        assert child.poll() is None, (tmp_path / "sink.log").read_text()
        child.send_signal(signal.SIGKILL)  # no graceful close: parts stay open, offsets uncommitted
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    written_before = len(keys_on_disk(out))
    print(f"sink killed after writing {written_before}/{len(first)} rows")
    # A crash in the middle of a write leaves a torn line: simulate one on the newest part.
    newest = sorted(out.glob("math/part-*.jsonl"))[-1]
    with newest.open("ab") as f:
        f.write(b'{"id": "math:s999", "input_ids": [1, 2, 3')
    # More work arrives, plus replays of keys already written (e.g. a DLQ replay).
    await produce(settings, accepted_records(range(120, 150)) + accepted_records(range(0, 10)))

    child = start_sink(settings, out, tmp_path)
    try:
        await wait_until(lambda: committed_everything(settings), timeout=120, interval=0.5,
                         message="sink caught up")
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(30)

    on_disk = keys_on_disk(out)
    dupes = [k for k, n in Counter(on_disk).items() if n > 1]
    assert dupes == []
    assert set(on_disk) == {f"math:s{i}" for i in range(150)}
    assert not newest.read_bytes().endswith(b"[1, 2, 3"), "torn tail was not truncated"
    assert "torn write" in (tmp_path / "sink.log").read_text()
    parts = sorted(p.name for p in out.glob("math/part-*.jsonl"))
    assert len(parts) >= 3  # rotated by size, and a new part after the restart
