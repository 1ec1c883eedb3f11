"""The audit worker on a real broker: good → accepted, bad → dead letter with every code."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from schemas import (
    ACCEPTED_TOPIC,
    DEAD_LETTER_TOPIC,
    DLQ_HEADERS,
    SAMPLES_TOPIC,
    SampleAudited,
    decode,
    encode,
)
from services.audit.app import create_app
from services.common.config import Settings
from services.common.kafka import ensure_topics, header
from tests.kafka_fixture import read_records, send_records
from tests.unit.test_audit_checks import make
from tests.unit.test_audit_support import deepseek

pytestmark = pytest.mark.kafka


async def test_audit_worker_routes_good_bad_and_poison(settings_factory: Callable[..., Settings]) -> None:
    settings = settings_factory(stage={"batch_max": 4, "batch_timeout_ms": 50})
    await ensure_topics(settings.kafka)
    profile = deepseek()
    good1 = make(profile)
    good1.sample_id = good1.response.sample_id = "good1"
    bad = make(profile, content="", finish="tool_calls")  # no answer, and no tool call either
    bad.sample_id = bad.response.sample_id = "bad"
    unknown = make(profile)
    unknown.sample_id, unknown.profile = "unknown", "no-such-profile"
    out_of_vocab = make(profile, output_ids=[200_000, 1])
    out_of_vocab.sample_id = "oov"
    good2 = make(profile, content="world")
    good2.sample_id = good2.response.sample_id = "good2"

    records = [
        (b"math:good1", encode(good1)),
        (b"math:bad", encode(bad)),
        (b"math:poison", b"\x00 not json"),
        (b"math:unknown", encode(unknown)),
        (b"math:oov", encode(out_of_vocab)),
        (b"math:good2", encode(good2)),
    ]
    await send_records(settings, SAMPLES_TOPIC, records)

    service = create_app(settings)
    await service.start()
    task = asyncio.create_task(service.run())
    try:
        accepted = await read_records(settings, settings.kafka.topic(ACCEPTED_TOPIC), 2)
        dead = await read_records(settings, settings.kafka.topic(DEAD_LETTER_TOPIC), 4)
    finally:
        service.stop()
        await asyncio.wait_for(task, 60)
        await service.close()

    assert sorted(r.key for r in accepted) == [b"math:good1", b"math:good2"]
    for r in accepted:
        verdict = decode(r.value, SampleAudited)
        assert verdict.passed and verdict.reasons == []
        assert any(c.code == "roundtrip" and c.message == "exact" for c in verdict.results)

    by_key = {r.key: r for r in dead}
    assert set(by_key) == {b"math:bad", b"math:poison", b"math:unknown", b"math:oov"}
    sent = dict(records)
    for key, r in by_key.items():
        assert r.value == sent[key]  # byte for byte
        assert header(r.headers, DLQ_HEADERS.STAGE) == "audit"
    bad_headers = by_key[b"math:bad"].headers
    assert header(bad_headers, DLQ_HEADERS.REASON) == "content_nonempty"
    assert header(bad_headers, DLQ_HEADERS.REASONS) == "content_nonempty,finish_stop"
    assert "finish reason 'tool_calls'" in (header(bad_headers, DLQ_HEADERS.MESSAGE) or "")
    assert header(by_key[b"math:poison"].headers, DLQ_HEADERS.REASON) == "invalid_json"
    assert header(by_key[b"math:unknown"].headers, DLQ_HEADERS.REASON) == "unknown_profile"
    assert header(by_key[b"math:oov"].headers, DLQ_HEADERS.REASON) == "ids_in_vocab"
    assert service.runner.processed == len(records)
