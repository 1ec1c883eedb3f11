"""Benchmark 2: the whole pipeline through Kafka vs one asyncio script without Kafka.

A zero-latency simulator (its own process). draftstream: publish -> inference ->
reconstruct -> audit -> sink, every service its own process (``draftstream run
<stage>``) on the real broker, timed from the start of publishing until every prompt
is accounted for (an accepted row in the sink's files or a dead letter). Reference:
one asyncio process making the same provider calls (the worker's HTTP client, same concurrency, same
request bodies), reconstructing and auditing with the same cores in batches (in a
worker thread, overlapping the HTTP calls) and writing JSONL rows to memory — the shape
of the script the real run used, without durability, replay or halts. Warm-up rounds
fill the simulator's per-prompt cache and the services' tokenizers and let the broker's
JIT settle (its CPU per round of 2,000 prompts fell from 2.0 to 0.6 s over a fresh broker's
first five rounds), and one reference round does the same for the script; then the two
alternate, round by round (five pairs: on 2 shared cores one pair's ratio ranged
0.72-1.06), and the ratio is the median of the rounds' ratios (spread: their min and max). Each round prints
the CPU seconds every process used (stages, simulator, broker, this process);
``BENCH_PROFILE=1`` runs the stages under cProfile and prints their top functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BOOTSTRAP,
    Proc,
    Result,
    base_sections,
    delete_topics,
    free_port,
    listener_pid,
    main,
    median,
    pid_cpu_seconds,
    processes,
    prompt_texts,
    result,
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
from services.inference.adapters.transport import make_http_client

DATASET = "bench"
BATCH = 64
STAGES = ("inference", "reconstruct", "audit", "sink")
_ID = re.compile(rb'"id":\s*"([^"]+)"')


class Accounting:
    """Keys accounted for: ids in the sink's JSONL files (tailed) and keys on dead-letter."""

    def __init__(self, out_dir: Path, settings: Any, datasets: str = DATASET) -> None:
        self.out_dir = out_dir
        self.datasets = datasets  # a glob of the sink's dataset folders
        self.settings = settings
        self.accepted: set[str] = set()
        self.rows: Counter[str] = Counter()  # rows per id in the sink's files (a duplicate counts 2)
        self.dead: set[str] = set()
        self._offsets: dict[Path, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Follow the dead-letter topic from its beginning."""
        from aiokafka import TopicPartition

        from schemas import DEAD_LETTER_TOPIC
        from services.common.kafka import make_consumer
        from services.common.topics import ready_partitions

        topic = self.settings.kafka.topic(DEAD_LETTER_TOPIC)
        consumer = make_consumer(self.settings.kafka, group_id=None)
        await consumer.start()
        # The topic was just created: wait for its leaders (a fresh broker's metadata may not list it yet).
        tps = [TopicPartition(topic, p) for p in await ready_partitions(self.settings.kafka, topic)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)

        async def follow() -> None:
            try:
                while True:
                    batches = await consumer.getmany(timeout_ms=200)
                    for records in batches.values():
                        self.dead.update(r.key.decode() for r in records if r.key is not None)
            finally:
                await consumer.stop()

        self._task = asyncio.create_task(follow())

    async def stop(self) -> None:
        """Stop following."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def scan(self) -> None:
        """Read what the sink appended since the last scan (whole lines only)."""
        for path in sorted(self.out_dir.glob(f"{self.datasets}/part-*.jsonl")):
            start = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                m = _ID.search(line[:400])
                if m:
                    self.accepted.add(m.group(1).decode())
                    self.rows[m.group(1).decode()] += 1
            self._offsets[path] = start + end

    def count(self, keys: set[str]) -> tuple[int, int]:
        """(accepted, dead-lettered) among ``keys``."""
        self.scan()
        return len(keys & self.accepted), len(keys & self.dead)


async def pipeline_round(
    config: Path, work: Path, acct: Accounting, texts: list[str], tag: str, procs: list[Proc]
) -> tuple[float, int, int]:
    """Publish one round and wait until every prompt is accounted for; (seconds, accepted, dead)."""
    from services.common.config import load_settings
    from services.publish.app import publish

    ids = [f"{tag}-{i}" for i in range(len(texts))]
    path = write_prompts(work / f"prompts-{tag}.jsonl", ids, texts)
    keys = {f"{DATASET}:{i}" for i in ids}
    t0 = time.monotonic()
    report = await publish(load_settings(config), [path], dataset=DATASET)
    if report.published != len(texts):
        raise RuntimeError(f"published {report.published} of {len(texts)}")

    async def done() -> bool:
        accepted, dead = acct.count(keys)
        return accepted + dead >= len(keys)

    await wait_until(done, 600, 0.05, f"round {tag} accounted for", procs)
    seconds = time.monotonic() - t0
    accepted, dead = acct.count(keys)
    return seconds, accepted, dead


async def reference_round(
    settings: Any, base_url: str, texts: list[str], tag: str, systems: list[str] | None = None
) -> tuple[float, int, int]:
    """The no-Kafka script: calls, reconstruct + audit in batches, JSONL rows in memory.

    ``systems``: a system prompt per text ("" for none), for prompts that offer tools there.
    """
    import msgspec

    from schemas import Message, PromptPublished
    from services.audit.core import audit_batch
    from services.common.kafka import DeadLetter
    from services.inference.adapters.request_bodies import chat_request_body
    from services.inference.adapters.wire import parse_openrouter
    from services.inference.core import response_event
    from services.profiles import load_profile
    from services.profiles.conventions import convention_for
    from services.reconstruct.core import reconstruct_batch
    from services.sink.core import row_line, training_row

    profile = await asyncio.to_thread(load_profile, settings.defaults.profile)
    convention = convention_for(settings.provider.kind, settings.provider.convention)
    dataset = settings.defaults
    thresholds = dataset.audit
    out = io.BytesIO()
    counts = {"accepted": 0, "rejected": 0}  # topology: not a topic
    limit = asyncio.Semaphore(settings.provider.concurrency)
    pending: list[Any] = []
    work: list[asyncio.Future[None]] = []

    def process(batch: list[Any]) -> None:
        samples = [s for s in reconstruct_batch(batch, profile, convention) if not isinstance(s, DeadLetter)]
        counts["rejected"] += len(batch) - len(samples)
        for audited in audit_batch(samples, profile, thresholds, audited_at=time.time()):
            if audited.passed:
                out.write(row_line(training_row(audited)))
                counts["accepted"] += 1  # topology: not a topic
            else:
                counts["rejected"] += 1

    async def one(client: httpx.AsyncClient, i: int, text: str) -> None:
        system = [Message(role="system", content=systems[i])] if systems and systems[i] else []
        messages = [*system, Message(role="user", content=text)]
        prompt = PromptPublished(dataset=DATASET, sample_id=f"{tag}-{i}", messages=messages)
        body = chat_request_body(
            prompt,
            dataset,
            model=settings.provider.model,
            max_tokens=dataset.max_tokens,
            extra_body=settings.provider.extra_body,
            logprobs=settings.provider.request_logprobs,
        )
        async with limit:
            t = time.monotonic()
            response = await client.post(
                f"{base_url}/chat/completions",
                content=msgspec.json.encode(body),
                headers={"Content-Type": "application/json"},
            )
            response.raise_for_status()
            parsed = parse_openrouter(msgspec.json.decode(response.content))
        pending.append(
            response_event(
                prompt,
                parsed,
                provider="simulator",
                model=settings.provider.model,
                profile=dataset.profile,
                tools_sent=False,
                max_tokens=dataset.max_tokens,
                latency_s=time.monotonic() - t,
                attempt=1,
                now=time.time(),
            )
        )
        if len(pending) >= BATCH:
            batch = pending[:]
            pending.clear()
            work.append(asyncio.ensure_future(asyncio.to_thread(process, batch)))

    t0 = time.monotonic()
    # The same HTTP client the inference worker uses, so the comparison is about Kafka.
    async with make_http_client(settings) as client:
        await asyncio.gather(*(one(client, i, text) for i, text in enumerate(texts)))
    if pending:
        work.append(asyncio.ensure_future(asyncio.to_thread(process, pending[:])))
    await asyncio.gather(*work)
    seconds = time.monotonic() - t0
    return seconds, counts["accepted"], counts["rejected"]  # topology: not a topic


class CpuMeter:
    """CPU seconds per process over one round: the stages, the simulator, the broker, this process."""

    def __init__(self, procs: list[Proc]) -> None:
        port = int(BOOTSTRAP.rsplit(":", 1)[1])
        self.pids = {p.name: p.pid for p in procs}
        broker = listener_pid(port)
        if broker is not None:
            self.pids["broker"] = broker
        self._start: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        out = {"bench": time.process_time()}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError):
                out[name] = pid_cpu_seconds(pid)
        return out

    def start(self) -> None:
        """Take the starting snapshot."""
        self._start = self._now()

    def used(self) -> dict[str, float]:
        """CPU seconds each process used since :meth:`start`."""
        now = self._now()
        return {n: now[n] - self._start[n] for n in now if n in self._start}

    def line(self, names: tuple[str, ...]) -> str:
        """CPU seconds used by ``names`` since :meth:`start`, and their total."""
        all_used = self.used()
        used = {n: all_used[n] for n in names if n in all_used}
        parts = ", ".join(f"{n} {v:.2f}" for n, v in used.items())
        return f"CPU s: {parts}; total {sum(used.values()):.2f}"


