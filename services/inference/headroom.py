"""A worker's leases of headroom under the caps (``leases``), and the wait for room before a request.

The budget announces on ``leases`` whether requests need a lease (:class:`~schemas.LeasePolicy`,
with its epoch). While they do, a request of a dataset goes out only when this worker's
lease of that dataset is valid and has room for the request's worst case: what the worker
consumed this epoch (worst case of its requests in flight, what its answered requests used)
plus ``max_tokens`` stays within the tokens granted. Otherwise the request waits (in the
halt gate's ``held`` set: it sent nothing), and the worker asks the budget for the
shortfall. An answer landing below its worst case gives the difference back at once. The
lease is renewed every third of its TTL; it is void here a little before the TTL runs out
without a renewal, and when a new epoch is announced (a restarted budget). A lease with room
left and nothing of its dataset in flight, waiting, admitted or answered for a whole renewal period is
released (its partitions went to another worker, or ran dry): room held by a worker with
nothing to send would keep the other workers waiting and the dataset from finishing at its
cap. On a clean stop the worker releases its leases; a killed worker's expire at the budget.

Without a policy on ``leases`` (no budget service running leases) nothing waits here.
Written on aiokafka directly, like :class:`~services.common.halts.HaltFollower`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import (
    LEASES_TOPIC,
    LeaseGranted,
    LeasePolicy,
    LeaseReleased,
    LeaseRequested,
    SchemaError,
    decode_lease,
    encode,
    lease_key,
)
from services.common.config import KafkaSettings
from services.common.halts import HaltFollower
from services.common.kafka import make_consumer
from services.common.service import release
from services.common.topics import Record, follow, read_compacted, ready_partitions

log = logging.getLogger(__name__)

ASK_EVERY_S = 0.25
"""A worker waiting for headroom repeats its request this often (the budget may have freed some)."""
ASK_MORE_EVERY_S = 0.05
"""How soon a worker asks again when more of its requests wait than it last asked for."""


@dataclass
class _Grant:
    granted: int
    unlimited: bool
    valid_until: float  # monotonic


@dataclass(eq=False)
class _Waiter:
    """A request waiting for room: woken (its future set) when the room may fit it."""

    max_tokens: int
    woken: asyncio.Future[None]
    in_line: bool = True


@dataclass(frozen=True)
class _Reserved:
    epoch: str
    dataset: str
    max_tokens: int


class Slots(Protocol):
    """The provider slots of the worker's requests: given up while a request waits, taken back to send."""

    def yield_slot(self) -> None: ...
    async def reclaim_slot(self, slots: int) -> None: ...


