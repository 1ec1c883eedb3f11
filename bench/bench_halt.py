"""Benchmark 4: how fast a halt stops an inference worker with 10,000 requests in flight.

One inference worker (its own process) keeps ``provider.concurrency`` requests in flight
(10,000; 100 at ``--quick``)
against a slow simulator (its own process, real-time on a core of its own at full size where
allowed, as a provider has machines of its own; jittered latency so completions and refills
never stop). Each trial waits until the requests in flight at the simulator reach the
bound (or stop growing: in flight = rate x latency, the latency is long enough at 10,000
for the worker's rate to hold them), lets a random part of a latency pass, publishes a halt for the dataset (the record
``services.control.publish_control`` writes, sent on an already connected producer)
and records, per trial, the time from just before the send to the last request that reached
the simulator afterwards (0 when none did) **and** when the halt was in force in the worker
(the worker logs it); the stop time is the larger of the two, no request may reach the
simulator after the halt was in force (stamped later than that by more than the simulator
stamped a request of the bench's own sent at the halt: its loop stamps what arrives late at
this load, on a core of its own too), and a trial in which the worker was not sending at
the moment of the halt (no request stamped by the simulator from ``SENDING_S`` before it on,
asked once the halt has settled: the simulator's loop stamps late at 10,000 in flight) is not
counted: a frozen worker sends nothing, which the simulator alone would read as a fast stop.
Trials run until :data:`WANTED_TRIALS` are counted or :data:`MOST_TRIALS` have run.
The worker's cycle collections of 50 ms or more over the whole run are counted by generation. The
responses that landed after the halt are summed in completion tokens and compared
with the in-flight bound (concurrency x max_tokens): a worker that stops sending can
never exceed it. A resume starts the next trial; each trial's prompts are published
while the worker stands halted, so the backlog never has to hold every trial at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from pathlib import Path

import httpx

from bench.bench_concurrency import DATASET, inflight, publish_backlog, raise_fd_limit, ramp
from bench.common import (
    Result,
    base_sections,
    delete_topics,
    free_port,
    keep_off_simulator_core,
    main,
    percentile,
    processes,
    result,
    sim_stats,
    simulator_core,
    simulator_proc,
    stage_proc,
    unique_prefix,
    wait_simulator,
    workdir,
    write_config,
)

MAX_TOKENS = 512
QUIET_S = 1.5
TARGET_MS = 100.0
SENDING_S = 0.5
"""The worker counts as sending at the halt when the simulator stamped a request from this long before it on."""
SLOW_GC_MS = 50.0
WANTED_TRIALS = 8
"""Trials are run until this many counted..."""
MOST_TRIALS = 14
"""...or this many were run."""


async def stamp_lag(client: httpx.AsyncClient, base: str) -> float:
    """Seconds from sending a request to the simulator's stamp of it (its clock where it stamps chat requests)."""
    sent = time.time()
    stats = await sim_stats(client, base)
    return max(0.0, float(stats["now"]) - sent)


async def responses_after(config: Path, marks: list[tuple[float, float]]) -> list[tuple[int, int]]:
    """Per (halt, resume) window: (responses received inside it, their completion tokens)."""
    from aiokafka import TopicPartition

    from schemas import RESPONSES_TOPIC, ResponseReceived, decode
    from services.common.config import load_settings
    from services.common.kafka import make_consumer

    settings = load_settings(config)
    topic = settings.kafka.topic(RESPONSES_TOPIC)
    consumer = make_consumer(settings.kafka, group_id=None)
    await consumer.start()
    out = [(0, 0) for _ in marks]
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        if not tps:
            await consumer._client.force_metadata_update()  # noqa: SLF001 - first look at a new topic
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            batches = await consumer.getmany(timeout_ms=1000, max_records=2000)
            for records in batches.values():
                for record in records:
                    response = decode(record.value, ResponseReceived)
                    for i, (start, stop) in enumerate(marks):
                        if start < response.received_at <= stop:
                            n, tokens = out[i]
                            out[i] = (n + 1, tokens + (response.usage.completion_tokens or 0))
    finally:
        await consumer.stop()
    return out


def _in_force_ms(log_path: Path) -> list[str]:
    """How long after each halt it was in force in the worker, as the worker logged it."""
    text = log_path.read_text(errors="replace")
    return re.findall(rf"halt {DATASET} \(by bench\): bench; in force here (-?\d+) ms", text)


