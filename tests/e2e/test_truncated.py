"""``[datasets.NAME.audit] accept_truncated``: an answer cut at ``max_tokens`` kept, flagged, everywhere.

A real broker, the simulator over real HTTP (logprobs on, so the cut ids are exact) and
every stage. Two datasets get the same prompts with a ``max_tokens`` far below what the
simulator generates, so every answer is cut (``finish_reason: length``):

- ``cut`` sets ``accept_truncated = true``: every prompt is accepted, its output ids equal
  the simulator's own truth (the ids it generated up to the cut, ``GET /_sim/truth``), the
  sink row says ``metadata.truncated: true``, each export carries the flag, and ``status``
  counts them apart;
- ``plain`` keeps the default: every prompt is dead-lettered ``finish_stop``, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.common.kafka import ensure_topics
from services.export.app import export
from services.publish.app import publish
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.status.app import collect
from tests.e2e.harness import Pipeline, dead_letters, sink_rows
from tests.e2e.test_pipeline_truth import write_prompts

pytestmark = pytest.mark.e2e

N_PROMPTS = 12
MAX_TOKENS = 12  # the simulator writes 40-80 reasoning ids: every answer is cut


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


async def test_truncated_answers_are_accepted_flagged_and_exported_only_where_asked(
    settings_factory: Callable[..., Any], tmp_path: Path
) -> None:
    sim = await start_simulator(
        SimulatorOptions(seed=3, reasoning_tokens=(40, 80), content_tokens=(10, 20), logprobs=True, keep_truth=True)
    )
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 16, "request_logprobs": True, "backoff_initial_s": 0.05},
        datasets={
            "cut": {"max_tokens": MAX_TOKENS, "audit": {"usage_offset": 0, "accept_truncated": True}},
            "plain": {"max_tokens": MAX_TOKENS, "audit": {"usage_offset": 0}},
        },
    )
    out_dir = Path(settings.sink.out_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", N_PROMPTS)
    await ensure_topics(settings.kafka, ["cut", "plain"])
    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "inference", "reconstruct", "audit", "sink")
        for dataset in ("cut", "plain"):
            assert (await publish(settings, [prompts], dataset=dataset)).published == N_PROMPTS

        async def settled() -> bool:
            done = {r["id"] for r in sink_rows(out_dir)} | {d.key for d in await dead_letters(settings)}
            return len(done) >= 2 * N_PROMPTS

        await pipeline.wait(settled, 180, "every prompt accepted or dead-lettered")
    finally:
        await pipeline.stop()
        truths = sim.truth()
        await sim.close()

    rows = {r["id"]: r for r in sink_rows(out_dir)}
    letters = await dead_letters(settings)
    # With the setting: every cut answer accepted, flagged, its ids the simulator's own up to the cut.
    assert sorted(rows) == sorted(f"cut:q{i:04d}" for i in range(N_PROMPTS)), sorted(rows)
    for key, row in rows.items():
        assert row["metadata"]["finish_reason"] == "length" and row["metadata"]["truncated"] is True, key
        assert row["output_ids"] == truths[key] and len(row["output_ids"]) == MAX_TOKENS, key
        finish = next(c for c in row["metadata"]["audit"]["checks"] if c["code"] == "finish_stop")
        assert finish["passed"] and "accept_truncated" in finish["message"]
    # Without it: dead-lettered finish_stop, as before.
    assert sorted(d.key for d in letters) == sorted(f"plain:q{i:04d}" for i in range(N_PROMPTS))
    assert {(d.stage, d.reason) for d in letters} == {("audit", "finish_stop")}

    # Every export carries the flag.
    hf = export("hf", out_dir, tmp_path / "hf")
    spec = export("speculators", out_dir, tmp_path / "spec", merge=True)
    forge = export("specforge", out_dir, tmp_path / "forge", settings=settings)
    exported = {
        "hf": [r["metadata"]["truncated"] for f in hf.files for r in jsonl(f)],
        "speculators": [r["truncated"] for f in spec.files for r in jsonl(f)],
        "specforge": [r["truncated"] for f in forge.files for r in jsonl(f)],
    }
    assert exported == {name: [True] * N_PROMPTS for name in exported}, exported

    # status counts them apart.
    snapshot = await collect(settings)
    assert snapshot.accepted_truncated == {"cut": N_PROMPTS}
