"""Benchmark 6: goodput against a rate-limited provider, as a share of the key's limit, per limit shape.

The simulator (its own process) limits the key the way paid APIs do, one shape per scenario,
answering in 0.5-1.0 s (``Retry-After: 1`` for the open cap, the time to the next token or
window for a rate):

- ``bucket``: a token bucket of 20 requests/s with a burst of 5, at most 16 open (how most
  APIs limit a key); the limit is the bucket's rate.
- ``window``: a fixed window of requests (600 a minute; 100 in 10 s at ``--quick``) reset at
  each window's start; the limit is the window's count over its length (the first window is
  partial, the run starts anywhere in it: over 2.5 windows that may favour the run).
- ``open-cap``: at most 16 open and no rate; the limit is 16 over the mean latency.
- ``halved``: the bucket of 20/s (burst 5) halved 15 s after the first request and restored
  45 s after it; the limit is the rate in force.

Every shape runs twice: with the limit stated in ``X-RateLimit-*`` headers, and silent
(``--limit-headers none``: no such header, a whole-second ``Retry-After`` -- 1 s, or the wait to
the window's reset -- and an OpenRouter-style error body), where only what is admitted tells.

One inference worker (its own process) with the default config (``provider.concurrency``
256, no rate settings) works through a backlog of prompts. Per shape it prints goodput (HTTP
200 answers a second at the simulator, from its first request to the last answer) over the
limit, refusals (429) per admitted request, and dead letters; ``halved`` also the time from
the halving until the goodput over the next 5 s is at least 0.9 of the halved limit (the
re-convergence time) and the goodput over the halved stretch after it. Targets:
goodput >= 0.9 of the limit, refused/admitted <= 0.1 for the bucket and for every silent shape,
re-converged within 10 s, no dead letter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.bench_concurrency import DATASET, publish_backlog
from bench.common import (
    Result,
    base_sections,
    delete_topics,
    free_port,
    main,
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

LATENCY, JITTER = 0.5, 0.5  # answers in 0.5-1.0 s
SETTLE_S = 5.0  # the goodput over this long after a change decides whether the pace re-converged


@dataclass(frozen=True)
class Shape:
    """A limit shape: the simulator's options, the limit in requests/s, the prompts to send."""

    name: str
    extra: tuple[str, ...]
    limit: float
    prompts: int
    halve_at: float | None = None  # seconds after the first request: the limit halves
    restore_at: float | None = None
    window: tuple[int, float] | None = None  # requests per fixed window, its length in seconds
    silent: bool = False  # no X-RateLimit-* headers, a whole-second Retry-After


def shapes(quick: bool) -> list[Shape]:
    """The four shapes, each stated and silent (smaller at ``--quick``)."""
    stated = limit_shapes(quick)
    silent = [
        dataclasses.replace(s, name=f"{s.name}, silent", extra=(*s.extra, "--limit-headers", "none"), silent=True)
        for s in stated
    ]
    return [shape for pair in zip(stated, silent, strict=True) for shape in pair]


def limit_shapes(quick: bool) -> list[Shape]:
    """The four shapes with their limits stated (smaller at ``--quick``)."""
    bucket = ("--rate-limit-rps", "20", "--rate-limit-burst", "5", "--max-open", "16", "--retry-after", "1")
    window = (50, 5.0) if quick else (600, 60.0)
    halve, restore, tail = (5.0, 15.0, 3.0) if quick else (15.0, 45.0, 10.0)
    return [
        Shape("bucket", bucket, 20.0, 100 if quick else 300),
        Shape(
            "window",
            ("--rate-limit-window", str(window[0]), "--rate-limit-window-s", str(window[1])),
            window[0] / window[1],
            int(window[0] * 2.5),
            window=window,
        ),
        Shape(
            "open-cap", ("--max-open", "16", "--retry-after", "1"), 16 / (LATENCY + JITTER / 2), 100 if quick else 300
        ),
        Shape(
            "halved",
            (
                "--rate-limit-rps", "20", "--rate-limit-burst", "5", "--rate-limit-schedule",
                f"{halve}:0.5,{restore}:1", "--retry-after", "1",
            ),
            20.0,
            int(20 * halve + 10 * (restore - halve) + 20 * tail),
            halve,
            restore,
        ),
    ]


