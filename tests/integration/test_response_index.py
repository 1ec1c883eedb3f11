"""Issue 27: an inference worker's start-up reads ``response-index``, not every paid answer's value.

A real broker, the simulator over real HTTP; what was paid is counted at the simulator
(``stats()["keys"]``), never by the code under test. Covers: a restart reads no stored
value and still answers every request seen again from the store (0 paid twice); a store
written without an index (before issue 27) is read whole once, indexed, and the next start
reads none of it; store records past the last checkpoint (a worker that wrote no index)
are read from the store's tail, and only those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from schemas import ResponseIndexed, StoreCheckpointed, decode_store_index, encode
from services.common.config import Settings
from services.common.kafka import ensure_topics
from services.common.topics import read_compacted
from services.inference.store_index import checkpoint_key
from tests.integration import test_inference_worker as worker_tests
from tests.integration.test_inference_worker import Collector, prompt, provider_cfg, publish, running
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka

sim_factory = worker_tests.sim_factory  # the simulator fixture of the worker tests


def paid(sim: Any) -> int:
    """Chat requests that reached the simulator: what the provider bills."""
    return int(sum(sim.stats()["keys"].values()))


async def run_until(settings: Settings, out: Collector, total: int, **kw: Any) -> Any:
    """A worker run until ``total`` responses are on the topic; returns the stopped worker."""
    async with running(settings, **kw) as worker:
        await wait_until(lambda: len(out.responses()) >= total, timeout=90, message=f"{total} responses")
    return worker


async def test_a_restart_reads_the_index_not_the_values_and_pays_nothing_twice(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    sim = await sim_factory()
    settings = settings_factory(provider=provider_cfg(sim))
    await ensure_topics(settings.kafka, ["chat"])
    values = [(p.sample_id, encode(p)) for p in (prompt("chat", i) for i in range(12))]
    await publish(settings, "chat", values)
    async with Collector(settings, "responses", "dead-letter") as out:
        first = await run_until(settings, out, 12)
        assert paid(sim) == 12 and first.store.tail_records == 0  # an empty store: nothing to read
        index = await read_compacted(settings.kafka, settings.kafka.topic("response-index"))
        events = {k.decode(): decode_store_index(v) for k, v in index.values.items()}
        located = {k: e for k, e in events.items() if isinstance(e, ResponseIndexed)}
        checkpoints = {e.partition: e.next_offset for e in events.values() if isinstance(e, StoreCheckpointed)}
        store = await read_compacted(settings.kafka, settings.kafka.topic("response-store"))
        assert set(located) == {k.decode() for k in store.values}
        assert checkpoints == {p: end for p, end in store.ends.items() if end > 0}
        assert all(checkpoint_key(p).encode() in index.values for p in checkpoints)

        await publish(settings, "chat", values)  # every prompt seen again after a restart
        second = await run_until(settings, out, 24)
    assert second.answers.reused == 12
    assert paid(sim) == 12  # answered from the store, not paid twice
    assert second.store.loaded_from_index == 12
    assert second.store.tail_records == 0 and second.store.tail_bytes == 0  # no stored value read at start
    assert out.dead_letters() == []


async def test_an_old_store_without_an_index_is_indexed_once_then_only_its_new_tail_is_read(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    sim = await sim_factory()
    old = settings_factory(provider=provider_cfg(sim), inference={"store_index": False})
    settings = settings_factory(provider=provider_cfg(sim))
    await ensure_topics(settings.kafka, ["chat"])
    first_ten = [(p.sample_id, encode(p)) for p in (prompt("chat", i) for i in range(10))]
    await publish(settings, "chat", first_ten)
    async with Collector(settings, "responses", "dead-letter") as out:
        await run_until(old, out, 10)  # a worker as before issue 27: a store, no index
        index = await read_compacted(settings.kafka, settings.kafka.topic("response-index"))
        assert index.values == {}

        await publish(settings, "chat", first_ten)
        with caplog.at_level(logging.INFO, logger="services.inference.store"):
            upgrading = await run_until(settings, out, 20)
        assert "building the index from the store once" in caplog.text
        assert upgrading.store.loaded_from_index == 0 and upgrading.store.tail_records == 10
        assert upgrading.answers.reused == 10 and paid(sim) == 10

        # Five more paid by a worker that writes no index: past every checkpoint.
        five_more = [(p.sample_id, encode(p)) for p in (prompt("chat", i) for i in range(10, 15))]
        await publish(settings, "chat", five_more)
        await run_until(old, out, 25)
        assert paid(sim) == 15

        caplog.clear()
        await publish(settings, "chat", first_ten + five_more)
        with caplog.at_level(logging.INFO, logger="services.inference.store"):
            restarted = await run_until(settings, out, 40)
        assert "building the index" not in caplog.text
    assert restarted.store.loaded_from_index == 10  # the indexed part comes from the index
    assert restarted.store.tail_records == 5  # only the records past the checkpoints are read
    assert restarted.answers.reused == 15 and paid(sim) == 15  # nothing paid twice
    assert out.dead_letters() == []
