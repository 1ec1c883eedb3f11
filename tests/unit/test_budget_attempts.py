"""Attempts, not samples (services.budget.core/leases/reconcile): each attempt held until its own answer.

The truth is arithmetic the test does itself: the cap, the worst case of what was sent,
and what the provider's key says it charged.
"""

from __future__ import annotations

import msgspec

from schemas import GLOBAL_SCOPE, BudgetSnapshot, RequestStarted, decode, encode
from services.budget.core import Ledger
from services.budget.lost import lost_lines, snapshot_lost_lines
from services.budget.reconcile import KeyUsage
from services.budget.totals import Caps
from tests.unit.test_budget_leases import EPOCH, MAX, Run

PRICE = 2e-6  # USD per completion token


def attempt(run: Run, worker: str, sample_id: str, attempt_id: str, **kw: object) -> RequestStarted:
    """An attempt with its own id, announced under the lease of ``worker``."""
    event = RequestStarted(
        dataset="d", sample_id=sample_id, max_tokens=MAX, worker=worker, started_at=run.now,
        lease_epoch=EPOCH, attempt_id=attempt_id, **kw,  # type: ignore[arg-type]
    )
    run.offset += 1
    run.ledger.on_request(event, "requests:0", run.offset, run.now)
    run.book.on_request(event)
    return event


def answer(run: Run, sample_id: str, attempt_id: str, used: int) -> None:
    """The answer of one attempt (it names the attempt)."""
    from schemas import Message, PromptPublished, ResponseReceived, Usage

    response = ResponseReceived(
        dataset="d", sample_id=sample_id, provider="p", model="m", attempt_id=attempt_id,
        prompt=PromptPublished(dataset="d", sample_id=sample_id, messages=[Message(role="user", content="q")]),
        usage=Usage(prompt_tokens=1, completion_tokens=used, cost=used * PRICE),
    )
    run.offset += 1
    run.ledger.on_response(response, "responses:0", run.offset, run.now)
    run.book.on_answer(response.attempt_key, used)


def test_a_later_attempt_of_the_same_prompt_never_settles_a_dead_workers_attempt() -> None:
    run = Run({"d": Caps(completion_tokens=4 * MAX)}, ttl_s=5.0)
    run.ask("w1", 2 * MAX)
    assert run.decide()[0] == {"w1": 2 * MAX}
    attempt(run, "w1", "s0", "a1")
    attempt(run, "w1", "s1", "a2")  # w1 is SIGKILLed: the provider generates both to the end
    run.now += 6.5  # past w1's TTL and grace
    run.ask("w2", 2 * MAX)
    assert run.decide()[0] == {"w2": 2 * MAX}
    attempt(run, "w2", "s0", "b1")  # the restarted worker sends the same prompts again
    attempt(run, "w2", "s1", "b2")
    answer(run, "s0", "b1", 5_000)
    answer(run, "s1", "b2", 6_000)
    # w1's two attempts stay held at their worst case: spent + lost = the whole cap's use so far.
    assert run.ledger.inflight_tokens("d") == 2 * MAX
    assert run.ledger.scopes["d"].completion_tokens == 11_000
    assert sorted(a.worker for a in run.ledger.lost_attempts("d")) == ["w1", "w1"]
    assert run.ledger.scopes["d"].lost_repaid == 2
    # Free room under the cap never counts the lost attempts as free.
    assert run.book.free("d") <= 4 * MAX - 11_000 - 2 * MAX


def test_an_attempt_that_ended_with_an_error_is_released_by_the_next_one_it_names() -> None:
    run = Run({"d": Caps(completion_tokens=4 * MAX)})
    run.ask("w1", 2 * MAX)
    run.decide()
    attempt(run, "w1", "s0", "a1")  # a 500: nothing billed
    attempt(run, "w1", "s0", "a2", supersedes="a1")
    assert run.ledger.inflight_tokens("d") == MAX
    assert run.book.leases[("w1", "d")].consumed == MAX
    # Another worker cannot release w1's attempt by naming it.
    attempt(run, "w2", "s0", "c1", supersedes="a2")
    assert run.ledger.inflight_tokens("d") == 2 * MAX
    assert run.book.leases[("w1", "d")].consumed == MAX


