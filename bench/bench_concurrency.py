"""Benchmark 3: one inference worker with many requests in flight, against a bare aiohttp client.

The simulator (its own process) answers after a fixed latency. draftstream: one
inference worker (its own process, ``draftstream run inference``) with
``provider.concurrency`` requests in flight over a backlog of prompts, publishing a
request-started and a response record per prompt. Reference: a bare aiohttp client in
this process keeping the same number of requests in flight with the same request
bodies (``Provider.request_identity``) and headers against the same simulator, reading
each body and nothing else. The two alternate in rounds (worker, bare / bare, worker /
...): the worker is resumed for its rounds and halted for the client's (the halt on
``control``, as a person would send it). Each round measures the request rate at the
simulator over a window after the in-flight count has reached the bound and one more
latency has passed; the ratio is the median of the rounds' worker / client ratios, its
spread the min and max. Scenarios: 1,000 and 10,000 in flight (smaller at ``--quick``);
each scenario starts a fresh worker, whose peak resident memory (VmHWM) is checked
against 1 GiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.common import (
    Proc,
    Result,
    base_sections,
    delete_topics,
    free_port,
    main,
    median,
    processes,
    prompt_texts,
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
    write_prompts,
)

DATASET = "bench"
DISTINCT = 64
MAX_TOKENS = 1024
RSS_BOUND_MIB = 1024.0


def raise_fd_limit(wanted: int) -> None:
    """Raise this process's soft open-files limit toward ``wanted`` (capped by the hard limit).

    Children inherit it: the simulator and the worker each hold one socket per request in flight.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < wanted:
        print(f"warning: open-files limit {soft} < {wanted}: connections may fail", flush=True)


async def publish_backlog(
    config: Path, work: Path, n: int, distinct: int = DISTINCT, tag: str = "p", dataset: str = DATASET
) -> float:
    """Publish ``n`` prompts (``distinct`` different texts, unique ids); returns seconds taken."""
    from services.common.config import load_settings
    from services.publish.app import publish

    texts = prompt_texts(distinct)
    path = write_prompts(
        work / f"prompts-{tag}.jsonl", [f"{tag}{i}" for i in range(n)], [texts[i % distinct] for i in range(n)]
    )
    settings = load_settings(config)
    t0 = time.monotonic()
    report = await publish(settings, [path], dataset=dataset)
    if report.published != n:
        raise RuntimeError(f"published {report.published} of {n} prompts")
    path.unlink()
    return time.monotonic() - t0


async def inflight(client: httpx.AsyncClient, base: str) -> int:
    """Requests the simulator has received and not yet answered."""
    s = await sim_stats(client, base)
    return int(s["total_requests"]) - sum(int(v) for v in s["statuses"].values())


