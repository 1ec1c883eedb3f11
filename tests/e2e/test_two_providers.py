"""Issue 54: a local server and a paid API side by side, under one budget.

Two simulators over real HTTP: ``local`` (an ``openai``-kind server, ``--free``: no
``usage.cost``) and ``openrouter`` (an ``openrouter``-kind API); one inference worker for
each (``Settings.for_provider``, what ``run inference --provider NAME`` runs), one budget
whose global cap ends the run, reconstruct, audit and sink, 200 prompts over two datasets.

- both up: every prompt accounted for exactly once, the cap never crossed, each row's
  ``provider`` the one that billed it, ``budget`` and ``status`` show both providers;
- the local simulator killed mid-run: its worker's halt is scoped to ``provider:local``,
  0 control events from the other worker, its partitions answered by the healthy worker
  (how long it took is reported), 0 prompts lost, paid twice only within the local worker's
  in-flight bound (the attempts the server cut off stay held at their worst case, only
  those); once the server is back its worker rejoins and is answered again.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from schemas import Halt, ResponseReceived, encode, sample_key
from services.audit.app import create_app as audit_app
from services.budget.app import create_app as budget_app
from services.budget.cli import budget_table
from services.budget.provider_table import provider_table
from services.common.config import Settings
from services.common.kafka import ensure_topics
from services.control import read_budget_snapshots, read_control_state
from services.export.app import export
from services.inference.app import InferenceWorker
from services.inference.app import create_app as inference_app
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import RunningSimulator, start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from services.status.app import collect
from services.status.core import render
from tests.e2e.harness import (
    Pipeline,
    budget_caught_up,
    control_events,
    dead_letters,
    produce,
    responses,
    sink_rows,
    small_prompt,
)

pytestmark = pytest.mark.e2e

DATASETS = ("chat", "math")
PROMPTS = 100  # per dataset
MAX_TOKENS = 64
CAP = 2_400  # completion tokens, global: about 130 of the 200 answers fit
FAST = {"reasoning_tokens": (4, 12), "content_tokens": (4, 12), "latency_s": 0.15, "latency_jitter_s": 0.1}
LOCAL = SimulatorOptions(provider_name="local-sglang", free=True, **FAST)  # type: ignore[arg-type]
PAID = SimulatorOptions(provider_name="SimOpenRouter", seed=7, **FAST)  # type: ignore[arg-type]


def provider_section(sim: RunningSimulator, kind: str, **kw: Any) -> dict[str, Any]:
    """A ``[providers.NAME]`` section for a simulator: small windows, quick retries and probes."""
    return {
        "kind": kind,
        "base_url": sim.url,
        "api_key": "sk-test" if kind == "openrouter" else None,
        "concurrency": 4,
        "max_attempts": 3,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3,
        "timeout_s": 3.0,  # answers take 0.15-0.25 s; the budget's in-flight TTL is (3 + 0.3) x 3 = 10 s
        "outage_after": 4,
        "probe_interval_s": 0.5,
        "convention": "vllm",  # the simulators answer as vLLM does: no whitespace stripped
        **kw,
    }


def two_provider_settings(settings_factory: Callable[..., Settings], local: RunningSimulator,
                          paid: RunningSimulator) -> Settings:
    """One configuration naming both providers, one global cap, fast stages."""
    return settings_factory(
        providers={
            "local": provider_section(local, "openai", model="qwen3"),  # the model a local server lists
            "openrouter": provider_section(paid, "openrouter"),
        },
        budget={"global_cap_completion_tokens": CAP, "key_usage_interval_s": 0.5},
        datasets={d: {"max_tokens": MAX_TOKENS, "audit": {"usage_offset": 0}} for d in DATASETS},
        stage={"batch_max": 32, "batch_timeout_ms": 50},
        inference={"handover_timeout_s": 10.0},
    )


async def publish_prompts(settings: Settings) -> set[str]:
    """100 prompts on each dataset's topic; their keys."""
    await ensure_topics(settings.kafka, DATASETS)
    keys: set[str] = set()
    for dataset in DATASETS:
        prompts = [small_prompt(dataset, i, max_tokens=MAX_TOKENS) for i in range(PROMPTS)]
        records = [(sample_key(dataset, p.sample_id).encode(), encode(p)) for p in prompts]
        await produce(settings, settings.kafka.prompts_topic(dataset), records)
        keys |= {sample_key(dataset, p.sample_id) for p in prompts}
    return keys


