"""The inference worker's wait for headroom: requests of a dataset wait in line, oldest first.

In-process only (the lease records are fed as the follower would deliver them; the worker's
asks are collected instead of produced). The whole loop over a real broker, budget and
simulator is in tests/integration/test_budget_headroom.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas import LeaseGranted, LeasePolicy, LeaseReleased, LeaseRequested, decode_lease, encode
from services.common.config import KafkaSettings
from services.common.halts import HaltFollower, Stopped
from services.inference import headroom as headroom_mod
from services.inference.headroom import Headroom

EPOCH = "e1"


class _Asks:
    """Collects what the worker sends on ``leases`` (a producer's ``send`` and its delivery)."""

    def __init__(self) -> None:
        self.sent: list[LeaseRequested] = []
        self.released: list[LeaseReleased] = []

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[None]:
        event = decode_lease(value)
        if isinstance(event, LeaseRequested):
            self.sent.append(event)
        elif isinstance(event, LeaseReleased):
            self.released.append(event)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def _headroom() -> tuple[Headroom, asyncio.Event, _Asks]:
    stopping = asyncio.Event()
    halts = HaltFollower(KafkaSettings(), stopping)
    room = Headroom(KafkaSettings(), "w1", halts)
    asks = _Asks()
    room._producer = asks  # type: ignore[assignment]  # only send() is used
    room._take_value(encode(LeasePolicy(epoch=EPOCH, in_force=True, ttl_s=30.0, at=time.time())))
    return room, stopping, asks


def _grant(room: Headroom, dataset: str, granted: int, *, unlimited: bool = False, releases: int = 0) -> None:
    event = LeaseGranted(worker="w1", dataset=dataset, epoch=EPOCH, granted=granted, unlimited=unlimited,
                         ttl_s=30.0, releases=releases, at=time.time())
    room._take_value(encode(event))


async def _settled() -> None:
    for _ in range(5):  # the woken requests run on the next turns of the loop
        await asyncio.sleep(0)


def test_room_handed_back_admits_the_oldest_requests_it_fits_and_no_others() -> None:
    async def main() -> None:
        room, _, asks = _headroom()
        order: list[str] = []

        async def request(key: str) -> None:
            await room.admit("capped", key, 100)
            order.append(key)

        tasks = [asyncio.create_task(request(f"capped:{i}")) for i in range(6)]
        await _settled()
        assert order == [] and room.waiting("capped") == 6
        assert room.short() == {"capped"}
        assert asks.sent and asks.sent[0].target == 100  # the first to wait asks at once
        _grant(room, "capped", 250)  # room for two
        await _settled()
        assert order == ["capped:0", "capped:1"] and room.waiting("capped") == 4
        _grant(room, "other", 0, unlimited=True)
        room.settle("other:x", 10)  # another dataset's answer hands back nothing of this one's room
        await _settled()
        assert order == ["capped:0", "capped:1"]
        room.settle("capped:0", 90)  # 10 back, room 60: still not one more request's worst case
        await _settled()
        assert order == ["capped:0", "capped:1"]
        room.settle("capped:1", 0)  # 100 more back, room 160: one more request, not two
        await _settled()
        assert order == ["capped:0", "capped:1", "capped:2"] and room.waiting("capped") == 3
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert room.waiting("capped") == 0 and room.short() == set()
        await room.close()

    asyncio.run(main())


def test_a_cancelled_request_leaves_the_line_and_the_ask() -> None:
    async def main() -> None:
        room, _, asks = _headroom()
        tasks = [asyncio.create_task(room.admit("capped", f"capped:{i}", 100)) for i in range(3)]
        await _settled()
        tasks[1].cancel()
        await asyncio.gather(tasks[1], return_exceptions=True)
        assert room.waiting("capped") == 2
        room._asked.clear()  # the next ask, without waiting for its time
        await room._ask("capped", 100)
        assert asks.sent[-1].target == 200  # the two still waiting, not three
        _grant(room, "capped", 100)
        await _settled()
        assert tasks[0].done() and not tasks[2].done()  # the oldest left waiting goes first
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await room.close()

    asyncio.run(main())


def test_a_stopping_worker_releases_its_waiting_requests_within_one_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headroom_mod, "ASK_EVERY_S", 0.02)

    async def main() -> None:
        room, stopping, asks = _headroom()
        tasks = [asyncio.create_task(room.admit("capped", f"capped:{i}", 100)) for i in range(50)]
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in tasks)
        assert len(asks.sent) >= 2 and asks.sent[-1].target == 5_000  # asked again, for all 50
        stopping.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 1.0)
        assert all(isinstance(r, Stopped) for r in results)
        assert room.waiting("capped") == 0
        await room.close()

    asyncio.run(main())


def test_a_lease_with_nothing_to_send_is_released_and_grants_decided_before_are_ignored() -> None:
    """Its partitions went to another worker (or ran dry): the room it holds goes back to the budget."""

    async def main() -> None:
        room, _, asks = _headroom()
        _grant(room, "capped", 500)
        await room.admit("capped", "capped:a", 100)
        await room.renew_once()  # a request in flight: renewed, not released
        room.settle("capped:a", 40)
        await room.renew_once()  # answered since the last renewal: renewed
        assert asks.released == [] and room.room("capped") == 460
        assert [e.target for e in asks.sent[-2:]] == [100, 40]
        await room.renew_once()  # nothing in flight, waiting or admitted for a whole period
        assert [(e.dataset, e.releases) for e in asks.released] == [("capped", 1)]
        assert room.room("capped") == 0  # void here first: never used here and by another worker
        _grant(room, "capped", 500)  # decided before the budget applied the release
        assert room.room("capped") == 0
        await room.renew_once()  # not renewed any more: the budget lets the lease go
        assert asks.sent[-1].target == 40 and len(asks.released) == 1
        waiting = asyncio.create_task(room.admit("capped", "capped:b", 100))
        await _settled()
        assert room.waiting("capped") == 1 and asks.sent[-1].target == 140  # asks again when needed
        _grant(room, "capped", 140, releases=1)
        await asyncio.wait_for(waiting, 1.0)
        await room.renew_once()  # busy again: renewed
        assert len(asks.released) == 1
        room.settle("capped:b", 100)
        await room.close()  # the clean stop's release counts on
        assert [e.releases for e in asks.released] == [1, 2]

    asyncio.run(main())


def test_an_unlimited_or_empty_lease_is_not_released() -> None:
    async def main() -> None:
        room, _, asks = _headroom()
        _grant(room, "free", 0, unlimited=True)
        _grant(room, "spent", 0)
        for _ in range(3):
            await room.renew_once()
        assert asks.released == [] and {e.dataset for e in asks.sent} == {"free", "spent"}

    asyncio.run(main())