async def run_shape(work: Path, shape: Shape) -> dict[str, Any]:
    """One simulator with ``shape``, one worker on a backlog: the answers over time and the totals."""
    from schemas import DEAD_LETTER_TOPIC
    from services.common.config import load_settings
    from services.common.kafka import ensure_topics
    from services.common.topics import read_to_end

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tag = shape.name.replace(", ", "-")
    prefix = unique_prefix(f"ratelimit-{tag}")
    config = write_config(
        work / f"bench-{prefix}toml", base_sections(prefix, provider_url=f"{base}/api/v1", out_dir=work / "out")
    )
    settings = load_settings(config)
    assert settings.provider.concurrency == 256 and settings.provider.requests_per_minute is None
    await ensure_topics(settings.kafka, [DATASET])
    await publish_backlog(config, work, shape.prompts, tag=f"rl-{prefix}")
    samples: list[tuple[float, int]] = []  # (seconds since the first request, answers so far)
    with processes() as procs:
        sim = simulator_proc(
            work, port, latency=LATENCY, jitter=JITTER, reasoning="20-60", content="5-20", extra=shape.extra,
            name=f"simulator-{tag}",
        )
        procs.append(sim)
        await wait_simulator(base, sim)
        procs.append(stage_proc("inference", config, work, name=f"inference-{tag}"))
        async with httpx.AsyncClient(timeout=10.0) as client:

            async def requested() -> bool:
                return int((await sim_stats(client, base))["total_requests"]) > 0

            await wait_until(requested, 120, 0.02, "the first request", procs)
            t0 = time.monotonic()
            deadline = t0 + 30.0 + 3.0 * shape.prompts / (shape.limit / 2)
            stats: dict[str, Any] = {}
            while time.monotonic() < deadline:
                stats = await sim_stats(client, base)
                ok = int(stats["statuses"].get("200", 0))
                samples.append((time.monotonic() - t0, ok))
                if ok >= shape.prompts:
                    break
                for p in procs:
                    p.check()
                await asyncio.sleep(0.25)
    letters: list[Any] = []
    await read_to_end(settings.kafka, settings.kafka.topic(DEAD_LETTER_TOPIC), letters.append)
    await delete_topics(prefix)
    statuses = stats.get("statuses", {})
    return {
        "progress": samples,
        "ok": int(statuses.get("200", 0)),
        "refused": int(statuses.get("429", 0)),
        "dead": len(letters),
        "t0": t0,
    }


def answers_between(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Answers a second between two times (the samples nearest inside them)."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def reconverged_after(samples: list[tuple[float, int]], change: float, until: float, limit: float) -> float | None:
    """Seconds from ``change`` until the goodput over the next ``SETTLE_S`` is >= 0.9 of ``limit``."""
    for at, _ in samples:
        if at < change or at + SETTLE_S > until:
            continue
        if answers_between(samples, at, at + SETTLE_S) >= 0.9 * limit:
            return at - change
    return None


async def measure(quick: bool) -> list[Result]:
    """Every shape against a fresh simulator and worker (at ``--quick`` all at once: the figures
    at that size only show the benchmark runs)."""
    rows: list[Result] = []
    with workdir("ratelimit") as work:
        if quick:
            runs = await asyncio.gather(*(run_shape(work, shape) for shape in shapes(quick)))
        else:
            runs = [await run_shape(work, shape) for shape in shapes(quick)]
        for shape, run in zip(shapes(quick), runs, strict=True):
            samples, ok, refused, dead = run["progress"], run["ok"], run["refused"], run["dead"]
            elapsed = samples[-1][0] if samples else 0.0
            limit = shape.limit
            fastest = ""
            if shape.window is not None:
                # Windows are counted on the simulator's monotonic clock (the same on this host)
                # from 0. The limit is the window's count over its length; beside it, the fastest
                # run a client bursting each window's whole quota at its start could make.
                count, length = shape.window
                first = math.floor(run["t0"] / length)
                opens = (first + math.ceil(shape.prompts / count) - 1) * length
                fastest = f" (bursting each window's quota: {max(0.0, opens - run['t0']) + LATENCY + JITTER / 2:.1f} s)"
            if shape.halve_at is not None and shape.restore_at is not None:
                # The limit in force, averaged over the run: what the key admitted at most.
                halved = max(0.0, min(elapsed, shape.restore_at) - shape.halve_at)
                limit = (shape.limit * (elapsed - halved) + shape.limit / 2 * halved) / max(elapsed, 1e-9)
            goodput = ok / elapsed if elapsed > 0 else 0.0
            per_admitted = refused / max(1, ok)
            line = (
                f"{shape.name}: {ok} answers in {elapsed:.1f} s{fastest} = {goodput:.1f}/s of a {limit:.1f}/s limit "
                f"({goodput / limit:.3f}); {refused} refused ({per_admitted:.3f} per admitted); {dead} dead letter(s)"
            )
            ratio = goodput / limit
            rows.append(result(f"goodput / limit, {shape.name}", goodput, limit, ratio, ">= 0.9", "answers/s"))
            target = "<= 0.1" if shape.name == "bucket" or shape.silent else "<= 1.0"
            unit = "requests"  # topology: not a topic
            rows.append(result(f"refused / admitted, {shape.name}", refused, ok, per_admitted, target, unit))
            rows.append(result(f"dead letters, {shape.name}", float(dead), 0.0, float(dead), "<= 0.0", "records"))
            if shape.halve_at is not None and shape.restore_at is not None:
                half = shape.limit / 2
                took = reconverged_after(samples, shape.halve_at, shape.restore_at, half)
                value = took if took is not None else float("inf")
                settled = answers_between(samples, shape.halve_at + (took or 0.0), shape.restore_at)
                line += (
                    f"; halved at {shape.halve_at:g} s: re-converged after "
                    f"{'never' if took is None else f'{took:.1f} s'}, then {settled:.1f}/s of {half:g} "
                    f"({settled / half:.3f})"
                )
                rows.append(result(f"re-convergence after halving, {shape.name}", value, 10.0, value / 10.0,
                                   "<= 1.0", "s"))
            print(line, flush=True)
    return rows


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
