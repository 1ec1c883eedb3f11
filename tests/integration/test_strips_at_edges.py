"""A stripping server declared lossless, on a real broker: caught, recorded, shown by ``status``, 0 wrong.

SGLang before 2026 (``.strip()`` of the content) behind ``kind = "openai"`` with no convention:
the default ``vllm`` convention says nothing is stripped. Truth: R1's raw text encoded by the
real tokenizer (tests/unit/test_verify.py): three answers whose counts show the strip come first,
the one whose count cannot (``"\\n\\n" + " trailing"`` and ``"trailing"`` are as many ids) after them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from rich.console import Console

from schemas import (
    DEAD_LETTER_TOPIC,
    DLQ_HEADERS,
    PROVIDER_FACTS_TOPIC,
    RESPONSES_TOPIC,
    SAMPLES_TOPIC,
    ProviderFactRecorded,
    SampleReconstructed,
    decode,
)
from services.common.config import Settings
from services.common.kafka import ensure_topics, header
from services.common.topics import read_compacted
from services.reconstruct.app import create_app
from services.status.app import collect
from services.status.core import render
from tests.integration.test_provider_facts import _r1
from tests.kafka_fixture import read_records, send_records, wait_until
from tests.unit.test_profiles import deepseek
from tests.unit.test_verify import (
    COINCIDENT_CONTENT,
    COINCIDENT_REASONING,
    _stripped,
    telling_answers,
)

pytestmark = pytest.mark.kafka


async def test_a_stripping_server_declared_lossless_is_caught_recorded_and_shown(
    settings_factory: Callable[..., Settings],
) -> None:
    settings = settings_factory(stage={"batch_max": 1, "batch_timeout_ms": 50})
    await ensure_topics(settings.kafka)
    telling = telling_answers("telling")
    coincident, _ = _stripped("coincident", COINCIDENT_REASONING, COINCIDENT_CONTENT)
    worker = create_app(settings, profiles={"deepseek-r1": deepseek()})
    await worker.start()
    task = asyncio.create_task(worker.run())
    try:
        # Keys spread over partitions, whose order no one keeps: the telling answers first, then the other.
        await send_records(settings, RESPONSES_TOPIC, [*map(_r1, telling)])
        await wait_until(lambda: worker.facts.book().strips("openai/m") is not None, timeout=60,
                         message="the strips_at_edges fact")  # fmt: skip
        await send_records(settings, RESPONSES_TOPIC, [_r1(coincident)])
        await wait_until(lambda: worker.processed >= 4, timeout=60, message="every answer processed")
        dead = await read_records(settings, settings.kafka.topic(DEAD_LETTER_TOPIC), 2)
        samples = await read_records(settings, settings.kafka.topic(SAMPLES_TOPIC), 0)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 60)
        await worker.close()
    facts = {k.decode(): decode(v, ProviderFactRecorded) for k, v in (await read_compacted(
        settings.kafka, settings.kafka.topic(PROVIDER_FACTS_TOPIC))).values.items()}  # fmt: skip
    fact = facts["openai/m|strips_at_edges"]
    evidence = fact.evidence.encode()
    assert evidence in {b"math:telling0", b"math:telling1", b"math:telling2"} and "content_start" in fact.reason
    reasons = {letter.key: header(letter.headers, DLQ_HEADERS.REASON) for letter in dead}
    # Accepted with wrong ids under the rule that trusted the count; refused once the server was caught.
    assert reasons.pop(b"math:coincident") == "whitespace_ambiguous"
    assert reasons[evidence] == "whitespace_stripped" and set(reasons.values()) == {"whitespace_stripped"}
    # The telling answers judged before the catch are samples that miss their counts (the audit's usage_matches
    # refuses them); the one whose batch caught the server, and any after it, are refused here.
    assert len(samples) + len(reasons) == 3 and not {r.key for r in samples} & set(reasons)
    for record in samples:
        sample = decode(record.value, SampleReconstructed)
        assert len(sample.output_ids) != sample.response.usage.completion_tokens


    snapshot = await collect(settings)
    assert snapshot.strips["openai/m"].evidence == fact.evidence
    console = Console(record=True, width=240)
    console.print(render(snapshot))
    shown = console.export_text()
    assert "upstreams caught stripping (strips_at_edges): 1" in shown
    assert "openai/m" in shown and fact.evidence in shown
