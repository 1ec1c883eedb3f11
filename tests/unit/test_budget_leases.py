"""Leases of headroom (services.budget.leases): grants within the caps, refunds, expiry, the finish.

The truth is arithmetic the test does itself: the cap, the answer lengths it draws, and
what a worker that keeps its own consumption within its grant may send.
"""

from __future__ import annotations

import random

from schemas import (
    GLOBAL_SCOPE,
    LeaseReleased,
    LeaseRequested,
    Message,
    PromptPublished,
    RequestStarted,
    ResponseReceived,
    Usage,
)
from services.budget.core import Ledger
from services.budget.leases import CAPPED_PREFIX, LeaseBook
from services.budget.totals import Caps

EPOCH = "e1"
MAX = 16_384


class Run:
    """A ledger and a lease book fed as the budget service feeds them."""

    def __init__(self, caps: dict[str, Caps], *, ttl_s: float = 10.0, grants_from: float = 0.0) -> None:
        self.ledger = Ledger(caps_for=lambda scope: caps.get(scope, Caps()), include_inflight=False)
        self.book = LeaseBook(
            self.ledger, epoch=EPOCH, ttl_s=ttl_s, grace_s=1.0, max_tokens_for=lambda _: MAX, grants_from=grants_from
        )
        self.offset = 0
        self.now = 1000.0

    def ask(self, worker: str, target: int, dataset: str = "d", step: int = MAX) -> None:
        event = LeaseRequested(worker=worker, dataset=dataset, epoch=EPOCH, target=target, step=step)
        self.book.on_lease_request(event, self.now)

    def decide(self) -> tuple[dict[str, int], list[tuple[str, str]]]:
        self.book.expire(self.now)  # every request was read (the shell checks before expiring)
        grants, finished = self.book.decide(self.now)
        return {g.worker: g.granted for g in grants}, finished

    def send(self, worker: str, sample_id: str, dataset: str = "d", max_tokens: int = MAX) -> RequestStarted:
        event = RequestStarted(
            dataset=dataset, sample_id=sample_id, max_tokens=max_tokens, worker=worker,
            started_at=self.now, lease_epoch=EPOCH,
        )
        self.offset += 1
        self.ledger.on_request(event, "requests:0", self.offset, self.now)
        self.book.on_request(event)
        return event

    def answer(self, sample_id: str, used: int, dataset: str = "d") -> None:
        response = ResponseReceived(
            dataset=dataset, sample_id=sample_id, provider="p", model="m",
            prompt=PromptPublished(dataset=dataset, sample_id=sample_id, messages=[Message(role="user", content="q")]),
            usage=Usage(prompt_tokens=1, completion_tokens=used),
        )
        self.offset += 1
        self.ledger.on_response(response, "responses:0", self.offset, self.now)
        self.book.on_answer(response.attempt_key, used)


def test_grants_are_whole_requests_within_the_cap() -> None:
    run = Run({"d": Caps(completion_tokens=100_000)})
    run.ask("w1", 10 * MAX)
    granted, finished = run.decide()
    # 100,000 holds six requests of 16,384 (98,304), not seven.
    assert granted == {"w1": 6 * MAX}
    assert finished == []
    run.ask("w2", MAX)
    granted, _ = run.decide()
    assert granted == {"w2": 0}  # nothing left for a second worker


def test_an_answer_below_its_worst_case_hands_the_rest_back_to_its_worker() -> None:
    run = Run({"d": Caps(completion_tokens=3 * MAX)})
    run.ask("w1", 3 * MAX)
    assert run.decide()[0] == {"w1": 3 * MAX}
    for i in range(3):
        run.send("w1", f"s{i}")
    run.answer("s0", 4_000)
    lease = run.book.leases[("w1", "d")]
    assert lease.consumed == 2 * MAX + 4_000
    assert lease.unused == MAX - 4_000  # not enough for another request yet
    run.answer("s1", 5_000)
    assert lease.unused == 2 * MAX - 9_000  # now one more fits
    assert lease.unused >= MAX


def test_an_answer_read_before_its_request_charges_what_it_used() -> None:
    run = Run({"d": Caps(completion_tokens=2 * MAX)})
    run.ask("w1", 2 * MAX)
    run.decide()
    run.answer("s0", 3_000)  # the responses partition was fetched first
    run.send("w1", "s0")
    assert run.book.leases[("w1", "d")].consumed == 3_000


