"""Issue 13's inference acceptance: never pay twice, check before spending, halt on an outage.

A real broker, the simulator over real HTTP; provider requests are counted where they are
paid, at the simulator (``stats()["keys"]``: chat requests per ``<dataset>:<sample_id>``).

- re-publishing 400 prompts straight to the topic: 0 new provider requests, 0 new rows;
- a graceful stop mid-run and a restart: requests == prompts exactly; a SIGKILL mid-run:
  prompts paid twice ≤ requests in flight at the kill;
- reconstruct dead letters from a wrong profile, replayed after the fix: 0 new requests,
  all accepted;
- a bad profile, a wrong base URL, a missing key: 0 requests, a halt with the reason in
  ``status``;
- the simulator down (connection refused) for ~8 s: a halt within ``outage_after``
  failures, an automatic resume, every prompt answered, no dead letter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import Halt, Resume
from services.audit.app import create_app as audit_app
from services.budget.app import create_app as budget_app
from services.common.config import Settings
from services.common.kafka import ensure_topics
from services.dlq.app import replay
from services.dlq.core import Filters
from services.inference.app import InferenceWorker
from services.inference.app import create_app as inference_app
from services.inference.core import OUTAGE_ACTOR, PREFLIGHT_ACTOR
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import RunningSimulator, start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from services.status.app import collect
from services.status.core import render
from tests.e2e.harness import (
    Pipeline,
    accepted_keys,
    control_events,
    dead_letters,
    produce,
    prompt_value,
    read_all,
    responses,
    small_prompt,
    stage_caught_up,
    wait_until,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
FAST = {"reasoning_tokens": (4, 12), "content_tokens": (4, 12)}


def provider(sim: RunningSimulator, **kw: Any) -> dict[str, Any]:
    """Provider settings for the simulator: quick retries, quick probes."""
    return {
        "kind": "simulator",
        "base_url": sim.url,
        "concurrency": 32,
        "max_attempts": 3,
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.3,
        "timeout_s": 10.0,
        "probe_interval_s": 0.5,
        **kw,
    }


def paid(*sims: RunningSimulator) -> Counter[str]:
    """Chat requests per key that reached the simulator(s): what the provider bills."""
    total: Counter[str] = Counter()
    for sim in sims:
        total.update(sim.stats()["keys"])
    return total


@contextlib.asynccontextmanager
async def worker_running(settings: Settings, **kw: Any) -> AsyncIterator[tuple[InferenceWorker, asyncio.Task[None]]]:
    """An inference worker running in the background; stopped gracefully unless already done."""
    worker = inference_app(settings, **kw)
    await worker.start()
    task = asyncio.create_task(worker.run())
    try:
        yield worker, task
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=60)
        await worker.close()


# --- never pay twice ----------------------------------------------------------------------


async def test_republishing_the_same_prompts_pays_nothing_and_writes_no_row(
    settings_factory: Callable[..., Settings], report: Callable[..., str]
) -> None:
    dataset, n = "again", 400
    sim = await start_simulator(SimulatorOptions(**FAST))
    settings = settings_factory(provider=provider(sim))
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, [dataset])
    keys = {f"{dataset}:{small_prompt(dataset, i).sample_id}" for i in range(n)}
    values = [prompt_value(dataset, i) for i in range(n)]

    async def settled() -> bool:
        done = set(accepted_keys(out_dir)) | {d.key for d in await dead_letters(settings)}
        return done == keys

    pipeline = Pipeline()
    try:
        worker = await pipeline.start("inference", inference_app(settings))
        assert isinstance(worker, InferenceWorker)
        budget = await pipeline.start("budget", budget_app(settings))
        await pipeline.start("reconstruct", reconstruct_app(settings))
        await pipeline.start("audit", audit_app(settings))
        await pipeline.start("sink", sink_app(settings))
        await produce(settings, settings.kafka.prompts_topic(dataset), values)
        await pipeline.wait(settled, 180, "every prompt accepted or dead-lettered")
        paid_first = sum(paid(sim).values())
        rows_first = accepted_keys(out_dir)
        samples_topic = settings.kafka.topic("samples")
        samples_first = len((await read_all(settings, samples_topic))[samples_topic])

        # The same prompts again, straight to the topic (no publish-side dedup).
        await produce(settings, settings.kafka.prompts_topic(dataset), values)
        await pipeline.wait(lambda: worker.answers.reused >= n, 120, f"the {n} answered from the response store")

        async def downstream_done() -> bool:
            return len((await read_all(settings, samples_topic))[samples_topic]) >= 2 * samples_first

        await pipeline.wait(downstream_done, 120, "the re-sent responses rebuilt again")
        for stage in ("audit", "sink"):  # the re-sent samples audited, their accepted records written
            await pipeline.wait(lambda stage=stage: stage_caught_up(settings, stage), 60, f"{stage} caught up")
        counted = budget.ledger.scopes["global"].responses  # type: ignore[attr-defined]
    finally:
        await pipeline.stop()
        await sim.close()
    rows_after = accepted_keys(out_dir)
    on_topic = await responses(settings)
    reused = [r for r in on_topic if r.reused]
    report(
        prompts=n,
        paid_first=paid_first,
        paid_after_republish=sum(paid(sim).values()),
        reused=len(reused),
        rows_first=sum(rows_first.values()),
        rows_after=sum(rows_after.values()),
        budget_responses=counted,
    )
    assert paid_first == n and max(paid(sim).values()) == 1
    assert sum(paid(sim).values()) == paid_first  # 0 new provider requests
    assert rows_after == rows_first and max(rows_after.values()) == 1  # 0 new rows
    assert len(reused) == n and all(r.request_hash for r in on_topic)
    assert counted == n  # the budget did not count the re-sent responses again


async def test_graceful_stop_then_restart_pays_each_prompt_exactly_once(
    settings_factory: Callable[..., Settings], report: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    dataset, n = "stopgo", 400
    caplog.set_level(logging.INFO, logger="services.inference.app")
    sim = await start_simulator(SimulatorOptions(latency_s=0.1, latency_jitter_s=0.4, **FAST))
    settings = settings_factory(provider=provider(sim, concurrency=48), inference={"progress_interval_s": 0.5})
    await ensure_topics(settings.kafka, [dataset])
    await produce(settings, settings.kafka.prompts_topic(dataset), [prompt_value(dataset, i) for i in range(n)])
    try:
        async with worker_running(settings) as (worker, task):
            await wait_until(lambda: worker.answers.responded >= 100, timeout=60, message="100 responses")
            inflight_at_stop = len(worker.inflight)
            worker.stop()  # what SIGINT does (services.common.service.run_service)
            await asyncio.wait_for(task, timeout=60)
            answered_at_stop = worker.answers.responded
        assert answered_at_stop < n, "the run finished before the stop: nothing was tested"

        async def all_answered() -> bool:
            return {f"{r.dataset}:{r.sample_id}" for r in await responses(settings)} >= {
                f"{dataset}:{small_prompt(dataset, i).sample_id}" for i in range(n)
            }

        async with worker_running(settings) as (second, _):
            await wait_until(all_answered, timeout=120, interval=0.5, message="all 400 after the restart")
            reused_after_restart = second.answers.reused
    finally:
        await sim.close()
    requests = paid(sim)
    report(
        prompts=n,
        inflight_at_stop=inflight_at_stop,
        answered_at_stop=answered_at_stop,
        provider_requests=sum(requests.values()),
        paid_twice=sum(c - 1 for c in requests.values() if c > 1),
        reused_after_restart=reused_after_restart,
    )
    assert inflight_at_stop > 0
    assert sum(requests.values()) == n and len(requests) == n  # each prompt paid exactly once
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("inference progress")]
    assert progress and "in flight" in progress[-1] and "lag" in progress[-1]
    assert await dead_letters(settings) == []


async def test_kill_without_drain_pays_twice_at_most_what_was_in_flight(
    settings_factory: Callable[..., Settings], report: Callable[..., str]
) -> None:
    dataset, n = "killed", 300
    sim = await start_simulator(SimulatorOptions(latency_s=0.1, latency_jitter_s=0.4, **FAST))
    settings = settings_factory(provider=provider(sim, concurrency=32))
    await ensure_topics(settings.kafka, [dataset])
    await produce(settings, settings.kafka.prompts_topic(dataset), [prompt_value(dataset, i) for i in range(n)])
    env = {
        **os.environ,
        "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "DRAFTSTREAM_PROVIDER__BASE_URL": sim.url,
        "DRAFTSTREAM_PROVIDER__CONCURRENCY": "32",
        "DRAFTSTREAM_PROVIDER__BACKOFF_INITIAL_S": "0.02",
        "DRAFTSTREAM_METRICS__INFERENCE_PORT": "0",
    }
    env.pop("OPENROUTER_API_KEY", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "run", "inference", cwd=REPO, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async def some_answered() -> bool:
            return len(await responses(settings)) >= 100

        await wait_until(some_answered, timeout=90, interval=0.3, message="100 responses before the kill")
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    try:
        requested_at_kill = sum(paid(sim).values())
        published_at_kill = len(await responses(settings))
        # Paid for but not in the response store: what a restart must pay for again (a
        # response can be on `responses` a moment before its store write is acknowledged).
        store = settings.kafka.topic("response-store")
        stored_at_kill = len({r.key for r in (await read_all(settings, store))[store]})
        inflight_at_kill = requested_at_kill - stored_at_kill
        assert published_at_kill < n, "the worker finished before it was killed: nothing was tested"

        async def all_answered() -> bool:
            return len({r.sample_id for r in await responses(settings)}) >= n

        async with worker_running(settings) as (worker, _):
            await wait_until(all_answered, timeout=120, interval=0.5, message="all prompts after the restart")
            reused = worker.answers.reused
    finally:
        await sim.close()
    requests = paid(sim)
    paid_twice = sum(c - 1 for c in requests.values() if c > 1)
    report(
        prompts=n,
        requested_at_kill=requested_at_kill,
        published_at_kill=published_at_kill,
        stored_at_kill=stored_at_kill,
        inflight_at_kill=inflight_at_kill,
        provider_requests=sum(requests.values()),
        paid_twice=paid_twice,
        reused_after_restart=reused,
    )
    assert len(requests) == n
    assert paid_twice <= inflight_at_kill


# --- a fix after paying: replay, do not pay again -------------------------------------------


@pytest.mark.parametrize(
    ("wrong_profile", "paid_with_fixed_profile"),
    [
        # A typo in the reconstruct machine's configuration: every response is a
        # reconstruct dead letter (unknown_profile) after it was paid for.
        ("qwen-3", True),
        # A real profile that loads and passes its id check but is not this model's
        # format: rebuilt wrongly, caught by the audit.
        ("qwen3-thinking-2507", False),
    ],
)
async def test_replay_after_fixing_a_wrong_profile_pays_nothing_and_accepts_all(
    settings_factory: Callable[..., Settings],
    report: Callable[..., str],
    wrong_profile: str,
    paid_with_fixed_profile: bool,
) -> None:
    dataset, n = "wrongprof", 60
    sim = await start_simulator(SimulatorOptions(**FAST))  # a Qwen3 hybrid-thinking model
    wrong = settings_factory(provider=provider(sim), datasets={dataset: {"profile": wrong_profile}})
    fixed = settings_factory(provider=provider(sim), datasets={dataset: {"profile": "qwen3"}})
    out_dir = Path(wrong.sink.out_dir)
    await ensure_topics(wrong.kafka, [dataset])
    keys = {f"{dataset}:{small_prompt(dataset, i).sample_id}" for i in range(n)}

    async def settled() -> bool:
        done = set(accepted_keys(out_dir)) | {d.key for d in await dead_letters(wrong)}
        return done == keys

    pipeline = Pipeline()
    try:
        await pipeline.start("inference", inference_app(fixed if paid_with_fixed_profile else wrong))
        await pipeline.start("reconstruct", reconstruct_app(wrong))
        await pipeline.start("audit", audit_app(wrong))
        await pipeline.start("sink", sink_app(wrong))
        await produce(wrong, wrong.kafka.prompts_topic(dataset), [prompt_value(dataset, i) for i in range(n)])
        await pipeline.wait(settled, 120, "every prompt accepted or dead-lettered")
        first = await dead_letters(wrong)
        failed = {d.key for d in first}
        paid_before = sum(paid(sim).values())
        accepted_before = set(accepted_keys(out_dir))

        # The fix: the configuration names the right profile; reconstruct and audit restart.
        for name, make in (("reconstruct", reconstruct_app), ("audit", audit_app)):
            old = pipeline.services.pop(name)
            old.stop()
            await pipeline.tasks.pop(name)
            await old.close()
            await pipeline.start(name, make(fixed))
        await replay(fixed, Filters(stage="reconstruct"))
        await replay(fixed, Filters(stage="audit"), to="reconstruct")  # rebuild, not re-audit
        await pipeline.wait(lambda: set(accepted_keys(out_dir)) == keys, 120, "every prompt accepted after the replay")
    finally:
        await pipeline.stop()
        await sim.close()
    report(
        prompts=n,
        dead_letters_before=len(failed),
        stages=dict(Counter(d.stage for d in first)),
        accepted_before=len(accepted_before),
        accepted_after=len(accepted_keys(out_dir)),
        paid_before=paid_before,
        paid_after=sum(paid(sim).values()),
    )
    assert failed == keys, "the wrong profile failed nothing: nothing was tested"
    if paid_with_fixed_profile:
        assert {d.stage for d in first} == {"reconstruct"} and {d.reason for d in first} == {"unknown_profile"}
    assert sum(paid(sim).values()) == paid_before == n  # 0 new provider requests
    assert max(accepted_keys(out_dir).values()) == 1


# --- pre-flight: no money for what cannot work ------------------------------------------------


async def _halt_in_status(settings: Settings, scope: str) -> tuple[Halt, str]:
    """The standing halt of ``scope`` as ``draftstream status`` reads it, and the rendered screen."""
    from rich.console import Console

    async def found() -> Halt | None:
        snapshot = await collect(settings)
        return next((h for h in snapshot.halts if h.scope == scope), None)

    halt = await wait_until(found, timeout=30, interval=0.5, message=f"a halt of {scope} in status")
    console = Console(record=True, width=250)
    console.print(render(await collect(settings)))
    return halt, console.export_text()


@pytest.mark.parametrize(
    ("profile", "reason"),
    [("no-such-model", "unknown_profile"), ("kimi-k2-thinking", "tokenizer_missing")],
    ids=["unknown-profile", "missing-tokenizer"],
)
async def test_a_bad_profile_halts_its_dataset_before_any_request(
    profile: str, reason: str, settings_factory: Callable[..., Settings], report: Callable[..., str]
) -> None:
    sim = await start_simulator(SimulatorOptions(**FAST))
    settings = settings_factory(
        provider=provider(sim), datasets={"bad": {"profile": profile}, "good": {"profile": "qwen3"}}
    )
    await ensure_topics(settings.kafka, ["bad", "good"])
    await produce(settings, settings.kafka.prompts_topic("bad"), [prompt_value("bad", i) for i in range(20)])
    await produce(settings, settings.kafka.prompts_topic("good"), [prompt_value("good", i) for i in range(20)])
    try:
        async with worker_running(settings) as (worker, _):
            async def good_done() -> bool:
                return len({r.sample_id for r in await responses(settings) if r.dataset == "good"}) >= 20

            await wait_until(good_done, timeout=60, interval=0.5, message="the good dataset answered")
            assert worker.halted_scopes == ["bad"]
        halt, screen = await _halt_in_status(settings, "bad")
    finally:
        await sim.close()
    report(bad_requests=sum(c for k, c in paid(sim).items() if k.startswith("bad:")), halt=halt.reason[:80])
    assert not any(k.startswith("bad:") for k in paid(sim))
    assert halt.by == PREFLIGHT_ACTOR and profile in halt.reason and reason in halt.reason
    assert profile in screen and PREFLIGHT_ACTOR in screen
    assert await dead_letters(settings) == []  # halted, not drained


async def test_a_wrong_base_url_halts_before_any_request(
    settings_factory: Callable[..., Settings], report: Callable[..., str]
) -> None:
    sim = await start_simulator(SimulatorOptions(**FAST))
    settings = settings_factory(provider=provider(sim, base_url=f"{sim.base_url}/wrong/v1"))
    await ensure_topics(settings.kafka, ["lost"])
    await produce(settings, settings.kafka.prompts_topic("lost"), [prompt_value("lost", i) for i in range(20)])
    try:
        async with worker_running(settings) as (worker, _):
            assert worker.halted_scopes == ["provider:simulator"]  # before the first fetch
            halt, screen = await _halt_in_status(settings, "provider:simulator")
            await asyncio.sleep(2.0)  # probes run meanwhile; the base URL still answers 404
            assert worker.halted_scopes == ["provider:simulator"]
    finally:
        await sim.close()
    report(provider_requests=sum(paid(sim).values()), halt=halt.reason[:80])
    assert paid(sim) == Counter()
    assert "base URL answers 404" in halt.reason and halt.by == OUTAGE_ACTOR
    assert "base URL answers 404" in screen
    assert await dead_letters(settings) == []


async def test_an_openrouter_worker_without_a_key_halts_before_any_request(
    settings_factory: Callable[..., Settings], report: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    monkeypatch.delenv("DRAFTSTREAM_PROVIDER__API_KEY", raising=False)
    sim = await start_simulator(SimulatorOptions(**FAST))  # speaks OpenRouter's dialect
    settings = settings_factory(provider=provider(sim, kind="openrouter"))
    assert settings.provider.api_key is None
    await ensure_topics(settings.kafka, ["paid"])
    await produce(settings, settings.kafka.prompts_topic("paid"), [prompt_value("paid", i) for i in range(20)])
    try:
        async with worker_running(settings) as (worker, _):
            assert worker.halted_scopes == ["provider:openrouter"]
            halt, screen = await _halt_in_status(settings, "provider:openrouter")
    finally:
        await sim.close()
    report(provider_requests=sum(paid(sim).values()), halt=halt.reason[:80])
    assert paid(sim) == Counter()
    assert halt.by == PREFLIGHT_ACTOR and "OPENROUTER_API_KEY" in halt.reason
    assert "OPENROUTER_API_KEY" in screen
    assert await dead_letters(settings) == []


# --- an outage halts and resumes by itself --------------------------------------------------


async def test_an_outage_halts_within_n_failures_and_resumes_by_itself(
    settings_factory: Callable[..., Settings], report: Callable[..., str]
) -> None:
    dataset, n, outage_after = "outage", 300, 8
    options = SimulatorOptions(latency_s=0.05, latency_jitter_s=0.1, **FAST)
    first = await start_simulator(options)
    port = first.port
    settings = settings_factory(
        provider=provider(first, concurrency=16, outage_after=outage_after, probe_interval_s=1.0)
    )
    await ensure_topics(settings.kafka, [dataset])
    await produce(settings, settings.kafka.prompts_topic(dataset), [prompt_value(dataset, i) for i in range(n)])
    second: RunningSimulator | None = None
    first_closed = False
    try:
        async with worker_running(settings) as (worker, _):
            await wait_until(lambda: worker.answers.responded >= 50, timeout=60, message="50 responses")
            await first.close()  # connections refused from now on
            first_closed = True
            down_at = time.monotonic()
            await wait_until(
                lambda: worker.halted_scopes == ["provider:simulator"], timeout=60, message="the outage halt"
            )
            answered_at_halt = worker.answers.responded
            # ~8 s down: the probe (every 1 s) finds nobody seven times over.
            await asyncio.sleep(max(0.0, 8.0 - (time.monotonic() - down_at)))
            assert worker.halted_scopes == ["provider:simulator"]  # the probe found nobody: still halted
            second = await start_simulator(options, port=port)

            async def all_answered() -> bool:
                return len({r.sample_id for r in await responses(settings)}) >= n

            await wait_until(all_answered, timeout=120, interval=0.5, message="every prompt after the outage")
            assert worker.halted_scopes == []
    finally:
        if not first_closed:
            await first.close()
        if second is not None:
            await second.close()
    events = await control_events(settings)
    halts = [e for e in events if isinstance(e, Halt)]
    resumes = [e for e in events if isinstance(e, Resume)]
    letters = await dead_letters(settings)
    failures = int(halts[0].reason.split(" consecutive failures")[0].rsplit(" ", 1)[-1]) if halts else -1
    report(
        prompts=n,
        answered_before_halt=answered_at_halt,
        failures_at_halt=failures,
        halts=len(halts),
        resumes=len(resumes),
        dead_letters=len(letters),
        halt=halts[0].reason[:100] if halts else "",
    )
    assert len(halts) == 1 and halts[0].by == OUTAGE_ACTOR and halts[0].scope == "provider:simulator"
    assert "provider_connection_refused" in halts[0].reason
    assert failures == outage_after  # halted within N failures
    assert resumes and resumes[-1].by == OUTAGE_ACTOR
    assert {r.sample_id for r in await responses(settings)} == {small_prompt(dataset, i).sample_id for i in range(n)}
    assert letters == []  # an outage is not a reason to dead-letter a prompt
