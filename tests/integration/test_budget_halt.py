"""The budget stops real inference workers: simulator over HTTP, two workers, real broker.

A dataset capped at K completion tokens is halted by the budget; both workers stop sending
for it while another dataset goes on; the overshoot past K is at most the worst case of
the requests in flight when the halt was published. The measured stop latency and the
overshoot are printed (run with ``-s`` to see them); no assertion depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from schemas import (
    GLOBAL_SCOPE,
    Halt,
    Message,
    PromptPublished,
    RequestStarted,
    ResponseReceived,
    Resume,
    decode,
    encode,
    sample_key,
)
from services.budget.app import create_app as create_budget
from services.budget.core import BUDGET_ACTOR
from services.common.config import Settings
from services.common.kafka import Outgoing, ensure_topics, make_producer, publish_all
from services.common.topics import read_to_end
from services.control import publish_control, read_control_state
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka

CAP = 2000
MAX_TOKENS = 100
PROMPTS = 120
FREE_BEFORE = 30
FREE_AFTER = 90


async def read_all(settings: Settings, logical: str, type_: type[Any]) -> list[Any]:
    """Every record of a topic, decoded, from the beginning to its current end."""
    out: list[Any] = []
    await read_to_end(settings.kafka, settings.kafka.topic(logical), lambda r: out.append(decode(r.value, type_)))
    return out


def announced(r: RequestStarted) -> tuple[str, str, str, float]:
    """What tells one announcement from another (a withdrawal repeats it)."""
    return (r.dataset, r.sample_id, r.worker, r.started_at)


async def sent_requests(settings: Settings) -> list[RequestStarted]:
    """The requests really sent: each announcement on ``requests`` less those withheld after it."""
    sent: dict[tuple[str, str, str, float], RequestStarted] = {}
    for r in await read_all(settings, "requests", RequestStarted):
        key = announced(r)
        if r.withheld:
            del sent[key]  # a withdrawal always follows its own announcement
        else:
            sent[key] = r
    return list(sent.values())


async def publish_prompts(settings: Settings, dataset: str, count: int, first: int = 0) -> None:
    """``count`` small prompts on ``prompts.<dataset>``, numbered from ``first``."""
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        topic = settings.kafka.prompts_topic(dataset)
        await publish_all(
            producer,
            [
                Outgoing(
                    topic,
                    encode(
                        PromptPublished(
                            dataset=dataset,
                            sample_id=f"p{i}",
                            messages=[Message(role="user", content=f"question {i} of {dataset}")],
                        )
                    ),
                    sample_key(dataset, f"p{i}").encode(),
                )
                for i in range(first, first + count)
            ],
        )
    finally:
        await producer.stop()


@pytest.mark.long
async def test_cap_stops_both_workers_for_that_dataset_only(
    settings_factory: Callable[..., Settings],
) -> None:
    from services.inference.app import create_app as create_worker
    from services.simulator.app import start_simulator
    from services.simulator.options import SimulatorOptions

    sim = await start_simulator(SimulatorOptions(latency_s=0.5, reasoning_tokens=(20, 50), content_tokens=(10, 30)))
    settings = settings_factory(
        provider={"kind": "simulator", "base_url": sim.url, "concurrency": 4, "max_attempts": 2},
        datasets={
            "capped": {"cap_completion_tokens": CAP, "max_tokens": MAX_TOKENS},
            "free": {"cap_completion_tokens": None, "max_tokens": MAX_TOKENS},
        },
    )
    await ensure_topics(settings.kafka, settings.datasets)
    # Held by a person's global halt until both workers own partitions of both datasets.
    await publish_control(settings, Halt(scope=GLOBAL_SCOPE, reason="wait for both workers", by="test"))
    await publish_prompts(settings, "capped", PROMPTS)
    # A worker drains one partition's fetched records before the next, so "free" starts
    # small (both workers reach their capped partitions) and gets more after the halt.
    await publish_prompts(settings, "free", FREE_BEFORE)

    budget = create_budget(settings, checkpoint_interval_s=0.2)
    await budget.start()
    budget_task = asyncio.create_task(budget.run())
    workers = [create_worker(settings, worker_id=f"w{i}") for i in (1, 2)]
    tasks: list[asyncio.Task[None]] = []
    try:
        for worker in workers:
            await worker.start()
            tasks.append(asyncio.create_task(worker.run()))

        def both_assigned() -> bool:
            # Test-only peek at the consumers: each worker must own a partition of each topic.
            owned = [{tp.topic for tp in w._consumer.assignment()} for w in workers]  # type: ignore[union-attr]
            wanted = {settings.kafka.prompts_topic(d) for d in ("capped", "free")}
            return all(topics == wanted for topics in owned)

        await wait_until(both_assigned, 60, 0.2, message="both workers own capped and free partitions")
        await publish_control(settings, Resume(scope=GLOBAL_SCOPE, reason="go", by="test"))

        async def halted() -> Halt | None:
            event = (await read_control_state(settings)).get("capped")
            return event if isinstance(event, Halt) else None

        halt = await wait_until(halted, 120, 0.2, message="halt of 'capped'")
        assert halt.by == BUDGET_ACTOR
        for worker in workers:
            await wait_until(lambda w=worker: "capped" in w.halted_scopes, 30, message="workers see the halt")

        def free_requests_at_least(target: int) -> bool:
            scope = budget.ledger.scopes.get("free")
            return scope is not None and scope.requests >= target

        # Progress, not time: "free" must go on while "capped" sends nothing more. The
        # capped count is taken once "free" moved on after every worker saw the halt, so a
        # request being announced at that very moment is already on the topic.
        await publish_prompts(settings, "free", FREE_AFTER, first=FREE_BEFORE)
        free_seen = budget.ledger.scopes["free"].requests if "free" in budget.ledger.scopes else 0
        await wait_until(
            lambda: free_requests_at_least(free_seen + 5),
            120,
            0.2,
            message="free keeps going",
        )
        requests_then = await sent_requests(settings)
        free_then = started_count(requests_then, "free")
        await wait_until(lambda: free_requests_at_least(free_then + 10), 120, 0.2, message="free keeps going")
        for worker in workers:
            worker.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    except BaseException:
        budget_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await budget_task
        await budget.abort()
        raise
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for worker in workers:
            await worker.close()
        await sim.close()

    try:
        responses = await read_all(settings, "responses", ResponseReceived)
        await wait_until(
            lambda: budget.ledger.scopes[GLOBAL_SCOPE].responses >= len(responses),
            60,
            message="budget caught up",
        )
    finally:
        budget.stop()
        await asyncio.wait_for(budget_task, 30)
        await budget.close()

    requests = await sent_requests(settings)
    capped_requests = [r for r in requests if r.dataset == "capped"]
    free_requests = [r for r in requests if r.dataset == "free"]
    # Both workers served the capped dataset, and both stopped: nothing was sent for it
    # after the requests already read when every worker had seen the halt.
    assert {r.worker for r in capped_requests} == {"w1", "w2"}
    # (a request held back after that read was withdrawn, so "after" can only be fewer)
    assert {announced(r) for r in capped_requests} <= {announced(r) for r in requests_then}
    assert len(free_requests) > free_then  # the other dataset went on
    control = await read_control_state(settings)
    assert "free" not in control and isinstance(control[GLOBAL_SCOPE], Resume)

    # Overshoot: at most the worst case of what was in flight when the halt was published.
    answered_at = {r.sample_id: r.received_at for r in responses if r.dataset == "capped"}
    inflight_at_halt = sum(
        r.max_tokens for r in capped_requests if answered_at.get(r.sample_id, float("inf")) > halt.at
    )
    spent = budget.ledger.scopes["capped"].completion_tokens
    truth = sum(r.usage.completion_tokens or 0 for r in responses if r.dataset == "capped")
    assert spent == truth
    overshoot = spent - CAP
    last_capped = max(r.started_at for r in capped_requests)
    print(
        f"\ncap {CAP} completion tokens: spent {spent} (overshoot {overshoot:+d}, "
        f"in-flight worst case at the halt {inflight_at_halt}); halt: {halt.reason}; "
        f"last capped request {last_capped - halt.at:+.3f} s after the halt; "
        f"capped requests by worker {dict(Counter(r.worker for r in capped_requests))}, "
        f"free requests {len(free_requests)}"
    )
    assert overshoot <= inflight_at_halt


def started_count(requests: list[RequestStarted], dataset: str) -> int:
    """RequestStarted events of one dataset."""
    return sum(1 for r in requests if r.dataset == dataset)


async def run_cli(settings: Settings, *args: str) -> str:
    """Run the real ``draftstream`` command against the test's broker and topic prefix."""
    import os
    import sys

    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_cli_global_halt_stops_every_worker_and_resume_finishes_the_run(
    settings_factory: Callable[..., Settings],
) -> None:
    from services.inference.app import create_app as create_worker
    from services.simulator.app import start_simulator
    from services.simulator.options import SimulatorOptions

    total = 60
    sim = await start_simulator(SimulatorOptions(latency_s=0.3, reasoning_tokens=(10, 30), content_tokens=(5, 20)))
    settings = settings_factory(
        provider={"kind": "simulator", "base_url": sim.url, "concurrency": 3},
        datasets={"chat": {"max_tokens": MAX_TOKENS}},
    )
    await ensure_topics(settings.kafka, settings.datasets)
    await publish_prompts(settings, "chat", total)
    workers = [create_worker(settings, worker_id=f"w{i}") for i in (1, 2)]
    tasks: list[asyncio.Task[None]] = []
    try:
        for worker in workers:
            await worker.start()
            tasks.append(asyncio.create_task(worker.run()))

        async def answered() -> set[str]:
            return {r.sample_id for r in await read_all(settings, "responses", ResponseReceived)}

        await wait_until(lambda: _at_least(answered(), 10), 120, 0.3, message="first answers")
        printed = await run_cli(settings, "halt", "--reason", "stop NOW", "--by", "ann")
        assert "halted global" in printed
        for worker in workers:
            await wait_until(lambda w=worker: GLOBAL_SCOPE in w.halted_scopes, 30, message="halt seen")
        seen_at = time.time()
        halt = (await read_control_state(settings))[GLOBAL_SCOPE]
        assert isinstance(halt, Halt) and (halt.by, halt.reason) == ("ann", "stop NOW")

        # Drained: every request sent before the halt has its answer (or the run is done); a
        # request the halt held back before it went out was withdrawn and is not waited for.
        async def drained() -> bool:
            requests = await sent_requests(settings)
            return len(await answered()) >= len({r.sample_id for r in requests})

        await wait_until(drained, 60, 0.3, message="in-flight requests answered")
        answered_while_halted = await answered()
        printed = await run_cli(settings, "resume", "--reason", "checked", "--by", "ann")
        assert "resumed global" in printed
        resume = (await read_control_state(settings))[GLOBAL_SCOPE]
        assert isinstance(resume, Resume)
        await wait_until(lambda: _at_least(answered(), total), 180, 0.5, message="every prompt answered")
        for worker in workers:
            worker.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for worker in workers:
            await worker.close()
        await sim.close()

    requests = await sent_requests(settings)
    during_halt = [r for r in requests if seen_at < r.started_at < resume.at]
    assert during_halt == []
    assert len(answered_while_halted) < total  # the halt really held work back
    assert {r.sample_id for r in await read_all(settings, "responses", ResponseReceived)} == {
        f"p{i}" for i in range(total)
    }
    before = [r.started_at for r in requests if r.started_at <= resume.at]
    withheld = sum(r.withheld for r in await read_all(settings, "requests", RequestStarted))
    print(
        f"\nglobal halt: last request {max(before) - halt.at:+.3f} s after the halt was published, "
        f"workers saw it {seen_at - halt.at:.3f} s after; {len(requests)} requests "
        f"({withheld} more held back by the halt), {total} prompts answered"
    )


async def _at_least(items: Any, count: int) -> bool:
    return len(await items) >= count