def test_withheld_and_failed_requests_cost_nothing() -> None:
    run = Run({"d": Caps(completion_tokens=2 * MAX)})
    run.ask("w1", 2 * MAX)
    run.decide()
    started = run.send("w1", "s0")
    run.send("w1", "s1")
    lease = run.book.leases[("w1", "d")]
    assert lease.unused == 0
    withheld = RequestStarted(
        dataset="d", sample_id="s0", max_tokens=MAX, worker="w1", started_at=started.started_at,
        withheld=True, lease_epoch=EPOCH,
    )
    run.book.on_request(withheld)
    run.book.on_failed("d", "s1")
    assert lease.consumed == 0 and lease.unused == 2 * MAX


def test_requests_of_another_epoch_are_not_charged_to_a_lease() -> None:
    run = Run({"d": Caps(completion_tokens=2 * MAX)})
    old = RequestStarted(dataset="d", sample_id="x", max_tokens=MAX, worker="w1", lease_epoch="old")
    run.ledger.on_request(old, "requests:0", 1, run.now)
    run.book.on_request(old)
    run.ask("w1", 2 * MAX)
    # The old epoch's request is still in flight: only one more request fits under the cap.
    assert run.decide()[0] == {"w1": MAX}


def test_an_expired_lease_is_taken_back_and_given_to_another_worker() -> None:
    run = Run({"d": Caps(completion_tokens=2 * MAX)}, ttl_s=5.0)
    run.ask("w1", 2 * MAX)
    assert run.decide()[0] == {"w1": 2 * MAX}
    run.send("w1", "s0")  # then w1 dies with one request in flight and one unused
    run.now += 3.0
    run.ask("w2", MAX)
    assert run.decide()[0] == {"w2": 0}
    run.now += 3.5  # past w1's TTL (5 s) and grace (1 s)
    run.ask("w2", MAX)
    assert run.decide()[0] == {"w2": MAX}
    assert run.book.leases[("w1", "d")].unused == 0
    # w1's request in flight is still counted: nothing more fits.
    run.ask("w2", 2 * MAX)
    assert run.decide()[0] == {"w2": MAX}


def test_a_released_lease_frees_its_unused_part_at_once() -> None:
    run = Run({"d": Caps(completion_tokens=2 * MAX)})
    run.ask("w1", 2 * MAX)
    run.decide()
    run.book.on_release(LeaseReleased(worker="w1", dataset="d", epoch=EPOCH))
    run.ask("w2", 2 * MAX)
    assert run.decide()[0] == {"w2": 2 * MAX}


