"""Dead-letter tooling on a real broker: list, show, replay, no double replay, max replays, dry run."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import (
    DLQ_HEADERS,
    Message,
    PromptPublished,
    ResponseReceived,
    SampleReconstructed,
    decode,
    encode,
)
from services.common.kafka import DeadLetter, dead_letter, ensure_topics, header, make_producer, publish_all
from services.common.topics import read_to_end
from services.dlq.app import read_dead_letters, replay
from services.dlq.core import Filters

pytestmark = pytest.mark.kafka


async def read_topic(settings, topic: str) -> list:
    records: list = []
    await read_to_end(settings.kafka, topic, records.append, deadline_s=60)
    return records


async def put_dead_letters(settings, letters: list[dict]) -> None:
    kafka = settings.kafka
    producer = make_producer(kafka)
    await producer.start()
    try:
        await publish_all(
            producer,
            [
                dead_letter(
                    dlq_topic=kafka.topic("dead-letter"),
                    stage=d["stage"],
                    verdict=DeadLetter(d["reason"], d.get("message", "failed")),
                    value=d["value"],
                    key=d["key"].encode(),
                    topic=d["topic"],
                    partition=0,
                    offset=i,
                    in_headers=d.get("headers"),
                )
                for i, d in enumerate(letters)
            ],
        )
    finally:
        await producer.stop()


def prompt(sample_id: str) -> PromptPublished:
    return PromptPublished(
        dataset="math",
        sample_id=sample_id,
        messages=[Message(role="user", content=f"Problem {sample_id}: is 221 prime? Explain.\u00e9")],
    )


def sample_value(sample_id: str) -> bytes:
    response = ResponseReceived(
        dataset="math",
        sample_id=sample_id,
        prompt=prompt(sample_id),
        provider="simulator",
        model="deepseek/deepseek-v3",
        reasoning="221 = 13 * 17",
        content="No.",
    )
    sample = SampleReconstructed(
        dataset="math",
        sample_id=sample_id,
        profile="deepseek-v3",
        response=response,
        prompt_ids=[0, 11, 12],
        output_ids=[21, 22, 1],
        loss_mask=[0, 0, 0, 1, 1, 1],
        method="reencode",
    )
    return encode(sample)


def cli_config(settings, tmp_path: Path) -> Path:
    path = tmp_path / "draftstream.toml"
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{settings.kafka.bootstrap_servers}"\n'
        f'topic_prefix = "{settings.kafka.topic_prefix}"\n'
    )
    return path


async def setup_scenario(settings):
    kafka = settings.kafka
    await ensure_topics(kafka, ["math"])
    samples = kafka.topic("samples")
    await put_dead_letters(
        settings,
        [
            {
                "stage": "audit",
                "reason": "roundtrip_mismatch",
                "key": f"math:s{i}",
                "topic": samples,
                "value": sample_value(f"s{i}"),
            }
            for i in range(3)
        ]
        + [
            {
                "stage": "inference",
                "reason": "http_400",
                "key": "math:p9",
                "topic": kafka.prompts_topic("math"),
                "value": encode(prompt("p9")),
            },
            {
                "stage": "audit",
                "reason": "roundtrip_mismatch",
                "key": "math:old",
                "topic": samples,
                "value": b'{"sample": "old"}',
                "headers": [(DLQ_HEADERS.REPLAY_COUNT, b"3"), (DLQ_HEADERS.FIRST_FAILURE, b"1700000000000")],
            },
            {
                "stage": "reconstruct",
                "reason": "unknown_profile",
                "key": "math:z",
                "topic": kafka.topic("gone"),
                "value": b'{"z": 1}',
            },
        ],
    )
    return settings


@pytest.fixture
async def scenario(settings_factory):
    return await setup_scenario(settings_factory())


async def test_list_and_filters(scenario) -> None:
    settings = scenario
    everything = await read_dead_letters(settings)
    assert len(everything) == 6
    audit = await read_dead_letters(settings, Filters(stage="audit"))
    assert {r.key_text for r in audit} == {"math:s0", "math:s1", "math:s2", "math:old"}
    assert [r.key_text for r in await read_dead_letters(settings, Filters(key="math:p9"))] == ["math:p9"]
    assert await read_dead_letters(settings, Filters(dataset="code")) == []


async def test_replay_sends_originals_once_and_respects_max_replays(scenario) -> None:
    settings = scenario
    kafka = settings.kafka
    samples = kafka.topic("samples")
    originals = {r.key_text: r.value for r in await read_dead_letters(settings)}

    dry = await replay(settings, Filters(stage="audit"), dry_run=True)
    assert dry.dry_run and len(dry.replayed) == 3
    assert await read_topic(settings, samples) == []  # dry run wrote nothing
    assert await read_topic(settings, kafka.topic("dlq-replayed")) == []

    report = await replay(settings, Filters(stage="audit"))
    assert sorted(p.record.key_text for p in report.replayed) == ["math:s0", "math:s1", "math:s2"]
    assert [r.key_text for r in report.over_max_replays] == ["math:old"]
    sent = await read_topic(settings, samples)
    assert sorted(r.key.decode() for r in sent) == ["math:s0", "math:s1", "math:s2"]
    for record in sent:
        assert record.value == originals[record.key.decode()]  # byte for byte
        headers = list(record.headers)
        assert header(headers, DLQ_HEADERS.REPLAY_COUNT) == "1"
        assert header(headers, DLQ_HEADERS.FIRST_FAILURE) is not None
        assert header(headers, DLQ_HEADERS.REASON) is None

    second = await replay(settings, Filters(stage="audit"))
    assert second.replayed == [] and len(second.already_replayed) == 3
    assert len(await read_topic(settings, samples)) == 3  # no double

    everything = await replay(settings)
    assert [p.record.key_text for p in everything.replayed] == ["math:p9"]
    assert everything.replayed[0].topic == kafka.prompts_topic("math")
    assert [(r.key_text, t) for r, t in everything.missing_topic] == [("math:z", kafka.topic("gone"))]

    # The replayed sample fails again: its new dead letter carries the history, and a
    # replay of it goes out with replay count 2 and the same first-failure time.
    again = sent[0]
    await put_dead_letters(
        settings,
        [
            {
                "stage": "audit",
                "reason": "roundtrip_mismatch",
                "key": again.key.decode(),
                "topic": samples,
                "value": again.value,
                "headers": list(again.headers),
            }
        ],
    )
    third = await replay(settings, Filters(key=again.key.decode()))
    assert len(third.replayed) == 1 and third.replayed[0].record.replay_count == 1
    latest = [r for r in await read_topic(settings, samples) if r.key == again.key]
    assert sorted(header(list(r.headers), DLQ_HEADERS.REPLAY_COUNT) for r in latest) == ["1", "2"]
    assert len({header(list(r.headers), DLQ_HEADERS.FIRST_FAILURE) for r in latest}) == 1


async def test_replay_to_a_named_stage(scenario) -> None:
    settings = scenario
    report = await replay(settings, Filters(key="math:s1"), to="inference")
    assert [p.topic for p in report.replayed] == [settings.kafka.prompts_topic("math")]
    prompts = await read_topic(settings, settings.kafka.prompts_topic("math"))
    assert [r.key for r in prompts] == [b"math:s1"]
    assert decode(prompts[0].value, PromptPublished) == prompt("s1")  # the sample's own prompt
    assert header(list(prompts[0].headers), DLQ_HEADERS.REPLAY_COUNT) == "1"


def test_cli_list_leaves_out_a_key_a_replay_got_accepted(settings_factory, tmp_path: Path) -> None:
    # As status counts them: a key with a sample on accepted is no longer dead-lettered; --all keeps its record.
    import asyncio

    from services.cli import app

    async def scenario_with_one_accepted():
        settings = await setup_scenario(settings_factory())
        producer = make_producer(settings.kafka)
        await producer.start()
        try:
            await producer.send_and_wait(settings.kafka.topic("accepted"), sample_value("s1"), key=b"math:s1")
        finally:
            await producer.stop()
        return settings

    settings = asyncio.run(scenario_with_one_accepted())
    config = str(cli_config(settings, tmp_path))
    runner = CliRunner()
    listed = runner.invoke(app, ["dlq", "list", "-c", config], terminal_width=200)
    assert listed.exit_code == 0, listed.output
    line = next(ln for ln in listed.output.splitlines() if "roundtrip_mismatch" in ln)
    assert " 3 " in line and "math:s1" not in listed.output, listed.output
    assert "not accepted" in " ".join(listed.output.split()) and ": 5" in listed.output, listed.output
    every = runner.invoke(app, ["dlq", "list", "--all", "-c", config], terminal_width=200)
    line = next(ln for ln in every.output.splitlines() if "roundtrip_mismatch" in ln)
    assert every.exit_code == 0 and " 4 " in line and ": 6" in every.output, every.output


def test_cli_list_show_replay(settings_factory, tmp_path: Path) -> None:
    import asyncio

    from services.cli import app

    settings = asyncio.run(setup_scenario(settings_factory()))
    config = str(cli_config(settings, tmp_path))
    runner = CliRunner()
    listed = runner.invoke(app, ["dlq", "list", "-c", config], terminal_width=200)
    assert listed.exit_code == 0, listed.output
    line = next(ln for ln in listed.output.splitlines() if "roundtrip_mismatch" in ln)
    assert " 4 " in line and any(k in line for k in ("math:s0", "math:s1", "math:s2", "math:old"))
    assert "http_400" in listed.output and "unknown_profile" in listed.output

    shown = runner.invoke(app, ["dlq", "show", "--key", "math:p9", "-c", config], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert DLQ_HEADERS.REASON in shown.output and '"sample_id":"p9"' in shown.output
    assert "1 of 1 matching" in shown.output

    bad_time = runner.invoke(app, ["dlq", "list", "--since", "last tuesday", "-c", config])
    assert bad_time.exit_code == 2 and "cannot read time" in bad_time.output

    dry = runner.invoke(
        app,
        ["dlq", "replay", "--reason", "roundtrip_mismatch", "--dry-run", "-c", config],
        terminal_width=200,
    )
    assert dry.exit_code == 0, dry.output
    assert "would replay 3 of 4" in dry.output and "refused" in dry.output and "math:old" in dry.output
    done = runner.invoke(app, ["dlq", "replay", "--stage", "reconstruct", "-c", config], terminal_width=200)
    assert done.exit_code == 0, done.output
    assert "does not exist" in done.output
