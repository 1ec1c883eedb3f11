"""Benchmark 8: the seeds' shape on one machine, at three sizes, and how each cost grows.

``BENCH_SCALE_PROMPTS`` prompts in all (default 16,000), then half and a quarter of that,
each size on fresh topics: 8 datasets (three offer tools in a Glaive-style system prompt;
two, three times the others' size, carry completion caps of 10M tokens scaled to the size
so that they halt at it), answers 500-16,000 tokens log-uniform with 80-95 % reasoning
(the simulator's ``--answer-tokens``), a tenth of the prompts 20,000-60,000 tokens long,
``provider.concurrency`` = 1,000, every stage (inference, reconstruct, audit, sink, budget)
in its own process on one broker, a zero-latency simulator in its own, on a core of its own
in both runs (real-time; the provider it stands in for does not share our cores).

Per size it prints: prompts/s and completion tokens/s end to end (publish start to the
last prompt accounted for: an accepted row, a dead letter, or held by its dataset's halt)
against the no-Kafka script of benchmark 2 on the same prompts (so the same answers), peak
RSS per service, broker disk per topic (DescribeLogDirs), each stage's CPU seconds per
1,000 prompts, each cap's overshoot against the in-flight bound, and, after the run with
every response in the store: the start-up time of an inference worker reading every stored
value (``store_index = false``) and reading ``response-index`` (the default),
of the budget service and of ``status``. Then each figure's growth law over the three sizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.bench_e2e import Accounting, CpuMeter, reference_round
from bench.broker_disk import disk_per_topic
from bench.common import (
    BOOTSTRAP,
    Result,
    base_sections,
    delete_topics,
    free_port,
    main,
    processes,
    result,
    simulator_proc,
    stage_proc,
    unique_prefix,
    wait_simulator,
    workdir,
    write_config,
)
from schemas import DEAD_LETTER_TOPIC, RESPONSE_INDEX_TOPIC

# name, weight (share of the prompts), offers tools, capped
DATASETS = (
    ("math", 3, False, True),
    ("chat", 3, False, True),
    ("tools", 1, True, False),
    ("glaive", 1, True, False),
    ("agent", 1, True, False),
    ("code", 1, False, False),
    ("reason", 1, False, False),
    ("stem", 1, False, False),
)
SERVICES = ("inference", "reconstruct", "audit", "sink", "budget")
CONCURRENCY = 1000
MAX_TOKENS = 17_000
SEEDS_CAP = 10_000_000  # completion tokens, at the default size
DEFAULT_PROMPTS = 16_000
# The simulator (both runs) on a core of its own, real-time (bench.common.give_own_core);
# BENCH_SCALE_SHARED_SIMULATOR=1 leaves it sharing the cores as before 2026-12-04.
OWN_CORE = os.environ.get("BENCH_SCALE_SHARED_SIMULATOR", "0") != "1"
_WORDS = ("the", "patch", "file", "test", "error", "function", "returns", "value", "line", "diff", "repo", "output")
_TOOLS = (
    "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
    + json.dumps(
        {
            "name": "run_shell",
            "description": "Run a shell command in the repository",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
        indent=4,
    )
)


# ----------------------------------------------------------------- the prompts
def sizes_of(total: int) -> dict[str, int]:
    """Prompts per dataset for ``total`` in all (by weight, at least 2 each)."""
    weights = sum(w for _, w, _, _ in DATASETS)
    return {name: max(2, total * w // weights) for name, w, _, _ in DATASETS}


def prompts_of(name: str, count: int, tools: bool, seed: int) -> list[tuple[str, str, str]]:
    """(sample id, system prompt, user text) rows; every tenth prompt is 20,000-60,000 tokens long."""
    rng = random.Random(f"{name}-{seed}")  # noqa: S311 - benchmark data
    rows = []
    for i in range(count):
        text = f"{name} task {seed}-{i}: fix the failing test and explain the change (case {rng.randint(0, 10**9)})."
        if i % 10 == 9:  # an agent trajectory: a long history before the question
            words = int(math.exp(rng.uniform(math.log(20_000), math.log(60_000))))
            text = " ".join(rng.choice(_WORDS) for _ in range(words)) + "\n" + text
        rows.append((f"{name}-{seed}-{i}", _TOOLS if tools else "", text))
    return rows


def write_rows(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    """The rows as OpenAI ``messages`` JSONL (publish keeps the ids)."""
    with path.open("w") as f:
        for sample_id, system, text in rows:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            f.write(json.dumps({"id": sample_id, "messages": messages}) + "\n")
    return path


def cap_for(total: int) -> int:
    """The seeds' 10M cap scaled to the run's size (a capped dataset needs about twice that)."""
    return max(1, SEEDS_CAP * total // DEFAULT_PROMPTS)


# ----------------------------------------------------------------- one size
async def _halted(settings: Any) -> set[str]:
    from schemas import Halt
    from services.control import read_control_state

    return {scope for scope, e in (await read_control_state(settings)).items() if isinstance(e, Halt)}


async def startups(config: Path) -> dict[str, Any]:
    """Start-up seconds with every response in the store: inference before/after the index, budget, status."""
    from services.budget.app import create_app as budget_app
    from services.common.config import load_settings
    from services.inference.app import create_app as inference_app
    from services.status.app import collect

    out: dict[str, Any] = {}
    for label, use_index in (("inference (reads every value)", False), ("inference (response-index)", True)):
        settings = load_settings(config, inference={"store_index": use_index})
        worker = inference_app(settings)
        t0 = time.monotonic()
        await worker.start()
        out[label] = time.monotonic() - t0
        assert worker.store is not None  # noqa: S101 - reuse_responses is on
        out[f"{label} MB read"] = worker.store.tail_bytes / 1e6
        await worker.close()
    settings = load_settings(config)
    budget = budget_app(settings)
    t0 = time.monotonic()
    await budget.start()
    out["budget"] = time.monotonic() - t0
    await budget.abort()
    t0 = time.monotonic()
    await collect(settings)
    out["status"] = time.monotonic() - t0
    return out


async def _sim_stats(base: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30.0) as http:
        response = await http.get(f"{base}/_sim/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats


async def run_size(total: int, seed: int, *, kills: bool = False) -> dict[str, Any]:
    """One size: the pipeline run, the reference on the same prompts, then the start-ups.

    ``kills``: SIGKILL each stage once while prompts flow (restarted at once), then count what
    was lost, written twice and paid twice instead of timing (no reference, no start-ups).
    """
    from services.common.config import load_settings
    from services.common.kafka import ensure_topics
    from services.control import read_budget_snapshots
    from services.publish.app import publish

    prefix = unique_prefix(f"scale{total}")
    counts = sizes_of(total)
    cap = cap_for(total)
    figures: dict[str, Any] = {"size": sum(counts.values()), "cap": cap}
    with workdir("scale") as work, processes() as procs:
        port = free_port()
        seeds_shape = ("--answer-tokens", "500-16000", "--reasoning-share", "0.8")
        sim = simulator_proc(work, port, latency=0.0, extra=seeds_shape, own_core=OWN_CORE)
        figures["simulator_own_core"] = sim.own_core
        procs.append(sim)
        base = f"http://127.0.0.1:{port}"
        out_dir = work / "out"
        datasets = {
            name: {"max_tokens": MAX_TOKENS, "cap_completion_tokens": cap if capped else 10**12}
            for name, _, _, capped in DATASETS
        }
        sections = base_sections(
            prefix,
            provider_url=f"{base}/api/v1",
            out_dir=out_dir,
            provider={"concurrency": CONCURRENCY, "timeout_s": 300.0},
            defaults={"max_tokens": MAX_TOKENS},
            # Count answers, not the in-flight worst case: at 1,000 in flight x 17,000 max_tokens the
            # worst case alone passes a scaled cap before the first answer (docs/bench-history.md, 2026-12-01).
            budget={"include_inflight": False},
            datasets=datasets,
        )
        config = write_config(work / "scale.toml", sections)
        settings = load_settings(config)
        await ensure_topics(settings.kafka, list(counts))
        await wait_simulator(base, sim)
        stages = {name: stage_proc(name, config, work) for name in SERVICES}
        procs.extend(stages.values())
        rows = {name: prompts_of(name, counts[name], tools, seed) for name, _, tools, _ in DATASETS}
        keys = {name: {f"{name}:{r[0]}" for r in rows[name]} for name in rows}
        acct = Accounting(out_dir, settings, datasets="*")
        await acct.start()
        capped = {name for name, _, _, c in DATASETS if c}
        await asyncio.sleep(15.0)  # the services load their tokenizers: not part of the per-prompt cost
        cpu0 = {name: proc.cpu_seconds() for name, proc in stages.items()}
        others = CpuMeter([sim])  # the simulator, the broker and this process (which publishes)
        others.start()
        to_kill = list(SERVICES) if kills else []
        killed: list[str] = []
        killed_at = -1
        t0 = time.monotonic()
        try:
            for name in counts:
                await publish(settings, [write_rows(work / f"{name}.jsonl", rows[name])], dataset=name)
            last_change, last_done, halted = t0, -1, set[str]()
            while True:
                for p in procs:
                    if p.name not in killed:  # a killed stage's old process (its new one has a new name)
                        p.check()
                done = {name: sum(acct.count(keys[name])) for name in keys}
                finished = all(done[n] >= counts[n] for n in counts if n not in capped)
                if sum(done.values()) != last_done:
                    last_done, last_change = sum(done.values()), time.monotonic()
                # The kills: one stage each time another seventh of the uncapped datasets' prompts is
                # accounted for (a capped dataset may halt at its cap before the last kill was due).
                progress = sum(done[n] for n in counts if n not in capped)
                due = sum(counts[n] for n in counts if n not in capped) * (len(killed) + 1) / (len(SERVICES) + 2)
                if to_kill and progress > killed_at and progress >= due:
                    killed_at = progress  # the next kill waits for progress after this one
                    name = to_kill.pop(0)
                    stages[name].popen.kill()
                    stages[name].popen.wait()
                    killed.append(name)
                    stages[name] = stage_proc(name, config, work, name=f"{name}-{len(killed)}")
                    procs.append(stages[name])
                    print(f"SIGKILL {name} at {sum(done.values()):,} accounted for; restarted", flush=True)
                halted = await _halted(settings)
                if finished and not to_kill and all(done[n] >= counts[n] or n in halted for n in capped):
                    if time.monotonic() - last_change > 10.0:  # the halted datasets' in-flight answers landed
                        break
                if time.monotonic() - t0 > 3600:
                    raise TimeoutError(f"size {total}: not accounted for within an hour: {done}")
                await asyncio.sleep(0.5)
            seconds = last_change - t0
            answered = set().union(*(keys[n] & (acct.accepted | acct.dead) for n in keys))
        finally:
            await acct.stop()
        await asyncio.sleep(2.0)  # one more budget checkpoint
        snapshots = await read_budget_snapshots(settings)
        figures["halted"] = sorted(halted)
        figures["answered"] = len(answered)
        figures["held_by_halt"] = sum(counts.values()) - len(answered)
        figures["rows"] = len(answered & acct.accepted)
        figures["overshoot"] = {n: snapshots[n].completion_tokens - cap for n in sorted(capped) if n in snapshots}
        figures["inflight_bound"] = CONCURRENCY * MAX_TOKENS
        if kills:
            for proc in stages.values():
                proc.stop()
            per_key = (await _sim_stats(base))["keys"]
            published = set().union(*keys.values())
            lost = {k for n in keys if n not in capped or n not in halted for k in keys[n] - answered}
            figures["kills"] = killed
            figures["lost"] = len(lost)
            figures["duplicate_rows"] = sum(c - 1 for c in acct.rows.values() if c > 1)
            figures["foreign"] = len((acct.accepted | acct.dead) - published)
            figures["paid_twice"] = sum(c - 1 for c in per_key.values() if c > 1)
            figures["paid_twice_bound"] = CONCURRENCY * killed.count("inference")
            await delete_topics(prefix)
            return figures
        figures["rss_mib"] = {name: proc.vm_hwm_kib() / 1024 for name, proc in stages.items()}
        per_1000 = 1000 / max(1, len(answered))
        figures["cpu_s_per_1000"] = {
            name: (proc.cpu_seconds() - cpu0[name]) * per_1000 for name, proc in stages.items()
        } | {f"{name} (pipeline run)": v * per_1000 for name, v in others.used().items()}
        for proc in stages.values():
            proc.stop()
        tokens = snapshots["global"].completion_tokens if "global" in snapshots else 0
        figures["pipeline_prompts_s"] = len(answered) / seconds
        figures["pipeline_tokens_s"] = tokens / seconds
        figures["disk_mb"] = {t: b / 1e6 for t, b in sorted((await disk_per_topic(prefix)).items())}
        # The no-Kafka script on exactly the prompts the pipeline answered (the same answers), against
        # a fresh simulator: it generates every answer again, as it did for the pipeline (its cache
        # would otherwise hand the script answers the pipeline paid the generation of).
        sim.stop()
        sim = simulator_proc(work, port, latency=0.0, extra=seeds_shape, name="simulator-reference",
                             own_core=OWN_CORE)
        figures["simulator_own_core"] &= sim.own_core  # both runs alike, or the ratio compares two set-ups
        procs.append(sim)
        await wait_simulator(base, sim)
        chosen = [r for n in rows for r in rows[n] if f"{n}:{r[0]}" in answered]
        others = CpuMeter([sim])
        others.start()
        ref_s, _, _ = await reference_round(
            settings, f"{base}/api/v1", [r[2] for r in chosen], f"ref{total}", [r[1] for r in chosen]
        )
        figures["cpu_s_per_1000"] |= {
            f"{'script' if name == 'bench' else name} (script run)": v * per_1000
            for name, v in others.used().items()
            if name != "broker"
        }
        figures["reference_prompts_s"] = len(chosen) / ref_s
        figures["reference_tokens_s"] = tokens / ref_s  # the same answers: the same tokens
        figures["startup_s"] = await startups(config)
    await delete_topics(prefix)
    return figures


@contextlib.asynccontextmanager
async def scratch(name: str) -> AsyncIterator[tuple[Any, Any, str]]:
    """(settings, started producer, prefix) on fresh topics, deleted afterwards."""
    from services.common.config import load_settings
    from services.common.kafka import ensure_topics, make_producer

    prefix = unique_prefix(name)
    settings = load_settings(None, kafka={"bootstrap_servers": BOOTSTRAP, "topic_prefix": prefix})
    await ensure_topics(settings.kafka, [])
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        yield settings, producer, prefix
    finally:
        await producer.stop()
        await delete_topics(prefix)


async def send_all(producer: Any, topic: str, records: Iterator[tuple[bytes, bytes, list[tuple[str, bytes]]]]) -> None:
    """Send (key, value, headers) records, 500 acknowledgements at a time."""
    acks = []
    for key, value, headers in records:
        acks.append(await producer.send(topic, value, key=key, headers=headers))
        if len(acks) >= 500:
            await asyncio.gather(*acks)
            acks.clear()
    await asyncio.gather(*acks)


async def index_load(n: int) -> str:
    """The index load alone with ``n`` paid responses on ``response-index`` (written here, tiny records).

    The three sizes are too small to show the index's own cost; this is its law's constant.
    """
    import hashlib
    import resource

    from schemas import ResponseIndexed, StoreCheckpointed, encode
    from services.inference.store_index import StoreIndex, checkpoint_key

    def records() -> Iterator[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
        for i in range(n):
            key = f"agent:sample-{i:08d}|{hashlib.sha256(str(i).encode()).hexdigest()}".encode()
            yield key, encode(ResponseIndexed(partition=i % 3, offset=i // 3)), []
        for p in range(3):
            yield checkpoint_key(p).encode(), encode(StoreCheckpointed(partition=p, next_offset=n // 3)), []

    async with scratch("index") as (settings, producer, prefix):
        topic = settings.kafka.topic(RESPONSE_INDEX_TOPIC)
        await send_all(producer, topic, records())
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0, cpu0 = time.monotonic(), time.process_time()
        loaded = await StoreIndex(settings.kafka, producer, topic).load([0, 1, 2], 600.0)
        seconds, cpu = time.monotonic() - t0, time.process_time() - cpu0
        rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        disk = (await disk_per_topic(prefix)).get(RESPONSE_INDEX_TOPIC, 0) / 1e6
    return (
        f"index load with {len(loaded.entries):,} paid responses: {seconds:.2f} s wall, {cpu:.2f} s CPU, "
        f"peak RSS +{rss:.0f} MiB, {disk:.0f} MB on the broker"
    )


async def status_with_dead_letters(n: int) -> str:
    """``status`` (which reads the whole ``dead-letter`` topic) with 0 and ``n`` dead letters of 35 KB."""
    from services.status.app import collect

    rng = random.Random(1)  # noqa: S311 - benchmark data
    words = [f"w{i}" for i in range(5000)]
    headers = [("draftstream.errors.stage", b"audit"), ("draftstream.errors.reason", b"usage_matches")]

    def records() -> Iterator[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
        for i in range(n):  # an answer's size, text that compresses like text
            yield f"d:{i}".encode(), " ".join(rng.choice(words) for _ in range(6000)).encode()[:35_000], headers

    async with scratch("status") as (settings, producer, _):
        t0 = time.monotonic()
        await collect(settings)
        empty = time.monotonic() - t0
        await send_all(producer, settings.kafka.topic(DEAD_LETTER_TOPIC), records())
        t0 = time.monotonic()
        snapshot = await collect(settings)
        full = time.monotonic() - t0
        await _tallied_by_budget(settings, n)
        t0 = time.monotonic()
        tallied = await collect(settings)
        bounded = time.monotonic() - t0
    count = sum(snapshot.dead_letters.values())
    assert sum(tallied.dead_letters.values()) == count  # noqa: S101 - the tally counts what the read counted
    return (
        f"status with 0 dead letters {empty:.2f} s; with {count:,} of 35 KB {full:.2f} s read whole (no budget ran), "
        f"{bounded:.2f} s from the budget's tally"
    )


async def _tallied_by_budget(settings: Any, n: int) -> None:
    """Run the budget service until its checkpoint's tally covers ``n`` dead letters."""
    from services.budget.app import create_app as budget_app
    from services.control import read_budget_snapshots

    budget = budget_app(settings, checkpoint_interval_s=0.5)
    await budget.start()
    task = asyncio.create_task(budget.run())
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            snap = (await read_budget_snapshots(settings)).get("global")
            if snap is not None and sum(sum(r.values()) for r in (snap.dead_letters or {}).values()) >= n:
                return
            await asyncio.sleep(1.0)
        raise TimeoutError(f"the budget did not tally {n:,} dead letters within 10 minutes")
    finally:
        budget.stop()
        await asyncio.wait_for(task, 60)
        await budget.close()


