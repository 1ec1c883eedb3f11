"""What a consumer may commit, and the commit: outputs first, offsets after, never backwards.

Shared by the batch stages (:class:`services.common.stage.StageRunner`, which finish a
whole batch before committing) and the inference worker (many prompts in flight,
finishing out of order). A record is *taken* when work on it starts and *done* once
its outputs (responses, dead letters) are acknowledged by the broker; per partition the
committable offset is the lowest offset taken and not done, or one past the highest
taken when all are done. So a crash never skips a record whose outputs were not yet
durable, and a commit never moves a partition's offset back (that would replay what was
finished; it raises instead: a bug, not a condition).

A consumer keeping up with a slow stream takes a batch of a record or two per fetch, and
an offset commit per batch cost as much as the rest of the batch's Kafka work (client and
broker, about 1.2 CPU ms each). :meth:`Checkpoint.commit_due` commits at most once per
``interval_s``; what is done meanwhile stays uncommitted a little longer, so a crash reads
up to that much again (downstream is idempotent by key). A clean stop and a revocation
commit at once.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

log = logging.getLogger(__name__)


class OffsetTracker:
    """Per partition: offsets taken, which of them are done, what may be committed (pure)."""

    def __init__(self) -> None:
        self._open: dict[Hashable, list[int]] = {}  # min-heap of taken offsets
        self._done: dict[Hashable, set[int]] = {}  # done offsets still in the heap
        self._next: dict[Hashable, int] = {}  # one past the highest offset taken
        self._committed: dict[Hashable, int] = {}

    def take(self, partition: Hashable, offset: int) -> None:
        """Record that ``offset`` is being processed."""
        heapq.heappush(self._open.setdefault(partition, []), offset)
        self._done.setdefault(partition, set())
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def done(self, partition: Hashable, offset: int) -> None:
        """Record that ``offset``'s output is durable; unknown partitions are ignored."""
        done = self._done.get(partition)
        if done is None:
            return
        done.add(offset)
        heap = self._open[partition]
        while heap and heap[0] in done:
            done.discard(heapq.heappop(heap))

    def pending(self, partition: Hashable | None = None) -> int:
        """How many taken offsets are not done (for one partition, or in all)."""
        parts = [partition] if partition is not None else list(self._open)
        return sum(len(self._open.get(p, ())) - len(self._done.get(p, ())) for p in parts)

    def next_offset(self, partition: Hashable) -> int | None:
        """One past the highest offset taken (where fetching resumes), or None."""
        return self._next.get(partition)

    def position(self, partition: Hashable) -> int | None:
        """The offset it is safe to commit for ``partition`` (None if nothing was taken)."""
        if partition not in self._next:
            return None
        heap = self._open[partition]
        return heap[0] if heap else self._next[partition]

    def to_commit(self) -> dict[Hashable, int]:
        """Offsets that moved since the last :meth:`committed` call.

        Raises ``ValueError`` when a partition's offset would go back below its last commit.
        """
        out: dict[Hashable, int] = {}
        for partition in self._next:
            pos = self.position(partition)
            last = self._committed.get(partition)
            if pos is None or pos == last:
                continue
            if last is not None and pos < last:
                raise ValueError(f"offset of {partition} would go back from {last} to {pos}")
            out[partition] = pos
        return out

    def committed(self, offsets: Mapping[Hashable, int]) -> None:
        """Note that ``offsets`` were committed."""
        self._committed.update(offsets)

    def forget(self, partitions: Iterable[Hashable]) -> None:
        """Drop partitions this consumer no longer owns (after a rebalance)."""
        for partition in partitions:
            for table in (self._open, self._done, self._next, self._committed):
                table.pop(partition, None)

    def partitions(self) -> list[Hashable]:
        """Partitions with any taken offset."""
        return list(self._next)


class Checkpoint(OffsetTracker):
    """An :class:`OffsetTracker` bound to its consumer: commits what is safe, keeps owned state."""

    def __init__(self, consumer: AIOKafkaConsumer, *, label: str, interval_s: float = 0.0) -> None:
        super().__init__()
        self._consumer = consumer
        self._label = label
        self._interval_s = interval_s
        self._last_commit = time.monotonic()

    async def commit_due(self) -> None:
        """Commit as :meth:`commit` does, once ``interval_s`` has passed since the last commit."""
        if time.monotonic() - self._last_commit >= self._interval_s:
            await self.commit()

    async def commit(self, only: Iterable[Any] | None = None) -> None:
        """Commit the offsets that moved (of ``only`` those partitions, when given).

        A failed commit (a rebalance in progress, a broker away) is logged and left for the
        next one: the outputs are durable already, an uncommitted record is only read again.
        """
        if only is None:
            self._last_commit = time.monotonic()
        offsets = self.to_commit()
        if only is not None:
            keep = set(only)
            offsets = {tp: off for tp, off in offsets.items() if tp in keep}
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:
            log.warning("%s: commit of %d partition(s) failed (%s); the next commit carries it", self._label,
                        len(offsets), exc)
            return
        self.committed(offsets)

    def reassigned(self, assigned: Iterable[Any]) -> None:
        """After a rebalance: forget partitions gone, fetch owned ones past what was taken."""
        owned = set(assigned)
        self.forget([tp for tp in self.partitions() if tp not in owned])
        for tp in owned:
            position = self.next_offset(tp)
            if position is not None:
                self._consumer.seek(tp, position)


__all__ = ["Checkpoint", "OffsetTracker"]
