"""A worker SIGKILLed mid-run must not let the provider bill past a cap (real broker, simulator over HTTP).

The truth is the simulator's own count of what it billed (``/_sim/stats``: answers served,
and answers generated to the end for clients that went away, as a provider bills them),
never the budget's. The inference worker runs as a process of its own and is SIGKILLed
while its requests are in flight; a second one (another process, another worker id) takes
its prompts over. Answers of 2,000-15,000 tokens, ``max_tokens`` 16,384.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from services.budget.app import BudgetService
from services.budget.lost import snapshot_lost_lines
from services.common.config import Settings
from services.common.kafka import ensure_topics
from services.control import read_budget_snapshots
from tests.integration.test_budget_halt import publish_prompts
from tests.integration.test_budget_headroom import LONG, MAX_TOKENS, capped_halt, running_budget
from tests.kafka_fixture import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.long(30)]

REPO = Path(__file__).resolve().parents[2]
CAP = 400_000
PROMPTS = 90  # about 760k tokens of answers: the cap binds
PRICE = 2e-6  # the simulator's USD per completion token, and the budget's configured price
TIMEOUT_S = 4.0  # the in-flight TTL, past which a lost attempt no longer bills: (4 + 0.5) x 2 = 9 s


def worker_process(settings: Settings, concurrency: int) -> Any:
    """``draftstream run inference`` as a process of its own (a SIGKILL kills it, not the test);
    its request timeout is the settings' (the in-flight TTL's base)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "DRAFTSTREAM_PROVIDER__BASE_URL": settings.provider.base_url,
        "DRAFTSTREAM_PROVIDER__CONCURRENCY": str(concurrency),
        "DRAFTSTREAM_PROVIDER__TIMEOUT_S": str(settings.provider.timeout_s),
        "DRAFTSTREAM_PROVIDER__MAX_ATTEMPTS": "2",
        "DRAFTSTREAM_PROVIDER__BACKOFF_MAX_S": "0.5",
        "DRAFTSTREAM_DEFAULTS__MAX_TOKENS": str(MAX_TOKENS),
        "DRAFTSTREAM_METRICS__INFERENCE_PORT": "0",
    }
    env.pop("OPENROUTER_API_KEY", None)
    return asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "run", "inference", cwd=REPO, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )


@contextlib.asynccontextmanager
async def long_run(
    settings_factory: Callable[..., Settings], *, key_usage: bool, timeout_s: float = TIMEOUT_S
) -> AsyncIterator[tuple[Any, Settings]]:
    """The simulator (slow, long answers) and a capped dataset of :data:`PROMPTS` prompts."""
    from services.simulator.app import start_simulator
    from services.simulator.options import SimulatorOptions

    sim = await start_simulator(
        SimulatorOptions(latency_s=1.0, latency_jitter_s=1.5, price_per_token=PRICE, **LONG)  # type: ignore[arg-type]
    )
    try:
        settings = settings_factory(
            provider={"kind": "simulator", "base_url": sim.url, "concurrency": 12, "max_attempts": 2,
                      "timeout_s": timeout_s, "backoff_max_s": 0.5},
            datasets={"capped": {"cap_completion_tokens": CAP, "max_tokens": MAX_TOKENS}},
            budget={"lease_ttl_s": 2.0, "lease_grace_s": 0.5, "key_usage_interval_s": 0.5 if key_usage else 0.0,
                    "prices": {"qwen/qwen3-8b": {"completion": PRICE * 1e6}}},
        )
        await ensure_topics(settings.kafka, settings.datasets)
        await publish_prompts(settings, "capped", PROMPTS)
        yield sim, settings
    finally:
        await sim.close()


