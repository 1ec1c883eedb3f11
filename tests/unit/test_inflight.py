"""The worker's prompts in flight in a rebalance: who is waited for, who is dropped.

Plain asyncio tasks stand in for prompts: one "at the provider" (it finishes when its
event is set), one held at a halt gate (it waits until cancelled).
"""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from services.inference.app import InFlight

KEPT, GONE = TopicPartition("prompts.chat", 0), TopicPartition("prompts.chat", 1)


async def _request(answered: asyncio.Event, done: list[str], name: str) -> None:
    await answered.wait()
    done.append(name)


async def _held_at_gate(resumed: asyncio.Event, done: list[str], name: str) -> None:
    await resumed.wait()  # never set here: a halt that stands
    done.append(name)


async def test_hand_over_waits_for_requests_of_the_partitions_going_and_not_for_held_ones() -> None:
    inflight, done = InFlight(), list[str]()
    answered, resumed = asyncio.Event(), asyncio.Event()
    inflight.spawn(_request(answered, done, "gone-request"), GONE)
    inflight.spawn(_held_at_gate(resumed, done, "gone-held"), GONE)
    inflight.spawn(_held_at_gate(resumed, done, "kept-held"), KEPT)
    await asyncio.sleep(0)
    held = {t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_held_at_gate"}  # type: ignore[union-attr]
    assert len(held) == 2 and inflight.partitions() == {KEPT, GONE}

    asyncio.get_running_loop().call_later(0.3, answered.set)
    unanswered = await inflight.hand_over([GONE], timeout_s=5.0, held=held)
    assert (unanswered, done) == (0, ["gone-request"])  # waited for the request, not for the held prompt

    # The partition went to another worker: its held prompt is dropped, the kept one stays.
    assert inflight.drop_held({KEPT}, held) == 1
    await asyncio.sleep(0.05)  # the cancelled task ends
    assert len(inflight) == 1 and inflight.partitions() == {KEPT}
    await inflight.cancel()


async def test_hand_over_gives_up_after_its_timeout() -> None:
    inflight, done = InFlight(), list[str]()
    never = asyncio.Event()
    inflight.spawn(_request(never, done, "slow"), GONE)
    assert await inflight.hand_over([GONE], timeout_s=0.2, held=set()) == 1
    assert len(inflight) == 1  # still running: its next owner may pay again (logged)
    await inflight.cancel()
