"""Starting a service while Kafka is unreachable retries with a fresh instance."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiokafka.errors import KafkaConnectionError

from services.common.service import start_with_retry


class Flaky:
    """Fails to start the first ``failures`` times it is built."""

    built = 0

    def __init__(self, failures: int) -> None:
        Flaky.built += 1
        self.attempt = Flaky.built
        self.failures = failures
        self.closed = False

    async def start(self) -> None:
        if self.attempt <= self.failures:
            raise KafkaConnectionError("Unable to bootstrap")

    async def run(self) -> None:
        return None

    def stop(self) -> None:
        return None

    async def close(self) -> None:
        self.closed = True


async def test_a_start_that_cannot_reach_kafka_is_retried_with_a_new_instance() -> None:
    Flaky.built = 0
    made: list[Flaky] = []

    def build() -> Flaky:
        made.append(Flaky(failures=2))
        return made[-1]

    started = await start_with_retry(build, name="t", timeout_s=30, stopping=asyncio.Event())
    assert started is made[-1]
    assert len(made) == 3
    assert [m.closed for m in made] == [True, True, False]


async def test_the_last_error_is_raised_after_the_timeout() -> None:
    Flaky.built = 0
    with pytest.raises(KafkaConnectionError):
        await start_with_retry(lambda: Flaky(failures=99), name="t", timeout_s=0.2, stopping=asyncio.Event())


async def test_a_stop_while_waiting_returns_none() -> None:
    Flaky.built = 0
    stopping = asyncio.Event()
    stopping.set()
    assert await start_with_retry(lambda: Flaky(failures=99), name="t", timeout_s=30, stopping=stopping) is None


def test_a_slow_cycle_collection_is_logged_and_a_quick_one_is_not(caplog: pytest.LogCaptureFixture) -> None:
    """A real collection over a heap of cycles, timed by the callback a service installs."""
    import gc

    from services.common import service

    watcher = service._SlowCollections()  # noqa: SLF001 - the callback collect_garbage_for_a_service installs
    caplog.set_level("WARNING", logger="services.common.service")
    cycles = []
    installed = service._SLOW.on_phase in gc.callbacks  # noqa: SLF001 - a test that ran a service installed it
    if installed:
        gc.callbacks.remove(service._SLOW.on_phase)  # noqa: SLF001
    gc.disable()  # only the two collections below run while the callback is installed
    try:
        for _ in range(400_000):
            node: list[object] = []
            node.append(node)
            cycles.append(node)
        del node
        gc.callbacks.append(watcher.on_phase)
        old = service.SLOW_COLLECTION_S
        # Below the threshold, not logged; the threshold is set out of reach so that a loaded
        # machine (a parallel run) cannot make the young generation's collection "slow".
        service.SLOW_COLLECTION_S = 3600.0
        try:
            gc.collect(0)
        finally:
            service.SLOW_COLLECTION_S = old
        assert not [r for r in caplog.records if "cycle collection" in r.getMessage()]
        service.SLOW_COLLECTION_S = 0.0  # any collection is "slow": the message and its figures
        try:
            gc.collect(2)
        finally:
            service.SLOW_COLLECTION_S = old
    finally:
        if watcher.on_phase in gc.callbacks:
            gc.callbacks.remove(watcher.on_phase)
        if installed:
            gc.callbacks.append(service._SLOW.on_phase)  # noqa: SLF001
        gc.enable()
    lines = [r.getMessage() for r in caplog.records if "cycle collection of generation 2" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(
        r"cycle collection of generation 2 took \d+ ms \(\d+ ms of CPU; \d+ collected\)", lines[0]
    )
    del cycles


class _Node:
    """A cycle: the node refers to itself."""

    def __init__(self) -> None:
        self.me = self


async def test_the_older_generations_are_collected_when_quiet_and_not_while_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cycle that outlived a young collection is found only by an older one: while the service
    is busy none runs (below the bound), once it has been quiet one does; the thresholds come back."""
    import gc
    import threading
    import weakref

    from services.common import service

    monkeypatch.setattr(service, "YOUNG_EVERY_S", 0.01)
    monkeypatch.setattr(service, "QUIET_FOR_S", 0.05)
    monkeypatch.setattr(service, "QUIET_AFTER_YOUNG", 1)
    monkeypatch.setattr(service, "BUSY_COLLECT_AFTER", 1_000_000)
    before = gc.get_threshold()
    state = {"quiet": False}
    node = _Node()
    gone = weakref.ref(node)
    gc.collect(0)  # the node outlives a young collection: an older generation holds it now
    del node
    collector = service.QuietCollector(lambda: state["quiet"])
    full: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        # Only the collector's own: another thread of the test process may collect meanwhile.
        if phase == "stop" and info["generation"] == 2 and threading.current_thread() is collector_thread:
            full.append(1)

    collector_thread = collector._thread  # noqa: SLF001 - whose collections are counted
    gc.callbacks.append(count)
    collector.start()
    try:
        await asyncio.sleep(0.2)
        assert gc.get_threshold() == service.QUIET_GC_THRESHOLDS
        assert full == []  # busy: no full collection (the cycle waits for one)
        state["quiet"] = True
        for _ in range(500):
            if full:
                break
            await asyncio.sleep(0.01)
        assert gone() is None
        await asyncio.sleep(0.3)  # the same quiet spell: its one full collection ran
        assert full == [1]
    finally:
        collector.stop()
        gc.callbacks.remove(count)
    assert gc.get_threshold() == service.SERVICE_GC_THRESHOLDS
    gc.set_threshold(*before)


@pytest.mark.parametrize("makes_cycles", [True, False], ids=["makes-cycles", "makes-none"])
async def test_a_busy_service_is_collected_after_the_bound_sooner_when_it_makes_cycles(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, makes_cycles: bool
) -> None:
    """Never quiet: an old cycle is collected after BUSY_COLLECT_AFTER young collections when those
    found CYCLES_SEEN objects in cycles, else only after BUSY_COLLECT_MOST."""
    import gc
    import re
    import weakref

    from services.common import service

    monkeypatch.setattr(service, "YOUNG_EVERY_S", 0.005)
    monkeypatch.setattr(service, "BUSY_COLLECT_AFTER", 20)
    monkeypatch.setattr(service, "CYCLES_SEEN", 1_000)
    monkeypatch.setattr(service, "BUSY_COLLECT_MOST", 200)
    before = gc.get_threshold()
    node = _Node()
    gone = weakref.ref(node)
    gc.collect(0)
    del node
    collector = service.QuietCollector(lambda: False)
    caplog.set_level("INFO", logger=service.log.name)
    collector.start()
    try:
        if makes_cycles:
            for _ in range(2_000):
                _Node()  # each a cycle the moment it is made, unreachable at once: found young
        for _ in range(1_000):
            if gone() is None:
                break
            await asyncio.sleep(0.01)
        assert gone() is None
    finally:
        collector.stop()
        gc.set_threshold(*before)
    young = [int(m) for m in re.findall(r"while busy \((\d+) young", caplog.text)]
    assert young, caplog.text
    if makes_cycles:
        assert 20 <= young[0] < 200
    else:
        assert young[0] >= 200