async def ramp(
    client: httpx.AsyncClient, base: str, concurrency: int, ramp_s: float, procs: list[Proc], who: str,
    latency: float,
) -> int:
    """Wait until the in-flight count reaches 95 % of the bound or stops growing (for 3 s); returns it.

    In flight = rate x latency: a side that cannot start requests fast enough never reaches the
    bound, and what it does reach is part of the finding. Nothing completes during the first
    latency, so a pause in growth before then (a slow start) is not a plateau.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    give_up = started + ramp_s
    best, best_at = 0, loop.time()
    while True:
        for p in procs:
            p.check()
        now = await inflight(client, base)
        if now >= int(0.95 * concurrency):
            return now
        if now > best * 1.01:
            best, best_at = now, loop.time()
        plateau = best > 0 and loop.time() - started > latency and loop.time() - best_at > 3.0
        if plateau or loop.time() > give_up:
            print(f"{who}: {now} of {concurrency} in flight at most (not growing)", flush=True)
            return now
        await asyncio.sleep(0.2)


async def window_rate(
    client: httpx.AsyncClient, base: str, concurrency: int, latency: float, window: float, ramp_s: float,
    procs: list[Proc], who: str,
) -> tuple[float, int]:
    """Ramp, then one latency, then requests/s at the simulator over ``window``; (rate, in flight reached)."""
    reached = await ramp(client, base, concurrency, ramp_s, procs, who, latency)
    t1 = time.time() + latency
    t2 = t1 + window
    await asyncio.sleep(t2 - time.time() + 0.2)
    after1 = int((await sim_stats(client, base, after=t1))["requests_after"])
    after2 = int((await sim_stats(client, base, after=t2))["requests_after"])
    return (after1 - after2) / window, reached


async def quiet(client: httpx.AsyncClient, base: str, procs: list[Proc], timeout: float = 120.0) -> None:
    """Wait until nothing is in flight at the simulator."""

    async def idle() -> bool:
        return await inflight(client, base) == 0

    await wait_until(idle, timeout, 0.2, "the simulator to drain", procs)


async def bare_round(
    client: httpx.AsyncClient, base: str, url: str, requests: list[tuple[bytes, dict[str, str]]],
    concurrency: int, latency: float, window: float, ramp_s: float, procs: list[Proc],
) -> tuple[float, int]:
    """The reference: a bare aiohttp client keeping ``concurrency`` of the worker's requests in flight."""
    stop = asyncio.Event()
    failures: list[str] = []

    async def loop(session: aiohttp.ClientSession, start: int) -> None:
        i = start
        while not stop.is_set():
            body, headers = requests[i % len(requests)]
            i += concurrency
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        failures.append(f"HTTP {response.status}")
            except (aiohttp.ClientError, OSError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.1)

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60.0 + latency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loops = [asyncio.create_task(loop(session, i)) for i in range(concurrency)]
        try:
            rate, reached = await window_rate(
                client, base, concurrency, latency, window, ramp_s, procs, "bare client"
            )
        finally:
            stop.set()
            await asyncio.gather(*loops, return_exceptions=True)
    if failures:
        print(f"bare client: {len(failures)} failed requests, first: {failures[0]}", flush=True)
    return rate, reached


@dataclass
class Scenario:
    """The rates of one in-flight bound, round by round."""

    concurrency: int
    worker: list[float] = field(default_factory=list)
    bare: list[float] = field(default_factory=list)
    peak_mib: float = 0.0
    cores: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """Worker / bare client, per round."""
        return [w / b for w, b in zip(self.worker, self.bare, strict=True) if b > 0]


async def bare_requests(settings: Any, n: int) -> list[tuple[bytes, dict[str, str]]]:
    """The worker's exact request bodies and headers for the benchmark prompts (``n`` distinct)."""
    import msgspec

    from schemas import Message, PromptPublished, sample_key
    from services.inference.adapters.http_provider import KEY_HEADER
    from services.inference.adapters.providers import make_provider

    provider = make_provider(settings, httpx.AsyncClient())
    dataset = settings.dataset(DATASET)
    out: list[tuple[bytes, dict[str, str]]] = []
    for i, text in enumerate(prompt_texts(n)):
        prompt = PromptPublished(dataset=DATASET, sample_id=f"bare{i}", messages=[Message(role="user", content=text)])
        body = provider.request_identity(prompt, dataset, max_tokens=MAX_TOKENS)["body"]
        headers = {"Content-Type": "application/json", KEY_HEADER: sample_key(DATASET, prompt.sample_id)}
        out.append((msgspec.json.encode(body), headers))
    return out


