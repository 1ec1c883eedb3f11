"""The budget service on a real broker: restart accounting, caps, halts, CLI, table."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

from schemas import (
    GLOBAL_SCOPE,
    Halt,
    Message,
    PromptPublished,
    RequestStarted,
    ResponseReceived,
    Resume,
    Usage,
    encode,
    sample_key,
)
from services.budget.app import BudgetService, create_app
from services.budget.core import BUDGET_ACTOR, estimate_usage
from services.common.config import Settings
from services.common.kafka import Outgoing, ensure_topics, make_producer, publish_all
from services.control import publish_control, read_budget_snapshots, read_control_state
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka


def response(dataset: str, sample_id: str, completion: int | None, *, cost: float | None = None) -> ResponseReceived:
    """A response; ``completion=None`` leaves usage out entirely."""
    usage = (
        Usage()
        if completion is None
        else Usage(prompt_tokens=7, completion_tokens=completion, reasoning_tokens=completion // 2, cost=cost)
    )
    return ResponseReceived(
        dataset=dataset,
        sample_id=sample_id,
        prompt=PromptPublished(
            dataset=dataset, sample_id=sample_id, messages=[Message(role="user", content="hi there")]
        ),
        provider="simulator",
        model="deepseek/deepseek-v3",
        reasoning="r" * 12,
        content="answer " * 5,
        usage=usage,
    )


async def send(settings: Settings, logical: str, events: list[Any]) -> None:
    """Publish events keyed ``<dataset>:<sample_id>`` and wait for the acks."""
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        topic = settings.kafka.topic(logical)
        await publish_all(
            producer,
            [Outgoing(topic, encode(e), sample_key(e.dataset, e.sample_id).encode()) for e in events],
        )
    finally:
        await producer.stop()


async def start_service(settings: Settings, **options: float) -> tuple[BudgetService, asyncio.Task[None]]:
    """Start a budget service and run it in a task."""
    service = create_app(settings, **options)
    await service.start()
    return service, asyncio.create_task(service.run())


async def stop_service(service: BudgetService, task: asyncio.Task[None]) -> None:
    """Graceful stop: finish the batch, final checkpoint, close."""
    service.stop()
    await asyncio.wait_for(task, 30)
    await service.close()


async def kill_service(service: BudgetService, task: asyncio.Task[None]) -> None:
    """Crash: cancel mid-flight, no final checkpoint."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await service.abort()


async def test_kill_and_restart_totals_equal_sum_of_usage(settings_factory: Callable[..., Settings]) -> None:
    settings = settings_factory(
        datasets={"math": {"cap_completion_tokens": None}, "code": {"cap_completion_tokens": None}}
    )
    await ensure_topics(settings.kafka, settings.datasets)
    events = [
        response("math" if i % 3 else "code", f"s{i}", None if i % 10 == 9 else 10 + i, cost=0.001 * i)
        for i in range(90)
    ]
    expected_completion = sum(estimate_usage(e)[1] for e in events)
    expected_prompt = sum(estimate_usage(e)[0] for e in events)
    expected_cost = sum(e.usage.cost or 0.0 for e in events)
    without_usage = sum(1 for e in events if e.usage.completion_tokens is None)

    first, task = await start_service(settings, checkpoint_interval_s=0.1)
    await send(settings, "responses", events[:30])
    await wait_until(lambda: first.ledger.scopes[GLOBAL_SCOPE].responses == 30, 30, message="first 30 counted")

    async def checkpointed(n: int) -> bool:
        snap = (await read_budget_snapshots(settings)).get(GLOBAL_SCOPE)
        return snap is not None and snap.responses == n

    await wait_until(lambda: checkpointed(30), 30, message="checkpoint of 30")
    first.checkpoint_interval_s = 3600.0  # the next 30 are counted but never checkpointed
    await send(settings, "responses", events[30:60])
    await wait_until(lambda: first.ledger.scopes[GLOBAL_SCOPE].responses == 60, 30, message="60 counted")
    await kill_service(first, task)
    await send(settings, "responses", events[60:])

    second, task = await start_service(settings, checkpoint_interval_s=0.1)
    assert second.ledger.scopes[GLOBAL_SCOPE].responses == 30  # restored, not yet replayed
    try:
        await wait_until(lambda: second.ledger.scopes[GLOBAL_SCOPE].responses >= 90, 30, message="90 counted")
    finally:
        await stop_service(second, task)
    total = second.ledger.scopes[GLOBAL_SCOPE]
    assert total.responses == 90
    assert total.completion_tokens == expected_completion
    assert total.prompt_tokens == expected_prompt
    assert total.cost_usd == pytest.approx(expected_cost)
    assert total.responses_without_usage == without_usage
    per_dataset = second.ledger.scopes["math"].completion_tokens + second.ledger.scopes["code"].completion_tokens
    assert per_dataset == expected_completion
    snaps = await read_budget_snapshots(settings)
    assert snaps[GLOBAL_SCOPE].completion_tokens == expected_completion
    assert snaps["math"].completion_tokens + snaps["code"].completion_tokens == expected_completion