def test_an_answer_settles_only_its_own_attempt() -> None:
    run = Run({"d": Caps(completion_tokens=4 * MAX)})
    run.ask("w1", 2 * MAX)
    run.ask("w2", 2 * MAX)
    run.decide()
    attempt(run, "w1", "s0", "a1")
    attempt(run, "w2", "s0", "b1")  # two workers on one prompt (a rebalance mid-request)
    answer(run, "s0", "b1", 1_000)
    assert run.ledger.inflight_tokens("d") == MAX  # a1 still held
    answer(run, "s0", "a1", 2_000)
    assert run.ledger.inflight_tokens("d") == 0
    assert run.book.leases[("w1", "d")].consumed == 2_000
    assert run.book.leases[("w2", "d")].consumed == 1_000


def test_records_of_older_workers_without_attempt_ids_are_matched_by_attempt_number() -> None:
    old = b'{"dataset":"d","sample_id":"s0","max_tokens":100,"worker":"w","attempt":2,"schema_version":1}'
    event = decode(old, RequestStarted)
    assert event.attempt_id == "" and event.attempt_key == "d:s0#2"


def test_key_usage_releases_settled_lost_attempts_down_to_what_was_charged() -> None:
    ledger = Ledger(caps_for=lambda _: Caps(completion_tokens=10 * MAX), inflight_ttl_s=30.0,
                    inflight_usd_per_token=PRICE)
    ledger.reconcile(7.0, 0.0)  # the key had been used before this run: that is the base
    for i in range(3):
        event = RequestStarted(dataset="d", sample_id=f"s{i}", max_tokens=MAX, worker="w1",
                               started_at=100.0, attempt_id=f"a{i}")
        ledger.on_request(event, "requests:0", i, 100.0)
    ledger.mark_lost([("d", f"d:s{i}#a{i}") for i in range(3)])
    # Lost but possibly still generating when the key was read: a reading releases nothing yet.
    ledger.reconcile(7.0 + 9_000 * PRICE, 110.0)
    assert ledger.lost_tokens("d") == 3 * MAX
    assert ledger.may_release("d", 110.0)
    assert not ledger.may_release("d", 110.0 + 31.0)  # the key has not been read for a TTL: nothing to wait for
    ledger.reconcile(7.0 + 20_000 * PRICE, 200.0)  # past the TTL; the provider charged 20,000 tokens for them
    assert ledger.lost_tokens("d") == 20_000
    assert ledger.inflight_tokens(GLOBAL_SCOPE) == 20_000
    assert not ledger.may_release("d", 200.0)
    # An answer billed and not read yet is unexplained too: it only holds more, never less.
    ledger.reconcile(7.0 + 60_000 * PRICE, 210.0)
    assert ledger.lost_tokens("d") == 3 * MAX
    # Without a price, dollars cannot be turned into tokens: the worst case stands.
    assert KeyUsage(0.0, 1.0).tokens(None) is None


def test_lost_attempts_survive_a_checkpoint_with_their_worker() -> None:
    ledger = Ledger(caps_for=lambda _: Caps(completion_tokens=10 * MAX), inflight_usd_per_token=PRICE)
    event = RequestStarted(dataset="d", sample_id="s0", max_tokens=MAX, worker="w9", started_at=5.0, attempt_id="x")
    ledger.on_request(event, "requests:0", 0, 5.0)
    ledger.mark_lost([("d", event.attempt_key)])
    snaps = {s.scope: decode(encode(s), BudgetSnapshot) for s in ledger.checkpoint(6.0, everything=True)}
    restored = Ledger(caps_for=lambda _: Caps(completion_tokens=10 * MAX), inflight_usd_per_token=PRICE)
    restored.restore(sorted(snaps.values(), key=lambda s: s.scope == GLOBAL_SCOPE), 50.0)
    assert [(a.worker, a.lost, a.started_at) for a in restored.lost_attempts("d")] == [("w9", True, 5.0)]
    lines = snapshot_lost_lines(snaps["d"])
    assert lines == [f"1 attempts lost with worker w9, counted at {MAX:,} tokens / ${MAX * PRICE:,.2f} "
                     "(the provider may have billed them)"]


