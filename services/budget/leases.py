"""Headroom under the caps, handed out as leases to the inference workers: pure.

A request goes out only while spend + the worst case of everything in flight + its own
``max_tokens`` stays within every cap that applies (its dataset's and the global one,
tokens and dollars). Several workers share that headroom through leases, one per worker
and dataset: a cumulative number of tokens ``granted`` in the budget's current epoch.
A worker keeps what it consumed this epoch — the worst case of its requests in flight
plus what its answered requests used — within its grant; the budget never grants more
than is free::

    committed(scope) = spent + worst case in flight + unused grants   (<= cap)

An answer landing below its worst case hands the difference back to the worker that sent
it (its consumption drops), so a worker asks only for the shortfall of its next request
and holds less than one request's worst case unused. A lease not renewed within its TTL
(plus a grace) is taken back: its grant shrinks to what the budget saw it consume, and
the rest goes to the other workers. A stopping worker releases its lease at once, and so
does one with nothing of the dataset left to send (its partitions went, or ran dry). When
no worker can fit one more request and nothing is in flight, the scope is finished at its
cap: :meth:`LeaseBook.decide` returns the halt reason with the unused remainder.

No Kafka, no clock: the budget service passes every event and the time in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from schemas import (
    GLOBAL_SCOPE,
    BudgetSnapshot,
    Halt,
    LeaseGranted,
    LeaseReleased,
    LeaseRequested,
    RequestStarted,
    attempt_key,
    sample_key,
)
from services.budget.core import BUDGET_ACTOR, Ledger
from services.budget.lost import lost_summary
from services.budget.usage import UNANSWERED_REASONS

_EARLY_MEMORY = 10_000

CAPPED_PREFIX = "capped:"
"""How the reason of a halt that finished a scope at its cap begins (status shows it)."""


def capped_summary(snapshot: BudgetSnapshot, reason: str | None = None) -> str | None:
    """``capped: X of Y used, Z prompts not sent`` for a scope the budget finished at its cap, else None.

    ``reason``: the budget's standing halt's reason, when fresher than the snapshot's.
    """
    if reason is None:
        reason = snapshot.halted_reason if snapshot.halted_by == BUDGET_ACTOR else ""
    if not reason.startswith(CAPPED_PREFIX):
        return None
    used: list[str] = []
    if snapshot.cap_completion_tokens is not None:
        used.append(f"{snapshot.completion_tokens:,} of {snapshot.cap_completion_tokens:,} tokens")
    if snapshot.cap_usd is not None:
        used.append(f"${snapshot.cost_usd:,.2f} of ${snapshot.cap_usd:,.2f}")
    prompts = "?" if snapshot.remaining_prompts is None else f"{snapshot.remaining_prompts:,}"
    return f"capped: {' and '.join(used)} used, {prompts} prompts not sent"


@dataclass
class Lease:
    """One worker's lease of one dataset in the current epoch, as the budget sees it."""

    worker: str
    dataset: str
    granted: int = 0
    consumed: int = 0  # worst case in flight + tokens its answers used (this epoch)
    expires_at: float = 0.0
    live: bool = False
    target: int = 0  # the cumulative grant the worker asked for
    step: int = 0  # one waiting request's worst case
    asked_at: float = 0.0
    releases: int = 0  # the worker's releases applied (its grants say so: older ones are stale)

    @property
    def unused(self) -> int:
        """Granted tokens the worker may still commit (none once expired or released)."""
        return max(0, self.granted - self.consumed) if self.live else 0


@dataclass(frozen=True)
class Reservation:
    """A request counted against a lease until it is answered, withheld or failed."""

    worker: str
    dataset: str
    max_tokens: int
    started_at: float