def test_room_an_idle_worker_releases_goes_to_the_one_waiting_and_its_grants_say_so() -> None:
    run = Run({"d": Caps(completion_tokens=3 * MAX)})
    run.ask("w1", 2 * MAX)
    grants, _ = run.book.decide(run.now)
    assert [(g.granted, g.releases) for g in grants] == [(2 * MAX, 0)]
    run.send("w1", "s0")
    run.answer("s0", MAX // 4)  # w1's partitions go elsewhere: its room stays unused
    run.ask("w2", 2 * MAX)
    assert run.decide() == ({"w2": MAX}, [])  # w1 could still fit one: not finished, w2 short
    run.ask("w2", 2 * MAX)
    assert run.decide() == ({"w2": MAX}, [])  # and so it would stay
    run.book.on_release(LeaseReleased(worker="w1", dataset="d", epoch=EPOCH, releases=1))
    run.ask("w2", 2 * MAX)
    assert run.decide()[0] == {"w2": 2 * MAX}
    run.ask("w1", MAX // 4 + MAX)  # w1 asks again: its grant starts from what it consumed
    grants, _ = run.book.decide(run.now)
    assert [(g.granted, g.releases) for g in grants] == [(MAX // 4, 1)]


def test_a_restarted_budget_grants_nothing_until_the_old_epoch_expired() -> None:
    run = Run({"d": Caps(completion_tokens=10 * MAX)}, grants_from=1010.0)
    run.ask("w1", MAX)
    assert run.decide() == ({"w1": 0}, [])
    run.now = 1010.0
    run.ask("w1", MAX)
    assert run.decide()[0] == {"w1": MAX}


def test_uncapped_scopes_get_unlimited_leases() -> None:
    run = Run({})
    run.book.on_lease_request(LeaseRequested(worker="w1", dataset="d", epoch=EPOCH, target=MAX, step=MAX), run.now)
    grants, finished = run.book.decide(run.now)
    assert [g.unlimited for g in grants] == [True] and finished == []


def test_dollar_caps_count_the_worst_case_at_the_completion_price() -> None:
    run = Run({"d": Caps(usd=1.0)})
    run.book.usd_per_token = 2e-5  # 50,000 tokens for a dollar: three requests of 16,384
    run.ask("w1", 5 * MAX)
    assert run.decide()[0] == {"w1": 3 * MAX}


def test_the_global_cap_bounds_every_dataset_together() -> None:
    run = Run({"a": Caps(completion_tokens=10 * MAX), "b": Caps(completion_tokens=10 * MAX),
               GLOBAL_SCOPE: Caps(completion_tokens=3 * MAX)})
    run.ask("w1", 2 * MAX, dataset="a")
    run.ask("w2", 2 * MAX, dataset="b")
    grants, _ = run.book.decide(run.now)
    assert sum(g.granted for g in grants) == 3 * MAX


def test_workers_that_keep_within_their_leases_end_at_the_cap_never_past_it() -> None:
    """Three workers, answers of 2,000-15,000 tokens: spent <= cap and >= cap - one request per worker."""
    cap = 300_000
    rng = random.Random(7)
    run = Run({"d": Caps(completion_tokens=cap)})
    workers = ["w1", "w2", "w3"]
    flying: dict[str, list[str]] = {w: [] for w in workers}
    sent = 0
    finished: list[tuple[str, str]] = []
    true_spend = 0
    for _ in range(500):
        for w in workers:  # each worker: four requests at once at most, asks for what it lacks
            lease = run.book.leases.get((w, "d"))
            consumed = lease.consumed if lease else 0
            granted = lease.granted if lease else 0
            while len(flying[w]) < 4 and granted - consumed >= MAX:
                run.send(w, f"s{sent}")
                flying[w].append(f"s{sent}")
                sent += 1
                consumed += MAX
            run.ask(w, consumed + (4 - len(flying[w])) * MAX)
        _, finished = run.decide()
        if finished:
            break
        for w in workers:  # one answer lands per worker per round
            if flying[w]:
                used = rng.randint(2_000, 15_000)
                true_spend += used
                run.answer(flying[w].pop(0), used)
        run.now += 0.1
    assert finished, "the scope never finished"
    scope, reason = finished[0]
    assert scope == "d" and reason.startswith(CAPPED_PREFIX)
    assert true_spend <= cap
    assert true_spend >= cap - len(workers) * MAX
    assert f"{true_spend} of {cap} completion tokens used, {cap - true_spend} unused" in reason


def test_a_dead_workers_unanswered_request_stays_held_after_the_ledger_forgets_it() -> None:
    run = Run({"d": Caps(completion_tokens=2 * MAX)}, ttl_s=5.0)
    run.ledger.inflight_ttl_s = 30.0
    run.ask("w1", MAX)
    run.decide()
    run.send("w1", "s0")  # w1 dies: its answer is never published, the provider may bill it in full
    run.now += 60.0
    assert run.ledger.expire_inflight(run.now) == 1
    run.ask("w2", 2 * MAX)
    assert run.decide()[0] == {"w2": MAX}


def test_a_scope_held_full_by_a_dead_workers_requests_finishes_once_its_lease_is_taken_back() -> None:
    run = Run({"d": Caps(completion_tokens=3 * MAX)}, ttl_s=5.0)
    run.ledger.inflight_ttl_s = 1_000.0  # the ledger forgets the requests only long after
    run.ask("w1", 2 * MAX)
    assert run.decide()[0] == {"w1": 2 * MAX}
    run.send("w1", "s0")
    run.send("w1", "s1")  # then w1 is killed: neither answer is ever published
    run.ask("w2", 2 * MAX)
    assert run.decide() == ({"w2": MAX}, [])
    run.send("w2", "s2")
    run.now += 3.0
    run.ask("w2", 2 * MAX)
    assert run.decide() == ({"w2": MAX}, [])  # w1's lease is live yet: its answers may come
    run.now += 3.5  # past w1's TTL and grace: its lease is taken back
    run.ask("w2", 2 * MAX)
    assert run.decide() == ({"w2": MAX}, [])  # w2's own request may still hand room back
    run.answer("s2", MAX)  # it used its worst case: nothing comes back
    run.ask("w2", 2 * MAX)
    granted, finished = run.decide()
    assert granted == {"w2": MAX}
    assert [scope for scope, _ in finished] == ["d"]
    reason = finished[0][1]
    assert reason.startswith(CAPPED_PREFIX)
    assert f"{MAX} of {3 * MAX} completion tokens used, {2 * MAX} unused" in reason
    assert f"{2 * MAX} of them held for 2 attempt(s) lost with worker(s) w1" in reason
