"""Hostile input: malformed records fed straight onto every stage's input topic.

The whole pipeline runs (inference against the simulator over HTTP, reconstruct, audit,
sink, budget) on a real broker. Good prompts flow before and among the poison; every poison
record must end as exactly one dead letter per stage that reads it, with the specific reason
code of the corpus (tests/e2e/hostile_corpus.py), its value byte for byte; no stage may die
or loop; every good prompt must be accepted. Control records with unknown actions are
logged and ignored, never taken as a resume.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import Halt, Resume, encode
from services.audit.app import create_app as audit_app
from services.budget.app import create_app as budget_app
from services.common.kafka import ensure_topics
from services.inference.app import InferenceWorker
from services.inference.app import create_app as inference_app
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from tests.e2e.harness import Pipeline, accepted_keys, dead_letters, produce, prompt_value
from tests.e2e.hostile_corpus import CONTROL_POISON, corpus

pytestmark = pytest.mark.e2e

DATASET = "hostile"
HALTED = "halted"
N_GOOD = 40


def _topic(settings: Any, logical: str) -> str:
    if logical == "prompts":
        return str(settings.kafka.prompts_topic(DATASET))
    return str(settings.kafka.topic(logical))


async def test_poison_records_become_dead_letters_and_good_ones_flow(
    settings_factory: Callable[..., Any], report: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """>= 25 malformed records per kind, on every input topic: each a dead letter with its reason."""
    sim = await start_simulator(SimulatorOptions(reasoning_tokens=(4, 16), content_tokens=(4, 16), seed=3))
    audit_cfg = {"usage_offset": 0}
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 16, "max_attempts": 2, "backoff_initial_s": 0.05},
        datasets={DATASET: {"audit": audit_cfg}, HALTED: {"audit": audit_cfg}},
        stage={"batch_max": 16, "batch_timeout_ms": 50},
    )
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, [DATASET, HALTED])
    poison = corpus(DATASET)
    assert len(poison) >= 25
    pipeline = Pipeline()
    try:
        worker = await pipeline.start("inference", inference_app(settings))
        assert isinstance(worker, InferenceWorker)
        await pipeline.start("reconstruct", reconstruct_app(settings))
        await pipeline.start("audit", audit_app(settings))
        await pipeline.start("sink", sink_app(settings))
        await pipeline.start("budget", budget_app(settings))

        def accepted() -> set[str]:
            return set(accepted_keys(out_dir))

        # Phase 1: good prompts alone.
        good_a = [prompt_value(DATASET, i) for i in range(N_GOOD)]
        t0 = time.monotonic()
        await produce(settings, _topic(settings, "prompts"), good_a)
        keys_a = {k.decode() for k, _ in good_a}
        await pipeline.wait(lambda: keys_a <= accepted(), 180, "clean prompts accepted")
        clean_rate = N_GOOD / (time.monotonic() - t0)

        # Phase 2: the same number of good prompts, interleaved with the poison on every topic.
        good_b = [prompt_value(DATASET, i) for i in range(N_GOOD, 2 * N_GOOD)]
        by_topic: dict[str, list[Any]] = {}
        for p in poison:
            by_topic.setdefault(p.logical, []).append((p.key(DATASET), p.value))
        prompts_mix: list[Any] = []
        queue = list(by_topic.pop("prompts"))
        for i, good in enumerate(good_b):
            prompts_mix.append(good)
            if i % 2 == 0 and queue:
                prompts_mix.append(queue.pop(0))
        prompts_mix.extend(queue)
        t0 = time.monotonic()
        await asyncio.gather(
            produce(settings, _topic(settings, "prompts"), prompts_mix),
            *(produce(settings, _topic(settings, logical), recs) for logical, recs in by_topic.items()),
        )
        keys_b = {k.decode() for k, _ in good_b}
        await pipeline.wait(lambda: keys_b <= accepted(), 240, "good prompts among the poison accepted")
        poisoned_rate = N_GOOD / (time.monotonic() - t0)
        expected_letters = sum(len(p.expected) for p in poison)

        async def all_letters() -> bool:
            return len(await dead_letters(settings)) >= expected_letters

        await pipeline.wait(all_letters, 120, "every poison record dead-lettered")

        # Phase 3: control. A halt, then records with unknown/malformed actions for the same
        # scope, then a marker halt of another scope: once the marker is applied, the bad
        # records before it were read too, and the halt must still stand.
        control = settings.kafka.topic("control")
        await produce(settings, control, [(HALTED.encode(), encode(Halt(scope=HALTED, reason="test", by="test")))])
        await produce(settings, control, [(HALTED.encode(), value) for _, value in CONTROL_POISON])
        await produce(settings, control, [(b"marker", encode(Halt(scope="marker", reason="sync", by="test")))])
        await pipeline.wait(lambda: "marker" in worker.halted_scopes, 60, "marker halt applied")
        assert HALTED in worker.halted_scopes, f"a malformed control record lifted the halt: {worker.halted_scopes}"
        halted_key, halted_value = prompt_value(HALTED, 0)
        live = prompt_value(DATASET, 999)
        await produce(settings, settings.kafka.prompts_topic(HALTED), [(halted_key, halted_value)])
        await produce(settings, _topic(settings, "prompts"), [live])
        await pipeline.wait(lambda: live[0].decode() in accepted(), 120, "a prompt of a running dataset")
        assert halted_key.decode() not in sim.stats()["keys"], "a halted dataset's prompt reached the provider"
        assert HALTED in worker.halted_scopes
        await produce(settings, control, [(HALTED.encode(), encode(Resume(scope=HALTED, reason="test", by="test")))])
        await pipeline.wait(lambda: halted_key.decode() in accepted(), 120, "the halted prompt after resume")
        pipeline.check_alive()
    finally:
        await pipeline.stop()
        await sim.close()

    ignored = [
        r.getMessage() for r in caplog.records
        if r.name == "services.common.halts" and "ignoring control record" in r.getMessage()
    ]
    # Both followers of control (the inference worker and the budget) ignore each bad record once.
    assert len(ignored) == 2 * len(CONTROL_POISON) and len(set(ignored)) == len(CONTROL_POISON), ignored
    assert sum("unknown_action" in m for m in ignored) >= 2, ignored
    letters = await dead_letters(settings)
    by_stage_key = Counter((d.stage, d.key) for d in letters)
    keys = accepted_keys(out_dir)
    line = report(
        poison_records=len(poison),
        expected_dead_letters=expected_letters,
        dead_letters=len(letters),
        control_poison=len(CONTROL_POISON),
        good_prompts=2 * N_GOOD + 2,
        accepted=len(keys),
        duplicates=sum(1 for n in keys.values() if n > 1),
        good_per_s_clean=round(clean_rate, 2),
        good_per_s_with_poison=round(poisoned_rate, 2),
        reasons=dict(Counter(f"{d.stage}:{d.reason}" for d in letters)),
    )
    mismatches = []
    for p in poison:
        for stage, reason in p.expected.items():
            key = p.key(DATASET).decode()
            found = [d for d in letters if d.stage == stage and d.key == key]
            if len(found) != 1:
                mismatches.append(f"{p.logical}/{p.name}@{stage}: {len(found)} dead letters")
                continue
            (d,) = found
            if d.reason != reason:
                mismatches.append(f"{p.logical}/{p.name}@{stage}: reason {d.reason}, expected {reason}")
            if d.value != p.value:
                mismatches.append(f"{p.logical}/{p.name}@{stage}: value not kept byte for byte (null as null)")
    assert not mismatches, "\n".join(mismatches) + "\n" + line
    assert all(n == 1 for n in by_stage_key.values()), f"a record was dead-lettered twice: {line}"
    assert len(letters) == expected_letters, f"unexpected extra dead letters: {line}"
    poison_keys = {p.key(DATASET).decode() for p in poison}
    assert {d.key for d in letters} <= poison_keys, f"a good record was dead-lettered: {line}"
    good = {k.decode() for k, _ in good_a + good_b} | {live[0].decode(), halted_key.decode()}
    assert good <= set(keys), f"good prompts missing from the training files: {line}"
    assert all(n == 1 for n in keys.values()), line
