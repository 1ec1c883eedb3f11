"""Issue 56's acceptance: a replay that fails again is the same prompt, not a new failure.

A real broker, the simulator over real HTTP, every stage and the budget in this process. The
reconstruct stage is configured with a profile that does not exist (``qwen-3``), so each of 10
paid answers is a reconstruct dead letter. Replayed twice to reconstruct, each fails again: 30
dead letters on the topic, 10 prompts. Then:

- ``status`` (``collect``) counts 10 dead-lettered prompts, and the budget's yield is over 10
  verdicts (0% of 10), not 30;
- ``dlq list`` lists 10 keys, ``dlq list --all`` 30 records (the real command);
- the budget projects 0 prompts left: none waits, the replays were answered, also after a replay
  ``--to inference`` answered from the response store (nothing paid, 10 more records on the prompts
  topic);
- ``dlq replay --to inference --fresh`` pays the provider again for each of the 10 (the simulator
  counts 20 requests) and the budget counts those answers under the cap (20 responses, their
  completion tokens added); the answers fail again and are still 10 prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from schemas import GLOBAL_SCOPE
from services.audit.app import create_app as audit_app
from services.budget.app import create_app as budget_app
from services.cli import app
from services.common.kafka import ensure_topics
from services.control import read_budget_snapshots
from services.dlq.app import replay
from services.dlq.core import Filters
from services.inference.app import create_app as inference_app
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from services.status.app import collect
from tests.e2e.harness import Pipeline, dead_letters, end_offsets, produce, prompt_value
from tests.e2e.test_money_safety import FAST, paid, provider

pytestmark = pytest.mark.e2e

DATASET = "replayed"
N = 10
CAP = 1_000_000


async def test_replays_that_fail_again_count_each_prompt_once_and_a_fresh_one_is_paid(
    settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    sim = await start_simulator(SimulatorOptions(**FAST))
    datasets = {"profile": "qwen-3", "cap_completion_tokens": CAP}
    wrong = settings_factory(provider=provider(sim), datasets={DATASET: datasets})
    answering = settings_factory(
        provider=provider(sim), datasets={DATASET: {**datasets, "profile": "qwen3"}},
        kafka={"topic_prefix": wrong.kafka.topic_prefix},
    )
    await ensure_topics(wrong.kafka, [DATASET])
    config = tmp_path / "draftstream.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = "{wrong.kafka.bootstrap_servers}"\ntopic_prefix = "{wrong.kafka.topic_prefix}"\n'
    )

    async def letters(count: int) -> bool:
        return len(await dead_letters(wrong)) >= count

    async def budget_read_all() -> bool:
        """The budget's last checkpoint covers every dead letter and every prompt the inference group took."""
        snaps = await read_budget_snapshots(wrong)
        total, ours = snaps.get(GLOBAL_SCOPE), snaps.get(DATASET)
        if total is None or ours is None or ours.remaining_prompts != 0:
            return False
        ends = await end_offsets(wrong, wrong.kafka.topic("dead-letter"))
        return all(total.offsets.get(f"dead-letter:{p}", 0) >= end for p, end in ends.items())

    pipeline = Pipeline()
    try:
        await pipeline.start("budget", budget_app(wrong, checkpoint_interval_s=0.2, prompts_refresh_s=0.3))
        await pipeline.start("inference", inference_app(answering))
        await pipeline.start("reconstruct", reconstruct_app(wrong))
        await pipeline.start("audit", audit_app(wrong))
        await pipeline.start("sink", sink_app(wrong))
        await produce(wrong, wrong.kafka.prompts_topic(DATASET), [prompt_value(DATASET, i) for i in range(N)])
        await pipeline.wait(lambda: letters(N), 120, "every answer a reconstruct dead letter")
        await replay(wrong, Filters(stage="reconstruct"))
        await pipeline.wait(lambda: letters(2 * N), 120, "the first replay failed again")
        await replay(wrong, Filters(stage="reconstruct"))
        await pipeline.wait(lambda: letters(3 * N), 120, "the second replay failed again")
        await pipeline.wait(budget_read_all, 60, "the budget counted every dead letter")

        status = await collect(wrong)
        snaps = await read_budget_snapshots(wrong)
        runner = CliRunner()
        # The commands run their own event loop: in a thread, as from a shell.
        listed = await asyncio.to_thread(runner.invoke, app, ["dlq", "list", "-c", str(config)], terminal_width=200)
        listed_all = await asyncio.to_thread(
            runner.invoke, app, ["dlq", "list", "--all", "-c", str(config)], terminal_width=200
        )
        before = snaps[DATASET]
        would = await asyncio.to_thread(
            runner.invoke, app,
            ["dlq", "replay", "--stage", "reconstruct", "--to", "inference", "--dry-run", "-c", str(config)],
            terminal_width=200,
        )

        # Back through inference without --fresh: answered from the response store, nothing paid;
        # the prompts topic grows by 10 records, and still no prompt waits.
        reused = await replay(wrong, Filters(stage="reconstruct"), to="inference")
        await pipeline.wait(lambda: letters(4 * N), 120, "the reused answers failed again")
        await pipeline.wait(budget_read_all, 60, "the budget counted the reused answers")
        after_reuse = (await read_budget_snapshots(wrong))[DATASET]
        paid_before = sum(paid(sim).values())

        fresh = await replay(wrong, Filters(stage="reconstruct"), to="inference", fresh=True, max_replays=5)
        await pipeline.wait(lambda: letters(5 * N), 120, "the fresh answers failed again")
        await pipeline.wait(budget_read_all, 60, "the budget counted the fresh answers")
        after = (await read_budget_snapshots(wrong))[DATASET]
        status_after = await collect(wrong)
        paid_after = sum(paid(sim).values())
    finally:
        await pipeline.stop()
        await sim.close()

    line = report(
        dead_letter_records=status.topic_records.get(wrong.kafka.topic("dead-letter")),
        status_dead_lettered=sum(status.dead_letters.values()),
        yield_window=before.quality.window_verdicts if before.quality else None,
        verdicts=before.quality.verdicts if before.quality else None,
        reused_replayed=len(reused.replayed),
        fresh_replayed=len(fresh.replayed),
        paid_before=paid_before,
        paid_after=paid_after,
        responses_before=before.responses,
        responses_after=after.responses,
        tokens_before=before.completion_tokens,
        tokens_after=after.completion_tokens,
    )

    def words(text: str) -> str:
        return " ".join(text.split())  # a title wraps at the terminal's width

    assert status.topic_records.get(wrong.kafka.topic("dead-letter")) == 3 * N, line
    assert dict(status.dead_letters) == {("reconstruct", "unknown_profile"): N}, line
    assert before.quality is not None and (before.quality.verdicts, before.quality.window_verdicts) == (N, N), line
    assert before.quality.window_accepted == 0 and before.remaining_prompts == 0, line
    assert listed.exit_code == 0 and listed_all.exit_code == 0, listed.output + listed_all.output
    assert would.exit_code == 0 and f"would replay {N} of {3 * N}" in words(would.output), would.output
    assert "from its response store (the answers already paid for, no new charge); add --fresh" in words(
        would.output
    )
    topic = wrong.kafka.topic("dead-letter")
    title = f"keys dead-lettered, not accepted (latest per key; --all for every record) on {topic}: {N}"
    assert title in words(listed.output)
    assert f"dead letters on {topic}: {3 * N}" in words(listed_all.output)
    row = next(ln for ln in listed.output.splitlines() if "unknown_profile" in ln)
    assert f" {N} " in row, listed.output
    # The reused answers cost nothing and left no prompt waiting (the projection counts the prompts
    # the inference group has not consumed, not records on the topic less the answers paid for).
    assert len(reused.replayed) == N and paid_before == N, line
    assert after_reuse.responses == N and after_reuse.remaining_prompts == 0, line
    # Only the latest dead letter of each key was still to replay: 10 fresh answers, paid and counted.
    assert len(fresh.replayed) == N and paid_after == 2 * N, line
    assert after.responses == 2 * N and after.completion_tokens > before.completion_tokens, line
    assert after.cap_completion_tokens == CAP and after.completion_tokens <= CAP, line
    assert sum(status_after.dead_letters.values()) == N, line
