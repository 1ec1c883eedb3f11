"""A rebalance's window between revoking partitions and assigning them: no prompt leaves.

aiokafka calls the worker's listener with every partition revoked, runs the group's join
(seconds while other members join), then assigns. The worker lets the requests already at
the provider be answered and commits before it lets go (``on_partitions_revoked``); a
prompt still waiting at the gate then (for a lease, or a halt) sent nothing. If a lease
granted during the join let it go, and its partition went to another worker, that worker
would read it again from the committed offset and pay for it a second time (CI saw 66
answers for 60 prompts with three workers joining). The truth here is the simulator's own
count of the requests it served, over HTTP, with the worker on a real broker; the listener
is called as aiokafka calls it, so the window is held open as long as the test needs.

The window has a second side: aiokafka fetches the partitions it assigns before the
listener has caught the response store up, so a lookup then must wait for the catch-up.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import pytest

from schemas import (
    LEASES_TOPIC,
    LeaseGranted,
    LeasePolicy,
    Message,
    PromptPublished,
    ResponseReceived,
    Usage,
    encode,
    lease_key,
    sample_key,
)
from services.common.config import Settings
from services.common.kafka import ensure_topics, make_producer
from services.inference.app import _Rebalance
from services.inference.store import ResponseStore, open_store
from tests.integration.test_inference_worker import prompt, provider_cfg, publish, running, sim_factory  # noqa: F401
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka

EPOCH = "hand-over-test"


async def publish_lease(settings: Settings, event: LeasePolicy | LeaseGranted) -> None:
    """What the budget publishes on ``leases`` (no budget runs here: the test is the budget)."""
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await (await producer.send(settings.kafka.topic(LEASES_TOPIC), encode(event), key=lease_key(event).encode()))
    finally:
        await producer.stop()


async def test_a_lease_granted_between_revocation_and_assignment_sends_nothing_of_a_partition_gone(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]  # noqa: F811 - the fixture
) -> None:
    sim = await sim_factory()
    settings = settings_factory(kafka={"partitions": 3}, provider=provider_cfg(sim, concurrency=12))
    await ensure_topics(settings.kafka, ["chat"])
    await publish_lease(settings, LeasePolicy(epoch=EPOCH, in_force=True, ttl_s=60.0, at=time.time()))
    prompts = [prompt("chat", i) for i in range(12)]
    await publish(settings, "chat", [(p.sample_id, encode(p)) for p in prompts])
    async with running(settings) as worker:
        headroom = worker.headroom
        assert headroom is not None
        await wait_until(lambda: headroom.waiting("chat") == len(prompts), 60,
                         message="every prompt waits for a lease (nobody grants one yet)")
        by_partition = collections.Counter(worker.inflight._tasks.values())
        gone = max(by_partition, key=lambda tp: by_partition[tp])  # the partition with the most prompts
        kept = set(worker.assigned_partitions()) - {gone}
        listener = _Rebalance(worker)

        await listener.on_partitions_revoked(worker.assigned_partitions())
        # The join runs; meanwhile the budget grants the lease the worker asked for.
        await publish_lease(settings, LeaseGranted(worker=worker.worker_id, dataset="chat", epoch=EPOCH,
                                                   unlimited=True, ttl_s=60.0, at=time.time()))
        await wait_until(lambda: headroom.room("chat") is None, 30, message="the grant reached the worker")
        await asyncio.sleep(1.0)  # time enough for a woken prompt to reach the simulator
        sent_during_join = sim.stats()["total_requests"]

        await listener.on_partitions_assigned(kept)  # ``gone`` went to another worker
        expected = len(prompts) - by_partition[gone]
        await wait_until(lambda: sim.stats()["total_requests"] >= expected, 60,
                         message="the prompts of the partitions kept are sent")
        await asyncio.sleep(0.5)
        keys = sim.stats()["keys"]
        assert len(worker.inflight) == 0  # every prompt answered or dropped
    print(f"\n{len(prompts)} prompts waiting for a lease at the revocation, {by_partition[gone]} of them on the "
          f"partition that went; during the join {sent_during_join} sent; after the assignment {len(keys)} sent")
    assert sent_during_join == 0  # nothing left the gate between revocation and assignment
    assert len(keys) == expected and all(n == 1 for n in keys.values())
    gone_keys = {sample_key("chat", p.sample_id) for p in prompts} - set(keys)
    assert len(gone_keys) == by_partition[gone]  # those are the next owner's to send, once


async def test_a_prompt_looked_up_while_the_store_catches_up_finds_its_last_owners_answer(
    settings_factory: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiokafka hands a worker the partitions of a rebalance, and starts fetching them, before
    # it calls the listener that catches the response store up with what their last owner
    # paid for: a prompt fetched meanwhile was looked up in a store that had not indexed its
    # answer yet, and paid for again (CI: 61 answers for 60 prompts, three workers joining).
    # Here the next owner's store indexes what it follows half a second late.
    settings = settings_factory()
    producers = [make_producer(settings.kafka), make_producer(settings.kafka)]
    stores: list[ResponseStore] = []
    for producer in producers:
        await producer.start()
    try:
        for producer in producers:
            store = await open_store(settings, producer)
            assert store is not None
            stores.append(store)
        last_owner, next_owner = stores

        async def late_poll(store: ResponseStore, consumer: Any) -> None:
            batches = await consumer.getmany(timeout_ms=500)
            if store is next_owner:
                await asyncio.sleep(0.5)
            for records in batches.values():
                for record in records:
                    store._index_record(record)  # noqa: SLF001 - what _poll does, late

        monkeypatch.setattr(ResponseStore, "_poll", late_poll)
        key = "chat:p1|" + "ab" * 32
        paid = ResponseReceived(
            dataset="chat", sample_id="p1",
            prompt=PromptPublished(dataset="chat", sample_id="p1", messages=[Message(role="user", content="hi")]),
            provider="simulator", model="m", content="the answer", usage=Usage(completion_tokens=3),
        )
        await (await last_owner.put(key, encode(paid)))  # answered, acknowledged, then the partition goes
        catching_up = asyncio.create_task(next_owner.catch_up())  # the next owner's listener
        await asyncio.sleep(0)
        found = await next_owner.get(key)  # a prompt fetched while the listener runs
        assert await catching_up
        assert found is not None and found.content == "the answer"
    finally:
        for store in stores:
            await store.close()
        for producer in producers:
            await producer.stop()
