"""Issue 56's acceptance: ``draftstream run all --config X`` runs the README's real-use recipe.

The real command in a subprocess, as a person runs it: it starts every service the config needs
as child processes (a ``turns = "all"`` dataset, so the continuation stage too), each with its
own log. ``draftstream publish`` sends ShareGPT conversations of 2-5 assistant turns; the
simulator answers over real HTTP. Once every conversation has finished, SIGINT (Ctrl-C) goes
to ``run all`` alone: every child is gone within 10 s and ``run all`` exits 0. ``status`` then
lists each conversation once, finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.config import load_settings
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.status.app import collect
from services.status.core import conversation_endings
from tests.e2e.harness import pipeline_config, sink_rows
from tests.e2e.test_multi_turn import sharegpt_rows

pytestmark = pytest.mark.e2e

N = 8
STOP_WITHIN_S = 10.0


def alive(pid: int) -> bool:
    """Whether a process with this pid still exists (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_run_all_runs_a_multi_turn_dataset_to_completion_and_ctrl_c_stops_every_child(
    unique_prefix: str, kafka_bootstrap: str, tmp_path: Path, report: Callable[..., str]
) -> None:
    sim = await start_simulator(SimulatorOptions(seed=5, reasoning_tokens=(4, 10), content_tokens=(4, 10)))
    config = tmp_path / "draftstream.toml"
    multi_turn = '[datasets.chat]\nprofile = "qwen3"\nmax_tokens = 256\nturns = "all"\n'
    config.write_text(
        pipeline_config(tmp_path, kafka_bootstrap, sim.port, [], prefix=unique_prefix, concurrency=16, timeout_s=30)
        + multi_turn
    )
    rows = sharegpt_rows(N, random.Random(3))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    turns = sum(sum(1 for t in row["conversations"] if t["from"] == "gpt") for row in rows)
    settings = load_settings(config)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # the config says where Kafka is
    logs = tmp_path / "logs"
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "run", "all", "--config", str(config), "--logs", str(logs),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )
    output: list[str] = []
    children: dict[str, int] = {}
    try:
        assert parent.stdout is not None
        while len(children) < 6:
            line = (await asyncio.wait_for(parent.stdout.readline(), 60)).decode()
            assert line, f"run all ended early: {''.join(output)}"
            output.append(line)
            if found := re.match(r"started (\w+) \(pid (\d+), log ", line):
                children[found.group(1)] = int(found.group(2))
        publish = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "publish", str(data), "--dataset", "chat", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        )
        published, _ = await asyncio.wait_for(publish.communicate(), 120)
        assert publish.returncode == 0, published.decode()

        deadline = time.monotonic() + 180
        while len(sink_rows(Path(settings.sink.out_dir))) < turns:
            assert parent.returncode is None, "".join(output)
            assert time.monotonic() < deadline, f"{len(sink_rows(Path(settings.sink.out_dir)))} of {turns} turns"
            await asyncio.sleep(0.5)
        while True:  # the continuation stage records the last turn after the sink wrote it
            status = await collect(settings)
            endings = conversation_endings(status)
            if len(endings) == N and all(state == "finished" for state, _ in endings.values()):
                break
            assert time.monotonic() < deadline, endings
            await asyncio.sleep(0.5)

        stopped_at = time.monotonic()
        parent.send_signal(signal.SIGINT)  # Ctrl-C, to run all alone (its children have their own session)
        while any(alive(pid) for pid in children.values()) and time.monotonic() - stopped_at < STOP_WITHIN_S + 5:
            await asyncio.sleep(0.05)
        gone_in = time.monotonic() - stopped_at
        rest, _ = await asyncio.wait_for(parent.communicate(), 30)
        output.append(rest.decode())
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
        for pid in children.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        await sim.close()

    text = "".join(output)
    report(children=len(children), turns=turns, stopped_in_s=round(gone_in, 2), exit_code=parent.returncode)
    assert sorted(children) == ["audit", "budget", "continuation", "inference", "reconstruct", "sink"], text
    assert gone_in <= STOP_WITHIN_S and not any(alive(pid) for pid in children.values()), text
    assert parent.returncode == 0, text
    assert "every service stopped in" in text and "killed" not in text, text
    for name in children:  # one log each, written by that service
        assert (logs / f"{name}.log").stat().st_size > 0, name
    assert len(status.conversations) == N and not status.stopped