async def measure(quick: bool) -> list[Result]:
    """Halt trials against one worker; p99 stop time and worst token overshoot."""
    from schemas import CONTROL_TOPIC, Halt, Resume, encode
    from services.common.config import load_settings
    from services.common.kafka import make_producer
    from services.control import publish_control

    concurrency, latency, jitter = (100, 0.4, 0.4) if quick else (10_000, 10.0, 4.0)
    wanted, most = (3, 5) if quick else (WANTED_TRIALS, MOST_TRIALS)
    raise_fd_limit(concurrency + 4096)
    rng = random.Random(4)  # noqa: S311 - when to halt, not crypto
    ramp_s = 15.0 if quick else max(20.0, concurrency / 200)
    # Per trial: the ramp, one to two latencies of refills, the halt; published before each trial.
    per_trial = concurrency * 4
    prefix = unique_prefix("halt")
    delays: list[float] = []  # counted trials: the larger of the simulator's and the worker's figure
    after_in_force = 0  # requests the simulator saw after a halt was in force in the worker
    skipped = 0
    at_halt: list[int] = []
    marks: list[tuple[float, float]] = []
    with workdir("halt") as work, processes() as procs:
        port = free_port()
        # Jittered latency keeps completions (and refills) going at every moment, so a halt
        # always lands while the worker is about to send new requests.
        # On a core of its own (real-time, as a provider runs on machines of its own): sharing
        # the two cores with the worker, its loop stamped requests 100 ms and more after they
        # were written, which this benchmark would read as requests sent after a halt.
        # Pinned to that core, with the worker kept off it: unpinned, the real-time simulator
        # woke on the worker's core and preempted it for 50-70 ms at a time.
        sim = simulator_proc(
            work, port, latency=latency, jitter=jitter, reasoning="20-200", content="5-40", own_core=not quick,
            pinned=True,
        )
        procs.append(sim)
        shared = "no (--quick)" if quick else "no (not allowed here)"
        print(f"simulator on a core of its own: {f'yes, core {simulator_core()}' if sim.own_core else shared}",
              flush=True)
        base = f"http://127.0.0.1:{port}"
        config = write_config(
            work / "bench.toml",
            base_sections(
                prefix,
                provider_url=f"{base}/api/v1",
                out_dir=work / "out",
                provider={"concurrency": concurrency, "timeout_s": 60.0},
                defaults={"max_tokens": MAX_TOKENS},
            ),
        )
        settings = load_settings(config)
        await wait_simulator(base, sim)
        seconds = await publish_backlog(config, work, per_trial, tag="t0-")
        print(f"published {per_trial} prompts in {seconds:.1f}s", flush=True)
        worker = stage_proc("inference", config, work)
        procs.append(worker)
        if sim.own_core:
            apart = keep_off_simulator_core(worker.pid)
            print(f"worker kept off the simulator's core: {'yes' if apart else 'no'}", flush=True)
        control_topic = settings.kafka.topic(CONTROL_TOPIC)
        producer = make_producer(settings.kafka)
        await producer.start()
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(producer.stop)
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=10.0))

            trial = 0
            while len(delays) < wanted and trial < most:

                # In flight = rate x latency: the bound, or as many as the worker keeps going.
                await ramp(client, base, concurrency, ramp_s, [worker, sim], f"trial {trial + 1}", latency)
                # Halt at a random moment of the steady state (completions and refills ongoing).
                await asyncio.sleep(rng.uniform(latency, latency + jitter))
                n_inflight = await inflight(client, base)
                t_halt = time.time()
                # What publish_control sends, on a producer already connected: the clock
                # starts at the send, not at a client's connection setup.
                halt = Halt(scope=DATASET, reason="bench", by="bench", at=t_halt)
                lag = asyncio.create_task(stamp_lag(client, base))  # how late the simulator stamps now
                await producer.send_and_wait(control_topic, encode(halt), key=halt.scope.encode())
                # The halt took effect once no request has arrived for QUIET_S.
                last = t_halt
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    s = await sim_stats(client, base)
                    last = max(last, float(s["last_request_at"] or 0.0))
                    quiet_for = time.time() - max(last, t_halt)
                    if quiet_for > max(QUIET_S, latency + 0.5) and await inflight(client, base) == 0:
                        break
                delay = max(0.0, last - t_halt)
                at_halt.append(n_inflight)
                sending = int((await sim_stats(client, base, after=t_halt - SENDING_S))["requests_after"]) > 0
                trial += 1
                in_force = _in_force_ms(worker.log_path)
                force_ms = float(in_force[-1]) if len(in_force) >= trial else None
                # A request stamped after the halt was in force, later than the simulator's stamps
                # lagged at the halt: written after it, not merely stamped after it.
                stamps_late_s = await lag
                late = force_ms is not None and last > t_halt + force_ms / 1000 + stamps_late_s
                after_in_force += int(late)
                if sending and force_ms is not None:
                    delays.append(max(delay, force_ms / 1000))
                    verdict = "counted"
                else:
                    skipped += 1
                    verdict = "not counted (" + (
                        "the worker was not sending at the halt)" if force_ms is not None
                        else "the worker logged no time the halt was in force)"
                    )
                print(
                    f"trial {trial}: {n_inflight} in flight at the halt; last new request "
                    f"{delay * 1000:.0f} ms after it (stamped by the simulator); in force in the worker "
                    f"{'?' if force_ms is None else f'{force_ms:.0f}'} ms after it; the simulator stamped "
                    f"{stamps_late_s * 1000:.0f} ms late at the halt; "
                    f"{'a request after it was in force; ' if late else ''}{verdict}",
                    flush=True,
                )
                if len(delays) < wanted and trial < most:
                    await publish_backlog(config, work, per_trial, tag=f"t{trial}-")
                marks.append((t_halt, time.time()))
                await publish_control(settings, Resume(scope=DATASET, reason="bench", by="bench"))
        worker.check()
        found = re.findall(
            r"cycle collection of generation (\d) took (\d+) ms \((\d+) ms of CPU",
            worker.log_path.read_text(errors="replace"),
        )
        slow = [(gen, int(ms), int(cpu)) for gen, ms, cpu in found if int(ms) >= SLOW_GC_MS]
        pauses = [ms for _, ms, _ in slow]
        print(
            f"the worker's cycle collections of {SLOW_GC_MS:.0f} ms or more: {len(pauses)}"
            + (
                f" (by generation {({g: sum(1 for gen, _, _ in slow if gen == g) for g in '012'})}), "
                f"median {percentile(pauses, 50):.0f} ms, longest {max(pauses)} ms; of CPU time: "
                + ", ".join(f"{cpu} of {ms} ms" for _, ms, cpu in slow)
                if pauses
                else ""
            ),
            flush=True,
        )
        windows = await responses_after(config, marks)
    await delete_topics(prefix)
    bound = concurrency * MAX_TOKENS
    worst = max(tokens for _, tokens in windows)
    worst_n = max(n for n, _ in windows)
    p99_ms = percentile(delays, 99) * 1000 if delays else float("inf")
    print(
        f"halt stop time (the larger of the simulator's and the worker's) over {len(delays)} counted trials "
        f"({skipped} not counted): median {percentile(delays, 50) * 1000 if delays else float('inf'):.0f} ms, "
        f"p99 {p99_ms:.0f} ms; after the halt at most {worst_n} responses ({worst} tokens) landed, "
        f"in-flight bound {concurrency} requests x {MAX_TOKENS} = {bound} tokens",
        flush=True,
    )
    return [
        result(
            f"halt stop time p99 @{concurrency:,} in flight ({len(delays)} trials)",
            p99_ms,
            TARGET_MS,
            p99_ms / TARGET_MS,
            "<= 1.0",
            "ms",
        ),
        result(
            f"counted halt trials (of {len(delays) + skipped} run)", float(len(delays)), float(wanted),
            len(delays) / wanted, ">= 1.0", "trials",
        ),
        result("halt overshoot vs in-flight bound", float(worst), float(bound), worst / bound, "<= 1.0", "tokens"),
        result(
            "requests after a halt was in force", float(after_in_force), 0.0, float(after_in_force), "<= 0.0",
            "requests",  # topology: not a topic
        ),
        result(f"worker cycle collections >= {SLOW_GC_MS:.0f} ms", float(len(pauses)), 0.0, float(len(pauses)),
               "<= 0.0", "collections"),
    ]


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
