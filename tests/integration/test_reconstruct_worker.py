"""The reconstruct worker on a real broker: responses in, samples out, bad records dead-lettered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from schemas import (
    DEAD_LETTER_TOPIC,
    DLQ_HEADERS,
    RESPONSES_TOPIC,
    SAMPLES_TOPIC,
    SampleReconstructed,
    decode,
    encode,
)
from services.common.config import Settings
from services.common.kafka import ensure_topics, header
from services.common.metrics import RECONSTRUCTED
from services.reconstruct.app import create_app
from tests.kafka_fixture import read_records, send_records, wait_until
from tests.unit.test_profiles import deepseek, qwen
from tests.unit.test_reconstruct import response, tc

pytestmark = pytest.mark.kafka


async def test_worker_rebuilds_and_dead_letters(settings_factory: Callable[..., Settings]) -> None:
    settings = settings_factory(stage={"batch_max": 3, "batch_timeout_ms": 50})
    await ensure_topics(settings.kafka)
    ds, qw = deepseek(), qwen()
    r1 = "deepseek-r1"
    good1 = response(sample_id="good1", profile=r1)
    raw_call = '\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
    qwen_good = response(sample_id="qwen1", content=raw_call, profile="qwen3")
    empty = response(sample_id="empty", reasoning="", content="", profile=r1)
    bad_args = response(sample_id="badargs", tool_calls=[tc("calc", "{oops")], profile=r1)
    unknown = response(sample_id="unknown", profile="no-such-profile")
    good2 = response(sample_id="good2", content="Four.", profile=r1)
    records = [
        (b"math:good1", encode(good1)),
        (b"math:poison", b"\x00 not json"),
        (b"math:qwen1", encode(qwen_good)),
        (b"math:empty", encode(empty)),
        (b"math:badargs", encode(bad_args)),
        (b"math:unknown", encode(unknown)),
        (b"math:good2", encode(good2)),
    ]
    before = RECONSTRUCTED.labels(dataset="math", method="reencode")._value.get()
    await send_records(settings, RESPONSES_TOPIC, records)

    service = create_app(settings, profiles={"deepseek-r1": ds, "qwen3": qw})
    await service.start()
    task = asyncio.create_task(service.run())
    try:
        samples = await read_records(settings, settings.kafka.topic(SAMPLES_TOPIC), 3)
        dead = await read_records(settings, settings.kafka.topic(DEAD_LETTER_TOPIC), 4)
        await wait_until(
            lambda: service.processed >= len(records), timeout=60, message="all records processed"
        )
    finally:
        service.stop()
        await asyncio.wait_for(task, 60)
        await service.close()

    by_key = {r.key: decode(r.value, SampleReconstructed) for r in samples}
    assert set(by_key) == {b"math:good1", b"math:qwen1", b"math:good2"}
    s1 = by_key[b"math:good1"]
    assert s1.profile == "deepseek-r1" and s1.method == "reencode"
    assert ds.decode(s1.output_ids) == "Let me think.\n</think>\n\nThe answer is 4.<｜end▁of▁sentence｜>"
    assert s1.loss_mask == [0] * len(s1.prompt_ids) + [1] * len(s1.output_ids)
    q = by_key[b"math:qwen1"]
    assert q.profile == "qwen3" and q.output_ids[-1] == 151645 and 151657 in q.output_ids
    assert ds.decode(by_key[b"math:good2"].output_ids).endswith("Four.<｜end▁of▁sentence｜>")

    reasons = {r.key: header(r.headers, DLQ_HEADERS.REASON) for r in dead}
    assert reasons == {
        b"math:poison": "invalid_json",
        b"math:empty": "empty_response",
        b"math:badargs": "invalid_tool_arguments",
        b"math:unknown": "unknown_profile",
    }
    sent = dict(records)
    for r in dead:
        assert r.value == sent[r.key]  # byte for byte
        assert header(r.headers, DLQ_HEADERS.STAGE) == "reconstruct"
        assert header(r.headers, DLQ_HEADERS.TOPIC) == settings.kafka.topic(RESPONSES_TOPIC)
    assert RECONSTRUCTED.labels(dataset="math", method="reencode")._value.get() - before == 3
