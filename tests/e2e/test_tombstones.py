"""Tombstones: a record without a value on every stage's input topic, dead-lettered and replayed.

A real broker and every stage in this process (inference against the simulator over HTTP,
reconstruct, audit, sink, budget). A tombstone must become one dead letter per stage that
reads its topic, with a null value (never ``b""``) and the ``VALUE_NULL`` header; ``dlq
replay`` must send a tombstone back (value null), which every reading stage dead-letters
again for the same reason, with the replay count raised; no stage may die.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from schemas import DLQ_HEADERS
from services.common.kafka import ensure_topics, header
from services.dlq.app import replay
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.e2e.harness import Pipeline, dead_letters, produce, read_all

pytestmark = pytest.mark.e2e

DATASET = "tomb"
# Input topic (logical) -> the stages that read it.
READERS: dict[str, tuple[str, ...]] = {
    "prompts": ("inference",),
    "responses": ("reconstruct", "budget"),
    "samples": ("audit",),
    "accepted": ("sink",),
    "requests": ("budget",),
}


def _physical(settings: Any, logical: str) -> str:
    return str(settings.kafka.prompts_topic(DATASET) if logical == "prompts" else settings.kafka.topic(logical))


async def test_tombstones_stay_null_through_dead_letters_and_replay(settings_factory: Callable[..., Any]) -> None:
    sim = await start_simulator(SimulatorOptions(reasoning_tokens=(4, 8), content_tokens=(4, 8), seed=5))
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 4, "max_attempts": 1},
        datasets={DATASET: {}},
        stage={"batch_max": 16, "batch_timeout_ms": 50},
    )
    await ensure_topics(settings.kafka, [DATASET])
    topics = {logical: _physical(settings, logical) for logical in READERS}
    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "inference", "reconstruct", "audit", "sink", "budget")
        for logical, topic in topics.items():
            await produce(settings, topic, [(f"{DATASET}:tomb-{logical}".encode(), None)])
        first_count = sum(len(stages) for stages in READERS.values())

        async def letters_at_least(n: int) -> bool:
            return len(await dead_letters(settings)) >= n

        await pipeline.wait(lambda: letters_at_least(first_count), 120, "every tombstone dead-lettered")
        first = await dead_letters(settings)
        expected = Counter((stage, f"{DATASET}:tomb-{logical}") for logical, ss in READERS.items() for stage in ss)
        assert Counter((d.stage, d.key) for d in first) == expected
        for d in first:
            assert d.value is None, f"{d.stage} dead-lettered a tombstone with value {d.value!r}"
            assert header(d.headers, DLQ_HEADERS.VALUE_NULL) == "true", d
            assert d.reason == "empty_record", d
            assert d.topic == topics[d.key.removeprefix(f"{DATASET}:tomb-")]

        report = await replay(settings)
        assert len(report.replayed) == first_count and all(p.payload is None for p in report.replayed)
        # Each replayed dead letter sends one tombstone to its topic; each reader fails it again.
        second_count = sum(len(ss) * len(ss) for ss in READERS.values())
        await pipeline.wait(lambda: letters_at_least(first_count + second_count), 120, "replayed tombstones")
        pipeline.check_alive()
    finally:
        await pipeline.stop()
        await sim.close()

    on_topics = await read_all(settings, *topics.values())
    for logical, topic in topics.items():
        replayed = [r for r in on_topics[topic] if header(list(r.headers or ()), DLQ_HEADERS.REPLAY_COUNT) == "1"]
        assert len(replayed) == len(READERS[logical]), (topic, replayed)
        assert all(r.value is None for r in replayed), f"a replay sent {[r.value for r in replayed]!r} to {topic}"
    letters = await dead_letters(settings)
    assert len(letters) == first_count + second_count, Counter((d.stage, d.key) for d in letters)
    again = [d for d in letters if header(d.headers, DLQ_HEADERS.REPLAY_COUNT) == "1"]
    assert Counter(d.stage for d in again) == Counter(
        stage for ss in READERS.values() for _ in ss for stage in ss
    )
    for d in again:
        assert d.value is None and header(d.headers, DLQ_HEADERS.VALUE_NULL) == "true", d
        assert d.reason == "empty_record", d