async def kill_mid_run(sim: Any, budget: BudgetService, settings: Settings, concurrency: int) -> int:
    """Start a worker process, SIGKILL it while requests are in flight; how many were open at the kill."""
    proc = await worker_process(settings, concurrency)
    killed = f"{socket.gethostname()}-{proc.pid}"  # the worker id it announces its attempts with

    def its_attempts_open() -> bool:
        # An attempt of this worker the budget holds as unanswered, open at the provider now:
        # the budget's view alone lags (an answer it has not read yet), and other workers'
        # requests count for nothing. Answers take 1-2.5 s: it is still open at the kill.
        scope = budget.ledger.scopes.get("capped")
        open_keys = sim.server.stats.open_keys
        return scope is not None and scope.responses >= 3 and any(
            held.worker == killed and attempt.rpartition("#")[0] in open_keys
            for attempt, held in scope.inflight.items()
        )

    try:
        await wait_until(lambda: its_attempts_open() and sim.server.stats.open >= 4, 90, 0.02,
                         message=f"attempts of {killed} in flight before the kill")
        open_at_kill = int(sim.server.stats.open)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    return open_at_kill


async def settled_billing(sim: Any) -> dict[str, Any]:
    """The simulator's stats once nothing is open and every abandoned generation was billed."""
    last: list[int] = []

    def quiet() -> bool:
        stats = sim.stats()
        billed = int(stats["completion_tokens"])
        last.append(billed)
        return sim.server.stats.open == 0 and len(last) > 15 and last[-15] == billed

    await wait_until(quiet, 60, 0.2, message="the simulator billed everything it generated")
    return sim.stats()


@pytest.mark.parametrize("key_usage", [True, False], ids=["key-usage", "no-key-usage"])
async def test_a_worker_killed_mid_run_leaves_billing_within_the_cap(
    settings_factory: Callable[..., Settings], key_usage: bool
) -> None:
    async with long_run(settings_factory, key_usage=key_usage) as (sim, settings), running_budget(settings) as budget:
        open_at_kill = await kill_mid_run(sim, budget, settings, concurrency=12)
        second = await worker_process(settings, 12)
        try:
            halt = await wait_until(lambda: capped_halt(settings), 180, 0.3, message="'capped' finished at its cap")
        finally:
            second.send_signal(signal.SIGTERM)
            await second.wait()
        stats = await settled_billing(sim)
        snap = (await read_budget_snapshots(settings))["capped"]
        lost = budget.ledger.lost_attempts("capped")
        billed = int(stats["completion_tokens"])
        lines = snapshot_lost_lines(snap)
        asked = sim.stats()["keys"]  # requests the provider got, per prompt
        paid_twice = sum(1 for n in asked.values() if n > 1)  # prompts the provider was asked twice
        # The prompts of the lost attempts the budget counts as paid again (an attempt key is
        # "<dataset>:<sample_id>#<attempt id>").
        repaid = {attempt.rpartition("#")[0] for attempt in budget.ledger.scopes["capped"].repaid}
    print(
        f"\nkey usage {key_usage}: billed {billed} of {CAP} ({billed / CAP:.4f}); {open_at_kill} open at the kill, "
        f"{stats['abandoned_billed']} billed after their client died; {len(lost)} lost attempts hold "
        f"{snap.lost_tokens}, {snap.lost_repaid} re-paid ({paid_twice} prompts asked twice at the provider, "
        f"{sum(1 for p in repaid if asked.get(p, 0) > 1)} of them re-paid ones); "
        f"budget spent {snap.completion_tokens}\n"
        f"halt: {halt.reason}\n" + "\n".join(lines)
    )
    assert billed <= CAP  # the provider's own count: zero overshoot
    assert stats["abandoned_billed"] >= 1, "no generation outlived its client: the kill tested nothing"
    assert lost, "the killed worker's attempts were not kept as lost"
    assert any("attempts lost with worker" in line and "counted at" in line for line in lines)
    assert "lost with worker(s)" in halt.reason
    # Every prompt counted as paid again was paid at the provider. Asked twice there, unless its
    # lost attempt was announced and the kill came before it went out: the budget holds an
    # announced attempt of a dead worker as sent (it cannot know otherwise), so the count is an
    # upper bound on what the provider was asked twice, never below it.
    assert snap.lost_repaid == len(budget.ledger.scopes["capped"].repaid) <= len(lost)
    assert all(asked.get(prompt, 0) >= 1 for prompt in repaid), sorted(p for p in repaid if p not in asked)
    if key_usage:
        # The key's usage released the lost attempts down to what they cost: the cap is used.
        assert snap.lost_tokens < sum(a.max_tokens for a in lost)
        assert billed >= CAP - 2 * MAX_TOKENS
    else:
        assert snap.lost_tokens == sum(a.max_tokens for a in lost)  # the worst case stands


