"""Publishing to a real broker: the right records, stable keys, and a re-publish adds no new keys."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import PromptPublished, decode, sample_key
from services.dlq.app import read_to_end
from services.publish.app import publish

pytestmark = pytest.mark.kafka

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
    assert again.published == 8
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
    assert "published" in result.output and "skipped: oversize" in result.output
    assert result.output.splitlines()[-1] == (
        f"published 3 prompt(s) to {settings.kafka.topic_prefix}prompts.cli, skipped 7"
    )
