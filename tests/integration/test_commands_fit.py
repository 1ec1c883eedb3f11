"""``draftstream budget`` and ``draftstream status``, run as a person runs them: they fit the terminal,
and ``status --watch`` into a pipe writes a snapshot per interval.

The real commands in a subprocess against the broker, with ``COLUMNS`` set as a terminal of
80, 100 and 120 columns sets it, reading budget snapshots with every figure filled in and a
halt with a long reason: no line of their output is longer than the terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from schemas import BUDGET_STATE_TOPIC, CONTROL_TOPIC, Halt, encode
from services.common.config import Settings
from services.common.kafka import Outgoing, ensure_topics, make_producer, publish_all
from tests.unit.test_tables_fit import LONG_REASON, WIDTHS, snapshots

pytestmark = pytest.mark.kafka


async def test_budget_and_status_commands_fit_80_100_120_columns(settings_factory: Callable[..., Settings]) -> None:
    datasets = {"math-reasoning-olympiad": {"cap_completion_tokens": 20_000_000},
                "tools-with-a-long-name": {"cap_completion_tokens": 5_000_000}}
    settings = settings_factory(datasets=datasets)
    await ensure_topics(settings.kafka, list(datasets))
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        halt = Halt(scope="tools-with-a-long-name", reason=LONG_REASON, by="budget-quality", at=1.0)
        await publish_all(
            producer,
            [Outgoing(settings.kafka.topic(BUDGET_STATE_TOPIC), encode(s), s.scope.encode())
             for s in snapshots().values()]
            + [Outgoing(settings.kafka.topic(CONTROL_TOPIC), encode(halt), halt.scope.encode())],
        )
    finally:
        await producer.stop()
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "DRAFTSTREAM_METRICS__INFERENCE_PORT": "0",
    }
    for width in WIDTHS:
        for command in (["budget"], ["budget", "--wide"], ["status"]):
            done = subprocess.run(  # noqa: S603 - our own CLI
                [sys.executable, "-m", "services.cli", *command],
                env={**env, "COLUMNS": str(width)}, capture_output=True, text=True, timeout=120, check=False,
            )
            assert done.returncode == 0, done.stderr
            lines = done.stdout.splitlines()
            assert "draftstream" in done.stdout and "$99" in done.stdout.replace("\n", ""), done.stdout
            too_long = [line for line in lines if len(line) > width]
            assert not too_long, f"draftstream {' '.join(command)} at {width} columns: {too_long[0]!r}"


async def test_status_watch_into_a_pipe_writes_one_snapshot_per_interval(
    settings_factory: Callable[..., Settings],
) -> None:
    """Not a terminal: each interval's snapshot is printed whole and flushed as it is taken (a live
    display there wrote nothing until Ctrl-C)."""
    import asyncio
    import signal

    settings = settings_factory()
    await ensure_topics(settings.kafka, [])
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "DRAFTSTREAM_METRICS__INFERENCE_PORT": "0",
        "COLUMNS": "100",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "status", "--watch", "--interval", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    seen = 0
    try:
        while seen < 3:  # three snapshots, each arriving while the command still runs
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, (await proc.stderr.read()).decode() if proc.stderr else "no output"
            seen += line.startswith("draftstream status at")
        assert proc.returncode is None
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