class Headroom:
    """This worker's leases, kept current from ``leases``; the wait every request passes."""

    def __init__(
        self,
        kafka: KafkaSettings,
        worker_id: str,
        halts: HaltFollower,
        slots: Slots | None = None,
        concurrency: int = 1,
    ) -> None:
        self._kafka = kafka
        self._slots = slots
        self._concurrency = concurrency
        self.listeners: list[Callable[[], None]] = []
        """Called when the datasets short of headroom may have changed (their prompts wait or flow again)."""
        self._topic = kafka.topic(LEASES_TOPIC)
        self.worker_id = worker_id
        self._halts = halts
        self.policy: LeasePolicy | None = None
        self._grants: dict[str, _Grant] = {}
        self.consumed: dict[str, int] = {}
        self._reserved: dict[str, _Reserved] = {}
        self._kept: dict[str, _Reserved] = {}  # attempts that may have been billed unanswered (this epoch)
        self._waiting: dict[str, deque[_Waiter]] = {}  # dataset -> its waiting requests, oldest first
        self._waiting_tokens: dict[str, int] = {}  # dataset -> the sum of their worst cases
        self._askers: dict[str, asyncio.Task[None]] = {}  # dataset -> its repeated ask while requests wait
        self._asked: dict[str, tuple[int, float]] = {}  # dataset -> (target, monotonic time)
        self._released: dict[str, int] = {}  # dataset -> its releases this epoch (grants before the last are stale)
        self._active: set[str] = set()  # datasets with a request admitted or settled since the last renewal
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, producer: AIOKafkaProducer) -> None:
        """Read the standing policy, then follow ``leases`` and renew the leases held."""
        self._producer = producer
        values, ends = await read_compacted(self._kafka, self._topic)
        if b"policy" in values:
            self._take_value(values[b"policy"])
        consumer = self._consumer = make_consumer(self._kafka, group_id=None, fetch_max_wait_ms=50)
        await consumer.start()
        tps = [TopicPartition(self._topic, p) for p in await ready_partitions(self._kafka, self._topic)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, ends.get(tp.partition, 0))
        self._tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._renew())]

    @property
    def in_force(self) -> bool:
        """Whether requests need a lease now."""
        return self.policy is not None and self.policy.in_force

    def room(self, dataset: str) -> int | None:
        """Tokens this worker may still commit for ``dataset``: None when unlimited or no lease is needed."""
        if not self.in_force:
            return None
        grant = self._grants.get(dataset)
        if grant is None or grant.valid_until <= time.monotonic():
            return 0
        if grant.unlimited:
            return None
        return max(0, grant.granted - self.consumed.get(dataset, 0))

    async def admit(self, dataset: str, key: str, max_tokens: int) -> str:
        """Pass the halt gate and wait for room for ``max_tokens``; the lease epoch ("" when none is needed).

        The requests of a dataset wait in line, oldest first: room handed back wakes the
        oldest ones it fits, not every waiting request (near a cap a worker holds hundreds
        waiting, and every answer hands room back). A dataset's repeated ask for room runs
        once for all its waiting requests (:meth:`_asking`).

        Raises :class:`~services.common.halts.Stopped` when the worker stops meanwhile.
        """
        task = asyncio.current_task()
        while True:
            if self._halts.held_back(dataset):
                # A held prompt does not keep another request waiting for a slot (in a
                # rebalance, one the hand-over would wait for in vain).
                self._yield_slot()
            await self._halts.gate(dataset)
            room = self.room(dataset)
            if room is None or room >= max_tokens:
                epoch = self._reserve(dataset, key, max_tokens)
                if self._slots is not None:
                    try:
                        await self._slots.reclaim_slot(self._concurrency)
                    except BaseException:
                        self.settle(key, None)
                        raise
                return epoch
            self._yield_slot()
            waiter = _Waiter(max_tokens, asyncio.get_running_loop().create_future())
            line = self._waiting.setdefault(dataset, deque())
            line.append(waiter)
            self._waiting_tokens[dataset] = self._waiting_tokens.get(dataset, 0) + max_tokens
            if len(line) == 1:
                self._notify()
                if dataset not in self._askers:
                    self._askers[dataset] = asyncio.create_task(self._asking(dataset))
            if task is not None:
                self._halts.held.add(task)
            try:
                await self._ask(dataset, max_tokens)
                await waiter.woken
            finally:
                if waiter.in_line:  # not woken: cancelled, or the ask failed
                    waiter.in_line = False
                    line.remove(waiter)
                    self._waiting_tokens[dataset] -= max_tokens
                if task is not None:
                    self._halts.held.discard(task)
                if not line:
                    self._notify()

    def short(self) -> set[str]:
        """Datasets with a request waiting for headroom (no more of their prompts should be fetched)."""
        return {dataset for dataset, line in self._waiting.items() if line}

    def waiting(self, dataset: str) -> int:
        """How many requests of ``dataset`` wait for room."""
        return len(self._waiting.get(dataset, ()))

    def _yield_slot(self) -> None:
        if self._slots is not None:
            self._slots.yield_slot()

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()

    def _reserve(self, dataset: str, key: str, max_tokens: int) -> str:
        if not self.in_force or self.policy is None:
            return ""
        epoch = self.policy.epoch
        self.settle(key, None)  # a previous attempt of this prompt, if any
        self._reserved[key] = _Reserved(epoch, dataset, max_tokens)
        self._active.add(dataset)
        self.consumed[dataset] = self.consumed.get(dataset, 0) + max_tokens
        return epoch

    def keep(self, key: str, attempt_id: str) -> None:
        """The request of ``key`` may have been billed unanswered (a timeout): its worst case stays consumed.

        It is kept under its attempt id, so the prompt's next attempt reserves room of its own.
        """
        held = self._reserved.pop(key, None)
        if held is not None:
            self._kept[f"{key}#{attempt_id}"] = held

    def settle(self, key: str, used: int | None) -> None:
        """The request of ``key`` was answered (``used`` tokens) or never billed (None): room comes back."""
        held = self._reserved.pop(key, None)
        if held is None or self.policy is None or held.epoch != self.policy.epoch:
            return
        self._active.add(held.dataset)
        self.consumed[held.dataset] = self.consumed.get(held.dataset, 0) + (used or 0) - held.max_tokens
        self._wake(held.dataset)

    async def _ask(self, dataset: str, step: int) -> None:
        """Ask the budget for room for every waiting request (not more often than :data:`ASK_EVERY_S`)."""
        target = self.consumed.get(dataset, 0) + self._waiting_tokens.get(dataset, 0)
        last = self._asked.get(dataset)
        now = time.monotonic()
        if last is not None and now - last[1] < (ASK_MORE_EVERY_S if target > last[0] else ASK_EVERY_S):
            return  # thousands of requests starting to wait at once make one ask, not thousands
        self._asked[dataset] = (target, now)
        await self._send_request(dataset, target, step)

    async def _asking(self, dataset: str) -> None:
        """Ask again for the dataset's waiting requests every :data:`ASK_EVERY_S` while any wait.

        The budget frees room as answers land but grants only what is asked for.
        """
        try:
            while line := self._waiting.get(dataset):
                await asyncio.sleep(ASK_EVERY_S)
                if line:
                    try:
                        await self._ask(dataset, line[0].max_tokens)
                    except Exception:  # noqa: BLE001 - asked again in ASK_EVERY_S; the requests wait meanwhile
                        log.warning("could not ask for headroom for %s", dataset, exc_info=True)
                self._wake(dataset, every=self._halts.stopping)  # a stopping worker's requests leave
        finally:
            self._askers.pop(dataset, None)

    async def _send_request(self, dataset: str, target: int, step: int) -> None:
        if self.policy is None:
            return
        event = LeaseRequested(
            worker=self.worker_id, dataset=dataset, epoch=self.policy.epoch, target=target, step=step, at=time.time()
        )
        await self._send(event)

    async def _send(self, event: LeaseRequested | LeaseReleased) -> None:
        if self._producer is None:
            raise RuntimeError("start() the headroom first")
        await (await self._producer.send(self._topic, encode(event), key=lease_key(event).encode()))

    async def _renew(self) -> None:
        """Renew every lease held (or wanted) a few times per TTL."""
        while True:
            ttl = self.policy.ttl_s if self.policy is not None else 10.0
            await asyncio.sleep(max(0.05, ttl / 3))
            await self.renew_once()

    async def renew_once(self) -> None:
        """One renewal of every lease held (or wanted); a lease left idle since the last is released."""
        active, self._active = self._active, set()
        if not self.in_force:
            return
        for dataset in sorted(set(self._grants) | set(self._asked)):
            if self._idle(dataset, active):
                await self._give_back(dataset)
                continue
            target = self.consumed.get(dataset, 0) + self._waiting_tokens.get(dataset, 0)
            step = max((waiter.max_tokens for waiter in self._waiting.get(dataset, ())), default=0)
            try:
                await self._send_request(dataset, target, step)
            except Exception:  # noqa: BLE001 - the next renewal tries again; the lease lapses meanwhile
                log.warning("could not renew the lease of %s", dataset, exc_info=True)

    def _idle(self, dataset: str, active: set[str]) -> bool:
        """Whether the lease of ``dataset`` holds room nothing here uses: no request of it in
        flight or waiting, none admitted or answered since the last renewal (``active``)."""
        grant = self._grants.get(dataset)
        if grant is None or grant.unlimited or dataset in active or self._waiting.get(dataset):
            return False
        if any(held.dataset == dataset for held in self._reserved.values()):
            return False
        return (self.room(dataset) or 0) > 0

    async def _give_back(self, dataset: str) -> None:
        """Release the lease of ``dataset``: its room goes back to the budget (asked for again when needed).

        The grant is void here first. A grant the budget decided before it applied the release
        names fewer releases and is ignored (see :meth:`_take_value`), so the room is never
        used here and handed to another worker as well.
        """
        if self.policy is None:
            return
        unused = self.room(dataset) or 0
        self._grants.pop(dataset, None)
        self._asked.pop(dataset, None)
        event = self._release(dataset, self.policy.epoch)
        try:
            await self._send(event)
        except Exception:  # noqa: BLE001 - the lease stays the budget's view; the next grant restores it here
            self._released[dataset] = event.releases - 1
            log.warning("could not release the idle lease of %s", dataset, exc_info=True)
            return
        log.info("released the lease of %s: nothing of it to send here, %d token(s) of room back to the budget",
                 dataset, unused)

    def _release(self, dataset: str, epoch: str) -> LeaseReleased:
        """The next release of the lease of ``dataset`` (counted here: later grants must name it)."""
        count = self._released[dataset] = self._released.get(dataset, 0) + 1
        return LeaseReleased(worker=self.worker_id, dataset=dataset, epoch=epoch, releases=count, at=time.time())

    async def _follow(self) -> None:
        consumer = self._consumer
        assert consumer is not None  # noqa: S101 - set in start()
        await follow(consumer, self._take, what="lease", timeout_ms=200)  # without grants the worker only waits

    def _take(self, record: Record) -> None:
        self._take_value(record.value)

    def _take_value(self, value: bytes | None) -> None:
        try:
            event = decode_lease(value)
        except SchemaError as exc:
            log.warning("ignoring a lease record: %s (%s)", exc.reason, exc.message)
            return
        if isinstance(event, LeasePolicy):
            if self.policy is None or event.epoch != self.policy.epoch:
                log.info("lease epoch %s (%s)", event.epoch, "in force" if event.in_force else "not in force")
                self._grants.clear()
                self.consumed.clear()
                self._kept.clear()
                self._asked.clear()
                self._released.clear()
            self.policy = event
            self._wake()
        elif isinstance(event, LeaseGranted):
            if event.worker != self.worker_id or self.policy is None or event.epoch != self.policy.epoch:
                return
            if event.releases < self._released.get(event.dataset, 0):
                return  # decided before the budget took the released room back: it is not ours
            self._released[event.dataset] = event.releases
            # Valid a little less than its TTL from when it was granted (the budget's clock) and
            # from when it arrived, whichever ends first: a stalled worker does not outlive it.
            margin = min(1.0, event.ttl_s / 10)
            left = min(event.ttl_s, event.at + event.ttl_s - time.time()) - margin
            self._grants[event.dataset] = _Grant(event.granted, event.unlimited, time.monotonic() + left)
            self._wake(event.dataset)

    def _wake(self, dataset: str | None = None, *, every: bool = False) -> None:
        """Wake the oldest waiting requests of ``dataset`` (None: of every dataset) that its room fits.

        A woken request reserves its room itself when it runs (or waits again, at the end of the
        line, should the room be gone by then). ``every``: wake them all (the worker stops: they
        leave through the halt gate).
        """
        for name in [dataset] if dataset is not None else list(self._waiting):
            line = self._waiting.get(name)
            if not line:
                continue
            room = None if every else self.room(name)
            while line and (room is None or room >= line[0].max_tokens):
                waiter = line.popleft()
                waiter.in_line = False
                self._waiting_tokens[name] -= waiter.max_tokens
                if room is not None:
                    room -= waiter.max_tokens
                if not waiter.woken.done():
                    waiter.woken.set_result(None)

    async def close(self) -> None:
        """Release the leases held (the unused part goes back to the budget), stop following."""
        self._tasks.extend(self._askers.values())
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.in_force and self.policy is not None and self._producer is not None:
            for dataset in sorted(self._grants):
                event = self._release(dataset, self.policy.epoch)
                try:
                    await self._send(event)
                except Exception:  # noqa: BLE001 - it expires at the budget instead
                    log.warning("could not release the lease of %s: it expires instead", dataset, exc_info=True)
        await release(self._consumer)
        self._consumer = None
