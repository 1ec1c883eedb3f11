"""Benchmark 9: cap used and overshoot after one worker kill, at the seeds' answer lengths.

The seeds' run that crossed its cap: answers of 1,700-14,500 tokens, ``max_tokens`` 16,384,
256 in flight, a 10M-token cap over 2,000 prompts, the inference worker SIGKILLed 20 s in
and started again (a crash, an OOM kill). The worker is a process of its own; the budget
service and the simulator run in this process on the test broker, the simulator billing
answers whose client went away (as a provider does) and reporting the key's usage on
``GET /api/v1/key``, which the budget reads. The figures are the simulator's own count of
the completion tokens it billed once the dataset stands finished at its cap, as a fraction
of the cap (target >= 0.95), and the overshoot past the cap (target 0).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from bench.common import BOOTSTRAP, Result, delete_topics, main, publish_seeds, result, seeds_settings, unique_prefix

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 16_384
REASONING = (1_200, 11_500)
CONTENT = (500, 3_000)  # answers of 1,700-14,500 tokens
PRICE = 2e-6  # USD per completion token, the simulator's and the budget's
TIMEOUT_S = 30.0  # the in-flight TTL, past which a lost attempt no longer bills: (30 + 2) x 2 = 64 s


def _worker(prefix: str, base_url: str, concurrency: int) -> asyncio.Future[asyncio.subprocess.Process]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS": BOOTSTRAP,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": prefix,
        "DRAFTSTREAM_PROVIDER__BASE_URL": base_url,
        "DRAFTSTREAM_PROVIDER__CONCURRENCY": str(concurrency),
        "DRAFTSTREAM_PROVIDER__TIMEOUT_S": str(TIMEOUT_S),
        "DRAFTSTREAM_PROVIDER__MAX_ATTEMPTS": "2",
        "DRAFTSTREAM_PROVIDER__BACKOFF_MAX_S": "2",
        "DRAFTSTREAM_DEFAULTS__MAX_TOKENS": str(MAX_TOKENS),
        "DRAFTSTREAM_METRICS__INFERENCE_PORT": "0",
    }
    env.pop("OPENROUTER_API_KEY", None)
    return asyncio.ensure_future(asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "run", "inference", cwd=REPO, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    ))


async def measure(quick: bool) -> list[Result]:
    """One capped dataset; the worker killed ``kill_after_s`` in and started again; run until finished at its cap."""
    from schemas import Halt
    from services.budget.app import create_app as create_budget
    from services.budget.leases import CAPPED_PREFIX
    from services.control import read_control_state
    from services.simulator.app import SimulatorOptions, start_simulator

    env_prompts = os.environ.get("BENCH_LOST_PROMPTS")
    cap, concurrency, prompts, kill_after_s = (1_500_000, 64, 300, 8.0) if quick else (10_000_000, 256, 2_000, 20.0)
    if env_prompts:  # a smaller run on a shared machine: the cap scales with the prompts
        prompts = int(env_prompts)
        cap = cap * prompts // (300 if quick else 2_000)
    prefix = unique_prefix("lost")
    sim = await start_simulator(SimulatorOptions(
        latency_s=4.0, latency_jitter_s=4.0, reasoning_tokens=REASONING, content_tokens=CONTENT, price_per_token=PRICE
    ))
    settings = seeds_settings(
        prefix, sim.url, cap, MAX_TOKENS,
        provider={"concurrency": concurrency, "timeout_s": TIMEOUT_S, "max_attempts": 2, "backoff_max_s": 2.0},
        budget={"key_usage_interval_s": 2.0, "prices": {"qwen/qwen3-8b": {"completion": PRICE * 1e6}}},
    )
    print(f"cap {cap:,} tokens; {prompts:,} prompts; 1 worker x {concurrency} in flight x {MAX_TOKENS:,} max_tokens; "
          f"SIGKILL {kill_after_s:.0f} s in", flush=True)
    await publish_seeds(settings, prompts)

    budget = create_budget(settings, checkpoint_interval_s=0.5)
    await budget.start()
    task = asyncio.create_task(budget.run())
    started = time.monotonic()
    halt: Halt | None = None
    first = await _worker(prefix, sim.url, concurrency)
    second = None
    try:
        await asyncio.sleep(kill_after_s)
        open_at_kill = sim.server.stats.open
        first.send_signal(signal.SIGKILL)
        await first.wait()
        second = await _worker(prefix, sim.url, concurrency)
        while time.monotonic() - started < (300 if quick else 1_800):
            event = (await read_control_state(settings)).get("seeds")
            if isinstance(event, Halt) and event.reason.startswith(CAPPED_PREFIX):
                halt = event
                break
            await asyncio.sleep(0.5)
        if second is not None:
            second.send_signal(signal.SIGTERM)
            await second.wait()
        while sim.server.stats.open or sim.server.stats.billing.pending:
            await asyncio.sleep(0.5)  # every generation billed, its client there or not
        stats = sim.stats()
        lost = budget.ledger.lost_attempts("seeds")
        repaid = budget.ledger.scopes["seeds"].lost_repaid
    finally:
        budget.stop()
        await asyncio.wait([task], timeout=60)
        await budget.close()
        await sim.close()
        await delete_topics(prefix)
    if halt is None:
        raise RuntimeError("the dataset was not finished at its cap in time")
    billed = stats["completion_tokens"]
    print(f"{billed:,} of {cap:,} tokens billed ({billed / cap:.4f}), {stats['abandoned_billed']} of them for clients "
          f"gone; {open_at_kill} open at the kill, {len(lost)} attempts lost, {repaid} of their prompts re-paid; "
          f"{time.monotonic() - started:.0f} s; {halt.reason}", flush=True)
    return [
        result("cap used after one worker kill (key usage read)", float(billed), float(cap), billed / cap,
               ">= 0.95", "tokens"),
        result("cap overshoot after one worker kill", float(max(0, billed - cap)), float(cap), billed / cap,
               "<= 1.0", "tokens"),
    ]


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
