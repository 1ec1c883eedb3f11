"""Benchmark 3: one inference worker with many requests in flight against a slow provider.

The simulator (its own process) answers after a fixed latency; one inference worker
(its own process, ``draftstream run inference``) has ``provider.concurrency`` requests
in flight over a backlog of prompts. Measured: the steady-state request rate at the
simulator over a window, against the ideal in-flight / latency. The worker's peak
resident memory (VmHWM) is printed and checked against 1 GiB.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from bench.common import (
    Result,
    base_sections,
    delete_topics,
    free_port,
    main,
    processes,
    prompt_texts,
    result,
    sim_stats,
    simulator_proc,
    stage_proc,
    unique_prefix,
    wait_simulator,
    wait_until,
    workdir,
    write_config,
    write_prompts,
)

DATASET = "bench"


async def publish_backlog(config: Path, work: Path, n: int, distinct: int = 64, tag: str = "p") -> float:
    """Publish ``n`` prompts (``distinct`` different texts, unique ids); returns seconds taken."""
    from services.common.config import load_settings
    from services.publish.app import publish

    texts = prompt_texts(distinct)
    path = write_prompts(
        work / f"prompts-{tag}.jsonl", [f"{tag}{i}" for i in range(n)], [texts[i % distinct] for i in range(n)]
    )
    settings = load_settings(config)
    t0 = time.monotonic()
    report = await publish(settings, [path], dataset=DATASET)
    if report.published != n:
        raise RuntimeError(f"published {report.published} of {n} prompts")
    return time.monotonic() - t0


async def measure(quick: bool) -> list[Result]:
    """Run the worker against the slow simulator and measure its steady rate and memory."""
    concurrency, latency, window = (100, 0.5, 3.0) if quick else (1000, 2.0, 10.0)
    ideal = concurrency / latency
    backlog = int(concurrency + ideal * (latency + 2.0 + window) * 1.3)
    prefix = unique_prefix("concurrency")
    with workdir("concurrency") as work, processes() as procs:
        port = free_port()
        sim = simulator_proc(work, port, latency=latency, reasoning="20-60", content="5-20")
        procs.append(sim)
        base = f"http://127.0.0.1:{port}"
        config = write_config(
            work / "bench.toml",
            base_sections(
                prefix,
                provider_url=f"{base}/api/v1",
                out_dir=work / "out",
                provider={"concurrency": concurrency, "timeout_s": 60.0},
                defaults={"max_tokens": 1024},
            ),
        )
        await wait_simulator(base, sim)
        seconds = await publish_backlog(config, work, backlog)
        print(f"published {backlog} prompts in {seconds:.1f}s", flush=True)
        worker = stage_proc("inference", config, work)
        procs.append(worker)
        async with httpx.AsyncClient(timeout=10.0) as client:

            async def started() -> bool:
                return int((await sim_stats(client, base))["total_requests"]) > 0

            await wait_until(started, 120, 0.1, "the first request", [worker, sim])
            # One full latency cycle (plus slack) to reach steady state, then the window.
            t1 = time.time() + latency + 2.0
            t2 = t1 + window
            await asyncio.sleep(t1 - time.time())
            cpu1 = worker.cpu_seconds()
            await asyncio.sleep(t2 - time.time())
            cores = (worker.cpu_seconds() - cpu1) / window
            await asyncio.sleep(0.2)
            worker.check()
            after1 = int((await sim_stats(client, base, after=t1))["requests_after"])
            after2 = int((await sim_stats(client, base, after=t2))["requests_after"])
            total = int((await sim_stats(client, base))["total_requests"])
        rate = (after1 - after2) / window
        peak_mib = worker.vm_hwm_kib() / 1024
        if total >= backlog:
            print("warning: the backlog ran out before the window closed", flush=True)
        print(
            f"concurrency {concurrency}, latency {latency}s: {rate:.1f} req/s (ideal {ideal:.0f}), "
            f"{total} requests so far; worker CPU {cores:.0%} of a core; peak RSS {peak_mib:.0f} MiB",
            flush=True,
        )
    await delete_topics(prefix)
    return [
        result(f"inference rate @{concurrency} in flight", rate, ideal, rate / ideal, ">= 0.9", "req/s"),
        result("inference worker peak RSS", peak_mib, 1024.0, peak_mib / 1024.0, "<= 1.0", "MiB"),
    ]


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