async def capped(settings: Settings) -> bool:
    """The budget finished the run: its global halt stands."""
    event = (await read_control_state(settings)).get("global")
    return isinstance(event, Halt) and event.reason.startswith("capped:")


async def start_pipeline(settings: Settings) -> tuple[Pipeline, InferenceWorker, InferenceWorker]:
    """Budget, both workers (one per provider), reconstruct, audit and sink."""
    pipeline = Pipeline()
    await pipeline.start("budget", budget_app(settings))
    local = await pipeline.start("inference-local", inference_app(settings.for_provider("local"), worker_id="w-local"))
    paid = await pipeline.start(
        "inference-openrouter", inference_app(settings.for_provider("openrouter"), worker_id="w-openrouter")
    )
    for name, app in (("reconstruct", reconstruct_app), ("audit", audit_app), ("sink", sink_app)):
        await pipeline.start(name, app(settings))
    assert isinstance(local, InferenceWorker) and isinstance(paid, InferenceWorker)
    return pipeline, local, paid


async def settle(pipeline: Pipeline, settings: Settings, keys: set[str], out_dir: Path) -> None:
    """Until the cap ended the run and every answered prompt is a row or a dead letter."""
    await pipeline.wait(lambda: capped(settings), 120, "the budget's cap ends the run")

    async def downstream_done() -> bool:
        answered = {sample_key(r.dataset, r.sample_id) for r in await responses(settings)}
        done = {row["id"] for row in sink_rows(out_dir)} | {d.key for d in await dead_letters(settings)}
        return answered <= done

    await pipeline.wait(downstream_done, 90, "every answer accepted or dead-lettered")
    await pipeline.wait(lambda: budget_caught_up(settings), 30, "the budget's checkpoint counts every answer")


def screens(settings: Settings, snapshots: Any, control: Any, status: Any) -> tuple[str, str]:
    """``draftstream budget`` and ``draftstream status`` as a person reads them."""
    console = Console(record=True, width=250)
    console.print(budget_table(snapshots, control, settings, wide=True))
    console.print(provider_table(snapshots, control, settings, wide=True))
    budget_screen = console.export_text()
    console = Console(record=True, width=250)
    console.print(render(status))
    return budget_screen, console.export_text()


def accounted(keys: set[str], rows: list[dict[str, Any]], letters: list[Any], answered: set[str]) -> Counter[str]:
    """Per prompt: rows + dead letters + (1 if never answered): exactly 1 each when accounted for once."""
    count: Counter[str] = Counter({k: 0 for k in keys})
    count.update(row["id"] for row in rows)
    count.update({d.key for d in letters})
    count.update(keys - answered)
    return count