class LeaseBook:
    """The leases of one epoch over a :class:`Ledger`'s spend; decides grants and finished scopes.

    Args:
        ledger: spend, in-flight worst case and caps per scope.
        epoch: this budget instance's epoch (requests of other epochs count as in flight only).
        ttl_s: how long a grant is valid without a renewal.
        grace_s: how long past its expiry the budget waits before taking a lease back.
        max_tokens_for: one request's worst case in a dataset (what "one more request" needs).
        usd_per_token: worst-case dollars per completion token (None: dollar caps count spend only).
        grants_from: no headroom is granted before this time (a restarted budget waits until
            the previous epoch's grants have expired everywhere).
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        epoch: str,
        ttl_s: float,
        grace_s: float,
        max_tokens_for: Callable[[str], int],
        usd_per_token: float | None = None,
        grants_from: float = 0.0,
    ) -> None:
        self.ledger = ledger
        self.epoch = epoch
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.max_tokens_for = max_tokens_for
        self.usd_per_token = usd_per_token
        self.grants_from = grants_from
        self.leases: dict[tuple[str, str], Lease] = {}
        self._reserved: dict[str, Reservation] = {}
        self._pending: set[tuple[str, str]] = set()
        self._early: dict[str, int] = {}  # attempt key -> tokens of answers read before their request

    def _lease(self, worker: str, dataset: str) -> Lease:
        lease = self.leases.get((worker, dataset))
        if lease is None:
            lease = self.leases[(worker, dataset)] = Lease(worker, dataset)
        return lease

    # ------------------------------------------------------------------ what workers consumed
    def on_request(self, event: RequestStarted) -> None:
        """An attempt announced under this epoch's lease (or its withdrawal).

        Each attempt is a reservation of its own until its own answer arrives: a later attempt
        of the same prompt settles an earlier one only when it names it (``supersedes``: the
        same worker read an error for it, nothing was billed).
        """
        if event.lease_epoch != self.epoch:
            return
        key = event.attempt_key
        if event.withheld:
            held = self._reserved.get(key)
            if held is not None and held.worker == event.worker and held.started_at == event.started_at:
                self._unreserve(key, 0)
            return
        if event.supersedes:
            ended = attempt_key(event.dataset, event.sample_id, event.supersedes)
            held = self._reserved.get(ended)
            if held is not None and held.worker == event.worker:
                self._unreserve(ended, 0)
        early = self._early.pop(key, None)
        if early is not None:
            self._lease(event.worker, event.dataset).consumed += early
            return
        self._reserved[key] = Reservation(event.worker, event.dataset, event.max_tokens, event.started_at)
        self._lease(event.worker, event.dataset).consumed += event.max_tokens

    def on_answer(self, key: str, completion_tokens: int) -> None:
        """The answer of the attempt ``key`` landed: it consumed what it used, not its worst case.

        An answer read before its request (another partition fetched first) is kept until
        the request comes, so the request is charged what it used, not its worst case.
        """
        if key in self._reserved:
            self._unreserve(key, completion_tokens)
            return
        self._early[key] = completion_tokens
        while len(self._early) > _EARLY_MEMORY:
            self._early.pop(next(iter(self._early)))

    def on_failed(self, dataset: str, sample_id: str, reason: str = "") -> None:
        """A prompt that ended as a dead letter: its attempts under live leases used nothing.

        Attempts under a lease taken back (their worker died) stay held: the dead letter is another worker's.
        So do all when the last failure may have been billed (``reason`` in ``UNANSWERED_REASONS``).
        """
        if reason in UNANSWERED_REASONS:
            return
        prompt = sample_key(dataset, sample_id)
        for key in [k for k in self._reserved if k.rpartition("#")[0] == prompt]:
            held = self._reserved[key]
            if self.leases[(held.worker, held.dataset)].live:
                self._unreserve(key, 0)

    def _unreserve(self, key: str, used: int) -> None:
        held = self._reserved.pop(key, None)
        if held is not None:
            self._lease(held.worker, held.dataset).consumed += used - held.max_tokens

    # ------------------------------------------------------------------ what workers ask
    def on_lease_request(self, event: LeaseRequested, now: float) -> None:
        """A worker asks for headroom (or only renews its lease); answered by :meth:`decide`."""
        if event.epoch != self.epoch:
            return  # it has not seen this epoch's policy yet: it asks again once it has
        lease = self._lease(event.worker, event.dataset)
        lease.live = True
        lease.target = event.target
        lease.step = event.step
        lease.asked_at = now
        lease.expires_at = now + self.ttl_s
        self._pending.add((event.worker, event.dataset))

    def on_release(self, event: LeaseReleased) -> None:
        """A worker gives back what it did not use (it stops, or has nothing of the dataset to send)."""
        lease = self.leases.get((event.worker, event.dataset))
        if lease is not None and event.epoch == self.epoch:
            self._take_back(lease)
            lease.releases = max(lease.releases, event.releases)

    @staticmethod
    def _take_back(lease: Lease) -> None:
        lease.granted = min(lease.granted, max(0, lease.consumed))
        lease.live = False

    def due(self, now: float) -> list[Lease]:
        """The live leases not renewed within TTL + grace (their workers stopped sending by now)."""
        return [lease for lease in self.leases.values() if lease.live and now > lease.expires_at + self.grace_s]

    def expire(self, now: float) -> list[Lease]:
        """Take back the leases :meth:`due`; returns them.

        Only once every request announced so far was read: what such a worker sent before
        its lease lapsed must be in flight here before its grant shrinks to what it consumed.
        """
        gone = self.due(now)
        for lease in gone:
            self._take_back(lease)
            self.ledger.mark_lost(
                (held.dataset, key)
                for key, held in self._reserved.items()
                if (held.worker, held.dataset) == (lease.worker, lease.dataset)
            )
        return gone

    # ------------------------------------------------------------------ headroom
    def _leases_of(self, scope: str) -> list[Lease]:
        return [lease for lease in self.leases.values() if scope in (GLOBAL_SCOPE, lease.dataset)]

    def _uncapped(self, scope: str) -> bool:
        caps = self.ledger.caps(scope)
        return caps.completion_tokens is None and caps.usd is None

    def _holds(self) -> Callable[[str], int]:
        """What attempts hold in a scope (in flight, and lost with their worker): fixed while one :meth:`decide` runs.

        Computed once per scope and pass, not once per pending lease (each sums every attempt in flight).
        """
        memo: dict[str, int] = {}

        def held(scope: str) -> int:
            if scope not in memo:
                memo[scope] = self.ledger.inflight_tokens(scope)
            return memo[scope]

        return held

    def reserved_under(self, lease: Lease) -> tuple[int, int]:
        """The requests counted against ``lease`` and not answered yet, and their worst case."""
        held = [r.max_tokens for r in self._reserved.values() if (r.worker, r.dataset) == (lease.worker, lease.dataset)]
        return len(held), sum(held)

    def _may_land(self, scope: str) -> bool:
        """Whether an answer of ``scope`` may still land: an attempt in flight that is not lost.

        A lost attempt (its worker's lease was taken back, or its answer is overdue) stays held
        but will not be answered: waiting for it would keep a scope that cannot fit another
        request from finishing.
        """
        names = [n for n in self.ledger.scopes if n != GLOBAL_SCOPE] if scope == GLOBAL_SCOPE else [scope]
        for name in names:
            totals = self.ledger.scopes.get(name)
            if totals is not None and any(not held.lost for held in totals.inflight.values()):
                return True
        return False

    def free(self, scope: str, holds: Callable[[str], int] | None = None) -> float:
        """Tokens no request and no grant holds yet under every cap of ``scope`` (inf: uncapped).

        ``holds``: :meth:`_holds` of the current pass.
        """
        caps = self.ledger.caps(scope)
        totals = self.ledger.scopes.get(scope)
        spent = totals.completion_tokens if totals else 0
        held = (holds or self._holds())(scope) + sum(lease.unused for lease in self._leases_of(scope))
        free = math.inf
        if caps.completion_tokens is not None:
            free = caps.completion_tokens - spent - held
        if caps.usd is not None and self.usd_per_token:
            spent_usd = totals.cost_usd if totals else 0.0
            free = min(free, math.floor((caps.usd - spent_usd) / self.usd_per_token) - held)
        return free

    def decide(self, now: float) -> tuple[list[LeaseGranted], list[tuple[str, str]]]:
        """Grants answering the pending requests (whole steps only), and the scopes finished at their cap.

        A finished scope comes with its halt reason (see :data:`CAPPED_PREFIX`).
        """
        grants: list[LeaseGranted] = []
        holds = self._holds()
        for worker, dataset in sorted(self._pending, key=lambda k: self.leases[k].asked_at):
            lease = self.leases[(worker, dataset)]
            unlimited = self._uncapped(dataset) and self._uncapped(GLOBAL_SCOPE)
            wanted = lease.target - lease.granted
            if not unlimited and wanted > 0 and now >= self.grants_from:
                free = max(0.0, min(self.free(dataset, holds), self.free(GLOBAL_SCOPE, holds)))
                # Whole requests only: what the lease holds unused counts towards the next one.
                step, unused = max(1, lease.step), max(0, lease.granted - lease.consumed)
                whole = int((free + unused) // step) * step - unused
                lease.granted += max(0, min(wanted, whole))
            grants.append(
                LeaseGranted(
                    worker=worker,
                    dataset=dataset,
                    epoch=self.epoch,
                    granted=lease.granted,
                    unlimited=unlimited,
                    ttl_s=self.ttl_s,
                    releases=lease.releases,
                    at=now,
                )
            )
        self._pending.clear()
        return grants, self._finished(now, holds)

    def _finished(self, now: float, holds: Callable[[str], int]) -> list[tuple[str, str]]:
        if now < self.grants_from:
            return []
        datasets = set(self.ledger.datasets) | {lease.dataset for lease in self.leases.values()}
        out: list[tuple[str, str]] = []
        for scope in [*sorted(datasets), GLOBAL_SCOPE]:
            if scope == GLOBAL_SCOPE:
                need = min((self.max_tokens_for(d) for d in datasets), default=0)
            else:
                need = self.max_tokens_for(scope)
            if not datasets or self._uncapped(scope) or isinstance(self.ledger.control.get(scope), Halt):
                continue
            if self._may_land(scope) or self.ledger.may_release(scope, now):
                continue  # answers still to land, or a reading of the key's usage, may hand headroom back
            leases = self._leases_of(scope)
            if not any(lease.live and lease.target > lease.granted for lease in leases):
                continue  # no request waits for room: the scope is idle, not finished
            free = self.free(scope, holds)
            best = max((lease.unused for lease in leases), default=0)
            if free + best >= need:
                continue
            out.append((scope, self._reason(scope, need)))
        return out

    def _reason(self, scope: str, need: int) -> str:
        caps = self.ledger.caps(scope)
        totals = self.ledger.scopes.get(scope)
        label = "global" if scope == GLOBAL_SCOPE else f"dataset {scope}"
        parts: list[str] = []
        if caps.completion_tokens is not None:
            spent = totals.completion_tokens if totals else 0
            parts.append(
                f"{spent} of {caps.completion_tokens} completion tokens used, "
                f"{caps.completion_tokens - spent} unused"
            )
        if caps.usd is not None:
            spent_usd = totals.cost_usd if totals else 0.0
            parts.append(f"${spent_usd:.4f} of ${caps.usd:.4f} used, ${caps.usd - spent_usd:.4f} unused")
        lost = lost_summary(self.ledger, scope)
        if lost:
            parts.append(lost)
        return (
            f"{CAPPED_PREFIX} {label} finished at its cap: {'; '.join(parts)} "
            f"(no worker can fit another request's worst case of {need} tokens in it); raise the cap to send the rest"
        )
