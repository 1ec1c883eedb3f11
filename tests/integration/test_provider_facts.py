"""Provider facts on a real broker: written by one reconstruct worker, read by the next at start, followed.

Truth: R1's raw text encoded by the real tokenizer (tests/unit/test_facts.py); the answers are
a lossless OpenRouter upstream's fields of that text, named in ``provider``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from schemas import (
    DEAD_LETTER_TOPIC,
    DLQ_HEADERS,
    PROVIDER_FACTS_TOPIC,
    RESPONSES_TOPIC,
    SAMPLES_TOPIC,
    ProviderFactRecorded,
    ResponseReceived,
    SampleReconstructed,
    decode,
    encode,
)
from services.common.config import Settings
from services.common.kafka import ensure_topics, header
from services.common.topics import read_compacted
from services.reconstruct.app import create_app
from tests.kafka_fixture import read_records, send_records, wait_until
from tests.unit.test_facts import PLAIN_TEXT, SHOWING_TEXT, _answer
from tests.unit.test_profiles import deepseek
from tests.unit.test_reconstruct import R1_EOS, r1_ids

pytestmark = pytest.mark.kafka


def _r1(answer: ResponseReceived) -> tuple[bytes, bytes]:
    answer.profile = "deepseek-r1"
    return f"math:{answer.sample_id}".encode(), encode(answer)


async def test_facts_are_written_read_back_by_the_next_worker_and_followed(
    settings_factory: Callable[..., Settings],
) -> None:
    settings = settings_factory(stage={"batch_max": 4, "batch_timeout_ms": 50})
    await ensure_topics(settings.kafka)
    ds = deepseek()
    facts_topic = settings.kafka.topic(PROVIDER_FACTS_TOPIC)

    # Worker 1 sees the answer that shows its whitespace: it establishes the upstream's facts.
    await send_records(settings, RESPONSES_TOPIC, [_r1(_answer("showing", SHOWING_TEXT, "Lossless"))])
    first = create_app(settings, profiles={"deepseek-r1": ds})
    await first.start()
    task = asyncio.create_task(first.run())
    try:
        await read_records(settings, settings.kafka.topic(SAMPLES_TOPIC), 1)
        await wait_until(lambda: first.processed >= 1, timeout=60, message="the first answer processed")
    finally:
        first.stop()
        await asyncio.wait_for(task, 60)
        await first.close()
    written = {k.decode(): decode(v, ProviderFactRecorded) for k, v in (await read_compacted(
        settings.kafka, facts_topic)).values.items()}  # fmt: skip
    assert set(written) == {f"Lossless/m|{p}" for p in ("reasoning_start", "reasoning_end", "content_start",
                                                        "content_end")}  # fmt: skip
    assert {f.evidence for f in written.values()} == {"math:showing"} and not any(f.withdrawn for f in written.values())

    # Worker 2 starts after: the answer alone is ambiguous, the facts it read at start pin it.
    second = create_app(settings, profiles={"deepseek-r1": ds})
    await second.start()
    task = asyncio.create_task(second.run())
    try:
        await send_records(settings, RESPONSES_TOPIC, [_r1(_answer("plain", PLAIN_TEXT, "Lossless"))])
        samples = await read_records(settings, settings.kafka.topic(SAMPLES_TOPIC), 2)
        plain = {r.key: decode(r.value, SampleReconstructed) for r in samples}[b"math:plain"]
        assert list(plain.output_ids) == r1_ids(PLAIN_TEXT + R1_EOS)

        # Another worker withdraws the content-start fact while this one runs: it follows the topic.
        withdrawal = ProviderFactRecorded(upstream="Lossless/m", place="content_start", evidence="math:showing",
                                          withdrawn=True, contradicted_by="math:elsewhere", reason="test")
        await send_records(settings, PROVIDER_FACTS_TOPIC, [(b"Lossless/m|content_start", encode(withdrawal))])
        await wait_until(lambda: second.facts.book().contradicted("Lossless/m") is not None, timeout=30,
                         message="the withdrawal followed")  # fmt: skip
        await send_records(settings, RESPONSES_TOPIC, [_r1(_answer("plain2", PLAIN_TEXT, "Lossless"))])
        dead = await read_records(settings, settings.kafka.topic(DEAD_LETTER_TOPIC), 1)
        await wait_until(lambda: second.processed >= 2, timeout=60, message="both answers processed")
    finally:
        second.stop()
        await asyncio.wait_for(task, 60)
        await second.close()
    (letter,) = dead
    assert letter.key == b"math:plain2"
    assert header(letter.headers, DLQ_HEADERS.REASON) == "provider_fact_contradicted"
    message = header(letter.headers, DLQ_HEADERS.MESSAGE) or ""
    assert "Lossless/m|content_start" in message and "math:showing" in message and "math:elsewhere" in message


async def test_an_answer_refused_before_its_upstreams_fact_is_accepted_on_dlq_replay(
    settings_factory: Callable[..., Settings],
) -> None:
    """The stored answer goes back to ``responses`` from its dead letter: no request, the fact now pins it."""
    from services.dlq.app import replay
    from services.dlq.core import Filters

    settings = settings_factory(stage={"batch_max": 1, "batch_timeout_ms": 50})
    await ensure_topics(settings.kafka)
    worker = create_app(settings, profiles={"deepseek-r1": deepseek()})
    await worker.start()
    task = asyncio.create_task(worker.run())
    try:
        await send_records(settings, RESPONSES_TOPIC, [_r1(_answer("plain", PLAIN_TEXT, "Lossless"))])
        (letter,) = await read_records(settings, settings.kafka.topic(DEAD_LETTER_TOPIC), 1)
        assert header(letter.headers, DLQ_HEADERS.REASON) == "whitespace_ambiguous"
        await send_records(settings, RESPONSES_TOPIC, [_r1(_answer("showing", SHOWING_TEXT, "Lossless"))])
        await read_records(settings, settings.kafka.topic(SAMPLES_TOPIC), 1)
        report = await replay(settings, Filters(stage="reconstruct", reason="whitespace_ambiguous"))
        assert [p.record.key for p in report.replayed] == [b"math:plain"]
        samples = await read_records(settings, settings.kafka.topic(SAMPLES_TOPIC), 2)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 60)
        await worker.close()
    plain = {r.key: decode(r.value, SampleReconstructed) for r in samples}[b"math:plain"]
    assert list(plain.output_ids) == r1_ids(PLAIN_TEXT + R1_EOS)