def test_lost_lines_say_what_reconciliation_released_and_how_many_were_paid_again() -> None:
    lost = [msgspec.convert({"max_tokens": 100, "worker": "w1", "lost": True}, type=_held()) for _ in range(2)]
    lines = lost_lines(lost, 150, None, repaid=2)
    assert lines[0] == "2 attempts lost with worker w1, counted at 200 tokens (the provider may have billed them)"
    assert "released them to 150 tokens" in lines[1]
    assert lines[2] == "2 prompts of lost attempts paid again by a later attempt"


def _held() -> type:
    from schemas import HeldAttempt

    return HeldAttempt


def test_status_shows_the_lost_attempts_per_dataset_and_worker() -> None:
    from rich.console import Console

    from schemas import HeldAttempt
    from services.status.core import StatusSnapshot, render

    held = {f"d:s{i}#a{i}": HeldAttempt(max_tokens=MAX, worker="w1", lost=True) for i in range(3)}
    held["d:s9#b"] = HeldAttempt(max_tokens=MAX, worker="w2")  # in flight, not lost
    snap = StatusSnapshot(taken_at=0.0, budgets=[
        BudgetSnapshot(scope="d", attempts=held, lost_tokens=3 * MAX, lost_usd=3 * MAX * PRICE, lost_repaid=1),
        BudgetSnapshot(scope=GLOBAL_SCOPE, lost_tokens=3 * MAX),
    ])
    console = Console(record=True, width=300)
    console.print(render(snap))
    text = console.export_text()
    assert (f"d: 3 attempts lost with worker w1, counted at {3 * MAX:,} tokens / ${3 * MAX * PRICE:,.2f} "
            "(the provider may have billed them)") in text
    assert "d: 1 prompts of lost attempts paid again by a later attempt" in text
    assert "worker w2" not in text


def test_a_prompt_answered_before_its_other_attempt_was_found_lost_counts_as_re_paid_once() -> None:
    run = Run({"d": Caps(completion_tokens=4 * MAX)}, ttl_s=5.0)
    run.ask("w1", MAX)
    run.decide()
    attempt(run, "w1", "s#0", "a1")  # a sample id with the separator in it
    run.ask("w2", MAX)
    run.decide()
    attempt(run, "w2", "s#0", "b1")  # w1 hangs; w2 takes its partition over and is answered first
    answer(run, "s#0", "b1", 3_000)
    run.now += 6.5
    run.ask("w2", MAX)
    run.decide()  # w1's lease is taken back: its attempt is lost, its prompt was already paid again
    assert run.ledger.scopes["d"].lost_repaid == 1
    run.ledger.expire_inflight(run.now + 10_000)
    assert run.ledger.scopes["d"].lost_repaid == 1
    assert run.ledger.inflight_tokens("d") == MAX


def test_a_timed_out_attempt_may_have_been_billed_and_stays_held() -> None:
    from services.inference.core import ProviderFailure, may_be_billed

    timeout = ProviderFailure(reason="provider_timeout", message="read timeout", retryable=True)
    refused = ProviderFailure(reason="provider_connection_refused", message="refused", retryable=True)
    status = ProviderFailure(reason="provider_http_500", message="upstream", retryable=True, http_status=500)
    assert may_be_billed(timeout)
    assert not may_be_billed(refused) and not may_be_billed(status)

    run = Run({"d": Caps(completion_tokens=4 * MAX)})
    run.ask("w1", 2 * MAX)
    run.decide()
    attempt(run, "w1", "s0", "a1")  # times out: not named by the next attempt
    attempt(run, "w1", "s0", "a2")  # times out too, the last attempt: a dead letter follows
    run.ledger.on_request_failed("d", "s0", "dead-letter:0", 0, reason="provider_timeout")
    run.book.on_failed("d", "s0", "provider_timeout")
    assert run.ledger.inflight_tokens("d") == 2 * MAX
    assert run.book.leases[("w1", "d")].consumed == 2 * MAX
    # A dead letter whose last failure was read (nothing billed) releases the worker's attempts.
    attempt(run, "w1", "s1", "b1")
    run.ledger.on_request_failed("d", "s1", "dead-letter:0", 1, reason="provider_http_400")
    run.book.on_failed("d", "s1", "provider_http_400")
    assert run.ledger.inflight_tokens("d") == 2 * MAX
    assert run.book.leases[("w1", "d")].consumed == 2 * MAX
