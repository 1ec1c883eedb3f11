"""Benchmark 9: cap used and overshoot after one worker kill, at the seeds' answer lengths.

The seeds' run that crossed its cap: answers of 1,700-14,500 tokens, ``max_tokens`` 16,384,
256 in flight, a 10M-token cap over 2,000 prompts, the inference worker SIGKILLed 20 s in
and started again (a crash, an OOM kill). The worker is a process of its own; the budget
service runs in this process on the test broker and the simulator in one of its own, billing
answers whose client went away (as a provider does) and reporting the key's usage on
``GET /api/v1/key``, which the budget reads. The figures are the simulator's own count of
the completion tokens it billed once the dataset stands finished at its cap, as a fraction
of the cap (target >= 0.95), and the overshoot past the cap (target 0).

``BENCH_LOST_NO_PRICE=1``: the budget has no ``[budget.prices]`` (as a new user's run): the
price per token that turns the key's dollars into tokens comes from the answers' ``usage.cost``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BOOTSTRAP,
    Result,
    delete_topics,
    free_port,
    main,
    processes,
    publish_seeds,
    result,
    seeds_settings,
    sim_stats,
    simulator_proc,
    unique_prefix,
    wait_simulator,
    workdir,
)

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 16_384
REASONING = (1_200, 11_500)
CONTENT = (500, 3_000)  # answers of 1,700-14,500 tokens
PRICE = 2e-6  # USD per completion token, the simulator's and the budget's
TIMEOUT_S = 30.0  # the in-flight TTL, past which a lost attempt no longer bills: (30 + 2) x 2 = 64 s
# --quick: answers after 1-2.5 s, the TTL (4 + 2) x 2 = 12 s: the same story in a third of the time
QUICK_LATENCY, QUICK_JITTER, QUICK_TIMEOUT_S = 1.0, 1.5, 4.0


def _worker(
    prefix: str, base_url: str, concurrency: int, timeout_s: float, name: str = ""
) -> asyncio.Future[asyncio.subprocess.Process]:
    """``run inference`` in a process of its own; ``name``: its provider's name (halts, budget figures)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS": BOOTSTRAP,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": prefix,
        "DRAFTSTREAM_PROVIDER__BASE_URL": base_url,
        "DRAFTSTREAM_PROVIDER__CONCURRENCY": str(concurrency),
        "DRAFTSTREAM_PROVIDER__TIMEOUT_S": str(timeout_s),
        "DRAFTSTREAM_PROVIDER__MAX_ATTEMPTS": "2",
        "DRAFTSTREAM_PROVIDER__BACKOFF_MAX_S": "2",
        "DRAFTSTREAM_DEFAULTS__MAX_TOKENS": str(MAX_TOKENS),
        "DRAFTSTREAM_METRICS__INFERENCE_PORT": "0",
        **({"DRAFTSTREAM_PROVIDER__NAME": name} if name else {}),
    }
    env.pop("OPENROUTER_API_KEY", None)
    return asyncio.ensure_future(asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "run", "inference", cwd=REPO, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    ))


async def _finished_at_cap(settings: Any) -> Any:
    """The budget's standing halt that finished ``seeds`` at its cap, if any (a broker hiccup reads as none)."""
    from schemas import Halt
    from services.budget.leases import CAPPED_PREFIX
    from services.control import read_control_state

    try:
        event = (await read_control_state(settings)).get("seeds")
    except Exception:  # noqa: BLE001 - the shared broker missed a beat: ask again
        return None
    return event if isinstance(event, Halt) and event.reason.startswith(CAPPED_PREFIX) else None


