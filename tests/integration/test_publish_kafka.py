"""Publishing to a real broker: the right records, stable keys, a re-publish sends only what is
missing, and an interrupted publish is resumed by running it again."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import PromptPublished, decode, sample_key
from services.common.topics import read_keys, read_to_end
from services.publish.app import PublishInterrupted, publish

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
FILES = [
    DATA / "glaive_tools.jsonl",
    DATA / "sharegpt_chat.json",
    DATA / "openai_math.jsonl",
    DATA / "alpaca.jsonl",
]


async def read_topic(settings, topic: str) -> list:
    records: list = []
    assert await read_to_end(settings.kafka, topic, records.append, deadline_s=60)
    return records


async def test_publish_writes_normalised_prompts_with_stable_keys(settings_factory) -> None:
    settings = settings_factory()
    report = await publish(settings, FILES, dataset="mix")
    assert report.published == 8 and not report.rejections
    topic = settings.kafka.prompts_topic("mix")
    first = await read_topic(settings, topic)
    assert len(first) == 8
    prompts = {r.key.decode(): decode(r.value, PromptPublished) for r in first}
    assert all(key == sample_key("mix", p.sample_id) for key, p in prompts.items())
    assert {"mix:glaive-00017", "mix:sg_4kx1", "mix:7f1c2a9e-33b0-4c1e-9d55-0b7e3c1f8a21"} <= set(prompts)
    glaive = prompts["mix:glaive-00017"]
    assert glaive.tools is not None and glaive.tools[0]["function"]["name"] == "convert_currency"
    assert glaive.messages[-1].role == "user" and glaive.published_at > 0
    assert all(p.dataset == "mix" for p in prompts.values())

    again = await publish(settings, FILES, dataset="mix")
    assert (again.already_present, again.to_send, again.published) == (8, 0, 0)  # nothing sent twice
    assert len(await read_topic(settings, topic)) == 8
    forced = await publish(settings, FILES, dataset="mix", force=True)
    assert forced.published == 8 and forced.already_present == 0 and not forced.topic_checked
    both = await read_topic(settings, topic)
    assert len(both) == 16
    per_key = Counter(r.key for r in both)
    assert set(per_key.values()) == {2} and {k.decode() for k in per_key} == set(prompts)
    # the same key lands on the same partition, so downstream sees it in order
    partitions = {(r.key, r.partition) for r in both}
    assert len(partitions) == 8


async def test_publish_limit_and_parquet(settings_factory, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i} squared?"}]} for i in range(6)
    ]
    path = tmp_path / "squares.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    settings = settings_factory()
    report = await publish(settings, [path], dataset="squares", limit=4)
    assert report.published == 4
    records = await read_topic(settings, settings.kafka.prompts_topic("squares"))
    assert sorted(r.key.decode() for r in records) == [f"squares:q{i}" for i in range(4)]


async def test_strict_publishes_nothing(settings_factory) -> None:
    from services.dlq.app import list_topics
    from services.publish.app import PublishError

    settings = settings_factory(provider={"max_prompt_chars": 4000})
    with pytest.raises(PublishError):
        await publish(
            settings, [DATA / "openai_math.jsonl", DATA / "bad_rows.jsonl"], dataset="strict", strict=True
        )
    assert settings.kafka.prompts_topic("strict") not in await list_topics(settings.kafka)


def test_cli_publish_summary(settings_factory, tmp_path: Path) -> None:
    from services.cli import app

    settings = settings_factory()
    config = tmp_path / "draftstream.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = "{settings.kafka.bootstrap_servers}"\n'
        f'topic_prefix = "{settings.kafka.topic_prefix}"\n[provider]\nmax_prompt_chars = 4000\n'
    )
    result = CliRunner().invoke(
        app,
        ["publish", str(DATA / "bad_rows.jsonl"), str(DATA / "alpaca.jsonl"), "-d", "cli", "-c", str(config)],
    )
    assert result.exit_code == 0, result.output
    assert "bad_rows.jsonl:3: no_user_turn" in result.output
    assert "sent" in result.output and "skipped: oversize" in result.output
    assert result.output.splitlines()[-1] == (
        f"0 already on the topic, 3 sent to {settings.kafka.topic_prefix}prompts.cli, skipped 7"
    )
    again = CliRunner().invoke(
        app,
        ["publish", str(DATA / "bad_rows.jsonl"), str(DATA / "alpaca.jsonl"), "-d", "cli", "-c", str(config)],
    )
    assert again.exit_code == 0, again.output
    assert again.output.splitlines()[-1] == (
        f"3 already on the topic, 0 sent to {settings.kafka.topic_prefix}prompts.cli, skipped 7"
    )


def big_file(path: Path, rows: int) -> Path:
    with path.open("w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i} squared?"}]}))
            fh.write("\n")
    return path


async def test_cancelled_publish_counts_exactly_what_is_on_the_topic_and_resumes(
    settings_factory, tmp_path: Path
) -> None:
    settings = settings_factory()
    path = big_file(tmp_path / "big.jsonl", 6000)
    topic = settings.kafka.prompts_topic("big")

    class CancelAfterFirstAcks:
        task: asyncio.Task[object] | None = None

        def start(self, total: int) -> None:
            assert total == 6000

        def advance(self, n: int) -> None:
            if n and self.task is not None:
                self.task.cancel()  # as Ctrl-C does through asyncio.run

    sink = CancelAfterFirstAcks()
    sink.task = asyncio.create_task(publish(settings, [path], dataset="big", progress=sink))
    with pytest.raises(PublishInterrupted) as info:
        await sink.task
    first = info.value.report
    assert first.interrupted and 0 < first.published < 6000
    on_topic = await read_keys(settings.kafka, topic)
    assert len(on_topic) == first.published  # the count printed is what the topic holds

    second = await publish(settings, [path], dataset="big")
    assert (second.already_present, second.published) == (first.published, 6000 - first.published)
    records = await read_topic(settings, topic)
    assert len(records) == 6000 and len({r.key for r in records}) == 6000  # none sent twice

    third = await publish(settings, [path], dataset="big")
    assert (third.already_present, third.published) == (6000, 0)
    dry = await publish(settings, [path], dataset="big", dry_run=True)
    assert dry.topic_checked and (dry.already_present, dry.to_send, dry.published) == (6000, 0, 0)


def test_ctrl_c_on_the_cli_reports_the_rows_sent_and_a_rerun_sends_the_rest(settings_factory, tmp_path: Path) -> None:
    """SIGINT to a real ``draftstream publish`` process mid-send: exit 130, the count printed is
    the count on the topic, and the same command again sends exactly the rest."""
    settings = settings_factory()
    # The child is stopped (SIGSTOP) as soon as its first records are on the topic, and the
    # SIGINT reaches it when it is continued: the signal arrives mid-send however fast the
    # child sends or however slowly this process is scheduled, as long as the poll below
    # sees the first records before the child has sent all 40 windows of 500 (it sees them at the
    # first window here).
    rows = 20_000
    path = big_file(tmp_path / "big.jsonl", rows)
    topic = settings.kafka.prompts_topic("sigint")
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
    }
    command = [sys.executable, "-m", "services.cli", "publish", str(path), "-d", "sigint"]
    with TopicSize(settings, topic) as size:
        # The child hears SIGINT whatever the suite was started from (a background job of a
        # shell without job control inherits SIGINT ignored, and Python keeps it ignored).
        proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 120
            while size() == 0:  # sending has started
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "publish never started sending"
                time.sleep(0.01)
            proc.send_signal(signal.SIGSTOP)
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGCONT)
            output, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, output
    match = re.search(r"interrupted: (\d+) prompt\(s\) sent to (\S+), (\d+) not sent", output)
    assert match, output
    sent = int(match.group(1))
    assert 0 < sent < rows and int(match.group(3)) == rows - sent and match.group(2) == topic
    assert "Traceback" not in output
    assert len(asyncio.run(read_keys(settings.kafka, topic))) == sent

    again = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[-1] == f"{sent} already on the topic, {rows - sent} sent to {topic}, skipped 0"
    assert len(asyncio.run(read_keys(settings.kafka, topic))) == rows


class TopicSize:
    """Records on a topic now (sum of its partitions' end offsets; 0 before it exists), asked
    through one admin and one consumer kept open on a loop of their own, so each call is a
    round trip or two to the broker, not a client start-up."""

    def __init__(self, settings, topic: str) -> None:
        self.settings, self.topic = settings, topic
        self.loop = asyncio.new_event_loop()
        self.admin = self.consumer = None
        self.parts: list = []

    def __enter__(self) -> TopicSize:
        self.loop.run_until_complete(self._start())
        return self

    async def _start(self) -> None:
        from services.common.kafka import make_admin, make_consumer

        self.admin = make_admin(self.settings.kafka)
        self.consumer = make_consumer(self.settings.kafka, group_id=None)
        await self.admin.start()
        await self.consumer.start()

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.consumer.stop())
        self.loop.run_until_complete(self.admin.close())
        self.loop.close()

    def __call__(self) -> int:
        return self.loop.run_until_complete(self._size())

    async def _size(self) -> int:
        from aiokafka import TopicPartition

        from services.common.topics import partitions_of

        if not self.parts:
            self.parts = [TopicPartition(self.topic, p)
                          for p in (await partitions_of(self.admin, [self.topic])).get(self.topic, [])]
            if not self.parts:
                return 0
        return sum((await self.consumer.end_offsets(self.parts)).values())
