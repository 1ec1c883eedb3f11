"""The budget's accounting, pure: a :class:`Ledger` fed events, returning halt/resume decisions.

No Kafka, no clock, no environment: the shell passes every record's position and the
current time in, and publishes the :class:`~schemas.Halt`/:class:`~schemas.Resume` events
this module returns.

Restart without forgetting or double counting: every checkpoint writes the snapshot of
each scope that changed, all with the same consumed offsets, the ``global`` scope last
(``budget-state`` has one partition and the producer is idempotent, so when the global
snapshot of a checkpoint is in the log, so are the others of that checkpoint). On restart
the consumer seeks to the global snapshot's offsets, and a dataset scope counts a replayed
record only when its offset is at or past the dataset's own snapshot offsets: a crash in
the middle of a checkpoint can leave some datasets ahead of ``global``, never behind it.

Responses without usage are counted by estimated tokens (see :func:`estimate_usage`) and
flagged, never ignored.

Attempts, not samples: every ``RequestStarted`` is held at its worst case under its own
attempt key until the answer naming that attempt arrives; an attempt whose worker died, or
whose answer is overdue, is lost and stays held (checkpointed with its worker), see
docs/money-safety.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import msgspec

from schemas import (
    GLOBAL_SCOPE,
    BudgetSnapshot,
    Halt,
    HeldAttempt,
    RequestStarted,
    ResponseReceived,
    Resume,
    attempt_key,
    provider_of_scope,
    sample_key,
)
from services.budget.providers import ProviderBook
from services.budget.totals import (
    Caps,
    Counted,
    ScopeTotals,
    caps_raised,
    copy_tally,
    counted_snapshot,
    totals_from_snapshot,
)

# What one answer counts lives in services.budget.usage; re-exported for the modules that read it here.
from services.budget.usage import CHARS_PER_TOKEN as CHARS_PER_TOKEN
from services.budget.usage import UNANSWERED_REASONS
from services.budget.usage import Answer as Answer
from services.budget.usage import completion_tokens_of as completion_tokens_of
from services.budget.usage import estimate_usage as estimate_usage
from services.budget.usage import price_usd as price_usd
from services.common import outcomes

BUDGET_ACTOR = "budget"
"""The ``by`` of every halt and resume the budget service publishes itself."""


_ANSWERED_MEMORY = 200_000

State = Literal["running", "soft-limit", "halted"]


class Ledger:
    """Tokens, dollars and in-flight worst case per dataset and in total; decides halts.

    Args:
        caps_for: the caps of a scope (a dataset name or ``global``).
        soft_threshold: fraction of a cap past which a scope is in ``soft-limit``.
        prices: USD per million tokens by model, for responses without ``usage.cost``.
        include_inflight: halt early when spend plus in-flight ``max_tokens`` would cross a cap.
        inflight_ttl_s: an attempt unanswered for longer is lost (its answer will not come, and
            the provider is not billing it any more): still held, until the key's usage says
            what it cost (services.budget.reconcile).
        rate_window_s: the window of the moving spend rate.
        inflight_usd_per_token: worst-case dollars per in-flight token (None: dollars
            caps do not count in-flight requests).
    """

    def __init__(
        self,
        *,
        caps_for: Callable[[str], Caps],
        soft_threshold: float = 0.8,
        prices: Mapping[str, Mapping[str, float]] | None = None,
        include_inflight: bool = True,
        inflight_ttl_s: float = 600.0,
        rate_window_s: float = 60.0,
        inflight_usd_per_token: float | None = None,
        default_provider: str = "",
        provider_usd_per_token: Mapping[str, float] | None = None,
    ) -> None:
        self._caps_for = caps_for
        self.soft_threshold = soft_threshold
        self.prices = dict(prices or {})
        self.include_inflight = include_inflight
        self.inflight_ttl_s = inflight_ttl_s
        self.rate_window_s = rate_window_s
        self.inflight_usd_per_token = inflight_usd_per_token
        self.scopes: dict[str, ScopeTotals] = {GLOBAL_SCOPE: ScopeTotals(GLOBAL_SCOPE)}
        self.offsets: dict[str, int] = {}
        self.control: dict[str, Halt | Resume] = {}
        self._dirty: set[str] = set()
        self._answered: OrderedDict[str, None] = OrderedDict()  # attempt keys answered (read first)
        self._answered_samples: OrderedDict[str, None] = OrderedDict()  # prompts answered (lost attempts re-paid)
        self._resume_candidates: set[str] = set()
        # Spend per provider and each provider key's reading (services.budget.providers).
        prices_per_token = dict(provider_usd_per_token or {})
        if inflight_usd_per_token:  # the configured price of the default provider's model
            prices_per_token.setdefault(default_provider, inflight_usd_per_token)
        self.book = ProviderBook(default_provider, prices_per_token)
        self._dirty_providers: set[str] = set()

    # ------------------------------------------------------------------ restore
    def restore(self, snapshots: Iterable[BudgetSnapshot], now: float) -> dict[str, int]:
        """Load checkpointed totals; returns the offsets to seek to (``"<topic>:<p>"``)."""
        for snap in sorted(snapshots, key=lambda s: provider_of_scope(s.scope) is not None):
            provider = provider_of_scope(snap.scope)
            if provider is not None:  # after global: a provider's own key figures win
                self.book.totals[provider] = totals_from_snapshot(snap, now)
                self.book.key(provider).restore(snap.key_usage_base_usd, snap.key_unexplained_usd)
                continue
            self.scopes[snap.scope] = totals_from_snapshot(snap, now)
            if snap.scope == GLOBAL_SCOPE:  # written by a budget that read one key: the default provider's
                self.book.key("").restore(snap.key_usage_base_usd, snap.key_unexplained_usd)
        seek = dict(self.scopes[GLOBAL_SCOPE].floor)
        self.offsets = dict(seek)
        return seek

    def apply_control(self, event: Halt | Resume) -> None:
        """Record the standing control event of a scope (from the control topic)."""
        self.control[event.scope] = event
        provider = provider_of_scope(event.scope)
        if provider is not None:  # a provider's halt: its workers' own, never a cap's
            self._dirty_providers.add(provider)
            return
        self._dirty.add(event.scope)
        if not (isinstance(event, Halt) and event.by == BUDGET_ACTOR):
            self._resume_candidates.discard(event.scope)

    def startup_resumes(self, now: float) -> list[Resume]:
        """Resumes for scopes the budget halted whose cap was raised since (config change).

        A halt a person published is never resumed here. A raised cap whose scope is
        still over it (e.g. in-flight worst case) is resumed later by :meth:`evaluate`.
        """
        for scope, event in self.control.items():
            if not (isinstance(event, Halt) and event.by == BUDGET_ACTOR):
                continue
            totals = self.scopes.get(scope)
            if totals is None or totals.previous_caps is None:
                continue
            if caps_raised(totals.previous_caps, self.caps(scope)):
                self._resume_candidates.add(scope)
        return self._resumes(now)

    # ------------------------------------------------------------------ events
    def _scope(self, name: str) -> ScopeTotals:
        totals = self.scopes.get(name)
        if totals is None:
            totals = self.scopes[name] = ScopeTotals(name)
        return totals

    def touch(self, scope: str) -> None:
        """Mark a scope changed so the next checkpoint writes it (e.g. new audit verdicts)."""
        self._scope(scope)
        self._dirty.add(scope)

    def touch_provider(self, provider: str) -> None:
        """Mark a provider changed so the next checkpoint writes its figures (e.g. new audit verdicts)."""
        self._dirty_providers.add(self.book.name(provider))

    def tally_dead_letter(self, position: str, offset: int, stage: str, reason: str, key: str = "") -> None:
        """Count a new record of ``dead-letter`` as its key's latest outcome (``status`` reads the tally)."""
        total = self.scopes[GLOBAL_SCOPE]
        if total.dead_letters is not None and self._uncounted(position, offset):
            outcomes.record_dead_letter(total.dead_letters, total.dead_letter_keys, key, stage, reason)

    def tally_accepted(self, position: str, offset: int, key: str) -> None:
        """An accepted sample not counted before: its key's earlier dead letter no longer stands."""
        total = self.scopes[GLOBAL_SCOPE]
        if total.dead_letters is not None and key in total.dead_letter_keys and self._uncounted(position, offset):
            outcomes.record_accepted(total.dead_letters, total.dead_letter_keys, key)

    def tally_truncated(self, position: str, offset: int, dataset: str) -> None:
        """Count a truncated answer accepted, once (``status`` reads the tally)."""
        counts = self.scopes[GLOBAL_SCOPE].accepted_truncated
        if counts is not None and self._uncounted(position, offset):
            counts[dataset] = counts.get(dataset, 0) + 1

    def _uncounted(self, position: str, offset: int) -> bool:
        """Whether a tallied record is new (past the ledger's offsets); marks ``global`` changed if so."""
        if offset < self.offsets.get(position, 0):
            return False
        self._dirty.add(GLOBAL_SCOPE)
        return True

    def skip(self, position: str, offset: int) -> None:
        """Move past a record that counts for nothing (e.g. one sent to the dead letters)."""
        self._advance(position, offset)

    def _advance(self, position: str, offset: int) -> None:
        if offset + 1 > self.offsets.get(position, 0):
            self.offsets[position] = offset + 1

    def on_request(self, event: RequestStarted, position: str, offset: int, now: float) -> list[Halt]:
        """Count an attempt sent to the provider and hold its worst case until its own answer arrives.

        A withheld record takes back the announcement it repeats (that attempt was never sent);
        ``supersedes`` releases the same worker's previous attempt, which ended with an error.
        A later attempt of the same prompt never releases an earlier one otherwise: that one's
        worker may have died while the provider generated (and billed) its answer.
        """
        self._advance(position, offset)
        key = event.attempt_key
        dataset = self._scope(event.dataset)
        total = self.scopes[GLOBAL_SCOPE]
        provider = self.book.of(event.provider_name)
        if provider.counts(position, offset):
            provider.requests += -1 if event.withheld else 1
            self._dirty_providers.add(self.book.name(event.provider_name))
        for scope in (dataset, total):
            if not scope.counts(position, offset):
                continue
            self._dirty.add(scope.scope)
            if event.withheld:
                # The announced attempt never went out: it is not a request, nor in flight.
                scope.requests -= 1
                announced = dataset.inflight.get(key)
                if scope is dataset and announced is not None and (
                    event.attempt_id or announced.started_at == event.started_at
                ):
                    del dataset.inflight[key]
                    dataset.leased.discard(key)
                continue
            scope.requests += 1
            if scope is not dataset:
                continue
            ended = attempt_key(event.dataset, event.sample_id, event.supersedes) if event.supersedes else ""
            if ended in dataset.inflight and dataset.inflight[ended].worker == event.worker:
                del dataset.inflight[ended]
                dataset.leased.discard(ended)
            if key in self._answered:
                continue  # its answer was read first
            dataset.inflight[key] = HeldAttempt(
                max_tokens=event.max_tokens, worker=event.worker, started_at=event.started_at or now,
                provider=event.provider_name,
            )
            if event.lease_epoch:
                dataset.leased.add(key)
            else:
                dataset.leased.discard(key)
        return self._halts(now)

    def on_request_failed(
        self, dataset: str, sample_id: str, position: str, offset: int, *, reason: str = ""
    ) -> None:
        """A prompt that ended as an inference dead letter: its worker's attempts are answered (with errors).

        Attempts already lost (their worker died) stay held: the dead letter is another worker's.
        A last failure that may have been billed (``reason`` in ``UNANSWERED_REASONS``) releases nothing.
        """
        self._advance(position, offset)
        scope = self.scopes.get(dataset)
        if scope is not None and scope.counts(position, offset) and reason not in UNANSWERED_REASONS:
            prompt = sample_key(dataset, sample_id)
            for key in [k for k, held in scope.inflight.items() if _prompt_of(k) == prompt and not held.lost]:
                del scope.inflight[key]
                scope.leased.discard(key)
                self._dirty.add(scope.scope)

    def on_response(
        self, event: ResponseReceived, position: str, offset: int, now: float, *, replay: bool = False
    ) -> tuple[Counted | None, list[Halt]]:
        """Count a response's usage (estimated when absent); a replayed record adds nothing."""
        self._advance(position, offset)
        key = event.attempt_key
        dataset = self._scope(event.dataset)
        total = self.scopes[GLOBAL_SCOPE]
        if replay:
            return None, []
        prompt_key = sample_key(event.dataset, event.sample_id)
        for memory, entry in ((self._answered, key), (self._answered_samples, prompt_key)):
            memory[entry] = None
            memory.move_to_end(entry)
            while len(memory) > _ANSWERED_MEMORY:
                memory.popitem(last=False)
        prompt, completion, reasoning = estimate_usage(event)
        usage = event.usage
        estimated = usage.completion_tokens is None or usage.prompt_tokens is None
        cost: float | None = usage.cost
        priced = True
        if cost is None:
            cost = price_usd(self.prices, event.model, prompt, completion)
            priced = cost is not None
            cost = cost or 0.0
        counted: Counted | None = None
        provider = self.book.of(event.provider_name or event.provider)
        if provider.counts(position, offset):
            self._dirty_providers.add(self.book.name(event.provider_name or event.provider))
        for scope in (dataset, total, provider):
            if not scope.counts(position, offset):
                continue
            scope.prompt_tokens += prompt
            scope.completion_tokens += completion
            scope.reasoning_tokens += reasoning
            scope.cost_usd += cost
            scope.responses += 1
            scope.responses_without_usage += int(estimated)
            scope.window.append((now, cost, completion))
            if scope.first_event_at is None:
                scope.first_event_at = now
            if scope is provider:
                continue
            self._dirty.add(scope.scope)
            if scope is dataset:
                dataset.inflight.pop(key, None)
                dataset.leased.discard(key)
                self._count_repaid(dataset, prompt_key)
                counted = Counted(event.dataset, prompt, completion, reasoning, cost, estimated, priced)
        return counted, self._halts(now)

    @staticmethod
    def _count_repaid(dataset: ScopeTotals, key: str) -> None:
        """An answer of a prompt with a lost attempt: that prompt was paid again."""
        for lost, _ in dataset.lost_items():
            if _prompt_of(lost) == key and lost not in dataset.repaid:
                dataset.repaid.add(lost)
                dataset.lost_repaid += 1

    def _lose(self, scope: ScopeTotals, key: str, held: HeldAttempt) -> None:
        """Mark one attempt lost (still held); a prompt already answered by another attempt was paid again."""
        held.lost = True
        scope.lost.add(key)
        self._dirty.add(scope.scope)
        if _prompt_of(key) in self._answered_samples and key not in scope.repaid:
            scope.repaid.add(key)
            scope.lost_repaid += 1

    def mark_lost(self, keys: Iterable[tuple[str, str]]) -> int:
        """Mark attempts (dataset, attempt key) lost: their worker died unanswered. They stay held."""
        marked = 0
        for dataset, key in keys:
            scope = self.scopes.get(dataset)
            held = scope.inflight.get(key) if scope is not None else None
            if scope is not None and held is not None and not held.lost:
                self._lose(scope, key, held)
                marked += 1
        return marked

    def expire_inflight(self, now: float) -> int:
        """Mark attempts unanswered past the TTL lost (still held); returns how many were newly marked.

        Past the TTL an attempt is no longer billing: what it cost is settled, and a reading of
        the provider's key usage (:meth:`reconcile`) may release its worst case down to that.
        """
        overdue_before = now - self.inflight_ttl_s
        marked = 0
        for scope in self.scopes.values():
            for key, held in scope.inflight.items():
                if not held.lost and held.started_at < overdue_before:
                    self._lose(scope, key, held)
                    marked += 1
        return marked

    def reconcile(self, key_usage_usd: float, now: float, provider: str = "") -> None:
        """A reading of a provider key's usage (USD): what its answers do not explain bounds its lost attempts.

        ``provider``: the configured provider whose key was read ("": the default one).
        """
        self.book.reconcile(provider, key_usage_usd, now)
        self._dirty.add(GLOBAL_SCOPE)
        self._dirty_providers.add(self.book.name(provider))

    def may_release(self, scope: str, now: float) -> bool:
        """Whether a later reading of the key's usage may release some of the scope's lost attempts.

        Only while the key is being read (a reading within the in-flight TTL): a provider that
        stopped answering ``/key`` must not keep a scope from finishing at its cap.
        """
        return self.book.may_release(self.lost_attempts(scope), now, self.inflight_ttl_s)

    def lost_tokens(self, scope: str, *, unleased: bool = False) -> int:
        """What the lost attempts of ``scope`` hold: their worst case, released down to what the key was charged.

        ``unleased``: only those sent without a lease.
        """
        names = [n for n in self.scopes if n != GLOBAL_SCOPE] if scope == GLOBAL_SCOPE else [scope]
        lost = [
            held
            for n in names
            if n in self.scopes
            for k, held in self.scopes[n].lost_items()
            if not (unleased and k in self.scopes[n].leased)
        ]
        return self.book.lost_hold(lost, self.inflight_ttl_s)

    def lost_attempts(self, scope: str) -> list[HeldAttempt]:
        """The lost attempts of a scope."""
        names = [n for n in self.scopes if n != GLOBAL_SCOPE] if scope == GLOBAL_SCOPE else [scope]
        return [held for n in names if n in self.scopes for _, held in self.scopes[n].lost_items()]

    def evaluate(self, now: float) -> list[Halt | Resume]:
        """Halts for scopes over a cap, resumes for raised caps now under it."""
        out: list[Halt | Resume] = list(self._halts(now))
        out.extend(self._resumes(now))
        return out

    # ------------------------------------------------------------------ decisions
    def caps(self, scope: str) -> Caps:
        """The current caps of a scope."""
        return self._caps_for(scope)

    def inflight_tokens(self, scope: str, *, unleased: bool = False) -> int:
        """Worst case of the scope's unanswered attempts (``unleased``: only those sent without a lease).

        Lost attempts count at what they hold (:meth:`lost_tokens`), leased or not.
        """
        names = [n for n in self.scopes if n != GLOBAL_SCOPE] if scope == GLOBAL_SCOPE else [scope]
        total = 0
        for name in names:
            totals = self.scopes.get(name)
            if totals is not None:
                total += sum(
                    held.max_tokens
                    for k, held in totals.inflight.items()
                    if not held.lost and not (unleased and k in totals.leased)
                )
        return total + self.lost_tokens(scope, unleased=unleased)

    def over_cap(self, scope: str) -> str | None:
        """Why the scope must stop now (cap reached, or would be by in-flight worst case)."""
        totals = self.scopes.get(scope)
        if totals is None:
            return None
        caps = self.caps(scope)
        # Requests sent under a lease wait for headroom instead (services.budget.leases).
        inflight = self.inflight_tokens(scope, unleased=True) if self.include_inflight else 0
        label = "global" if scope == GLOBAL_SCOPE else f"dataset {scope}"
        if caps.completion_tokens is not None:
            spent = totals.completion_tokens
            if spent >= caps.completion_tokens:
                return f"{label}: {spent} completion tokens reached the cap of {caps.completion_tokens}"
            if inflight and spent + inflight > caps.completion_tokens:
                return (
                    f"{label}: {spent} completion tokens + {inflight} in flight (worst case) "
                    f"would cross the cap of {caps.completion_tokens}"
                )
        if caps.usd is not None:
            spent_usd = totals.cost_usd
            if spent_usd >= caps.usd:
                return f"{label}: ${spent_usd:.4f} reached the cap of ${caps.usd:.4f}"
            if inflight and self.inflight_usd_per_token:
                worst = inflight * self.inflight_usd_per_token
                if spent_usd + worst > caps.usd:
                    return (
                        f"{label}: ${spent_usd:.4f} + ${worst:.4f} in flight (worst case) "
                        f"would cross the cap of ${caps.usd:.4f}"
                    )
        return None

    def soft_limit(self, scope: str) -> bool:
        """Whether spend is past the soft threshold of a cap."""
        totals = self.scopes.get(scope)
        if totals is None:
            return False
        caps = self.caps(scope)
        tokens = caps.completion_tokens is not None and (
            totals.completion_tokens >= self.soft_threshold * caps.completion_tokens
        )
        usd = caps.usd is not None and totals.cost_usd >= self.soft_threshold * caps.usd
        return tokens or usd

    def state(self, scope: str) -> State:
        """running, soft-limit or halted (a standing halt on the scope itself)."""
        if isinstance(self.control.get(scope), Halt):
            return "halted"
        return "soft-limit" if self.soft_limit(scope) else "running"

    def _halts(self, now: float) -> list[Halt]:
        out: list[Halt] = []
        for scope in list(self.scopes):
            if isinstance(self.control.get(scope), Halt):
                continue
            reason = self.over_cap(scope)
            if reason is None:
                continue
            out.append(self.record_halt(scope, reason, now))
        return out

    def record_halt(self, scope: str, reason: str, now: float) -> Halt:
        """The budget's halt of a scope, recorded as standing here (to be published)."""
        halt = Halt(scope=scope, reason=reason, by=BUDGET_ACTOR, at=now)
        self.control[scope] = halt
        self._resume_candidates.discard(scope)
        self._dirty.add(scope)
        return halt

    def _resumes(self, now: float) -> list[Resume]:
        out: list[Resume] = []
        for scope in sorted(self._resume_candidates):
            event = self.control.get(scope)
            if not (isinstance(event, Halt) and event.by == BUDGET_ACTOR):
                self._resume_candidates.discard(scope)
                continue
            if self.over_cap(scope) is not None:
                continue
            caps = self.caps(scope)
            resume = Resume(
                scope=scope,
                reason=f"cap raised (completion tokens {caps.completion_tokens}, usd {caps.usd})",
                by=BUDGET_ACTOR,
                at=now,
            )
            self.control[scope] = resume
            self._resume_candidates.discard(scope)
            self._dirty.add(scope)
            out.append(resume)
        return out

    # ------------------------------------------------------------------ views
    def rate(self, scope: str, now: float) -> tuple[float, float]:
        """Moving spend rate of a scope: (dollars per second, completion tokens per second)."""
        totals = self.scopes.get(scope)
        return (0.0, 0.0) if totals is None else _rate(totals, now, self.rate_window_s)

    def projection(self, scope: str, remaining_prompts: int | None) -> tuple[float | None, int | None]:
        """Projected total (dollars, completion tokens) once the remaining prompts are answered."""
        totals = self.scopes.get(scope)
        if totals is None or remaining_prompts is None:
            return None, None
        if totals.responses == 0:
            return (totals.cost_usd, totals.completion_tokens) if remaining_prompts == 0 else (None, None)
        usd = totals.cost_usd + remaining_prompts * totals.cost_usd / totals.responses
        per_response = totals.completion_tokens / totals.responses
        tokens = totals.completion_tokens + round(remaining_prompts * per_response)
        return usd, tokens

    def snapshot(self, scope: str, now: float, remaining_prompts: int | None = None) -> BudgetSnapshot:
        """The checkpoint record of one scope, carrying the ledger's consumed offsets."""
        totals = self._scope(scope)
        caps = self.caps(scope)
        control = self.control.get(scope)
        halt = control if isinstance(control, Halt) else None
        rate_usd, rate_tokens = self.rate(scope, now)
        projected_usd, projected_tokens = self.projection(scope, remaining_prompts)
        lost = self.lost_tokens(scope)
        return msgspec.structs.replace(
            counted_snapshot(totals),
            cap_completion_tokens=caps.completion_tokens,
            cap_usd=caps.usd,
            state=self.state(scope),
            halted_by=halt.by if halt else "",
            halted_reason=halt.reason if halt else "",
            offsets=self._offsets_of(totals),
            inflight={k: held.max_tokens for k, held in totals.inflight.items()},
            inflight_tokens=self.inflight_tokens(scope),
            attempts={k: msgspec.structs.replace(held) for k, held in totals.inflight.items()},
            lost_tokens=lost,
            lost_usd=None if self.inflight_usd_per_token is None else lost * self.inflight_usd_per_token,
            lost_repaid=(
                sum(t.lost_repaid for n, t in self.scopes.items() if n != GLOBAL_SCOPE)
                if scope == GLOBAL_SCOPE else totals.lost_repaid
            ),
            key_usage_base_usd=self.book.key("").base_usd if scope == GLOBAL_SCOPE else None,
            key_unexplained_usd=self.book.key("").unexplained_usd if scope == GLOBAL_SCOPE else None,
            rate_usd_per_s=rate_usd,
            rate_tokens_per_s=rate_tokens,
            remaining_prompts=remaining_prompts,
            projected_usd=projected_usd,
            projected_completion_tokens=projected_tokens,
            updated_at=now,
            dead_letters=copy_tally(totals.dead_letters) if scope == GLOBAL_SCOPE else None,
            dead_letter_keys=(
                dict(totals.dead_letter_keys) if scope == GLOBAL_SCOPE and totals.dead_letters is not None else None
            ),
            accepted_truncated=(
                dict(totals.accepted_truncated)
                if scope == GLOBAL_SCOPE and totals.accepted_truncated is not None
                else None
            ),
        )

    def checkpoint(
        self, now: float, remaining: Mapping[str, int | None] | None = None, *, everything: bool = False
    ) -> list[BudgetSnapshot]:
        """Snapshots of the changed scopes (all with ``everything``), ``global`` last."""
        remaining = remaining or {}
        names = set(self.scopes) if everything else set(self._dirty)
        providers = set(self.book.totals) if everything else set(self._dirty_providers)
        if not names and not providers:
            return []
        names.add(GLOBAL_SCOPE)
        self._dirty.clear()
        self._dirty_providers.clear()
        ordered = sorted(n for n in names if n != GLOBAL_SCOPE) + [GLOBAL_SCOPE]
        global_remaining = None
        known = [remaining.get(n) for n in self.scopes if n != GLOBAL_SCOPE]
        if known and all(r is not None for r in known):
            global_remaining = sum(r for r in known if r is not None)
        snaps = [self.provider_snapshot(p, now) for p in sorted(providers)]
        for snap in snaps:
            self.book.of(provider_of_scope(snap.scope) or "").floor = dict(snap.offsets)
        dataset_snaps = [
            self.snapshot(n, now, global_remaining if n == GLOBAL_SCOPE else remaining.get(n)) for n in ordered
        ]
        for snap in dataset_snaps:
            self.scopes[snap.scope].floor = dict(snap.offsets)
        return snaps + dataset_snaps

    def provider_snapshot(self, provider: str, now: float) -> BudgetSnapshot:
        """The checkpoint record of one provider (scope ``provider:<name>``): its spend, rate, in flight,
        lost attempts and key reading; no caps (caps are per dataset and global)."""
        name = self.book.name(provider)
        totals = self.book.of(name)
        attempts = {
            k: msgspec.structs.replace(held)
            for n, t in self.scopes.items() if n != GLOBAL_SCOPE
            for k, held in t.inflight.items() if self.book.name(held.provider) == name
        }
        lost_attempts = [held for held in attempts.values() if held.lost]
        lost = self.book.lost_hold(lost_attempts, self.inflight_ttl_s)
        rate_usd, rate_tokens = _rate(totals, now, self.rate_window_s)
        control = self.control.get(totals.scope)
        halt = control if isinstance(control, Halt) else None
        key = self.book.key(name)
        usd_per_token = self.book.usd_per_token(name)
        return msgspec.structs.replace(
            counted_snapshot(totals),
            state="halted" if halt else "running",
            halted_by=halt.by if halt else "",
            halted_reason=halt.reason if halt else "",
            offsets=self._offsets_of(totals),
            inflight_tokens=sum(h.max_tokens for h in attempts.values() if not h.lost) + lost,
            attempts=attempts,
            lost_tokens=lost,
            lost_usd=None if usd_per_token is None else lost * usd_per_token,
            key_usage_base_usd=key.base_usd,
            key_unexplained_usd=key.unexplained_usd,
            unreconciled=self.book.unreconciled(name, len(lost_attempts)),
            rate_usd_per_s=rate_usd,
            rate_tokens_per_s=rate_tokens,
            updated_at=now,
        )

    def _offsets_of(self, totals: ScopeTotals) -> dict[str, int]:
        """The scope's counted-up-to offsets: the ledger's, or its own floor while replaying."""
        merged = dict(self.offsets)
        for position, offset in totals.floor.items():
            merged[position] = max(offset, merged.get(position, 0))
        return merged

    @property
    def datasets(self) -> list[str]:
        """The dataset scopes seen so far."""
        return sorted(n for n in self.scopes if n != GLOBAL_SCOPE)


def _rate(totals: ScopeTotals, now: float, window_s: float) -> tuple[float, float]:
    """The moving spend rate of one scope's totals: (dollars per second, completion tokens per second)."""
    if totals.first_event_at is None:
        return 0.0, 0.0
    while totals.window and totals.window[0][0] < now - window_s:
        totals.window.popleft()
    span = max(1.0, min(window_s, now - totals.first_event_at))
    usd = sum(c for _, c, _ in totals.window)
    tokens = sum(t for _, _, t in totals.window)
    return usd / span, tokens / span


def _prompt_of(attempt: str) -> str:
    """The ``<dataset>:<sample_id>`` of an attempt key."""
    return attempt.rpartition("#")[0]