async def _settled(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """The simulator's counters once nothing was billed for 5 s (abandoned generations included)."""
    last: dict[str, Any] = {}
    while True:
        stats = await sim_stats(client, base_url)
        if last and stats["completion_tokens"] == last["completion_tokens"] and not stats["open_requests"]:
            return stats
        last = stats
        await asyncio.sleep(5.0)


async def measure(quick: bool) -> list[Result]:
    """One capped dataset; the worker killed ``kill_after_s`` in and started again; run until finished at its cap."""
    from services.budget.app import create_app as create_budget

    env_prompts = os.environ.get("BENCH_LOST_PROMPTS")
    cap, concurrency, prompts, kill_after_s = (1_500_000, 64, 300, 6.0) if quick else (10_000_000, 256, 2_000, 20.0)
    latency, jitter, timeout_s = (QUICK_LATENCY, QUICK_JITTER, QUICK_TIMEOUT_S) if quick else (4.0, 4.0, TIMEOUT_S)
    if env_prompts:  # a smaller run on a shared machine: the cap scales with the prompts
        prompts = int(env_prompts)
        cap = cap * prompts // (300 if quick else 2_000)
    prefix = unique_prefix("lost")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with workdir("lost") as tmp, processes() as procs:
        # The simulator in a process of its own: sharing the budget's loop, its answers queued
        # behind it and timed out, which measures the machine, not the budget.
        sim = simulator_proc(tmp, port, latency=latency, jitter=jitter, reasoning=f"{REASONING[0]}-{REASONING[1]}",
                             content=f"{CONTENT[0]}-{CONTENT[1]}")
        procs.append(sim)
        await wait_simulator(base_url, sim)
        priced = os.environ.get("BENCH_LOST_NO_PRICE", "") != "1"
        prices = {"qwen/qwen3-8b": {"completion": PRICE * 1e6}} if priced else {}
        settings = seeds_settings(
            prefix, f"{base_url}/api/v1", cap, MAX_TOKENS,
            provider={"concurrency": concurrency, "timeout_s": timeout_s, "max_attempts": 2, "backoff_max_s": 2.0},
            budget={"key_usage_interval_s": 2.0, "prices": prices},
        )
        how = "[budget.prices] set" if priced else "no [budget.prices]: the price from the answers' usage.cost"
        print(f"cap {cap:,} tokens; {prompts:,} prompts; 1 worker x {concurrency} in flight x {MAX_TOKENS:,} "
              f"max_tokens; SIGKILL {kill_after_s:.0f} s in; {how}", flush=True)
        await publish_seeds(settings, prompts)
        budget = create_budget(settings, checkpoint_interval_s=0.5)
        await budget.start()
        task = asyncio.create_task(budget.run())
        started = time.monotonic()
        workers: list[asyncio.subprocess.Process] = []
        try:
            workers.append(await _worker(prefix, settings.provider.base_url, concurrency, timeout_s))
            await asyncio.sleep(kill_after_s)
            async with httpx.AsyncClient(timeout=30.0) as client:
                open_at_kill = (await sim_stats(client, base_url))["open_requests"]
                workers[0].send_signal(signal.SIGKILL)
                await workers[0].wait()
                workers.append(await _worker(prefix, settings.provider.base_url, concurrency, timeout_s))
                halt = None
                while halt is None and time.monotonic() - started < (300 if quick else 1_800):
                    halt = await _finished_at_cap(settings)
                    await asyncio.sleep(0.5)
                workers[1].send_signal(signal.SIGTERM)
                await workers[1].wait()
                stats = await _settled(client, base_url)
            lost = budget.ledger.lost_attempts("seeds")
            repaid = budget.ledger.scopes["seeds"].lost_repaid
            spent = budget.ledger.scopes["seeds"].completion_tokens
        finally:
            for proc in workers:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            budget.stop()
            await asyncio.wait([task], timeout=60)
            await budget.close()
            await delete_topics(prefix)
    if halt is None:
        raise RuntimeError("the dataset was not finished at its cap in time")
    billed = stats["completion_tokens"]
    print(f"{billed:,} of {cap:,} tokens billed ({billed / cap:.4f}), {stats['abandoned_billed']} answers billed for "
          f"clients gone; {open_at_kill} open at the kill, {len(lost)} attempts lost, {repaid} of their prompts "
          f"re-paid; the budget counted {spent:,} in answers; {time.monotonic() - started:.0f} s; {halt.reason}",
          flush=True)
    return [
        result(f"cap used after one worker kill (key usage read{'' if priced else ', no configured price'})",
               float(billed), float(cap), billed / cap, ">= 0.95", "tokens"),
        # The row's ratio is its own value over its reference: tokens past the cap per token of cap.
        result("cap overshoot after one worker kill", float(max(0, billed - cap)), float(cap),
               max(0, billed - cap) / cap, "<= 0.0", "tokens"),
    ]


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