async def scenario(
    concurrency: int, latency: float, window: float, rounds: int, work: Path, sim: Proc, base: str
) -> Scenario:
    """Alternate worker and bare-client rounds at one in-flight bound."""
    from schemas import CONTROL_TOPIC, Halt, Resume, encode
    from services.common.config import load_settings
    from services.common.kafka import ensure_topics, make_producer

    prefix = unique_prefix("concurrency")
    config = write_config(
        work / f"bench-{concurrency}.toml",
        base_sections(
            prefix,
            provider_url=f"{base}/api/v1",
            out_dir=work / "out",
            provider={"concurrency": concurrency, "timeout_s": 60.0 + latency},
            defaults={"max_tokens": MAX_TOKENS},
        ),
    )
    settings = load_settings(config)
    requests = await bare_requests(settings, DISTINCT)
    url = f"{base}/api/v1/chat/completions"
    ramp_s = max(30.0, concurrency / 200)
    ideal = concurrency / latency
    out = Scenario(concurrency)
    await ensure_topics(settings.kafka, [DATASET])
    producer = make_producer(settings.kafka)
    await producer.start()
    control = settings.kafka.topic(CONTROL_TOPIC)

    async def command(event: Halt | Resume) -> None:
        await producer.send_and_wait(control, encode(event), key=event.scope.encode())

    with processes() as procs:
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(producer.stop)
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30.0))
            # The worker starts halted; each of its rounds resumes it and halts it again.
            await command(Halt(scope=DATASET, reason="bench: between rounds", by="bench"))
            worker = stage_proc("inference", config, work, name=f"inference-{concurrency}")
            procs.append(worker)
            watched = [worker, sim]
            published = 0
            for i in range(rounds):
                for which in ("worker", "bare") if i % 2 == 0 else ("bare", "worker"):
                    if which == "bare":
                        rate, reached = await bare_round(
                            client, base, url, requests, concurrency, latency, window, ramp_s, watched
                        )
                        out.bare.append(rate)
                    else:
                        # Enough backlog for the ramp, one latency and the window at the rate seen so far.
                        expected = max(out.bare + out.worker, default=min(ideal, 2000.0))
                        need = int(concurrency * 2 + expected * (latency * 2 + window + 5) * 1.5)
                        seconds = await publish_backlog(config, work, need, tag=f"r{i}-")
                        published += need
                        print(f"published {need} prompts in {seconds:.1f}s", flush=True)
                        await command(Resume(scope=DATASET, reason="bench round", by="bench"))
                        cpu0, t0 = worker.cpu_seconds(), time.monotonic()
                        rate, reached = await window_rate(
                            client, base, concurrency, latency, window, ramp_s, watched, "worker"
                        )
                        out.cores.append((worker.cpu_seconds() - cpu0) / (time.monotonic() - t0))
                        await command(Halt(scope=DATASET, reason="bench: between rounds", by="bench"))
                        out.worker.append(rate)
                    await quiet(client, base, watched)
                    print(
                        f"{concurrency} in flight, round {i + 1} {which}: {rate:.1f} req/s (ideal {ideal:.0f}), "
                        f"{reached} in flight reached",
                        flush=True,
                    )
            total = int((await sim_stats(client, base))["total_requests"])
            out.peak_mib = worker.vm_hwm_kib() / 1024
            worker.check()
    await delete_topics(prefix)
    print(
        f"{concurrency} in flight: worker {', '.join(f'{r:.0f}' for r in out.worker)} req/s, bare client "
        f"{', '.join(f'{r:.0f}' for r in out.bare)} req/s; ratios {', '.join(f'{r:.3f}' for r in out.ratios)}; "
        f"worker CPU {', '.join(f'{c:.0%}' for c in out.cores)} of a core; peak RSS {out.peak_mib:.0f} MiB; "
        f"{total} requests at the simulator so far ({published} prompts published)",
        flush=True,
    )
    return out


async def measure(quick: bool) -> list[Result]:
    """Both scenarios against one simulator; rate ratios and the worker's peak memory."""
    # (in flight, latency s, window s, rounds): the window spans one latency at 10,000, so the
    # rate averages a whole send/complete cycle whatever shape the ramp had.
    plan = ((100, 0.5, 2.0, 1), (1000, 0.5, 2.0, 1)) if quick else ((1000, 2.0, 10.0, 3), (10_000, 10.0, 10.0, 3))
    raise_fd_limit(max(c for c, *_ in plan) + 4096)
    results: list[Result] = []
    with workdir("concurrency") as work, processes() as procs:
        for concurrency, latency, window, rounds in plan:
            port = free_port()
            sim = simulator_proc(work, port, latency=latency, reasoning="20-60", content="5-20")
            procs.append(sim)
            base = f"http://127.0.0.1:{port}"
            await wait_simulator(base, sim)
            s = await scenario(concurrency, latency, window, rounds, work, sim, base)
            sim.stop()
            ratio = median(s.ratios)
            results.append(
                result(
                    f"inference rate @{concurrency:,} in flight vs bare aiohttp",
                    median(s.worker),
                    median(s.bare),
                    ratio,
                    ">= 0.95" if concurrency <= 1000 else ">= 0.9",
                    "req/s",
                    spread(s.ratios),
                )
            )
            results.append(
                result(
                    f"inference worker peak RSS @{concurrency:,} in flight",
                    s.peak_mib,
                    RSS_BOUND_MIB,
                    s.peak_mib / RSS_BOUND_MIB,
                    "<= 1.0",
                    "MiB",
                )
            )
    return results


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