async def test_one_of_three_workers_killed_leaves_billing_within_the_cap(
    settings_factory: Callable[..., Settings],
) -> None:
    # A longer request timeout: a surviving worker's request that times out on a busy machine is
    # held as lost too (it may have been billed), with that worker's id; this test is about the kill.
    async with long_run(settings_factory, key_usage=True, timeout_s=3 * TIMEOUT_S) as (sim, settings), \
            running_budget(settings) as budget:
        others = [await worker_process(settings, 4) for _ in range(2)]
        try:
            open_at_kill = await kill_mid_run(sim, budget, settings, concurrency=4)
            halt = await wait_until(lambda: capped_halt(settings), 180, 0.3, message="'capped' finished at its cap")
        finally:
            for proc in others:
                proc.send_signal(signal.SIGTERM)
            for proc in others:
                await proc.wait()
        stats = await settled_billing(sim)
        lost = budget.ledger.lost_attempts("capped")
    billed = int(stats["completion_tokens"])
    print(f"\n3 workers, one killed: billed {billed} of {CAP} ({billed / CAP:.4f}); {open_at_kill} open at the kill, "
          f"{stats['abandoned_billed']} billed after their client died, {len(lost)} lost; halt: {halt.reason}")
    assert billed <= CAP
    assert lost and len({a.worker for a in lost}) == 1  # only the killed worker's attempts are lost


async def test_a_budget_killed_and_restarted_rebuilds_the_lost_attempts(
    settings_factory: Callable[..., Settings],
) -> None:
    from services.budget.app import create_app as create_budget

    async with long_run(settings_factory, key_usage=False) as (sim, settings):
        budget = create_budget(settings, checkpoint_interval_s=0.2, prompts_refresh_s=0.5)
        await budget.start()
        task = asyncio.create_task(budget.run())
        second = None
        try:
            await kill_mid_run(sim, budget, settings, concurrency=12)
            second = await worker_process(settings, 12)
            # The killed worker's lease expires and its attempts are lost; then the budget dies too.
            await wait_until(lambda: budget.ledger.lost_attempts("capped"), 30, 0.1, message="attempts lost")
            # More may be lost a moment later (the killed worker's later requests): the crash comes
            # once the set has held for 0.5 s and a checkpoint begun after it was read has finished
            # (checkpoints run one after another: the second one begun after the read means the first is done).
            lost_before: set[tuple[str, float]] = set()
            while (now := {(a.worker, a.started_at) for a in budget.ledger.lost_attempts("capped")}) != lost_before:
                lost_before = now
                await asyncio.sleep(0.5)
            for _ in range(2):
                begun = budget._last_checkpoint  # noqa: SLF001 - when the budget's last checkpoint began
                await wait_until(lambda b=begun: budget._last_checkpoint != b, 30, 0.05, message="a checkpoint")  # noqa: SLF001
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await budget.abort()  # a crash: no final checkpoint
            async with running_budget(settings) as restarted:
                rebuilt = {(a.worker, a.started_at) for a in restarted.ledger.lost_attempts("capped")}
                halt = await wait_until(lambda: capped_halt(settings), 180, 0.3, message="'capped' finished at its cap")
                stats = await settled_billing(sim)
        finally:
            if second is not None:
                second.send_signal(signal.SIGTERM)
                await second.wait()
            if not task.done():
                task.cancel()
    billed = int(stats["completion_tokens"])
    print(f"\nbudget killed and restarted: billed {billed} of {CAP} ({billed / CAP:.4f}); "
          f"{len(lost_before)} lost before the crash, {len(rebuilt)} rebuilt; halt: {halt.reason}")
    assert billed <= CAP
    assert lost_before and lost_before <= rebuilt  # every lost attempt survived the crash, with its worker
