"""Multi-turn regeneration under SIGKILL (issue 26): the continuation stage and inference killed mid-run.

Every service runs as its own process (``draftstream run ...``) against the test broker and the
simulator over HTTP (with latency, so requests are in flight at a kill). 60 ShareGPT
conversations of 2-6 assistant turns are published with ``turns = "all"``; once turns flow,
inference is SIGKILLed and restarted, then the continuation stage.

Asserts: every conversation reaches its last turn (0 lost turns: each has a state ``finished``
and one row per turn, nothing stuck); no row is written twice; every published turn key has a
row; the budget equals the usage of every paid response; and the requests the provider was
paid for twice stay within the requests in flight at the inference kill (``concurrency``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.common.config import load_settings
from services.common.kafka import ensure_topics
from services.publish.app import publish
from tests.e2e.brokers import Supervisor, free_port
from tests.e2e.harness import (
    Tally,
    accepted_keys,
    budget_caught_up,
    cli,
    dead_letters,
    pipeline_config,
    read_all,
    wait_http,
    wait_until,
)
from tests.e2e.test_multi_turn import conversation_states, sharegpt_rows, write_jsonl

pytestmark = pytest.mark.e2e

DATASET = "chat"
N_CONVERSATIONS = 60
CONCURRENCY = 16
SERVICES = ("budget", "inference", "reconstruct", "audit", "sink", "continuation")


@pytest.mark.long(40)
@pytest.mark.timeout(600)
async def test_sigkill_of_continuation_and_inference_loses_no_turn(
    tmp_path: Path, report: Callable[..., str], kafka_bootstrap: str, unique_prefix: str
) -> None:
    rng = random.Random(2626)  # noqa: S311 - a test schedule
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    sim_port = free_port()
    config = run_dir / "draftstream.toml"
    text = pipeline_config(run_dir, kafka_bootstrap, sim_port, [DATASET], prefix=unique_prefix,
                           concurrency=CONCURRENCY, timeout_s=10)
    config.write_text(text.replace(f"[datasets.{DATASET}]\n", f'[datasets.{DATASET}]\nturns = "all"\n'), "utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "DRAFTSTREAM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    settings = load_settings(config)
    assert settings.dataset(DATASET).turns == "all"
    rows_file = write_jsonl(tmp_path / "chat.jsonl", sharegpt_rows(N_CONVERSATIONS, rng))
    expected_turns = {
        f"{DATASET}:{row['id']}": sum(1 for t in row["conversations"] if t["from"] == "gpt")
        for row in map(json.loads, rows_file.read_text("utf-8").splitlines())
    }
    out_dir = run_dir / "out"
    sup = Supervisor(run_dir / "logs", env)
    events: list[str] = []
    try:
        await ensure_topics(settings.kafka, [DATASET])
        sup.start("simulator", cli(
            "simulate-provider", "--port", str(sim_port), "--metrics-port", "0", "--seed", "26",
            "--reasoning-tokens", "8-24", "--content-tokens", "8-24", "--latency", "0.2", "--jitter", "0.2",
        ))  # fmt: skip
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{sim_port}/health", 60)
        for name in SERVICES:
            sup.start(name, cli("run", name, "--config", str(config)))
        t0 = time.monotonic()
        sent = await publish(settings, [rows_file], dataset=DATASET)
        assert sent.published == N_CONVERSATIONS

        for victim in ("inference", "continuation"):
            base = len(accepted_keys(out_dir))
            await wait_until(lambda b=base: len(accepted_keys(out_dir)) >= b + 25, timeout=180, interval=0.2,
                             message=f"turns flowing before the {victim} kill")
            sup.kill(victim)
            events.append(f"{time.monotonic() - t0:.1f}s SIGKILL {victim} at {len(accepted_keys(out_dir))} rows")
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            sup.start(victim)
            events.append(f"{time.monotonic() - t0:.1f}s restart {victim}")

        async def finished() -> bool:
            for name in sup.revive():
                events.append(f"{time.monotonic() - t0:.1f}s {name} exited by itself; restarted")
            states = await conversation_states(settings)
            return len(states) == N_CONVERSATIONS and all(s.state != "in_progress" for s in states.values())

        await wait_until(finished, timeout=300, interval=1.0, message="every conversation at its end")
        snapshot = await wait_until(lambda: budget_caught_up(settings), timeout=120, interval=1.0,
                                    message="budget caught up with every response")
        async with httpx.AsyncClient(timeout=10) as http:
            stats = (await http.get(f"http://127.0.0.1:{sim_port}/_sim/stats")).json()
        states = await conversation_states(settings)
        prompts_topic = settings.kafka.prompts_topic(DATASET)
        responses_topic = settings.kafka.topic("responses")
        got = await read_all(settings, prompts_topic, responses_topic)
        letters = await dead_letters(settings)
    finally:
        sup.stop_all()

    published = Counter((r.key or b"").decode() for r in got[prompts_topic])
    tally = Tally.of(set(published), out_dir, letters, got[responses_topic], snapshot, stats)
    short = {cid: (s.state, s.turns_done, expected_turns[cid]) for cid, s in states.items()
             if s.state != "finished" or s.turns_done != expected_turns[cid]}
    missing_rows = [f"{cid}:{t}" for cid, n in expected_turns.items() for t in range(n)
                    if f"{cid}:{t}" not in tally.keys]
    line = report(
        conversations=N_CONVERSATIONS, turns=sum(expected_turns.values()), **tally.counts(),
        republished_turns=sum(n - 1 for n in published.values()), inflight_bound=CONCURRENCY,
        kills=dict(sup.kills), not_finished=len(short), missing_rows=len(missing_rows), events="; ".join(events),
    )  # fmt: skip

    assert sup.kills == {"inference": 1, "continuation": 1}, line
    assert not letters, f"no fault was injected: every dead letter is a defect: {line}"
    assert not short, f"conversations that did not reach their last turn: {list(short.items())[:5]} {line}"
    assert not missing_rows, f"turns lost: {missing_rows[:5]} {line}"
    tally.assert_exactly_once(line)  # no turn lost, no row twice, the budget equals the bill
    assert len(tally.keys) == sum(expected_turns.values()), line
    assert tally.paid_twice <= CONCURRENCY, f"paid twice beyond the requests in flight at the kill: {line}"
