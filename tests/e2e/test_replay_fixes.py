"""Issue 7's end-to-end acceptance: fix the cause, replay the dead letters, accepted exactly once.

A real broker, the simulator over real HTTP, every stage in this process. The simulator's
``bad_usage`` fault makes ``usage_matches`` fail in the audit (the usage offset is
configured, so the check is exact), and ``truncate`` makes truncated answers fail for a
cause the fix does not touch. Then:

1. the cause is "fixed": the audit stage is restarted with ``usage_matches`` disabled
   for the dataset;
2. ``replay(settings, Filters(stage="audit"))`` re-sends every audit dead letter: the
   bad-usage samples are accepted, the truncated ones fail again (a new dead letter);
3. the same replay run a second time re-sends none of the first dead letters (the
   ledger remembers them), only the truncated samples' new ones, which fail again.

Asserts: no key twice in the sink files or on ``accepted``; every key ends in exactly one
place (a sink row, or dead letters only); every fixable sample is accepted after the
replay, no unfixable one is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import DLQ_HEADERS, SampleAudited, decode
from services.audit.app import create_app as audit_app
from services.common.kafka import ensure_topics, header
from services.common.service import Service
from services.dlq.app import replay
from services.dlq.core import Filters
from services.inference.app import create_app as inference_app
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from tests.e2e.harness import (
    DeadLetterRecord,
    Pipeline,
    accepted_keys,
    dead_letters,
    produce,
    prompt_value,
    read_all,
    small_prompt,
)

pytestmark = pytest.mark.e2e

DATASET = "fixme"
N_PROMPTS = 100
FIXED_CODE = "usage_matches"


async def restart(pipeline: Pipeline, name: str, service: Service) -> None:
    """Stop one running service of the pipeline (finishing its batch) and start its replacement."""
    old = pipeline.services.pop(name)
    task = pipeline.tasks.pop(name)
    old.stop()
    await task
    await old.close()
    await pipeline.start(name, service)


def audit_letters(letters: list[DeadLetterRecord]) -> list[DeadLetterRecord]:
    """The dead letters the audit stage wrote."""
    return [d for d in letters if d.stage == "audit"]


def reasons_of(letter: DeadLetterRecord) -> set[str]:
    """Every reason code of a dead letter (the primary and the full list)."""
    return {letter.reason, *(r for r in letter.reasons.split(",") if r)}


async def test_replay_after_fix_accepts_each_sample_exactly_once(
    settings_factory: Callable[..., Any], report: Callable[..., str]
) -> None:
    """Dead-lettered for a fixed cause → replayed → accepted once; replaying again changes nothing."""
    sim = await start_simulator(
        SimulatorOptions(
            seed=23,
            reasoning_tokens=(8, 30),
            content_tokens=(8, 20),
            rate_bad_usage=0.25,
            rate_truncate=0.10,
        )
    )
    provider = {"base_url": sim.url, "concurrency": 32}
    strict = settings_factory(provider=provider, datasets={DATASET: {"audit": {"usage_offset": 0}}})
    fixed = settings_factory(
        provider=provider,
        datasets={DATASET: {"audit": {"usage_offset": 0, "disabled_checks": [FIXED_CODE]}}},
    )
    assert fixed.kafka.topic_prefix == strict.kafka.topic_prefix
    out_dir = Path(strict.sink.out_dir)
    await ensure_topics(strict.kafka, [DATASET])
    keys = {f"{DATASET}:{small_prompt(DATASET, i).sample_id}" for i in range(N_PROMPTS)}

    async def settled(expected_audit_letters: int | None = None) -> bool:
        letters = await dead_letters(strict)
        done = set(accepted_keys(out_dir)) | {d.key for d in letters}
        if done != keys:
            return False
        return expected_audit_letters is None or len(audit_letters(letters)) >= expected_audit_letters

    pipeline = Pipeline()
    try:
        await pipeline.start("inference", inference_app(strict))
        await pipeline.start("reconstruct", reconstruct_app(strict))
        await pipeline.start("audit", audit_app(strict))
        await pipeline.start("sink", sink_app(strict))
        await produce(
            strict,
            strict.kafka.prompts_topic(DATASET),
            [prompt_value(DATASET, i) for i in range(N_PROMPTS)],
        )
        await pipeline.wait(settled, 150, "every prompt accepted or dead-lettered")

        first = audit_letters(await dead_letters(strict))
        fixable = {d.key for d in first if reasons_of(d) == {FIXED_CODE}}
        unfixable = {d.key for d in first} - fixable
        accepted_before = set(accepted_keys(out_dir))
        # A cut answer whose usage count is off is refused before the audit (truncated_tail_lost):
        # not an audit dead letter, not replayed here, dead for good.
        refused_early = {d.key for d in await dead_letters(strict) if d.stage != "audit"}

        # Fix the cause: the audit comes back with the check disabled for this dataset.
        await restart(pipeline, "audit", audit_app(fixed))
        first_replay = await replay(fixed, Filters(stage="audit"))
        # Accepted: the fixable ones; failed again: one new dead letter per unfixable one.
        await pipeline.wait(lambda: settled(len(first) + len(unfixable)), 120, "the replayed samples audited")
        await pipeline.wait(
            lambda: fixable <= set(accepted_keys(out_dir)), 60, "the fixed samples written by the sink"
        )

        second_replay = await replay(fixed, Filters(stage="audit"))
        await pipeline.wait(
            lambda: settled(len(first) + 2 * len(unfixable)), 120, "the second replay audited"
        )
    finally:
        await pipeline.stop()
        await sim.close()

    letters = await dead_letters(strict)
    final_audit = audit_letters(letters)
    accepted_topic = strict.kafka.topic("accepted")
    accepted_counts = Counter(
        f"{a.dataset}:{a.sample_id}"
        for a in (decode(r.value, SampleAudited) for r in (await read_all(strict, accepted_topic))[accepted_topic])
    )
    rows = accepted_keys(out_dir)
    dead_only = {d.key for d in letters} - set(rows)
    line = report(
        prompts=N_PROMPTS,
        accepted_first_pass=len(accepted_before),
        audit_dead_letters_first_pass=len(first),
        fixable=len(fixable),
        unfixable=len(unfixable),
        replayed_first=len(first_replay.replayed),
        replayed_second=len(second_replay.replayed),
        already_replayed_second=len(second_replay.already_replayed),
        sink_rows=sum(rows.values()),
        sink_keys=len(rows),
        dead_only_keys=len(dead_only),
        audit_dead_letters_final=len(final_audit),
        reasons_first=dict(Counter(d.reason for d in first)),
    )

    # The faults produced both kinds of dead letter, and the first pass accepted the rest.
    assert fixable and unfixable, f"need both fixable and unfixable dead letters: {line}"
    assert accepted_before.isdisjoint(fixable | unfixable), line

    # First replay: every audit dead letter was re-sent; the second re-sent none of those again,
    # only the unfixable samples' new dead letters.
    assert sorted(p.record.key_text for p in first_replay.replayed) == sorted(d.key for d in first), line
    first_ids = sorted(p.record.id for p in first_replay.replayed)
    assert sorted(r.id for r in second_replay.already_replayed) == first_ids, line
    assert sorted(p.record.key_text for p in second_replay.replayed) == sorted(unfixable), line
    assert all(p.record.replay_count == 1 for p in second_replay.replayed), line

    # Exactly once: no duplicate key in the sink files or on the accepted topic.
    assert all(n == 1 for n in rows.values()), f"a key written twice: {[k for k, n in rows.items() if n > 1]}"
    assert all(n == 1 for n in accepted_counts.values()), f"a key accepted twice: {line}"
    assert set(accepted_counts) == set(rows), line

    # Every key ends in exactly one place.
    assert set(rows) | dead_only == keys and set(rows).isdisjoint(dead_only), line
    assert set(rows) == accepted_before | fixable, line
    assert dead_only == unfixable | refused_early, line
    # The unfixable ones failed three times (original + two replays), never for the fixed check again.
    per_key = Counter(d.key for d in final_audit)
    assert all(per_key[k] == 3 for k in unfixable), line
    assert all(per_key[k] == 1 for k in fixable), line
    later = [d for d in final_audit if d.key in unfixable and int(header(d.headers, DLQ_HEADERS.REPLAY_COUNT) or 0)]
    assert len(later) == 2 * len(unfixable), line
    assert all(FIXED_CODE not in reasons_of(d) for d in later), line