def print_profiles(work: Path, procs: list[Proc]) -> None:
    """Stop the stage processes (they write their cProfile stats) and print each one's top functions."""
    import pstats

    for proc in procs:
        if proc.name in STAGES:
            proc.stop()
            path = work / f"{proc.name}.prof"
            if not path.is_file():
                print(f"(no profile from {proc.name})", flush=True)
                continue
            stream = io.StringIO()
            pstats.Stats(str(path), stream=stream).sort_stats("tottime").print_stats(25)
            print(f"--- {proc.name}: top functions by own time\n{stream.getvalue()}", flush=True)


async def measure(quick: bool) -> list[Result]:
    """Warm up, then alternate pipeline and reference rounds over the same prompts."""
    from services.common.config import load_settings
    from services.common.kafka import ensure_topics

    # 2,000 prompts a round: the steady rate of a run. At 400 a round lasted about half a
    # second, of which the pipeline's fill and drain (five hops through the broker) were
    # a third, so the figure measured latency, not the rate of a run of thousands.
    n, rounds, warm = (60, 1, 1) if quick else (int(os.environ.get("BENCH_E2E_PROMPTS", "2000")), 5, 3)
    texts = prompt_texts(n, seed=2)
    prefix = unique_prefix("e2e")
    ours: list[float] = []
    ref: list[float] = []
    with workdir("e2e") as work, processes() as procs:
        port = free_port()
        sim = simulator_proc(work, port, latency=0.0)
        procs.append(sim)
        base = f"http://127.0.0.1:{port}"
        out_dir = work / "out"
        config = write_config(
            work / "bench.toml", base_sections(prefix, provider_url=f"{base}/api/v1", out_dir=out_dir)
        )
        settings = load_settings(config)
        await ensure_topics(settings.kafka, [DATASET])
        await wait_simulator(base, sim)
        profiling = bool(os.environ.get("BENCH_PROFILE"))
        for stage in STAGES:
            procs.append(stage_proc(stage, config, work, profile=work / f"{stage}.prof" if profiling else None))
        acct = Accounting(out_dir, settings)
        await acct.start()
        try:
            meter = CpuMeter(procs)
            for w in range(warm):
                meter.start()
                seconds, accepted, dead = await pipeline_round(config, work, acct, texts, f"warm{w}", procs)
                print(
                    f"warm-up {w + 1}: {n} prompts in {seconds:.1f}s ({accepted} accepted, {dead} dead letters); "
                    f"{meter.line((*STAGES, 'simulator', 'broker', 'bench'))}",
                    flush=True,
                )
            # The reference warms up too (its profile load, the simulator's cache for its bodies).
            seconds, accepted, rejected = await reference_round(settings, f"{base}/api/v1", texts, "ref-warm")
            print(f"reference warm-up: {n} prompts in {seconds:.1f}s ({accepted} accepted)", flush=True)
            for i in range(rounds):
                for which in ("ours", "ref") if i % 2 == 0 else ("ref", "ours"):
                    meter.start()
                    if which == "ours":
                        seconds, accepted, dead = await pipeline_round(config, work, acct, texts, f"r{i}", procs)
                        ours.append(n / seconds)
                        print(
                            f"round {i + 1} pipeline: {n / seconds:.1f} prompts/s "
                            f"({accepted} accepted, {dead} dead letters); "
                            f"{meter.line((*STAGES, 'simulator', 'broker', 'bench'))}",
                            flush=True,
                        )
                    else:
                        seconds, accepted, rejected = await reference_round(
                            settings, f"{base}/api/v1", texts, f"ref{i}"
                        )
                        ref.append(n / seconds)
                        print(
                            f"round {i + 1} reference: {n / seconds:.1f} prompts/s "
                            f"({accepted} accepted, {rejected} rejected); {meter.line(('simulator', 'bench'))}",
                            flush=True,
                        )
        finally:
            await acct.stop()
            if profiling:
                print_profiles(work, procs)
    await delete_topics(prefix)
    ratios = [o / r for o, r in zip(ours, ref, strict=True)]
    return [
        result(
            "end to end prompts/s (Kafka vs script)",
            median(ours),
            median(ref),
            median(ratios),
            ">= 0.85",
            "prompts/s",
            spread(ratios),
        )
    ]


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