async def test_cap_halts_one_dataset_early_halt_and_resume_on_raised_cap(
    settings_factory: Callable[..., Settings],
) -> None:
    datasets = {
        "math": {"cap_completion_tokens": 100},
        "chat": {"cap_completion_tokens": 1000},
        "code": {"cap_completion_tokens": 1_000_000},
    }
    settings = settings_factory(datasets=datasets)
    await ensure_topics(settings.kafka, settings.datasets)
    # A person halted "code" before: the budget must never lift that.
    await publish_control(settings, Halt(scope="code", reason="checking outputs", by="ann@host"))
    service, task = await start_service(settings, checkpoint_interval_s=0.1)
    try:
        await send(settings, "responses", [response("code", f"c{i}", 500) for i in range(4)])
        await send(settings, "responses", [response("math", f"m{i}", 30) for i in range(4)])  # 120 >= 100
        # chat: 5 requests of 300 in flight = 1500 worst case > 1000 with nothing spent yet.
        await send(
            settings,
            "requests",
            [RequestStarted(dataset="chat", sample_id=f"q{i}", max_tokens=300) for i in range(5)],
        )
        state = await wait_until(lambda: _halted(settings, {"math", "chat"}), 30, message="halts for math and chat")
    finally:
        await stop_service(service, task)
    math, chat, code = state["math"], state["chat"], state["code"]
    assert isinstance(math, Halt) and math.by == BUDGET_ACTOR and "reached the cap of 100" in math.reason
    assert isinstance(chat, Halt) and chat.by == BUDGET_ACTOR and "in flight" in chat.reason
    assert isinstance(code, Halt) and code.by == "ann@host"
    assert GLOBAL_SCOPE not in state
    assert {e.scope for e in service.published_control} == {"math", "chat"}

    # The table, through the real CLI, shows who halted what and why (every column: --wide).
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "budget",
        "--wide",
        env={
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
            "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
            "DRAFTSTREAM_DATASETS__MATH__CAP_COMPLETION_TOKENS": "100",
            "COLUMNS": "250",
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    math_row = next(line for line in text.splitlines() if " math " in line)
    assert "120" in math_row and "halted by budget" in math_row
    code_row = next(line for line in text.splitlines() if " code " in line)
    assert "halted by ann@host: checking" in code_row

    # Restart with math's cap raised: the budget resumes its own halt, not ann's.
    raised = settings_factory(
        datasets={**datasets, "math": {"cap_completion_tokens": 500}},
        kafka={"topic_prefix": settings.kafka.topic_prefix},
    )
    service, task = await start_service(raised, checkpoint_interval_s=0.1)
    await stop_service(service, task)
    state = await read_control_state(settings)
    assert isinstance(state["math"], Resume) and state["math"].by == BUDGET_ACTOR
    assert isinstance(state["chat"], Halt)  # same cap, still halted
    assert isinstance(state["code"], Halt) and state["code"].by == "ann@host"


async def _halted(settings: Settings, scopes: set[str]) -> dict[str, Halt | Resume] | None:
    state = await read_control_state(settings)
    if all(isinstance(state.get(s), Halt) and state[s].by == BUDGET_ACTOR for s in scopes):
        return state
    return None


def test_halt_and_resume_cli_publish_who_and_why(settings_factory: Callable[..., Settings]) -> None:
    settings = settings_factory()
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
    }
    from services.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["halt", "--dataset", "math", "--reason", "outputs look wrong", "--by", "ann"], env=env)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["halt", "--reason", "stop NOW"], env=env)
    assert result.exit_code == 0, result.output
    state = asyncio.run(read_control_state(settings))
    assert isinstance(state["math"], Halt)
    assert (state["math"].by, state["math"].reason) == ("ann", "outputs look wrong")
    glob = state[GLOBAL_SCOPE]
    assert isinstance(glob, Halt) and glob.reason == "stop NOW" and "@" in glob.by and glob.at > 0

    result = runner.invoke(app, ["resume", "--reason", "fixed"], env=env)
    assert result.exit_code == 0, result.output
    state = asyncio.run(read_control_state(settings))
    assert isinstance(state[GLOBAL_SCOPE], Resume) and state[GLOBAL_SCOPE].reason == "fixed"
    assert isinstance(state["math"], Halt)  # a global resume does not lift a dataset's halt

    bad = runner.invoke(app, ["halt", "--dataset", "no/such", "--reason", "x"], env=env)
    assert bad.exit_code == 2 and "cannot be a topic name" in bad.output


async def test_bad_records_become_dead_letters_and_bad_control_is_ignored(
    settings_factory: Callable[..., Settings],
) -> None:
    from schemas import DLQ_HEADERS
    from services.common.kafka import header, make_consumer

    settings = settings_factory(datasets={"math": {"cap_completion_tokens": 10}})
    await ensure_topics(settings.kafka, settings.datasets)
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(settings.kafka.topic("responses"), b"{not json", key=b"math:x")
        await producer.send_and_wait(settings.kafka.topic("control"), b'{"action": "explode"}', key=b"math")
    finally:
        await producer.stop()
    service, task = await start_service(settings, checkpoint_interval_s=0.1)
    try:
        await send(settings, "responses", [response("math", "ok", 3)])
        await wait_until(lambda: service.ledger.scopes[GLOBAL_SCOPE].responses == 1, 30, message="counted")
    finally:
        await stop_service(service, task)
    assert "math" not in await read_control_state(settings)  # the garbled record is no resume, no halt
    consumer = make_consumer(settings.kafka, settings.kafka.topic("dead-letter"), group_id=None)
    await consumer.start()
    try:
        records = await wait_until(lambda: _fetch(consumer), 30, message="dead letter")
    finally:
        await consumer.stop()
    (record,) = records
    assert record.value == b"{not json"
    assert header(record.headers, DLQ_HEADERS.STAGE) == "budget"
    assert header(record.headers, DLQ_HEADERS.REASON) == "invalid_json"


async def _fetch(consumer: Any) -> list[Any]:
    batches = await consumer.getmany(timeout_ms=500)
    return [r for part in batches.values() for r in part]