async def test_two_providers_share_the_prompts_under_one_budget(
    settings_factory: Callable[..., Settings], report: Callable[..., str]
) -> None:
    local_sim, paid_sim = await start_simulator(LOCAL), await start_simulator(PAID)
    settings = two_provider_settings(settings_factory, local_sim, paid_sim)
    out_dir = Path(settings.sink.out_dir)
    keys = await publish_prompts(settings)
    pipeline = Pipeline()
    try:
        pipeline, _, _ = await start_pipeline(settings)
        await settle(pipeline, settings, keys, out_dir)

        async def judged() -> bool:  # every answer's audit verdict counted in its provider's yield
            snaps = await read_budget_snapshots(settings)
            found = [snaps.get(f"provider:{name}") for name in ("local", "openrouter")]
            return all(s is not None and s.quality is not None and s.quality.verdicts == s.responses for s in found)

        await pipeline.wait(judged, 30, "each provider's yield counts its answers' verdicts")
        snapshots = await read_budget_snapshots(settings)
        control = await read_control_state(settings)
        status = await collect(settings)
    finally:
        await pipeline.stop()
        await local_sim.close()
        await paid_sim.close()
    rows, letters, answers = sink_rows(out_dir), await dead_letters(settings), await responses(settings)
    billed = {"local": Counter(local_sim.stats()["keys"]), "openrouter": Counter(paid_sim.stats()["keys"])}
    events = await control_events(settings)
    budget_screen, status_screen = screens(settings, snapshots, control, status)
    spent = snapshots["global"].completion_tokens
    report(prompts=len(keys), rows=len(rows), dead_letters=len(letters), answered=len(answers),
           paid_local=sum(billed["local"].values()), paid_openrouter=sum(billed["openrouter"].values()),
           completion_tokens=spent, cap=CAP)
    count = accounted(keys, rows, letters, {sample_key(r.dataset, r.sample_id) for r in answers})
    assert set(count.values()) == {1}, {k: c for k, c in count.items() if c != 1}
    assert max((billed["local"] + billed["openrouter"]).values()) == 1  # none paid twice
    assert min(sum(b.values()) for b in billed.values()) > 0  # both providers took prompts
    assert spent <= CAP and len(answers) < len(keys)  # the cap ended the run, and was not crossed
    kinds = {"local": "openai", "openrouter": "openrouter"}
    for row in rows:
        meta = row["metadata"]
        paid_by = "local" if billed["local"][row["id"]] else "openrouter"
        assert (meta["provider_name"], meta["provider"]) == (paid_by, kinds[paid_by]), row["id"]
    assert not [e for e in events if e.scope.startswith("provider:")]  # nobody's provider was halted
    per_provider = {name: snapshots[f"provider:{name}"] for name in ("local", "openrouter")}
    assert sum(p.completion_tokens for p in per_provider.values()) == spent  # each answer counted for one
    for name, snap in per_provider.items():
        assert snap.responses == sum(billed[name].values()) > 0
        accepted = sum(1 for row in rows if billed[name][row["id"]])
        assert snap.quality is not None and snap.quality.accepted == accepted  # the provider's own yield
        row = next(line for line in budget_screen.splitlines() if line.strip("│ ").startswith(name))
        assert f"{snap.completion_tokens:,}" in row and kinds[name] in row
        assert f"{snap.completion_tokens:,}" in next(
            line for line in status_screen.splitlines() if line.strip("│ ").startswith(name))
    assert per_provider["local"].cost_usd == 0.0 and per_provider["openrouter"].cost_usd > 0  # a free local server
    # export --provider local: the local server's rows only
    exported = export("hf", out_dir, out_dir.parent / "export-local", provider="local")
    local_rows = {row["id"] for row in rows if billed["local"][row["id"]]}
    assert exported.rows_written == len(local_rows) and exported.left_out == len(rows) - len(local_rows)
    written = [json.loads(line) for f in exported.files for line in f.read_text().splitlines()]
    assert {row["id"] for row in written} == local_rows


