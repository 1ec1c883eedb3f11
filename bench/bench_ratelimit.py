"""Benchmark 6: goodput against a rate-limited provider, as a share of the key's limit.

The simulator (its own process) admits ``RPS`` requests a second (a token bucket with a
burst of one second's worth; beyond it: HTTP 429 with the ``Retry-After`` until the next
token) and answers after a fixed latency. One inference worker (its own process) with its
default ``provider.concurrency`` of 256 — several times what the limit admits in flight
(``RPS`` x latency) — works through a backlog of prompts. After a warm-up in which the
window adapts, answers per second at the simulator (HTTP 200 only: goodput, not requests)
are measured over windows; the reference is the limit itself. Target: at least 0.9 of it
(median of the windows; their spread is printed). Nothing may be dead-lettered.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from bench.bench_concurrency import DATASET, publish_backlog
from bench.common import (
    Proc,
    Result,
    base_sections,
    delete_topics,
    free_port,
    main,
    median,
    processes,
    result,
    sim_stats,
    simulator_proc,
    spread,
    stage_proc,
    unique_prefix,
    wait_simulator,
    wait_until,
    workdir,
    write_config,
)

CONCURRENCY = 256  # the worker's default: the limit is well below it


async def answered_and_refused(client: httpx.AsyncClient, base: str) -> tuple[int, int]:
    """HTTP 200 answers and 429 refusals the simulator has given so far."""
    statuses = (await sim_stats(client, base))["statuses"]
    return int(statuses.get("200", 0)), int(statuses.get("429", 0))


async def goodput(
    work: Path, base: str, sim: Proc, rps: float, latency: float, warmup: float, window: float, rounds: int
) -> tuple[list[float], int, float]:
    """Answers/s over ``rounds`` windows after ``warmup``; (rates, dead letters, 429s per answer)."""
    from schemas import DEAD_LETTER_TOPIC
    from services.common.config import load_settings
    from services.common.kafka import ensure_topics
    from services.common.topics import read_to_end

    prefix = unique_prefix("ratelimit")
    config = write_config(
        work / f"bench-{prefix}toml",
        base_sections(prefix, provider_url=f"{base}/api/v1", out_dir=work / "out"),
    )
    settings = load_settings(config)
    assert settings.provider.concurrency == CONCURRENCY, settings.provider.concurrency
    await ensure_topics(settings.kafka, [DATASET])
    backlog = int(rps * (warmup + window * rounds + 10) * 1.3) + CONCURRENCY
    await publish_backlog(config, work, backlog, tag=f"rl-{prefix}")
    rates: list[float] = []
    with processes() as procs:
        procs.append(stage_proc("inference", config, work, name="inference-ratelimit"))
        async with httpx.AsyncClient(timeout=10.0) as client:

            async def started() -> bool:
                return (await answered_and_refused(client, base))[0] > 0

            await wait_until(started, 120, 0.1, "the first answer", [*procs, sim])
            await asyncio.sleep(warmup)
            first_ok, first_refused = await answered_and_refused(client, base)
            ok0, t0 = first_ok, time.monotonic()
            for _ in range(rounds):
                await asyncio.sleep(window)
                for p in procs:
                    p.check()
                ok1, refused1 = await answered_and_refused(client, base)
                t1 = time.monotonic()
                rates.append((ok1 - ok0) / (t1 - t0))
                ok0, t0 = ok1, t1
            per_answer = (refused1 - first_refused) / max(1, ok1 - first_ok)
    letters: list[Any] = []
    await read_to_end(settings.kafka, settings.kafka.topic(DEAD_LETTER_TOPIC), letters.append)
    await delete_topics(prefix)
    print(
        f"limit {rps:g} req/s, latency {latency:g} s, worker concurrency {CONCURRENCY}: goodput "
        f"{', '.join(f'{r:.1f}' for r in rates)} answers/s; {per_answer:.2f} 429s per answer; "
        f"{len(letters)} dead letter(s)",
        flush=True,
    )
    return rates, len(letters), per_answer


async def measure(quick: bool) -> list[Result]:
    """One rate-limited simulator, one worker at its default concurrency."""
    rps, latency, warmup, window, rounds = (20.0, 0.5, 3.0, 4.0, 1) if quick else (50.0, 1.0, 15.0, 10.0, 3)
    with workdir("ratelimit") as work, processes() as procs:
        port = free_port()
        sim = simulator_proc(
            work, port, latency=latency, reasoning="20-60", content="5-20", extra=("--rate-limit-rps", str(rps))
        )
        procs.append(sim)
        base = f"http://127.0.0.1:{port}"
        await wait_simulator(base, sim)
        rates, dead, _ = await goodput(work, base, sim, rps, latency, warmup, window, rounds)
    value = median(rates)
    ratios = [r / rps for r in rates]
    rows = [
        result(
            f"goodput vs a {rps:g} req/s limit @{CONCURRENCY} concurrency",
            value,
            rps,
            value / rps,
            ">= 0.9",
            "answers/s",
            spread(ratios),
        )
    ]
    rows.append(result("dead letters against a rate limit", float(dead), 0.0, float(dead), "<= 0.0", "records"))
    return rows


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