# ----------------------------------------------------------------- the report
def law(small: float, large: float, ratio: float) -> str:
    """The growth law between two sizes ``ratio`` apart, from the log-log slope."""
    if small <= 0 or large <= 0:
        return "-"
    k = math.log(large / small) / math.log(ratio)
    if k < 0.3:
        return f"constant (n^{k:.2f})"
    if 0.7 <= k <= 1.3:
        return f"linear (n^{k:.2f})"
    return f"n^{k:.2f}"


def flat(figures: dict[str, Any]) -> dict[str, float]:
    """One size's figures as ``name -> number`` rows."""
    rows: dict[str, float] = {
        "prompts/s end to end": figures["pipeline_prompts_s"],
        "prompts/s no-Kafka script": figures["reference_prompts_s"],
        "ratio (Kafka / script)": figures["pipeline_prompts_s"] / figures["reference_prompts_s"],
        "completion tokens/s end to end": figures["pipeline_tokens_s"],
    }
    rows.update({f"peak RSS MiB {n}": v for n, v in figures["rss_mib"].items()})
    rows.update({f"CPU s / 1,000 prompts {n}": v for n, v in figures["cpu_s_per_1000"].items()})
    rows.update({f"disk MB {t}": v for t, v in figures["disk_mb"].items()})
    rows.update({f"overshoot tokens {n}": v for n, v in figures["overshoot"].items()})
    rows.update({f"start-up s {n}": v for n, v in figures["startup_s"].items()})
    return rows


