"""Benchmark 5: scale-out of inference workers in one consumer group.

A latency-bound provider (the simulator, its own process, fixed latency) and workers
with a small per-worker concurrency: one worker, then three workers (each its own
process) in one consumer group over a prompts topic with six partitions. Each phase
waits until the group is stable with every worker holding partitions, publishes a
backlog, and measures the steady request rate at the simulator over a window. Phases
alternate (1, 3, 3, 1, ...) and the medians are compared: target at least 2.7x.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

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
    stage_proc,
    unique_prefix,
    wait_simulator,
    wait_until,
    workdir,
    write_config,
)

PARTITIONS = 6


async def group_members(config: Path) -> tuple[str, int, int]:
    """(state, members, members holding at least one partition) of the inference group."""
    from services.common.config import load_settings
    from services.common.kafka import make_admin
    from services.inference.core import GROUP_ID

    settings = load_settings(config)
    admin = make_admin(settings.kafka)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([settings.kafka.group(GROUP_ID)])
        group = response.groups[0]
        state, members = str(group[2]), list(group[5])
        # member_assignment (last field) is empty bytes until the member holds partitions.
        holding = sum(1 for m in members if len(m[-1]) > 24)
        return state, len(members), holding
    finally:
        await admin.close()


async def phase(
    work: Path, base: str, sim: Proc, workers: int, concurrency: int, latency: float, window: float
) -> float:
    """One phase on fresh topics: start ``workers``, wait for a stable group, measure req/s."""
    from services.common.config import load_settings
    from services.common.kafka import ensure_topics

    prefix = unique_prefix(f"scale{workers}")
    ideal = workers * concurrency / latency
    backlog = int(ideal * (window + 4.0) * 1.5) + PARTITIONS * concurrency
    config = write_config(
        work / f"bench-{prefix}toml",
        base_sections(
            prefix,
            provider_url=f"{base}/api/v1",
            out_dir=work / "out",
            kafka={"partitions": PARTITIONS},
            provider={"concurrency": concurrency},
        ),
    )
    await ensure_topics(load_settings(config).kafka, [DATASET])
    with processes() as procs:
        for i in range(workers):
            procs.append(stage_proc("inference", config, work, name=f"inference-{workers}w-{i}"))

        async def stable() -> bool:
            try:
                state, members, holding = await group_members(config)
            except Exception:  # noqa: BLE001 - the group does not exist yet
                return False
            return state == "Stable" and members == workers and holding == workers

        await wait_until(stable, 180, 0.5, f"{workers} worker(s) in a stable group", [*procs, sim])
        async with httpx.AsyncClient(timeout=10.0) as client:
            before = int((await sim_stats(client, base))["total_requests"])
            await publish_backlog(config, work, backlog, tag=f"w{workers}-{prefix}")

            async def started() -> bool:
                return int((await sim_stats(client, base))["total_requests"]) > before

            await wait_until(started, 60, 0.05, "the first request", [*procs, sim])
            t1 = time.time() + latency + 1.0
            t2 = t1 + window
            await asyncio.sleep(t1 - time.time())
            cpu1 = [p.cpu_seconds() for p in procs]
            await asyncio.sleep(t2 - time.time())
            cores = [(p.cpu_seconds() - c) / window for p, c in zip(procs, cpu1, strict=True)]
            await asyncio.sleep(0.2)
            for p in procs:
                p.check()
            after1 = int((await sim_stats(client, base, after=t1))["requests_after"])
            after2 = int((await sim_stats(client, base, after=t2))["requests_after"])
        rate = (after1 - after2) / window
    await delete_topics(prefix)
    print(
        f"{workers} worker(s): {rate:.1f} req/s (ideal {ideal:.0f}); worker CPU "
        f"{', '.join(f'{c:.0%}' for c in cores)} of a core",
        flush=True,
    )
    return rate


async def measure(quick: bool) -> list[Result]:
    """Alternate 1-worker and 3-worker phases; compare the median rates."""
    concurrency, latency = 16, 0.5
    window, rounds = (3.0, 1) if quick else (8.0, 2)
    one: list[float] = []
    three: list[float] = []
    with workdir("scaleout") as work, processes() as procs:
        port = free_port()
        sim = simulator_proc(work, port, latency=latency, reasoning="20-60", content="5-20")
        procs.append(sim)
        base = f"http://127.0.0.1:{port}"
        await wait_simulator(base, sim)
        for i in range(rounds):
            order = (1, 3) if i % 2 == 0 else (3, 1)
            for workers in order:
                rate = await phase(work, base, sim, workers, concurrency, latency, window)
                (one if workers == 1 else three).append(rate)
    value, reference = median(three), median(one)
    return [result("scale-out 3 workers vs 1", value, reference, value / reference, ">= 2.7", "req/s")]


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