async def test_the_local_server_killed_mid_run_hands_its_prompts_to_the_paid_worker(
    settings_factory: Callable[..., Settings], report: Callable[..., str]
) -> None:
    local_sim, paid_sim = await start_simulator(LOCAL), await start_simulator(PAID)
    port = local_sim.port
    settings = two_provider_settings(settings_factory, local_sim, paid_sim)
    out_dir = Path(settings.sink.out_dir)
    keys = await publish_prompts(settings)
    pipeline, back = Pipeline(), None
    local_closed = False
    try:
        pipeline, local, paid = await start_pipeline(settings)
        await pipeline.wait(lambda: local.answers is not None and local.answers.responded >= 10, 60, "10 local answers")
        given = set(local.assigned_partitions())
        inflight_at_kill = local.settings.provider.concurrency
        await local_sim.close()  # connections refused from now on
        local_closed, killed_at = True, time.time()
        await pipeline.wait(lambda: local.halts.provider_halted(), 30, "the local provider's halt")
        await pipeline.wait(lambda: not local.in_group, 30, "the local worker leaves the group")
        assert not paid.halts.is_halted(*DATASETS)  # the other provider's worker goes on

        async def taken_over() -> float | None:
            for r in await responses(settings):
                if r.provider_name == "openrouter" and r.received_at > killed_at and _partition(r, given, settings):
                    return r.received_at - killed_at
            return None

        handed_over_s = await pipeline.wait(taken_over, 30, "a prompt of the local worker's partitions answered")
        answered_down = paid.answers.responded if paid.answers else 0
        back = await start_simulator(LOCAL, port=port)
        local_before = local.answers.responded if local.answers else 0
        await pipeline.wait(lambda: local.in_group and local.answers is not None
                            and local.answers.responded > local_before, 60, "the local worker answers again")
        await settle(pipeline, settings, keys, out_dir)
        snapshots = await read_budget_snapshots(settings)
    finally:
        await pipeline.stop()
        if not local_closed:
            await local_sim.close()
        if back is not None:
            await back.close()
        await paid_sim.close()
    rows, letters, answers = sink_rows(out_dir), await dead_letters(settings), await responses(settings)
    local_billed = Counter(local_sim.stats()["keys"])
    if back is not None:
        local_billed += Counter(back.stats()["keys"])
    both = local_billed + Counter(paid_sim.stats()["keys"])
    twice = [k for k, c in both.items() if c > 1]
    events = await control_events(settings)
    by_scope = Counter(e.scope for e in events)
    held = [a for scope, s in snapshots.items() if scope not in ("global",) and not scope.startswith("provider:")
            for a in s.attempts.values() if a.lost]
    count = accounted(keys, rows, letters, {sample_key(r.dataset, r.sample_id) for r in answers})
    report(prompts=len(keys), handed_over_s=round(handed_over_s, 2), rows=len(rows), dead_letters=len(letters),
           answered=len(answers), openrouter_answers_at_hand_over=answered_down, paid_twice=len(twice),
           inflight_bound=inflight_at_kill, control_events=dict(by_scope),
           prompts_lost=sum(c == 0 for c in count.values()), attempts_held_as_lost=len(held),
           completion_tokens=snapshots["global"].completion_tokens, cap=CAP)
    assert set(count.values()) == {1}, {k: c for k, c in count.items() if c != 1}
    halts = [e for e in events if isinstance(e, Halt) and e.scope == "provider:local"]
    assert halts and "provider outage" in halts[0].reason  # the local worker's outage halt, scoped to it
    assert by_scope["provider:openrouter"] == 0  # 0 halt/resume events from the other worker
    assert set(by_scope) <= {"provider:local", "global"}
    assert handed_over_s <= 30
    # 0 prompts lost (accounted above); the attempts the killed server cut off unanswered stay held at
    # their worst case (it may have generated them), only those, and only the local provider's.
    assert len(held) <= inflight_at_kill and {a.provider for a in held} <= {"local"}
    assert len(twice) <= inflight_at_kill  # paid twice only for what was at the killed server
    assert snapshots["global"].completion_tokens <= CAP


def _partition(response: ResponseReceived, given: set[Any], settings: Settings) -> bool:
    """Whether the response's prompt lives on one of ``given`` (the default partitioner: murmur2 of the key)."""
    from aiokafka.partitioner import DefaultPartitioner

    topic = settings.kafka.prompts_topic(response.dataset)
    parts = sorted(tp.partition for tp in given if tp.topic == topic)
    if not parts:
        return False
    n = settings.kafka.partitions
    key = sample_key(response.dataset, response.sample_id).encode()
    index = DefaultPartitioner()(key, list(range(n)), list(range(n)))
    return index in parts