def kill_line(f: dict[str, Any]) -> str:
    """The run with one SIGKILL of each stage, as one line."""
    return (
        f"SIGKILL of {', '.join(f['kills'])} at {f['size']:,} prompts: {f['answered']:,} answered "
        f"({f['rows']:,} accepted), held by the caps' halts {f['held_by_halt']:,}, lost {f['lost']}, "
        f"duplicate rows {f['duplicate_rows']}, keys nobody published {f['foreign']}, "
        f"paid twice {f['paid_twice']} (bound: {f['paid_twice_bound']:,} in flight at the inference kill)"
    )


def report(all_figures: list[dict[str, Any]]) -> str:
    """A Markdown table: one column per size, the growth law last."""
    flats = [flat(f) for f in all_figures]
    names = [n for n in flats[0] if all(n in f for f in flats)]
    sizes = [f["size"] for f in all_figures]
    lines = [
        "| figure | " + " | ".join(f"{s:,} prompts" for s in sizes) + " | growth law |",
        "|---|" + "---|" * (len(sizes) + 1),
    ]
    for name in names:
        values = [f[name] for f in flats]
        ratio = sizes[0] / sizes[-1]
        growth = law(values[-1], values[0], ratio) if "ratio" not in name and "/s" not in name else "-"
        lines.append(f"| {name} | " + " | ".join(f"{v:,.2f}" for v in values) + f" | {growth} |")
    extra = [
        f"{f['size']:,}: cap {f['cap']:,} tokens; answered {f['answered']:,} ({f['rows']:,} accepted), "
        f"held by the caps' halts "
        f"{f['held_by_halt']:,}, halted {', '.join(f['halted']) or 'none'}, in-flight bound {f['inflight_bound']:,}; "
        f"simulator on a core of its own: {'yes' if f.get('simulator_own_core') else 'no'}"
        for f in all_figures
    ]
    return "\n".join(lines + [""] + extra)


async def measure(quick: bool) -> list[Result]:
    """The three sizes, largest first, then the table."""
    total = 48 if quick else int(os.environ.get("BENCH_SCALE_PROMPTS", str(DEFAULT_PROMPTS)))
    all_figures = []
    for i, size in enumerate((total, total // 2, total // 4)):
        figures = await run_size(size, seed=i)
        print(json.dumps(figures, indent=1), flush=True)
        all_figures.append(figures)
    print(report(all_figures), flush=True)
    if os.environ.get("BENCH_SCALE_KILLS", "1") != "0":
        kill = await run_size(total // 4, seed=3, kills=True)
        print(json.dumps(kill, indent=1), flush=True)
        print(kill_line(kill), flush=True)
    entries = 2000 if quick else int(os.environ.get("BENCH_SCALE_INDEX", "500000"))
    if entries:
        print(await index_load(entries), flush=True)
    dead = 50 if quick else int(os.environ.get("BENCH_SCALE_DEAD_LETTERS", "20000"))
    if dead:
        print(await status_with_dead_letters(dead), flush=True)
    full = all_figures[0]
    ratio = full["pipeline_prompts_s"] / full["reference_prompts_s"]
    startup = full["startup_s"]
    return [
        result("scale: end to end prompts/s (Kafka vs script)", full["pipeline_prompts_s"],
               full["reference_prompts_s"], ratio, ">= 0.85", "prompts/s"),
        result("scale: inference start-up, full store (index vs every value)", startup["inference (response-index)"],
               startup["inference (reads every value)"],
               startup["inference (response-index)"] / max(1e-9, startup["inference (reads every value)"]),
               "<= 1.0", "s"),
        result("scale: largest peak RSS vs 1.5 GiB", max(full["rss_mib"].values()), 1536.0,
               max(full["rss_mib"].values()) / 1536.0, "<= 1.0", "MiB"),
    ]


def run(quick: bool) -> list[Result]:
    """Entry point (not in bench.run's list: ``make bench-scale`` runs it alone)."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
