"""The budget Ledger: accounting, caps, early halt on in-flight worst case, restore."""

from __future__ import annotations

import msgspec
import pytest

from schemas import (
    GLOBAL_SCOPE,
    Halt,
    Message,
    PromptPublished,
    RequestStarted,
    ResponseReceived,
    Resume,
    Usage,
)
from services.budget.core import BUDGET_ACTOR, Ledger, estimate_usage, price_usd
from services.budget.totals import Caps


def response(
    dataset: str = "math",
    sample_id: str = "s1",
    *,
    completion: int | None = 10,
    prompt: int | None = 5,
    reasoning: int | None = 2,
    cost: float | None = None,
    content: str = "",
    reasoning_text: str = "",
    model: str = "m",
    attempt: int = 1,
) -> ResponseReceived:
    """A response with the given usage."""
    return ResponseReceived(
        dataset=dataset,
        sample_id=sample_id,
        prompt=PromptPublished(dataset=dataset, sample_id=sample_id, messages=[Message(role="user", content="x" * 40)]),
        provider="p",
        model=model,
        content=content,
        reasoning=reasoning_text,
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, reasoning_tokens=reasoning, cost=cost),
        attempt=attempt,
    )


def request(dataset: str = "math", sample_id: str = "s1", max_tokens: int = 100, attempt: int = 1) -> RequestStarted:
    """A request sent to the provider."""
    return RequestStarted(dataset=dataset, sample_id=sample_id, max_tokens=max_tokens, attempt=attempt)


def make_ledger(caps: dict[str, Caps] | None = None, **kwargs: object) -> Ledger:
    """A ledger whose caps come from a dict (uncapped when absent)."""
    table = caps or {}
    return Ledger(caps_for=lambda scope: table.get(scope, Caps()), **kwargs)  # type: ignore[arg-type]


class Feeder:
    """Feeds a ledger with increasing offsets, as the shell does."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.offsets = {"requests:0": 0, "responses:0": 0}
        self.halts: list[Halt] = []

    def req(self, event: RequestStarted, now: float = 0.0) -> list[Halt]:
        off = self.offsets["requests:0"]
        self.offsets["requests:0"] += 1
        out = self.ledger.on_request(event, "requests:0", off, now)
        self.halts += out
        return out

    def resp(self, event: ResponseReceived, now: float = 0.0) -> list[Halt]:
        off = self.offsets["responses:0"]
        self.offsets["responses:0"] += 1
        _, out = self.ledger.on_response(event, "responses:0", off, now)
        self.halts += out
        return out


def test_totals_per_dataset_and_global() -> None:
    ledger = make_ledger()
    feed = Feeder(ledger)
    feed.req(request("math", "a"))
    feed.resp(response("math", "a", completion=10, prompt=5, reasoning=3, cost=0.5))
    feed.resp(response("code", "b", completion=7, prompt=1, reasoning=0, cost=0.25))
    math, code, total = (ledger.scopes[n] for n in ("math", "code", GLOBAL_SCOPE))
    assert (math.completion_tokens, math.prompt_tokens, math.reasoning_tokens) == (10, 5, 3)
    assert math.cost_usd == pytest.approx(0.5)
    assert (code.completion_tokens, code.cost_usd) == (7, pytest.approx(0.25))
    assert (total.completion_tokens, total.prompt_tokens, total.responses) == (17, 6, 2)
    assert total.cost_usd == pytest.approx(0.75)
    assert math.requests == 1 and total.requests == 1
    assert math.inflight == {}


def test_withheld_request_is_taken_back_and_no_longer_in_flight() -> None:
    """A request a halt held back before it went out: announced, then withheld; then sent again."""
    ledger = make_ledger()
    feed = Feeder(ledger)
    announced = msgspec.structs.replace(request("math", "a", max_tokens=300), started_at=10.0)
    feed.req(announced)
    feed.req(request("math", "b", max_tokens=50))
    assert ledger.inflight_tokens("math") == 350
    feed.req(msgspec.structs.replace(announced, withheld=True))
    math, total = ledger.scopes["math"], ledger.scopes[GLOBAL_SCOPE]
    assert (math.requests, total.requests) == (1, 1)
    assert ledger.inflight_tokens("math") == 50
    # The same attempt passes the gate again later: a new announcement, in flight again.
    feed.req(msgspec.structs.replace(announced, started_at=20.0))
    assert (math.requests, ledger.inflight_tokens("math")) == (2, 350)
    # After a rebalance two workers announced the same prompt; the first one's withdrawal
    # takes back its own request, never the other worker's still in flight.
    first = RequestStarted(dataset="math", sample_id="c", max_tokens=7, worker="w1", started_at=30.0)
    feed.req(first)
    feed.req(msgspec.structs.replace(first, worker="w2", started_at=31.0))
    feed.req(msgspec.structs.replace(first, withheld=True))
    assert (math.requests, ledger.inflight_tokens("math")) == (3, 357)


def test_price_table_used_when_cost_absent() -> None:
    prices = {"m": {"prompt": 1.0, "completion": 2.0}}
    assert price_usd(prices, "m", 1_000_000, 500_000) == pytest.approx(2.0)
    assert price_usd(prices, "other", 1, 1) is None
    ledger = make_ledger(prices=prices)
    counted, _ = ledger.on_response(response(completion=1_000_000, prompt=0, cost=None), "responses:0", 0, 0.0)
    assert counted is not None and counted.priced
    assert ledger.scopes["math"].cost_usd == pytest.approx(2.0)
    counted, _ = ledger.on_response(response(model="unknown", cost=None), "responses:0", 1, 0.0)
    assert counted is not None and not counted.priced


def test_response_without_usage_is_estimated_and_flagged() -> None:
    event = response(completion=None, prompt=None, reasoning=None, content="c" * 41, reasoning_text="r" * 20)
    assert estimate_usage(event) == (10, 16, 5)  # ceil(40/4), ceil(61/4), ceil(20/4)
    ledger = make_ledger()
    counted, _ = ledger.on_response(event, "responses:0", 0, 0.0)
    assert counted is not None and counted.estimated
    assert ledger.scopes["math"].completion_tokens == 16
    assert ledger.scopes["math"].responses_without_usage == 1
    assert ledger.scopes[GLOBAL_SCOPE].responses_without_usage == 1


def test_estimate_prefers_native_ids() -> None:
    event = response(completion=None, content="c" * 400)
    event.native_output_ids = [1, 2, 3]
    assert estimate_usage(event)[1] == 3


def test_cap_halts_that_dataset_only() -> None:
    ledger = make_ledger({"math": Caps(completion_tokens=25)}, include_inflight=False)
    feed = Feeder(ledger)
    feed.resp(response("math", "a", completion=10))
    feed.resp(response("code", "a", completion=100))
    assert feed.halts == []
    halts = feed.resp(response("math", "b", completion=15))
    assert [h.scope for h in halts] == ["math"]
    assert halts[0].by == BUDGET_ACTOR and "25" in halts[0].reason
    assert ledger.state("math") == "halted" and ledger.state("code") == "running"
    # Already halted: no second halt.
    assert feed.resp(response("math", "c", completion=5)) == []


def test_early_halt_on_inflight_worst_case() -> None:
    ledger = make_ledger({"math": Caps(completion_tokens=1000)})
    feed = Feeder(ledger)
    for i in range(6):
        assert feed.req(request("math", f"s{i}", max_tokens=150)) == []  # 900 worst case
    assert ledger.inflight_tokens("math") == 900
    feed.resp(response("math", "s0", completion=50))  # 50 + 750 in flight
    assert feed.halts == []
    halts = feed.req(request("math", "s6", max_tokens=250))  # 50 + 1000 > 1000
    assert [h.scope for h in halts] == ["math"]
    assert "in flight" in halts[0].reason
    # Without the early rule the same traffic does not halt.
    lax = make_ledger({"math": Caps(completion_tokens=1000)}, include_inflight=False)
    lax_feed = Feeder(lax)
    for i in range(7):
        lax_feed.req(request("math", f"s{i}", max_tokens=250))
    assert lax_feed.halts == []


def test_global_cap_and_dollar_cap() -> None:
    ledger = make_ledger({GLOBAL_SCOPE: Caps(usd=1.0)}, include_inflight=False)
    feed = Feeder(ledger)
    feed.resp(response("a", "1", cost=0.6))
    halts = feed.resp(response("b", "1", cost=0.5))
    assert [h.scope for h in halts] == [GLOBAL_SCOPE]


def test_soft_limit() -> None:
    ledger = make_ledger({"math": Caps(completion_tokens=100)}, soft_threshold=0.8, include_inflight=False)
    feed = Feeder(ledger)
    feed.resp(response(completion=79))
    assert ledger.state("math") == "running"
    feed.resp(response(sample_id="2", completion=1))
    assert ledger.state("math") == "soft-limit" and ledger.soft_limit("math")


def test_late_request_after_its_response_is_not_inflight() -> None:
    ledger = make_ledger()
    feed = Feeder(ledger)
    feed.resp(response("math", "a"))
    feed.req(request("math", "a"))
    assert ledger.inflight_tokens("math") == 0
    feed.req(request("math", "a", attempt=2))  # a genuine new attempt
    assert ledger.inflight_tokens("math") == 100


def test_an_attempt_unanswered_past_the_ttl_is_lost_and_stays_counted() -> None:
    ledger = make_ledger(inflight_ttl_s=10)
    feed = Feeder(ledger)
    held = request("math", "a")
    feed.req(held, now=0.0)
    assert ledger.expire_inflight(5.0) == 0
    assert ledger.expire_inflight(11.0) == 1
    assert ledger.expire_inflight(12.0) == 0  # marked once
    # The provider may have billed it: its worst case stays held until proven otherwise.
    assert ledger.inflight_tokens(GLOBAL_SCOPE) == held.max_tokens
    assert [a.lost for a in ledger.lost_attempts("math")] == [True]


def test_replayed_response_adds_nothing() -> None:
    ledger = make_ledger()
    counted, _ = ledger.on_response(response(), "responses:0", 0, 0.0, replay=True)
    assert counted is None
    assert ledger.scopes[GLOBAL_SCOPE].completion_tokens == 0
    assert ledger.offsets == {"responses:0": 1}


def test_rate_and_projection() -> None:
    ledger = make_ledger(rate_window_s=10)
    feed = Feeder(ledger)
    feed.resp(response(sample_id="a", completion=100, cost=1.0), now=100.0)
    feed.resp(response(sample_id="b", completion=300, cost=3.0), now=104.0)
    usd_rate, token_rate = ledger.rate("math", 104.0)
    assert usd_rate == pytest.approx(1.0) and token_rate == pytest.approx(100.0)
    assert ledger.rate("math", 200.0) == (0.0, 0.0)  # outside the window
    usd, tokens = ledger.projection("math", remaining_prompts=8)
    assert usd == pytest.approx(4.0 + 8 * 2.0) and tokens == 400 + 8 * 200
    assert ledger.projection("math", None) == (None, None)


def test_checkpoint_restore_neither_forgets_nor_double_counts() -> None:
    events = [response("math" if i % 2 else "code", f"s{i}", completion=i + 1) for i in range(20)]
    expected = sum(e.usage.completion_tokens or 0 for e in events)
    first = make_ledger()
    for off, e in enumerate(events[:12]):
        first.on_response(e, "responses:0", off, 0.0)
    snaps = first.checkpoint(0.0)
    assert snaps[-1].scope == GLOBAL_SCOPE and snaps[-1].offsets == {"responses:0": 12}
    # Counted three more, then crashed before any checkpoint.
    for off in range(12, 15):
        first.on_response(events[off], "responses:0", off, 0.0)
    second = make_ledger()
    seek = second.restore(snaps, 0.0)
    assert seek == {"responses:0": 12}
    for off in range(seek["responses:0"], 20):
        second.on_response(events[off], "responses:0", off, 0.0)
    assert second.scopes[GLOBAL_SCOPE].completion_tokens == expected
    assert second.scopes["math"].completion_tokens + second.scopes["code"].completion_tokens == expected


def test_crash_in_the_middle_of_a_checkpoint() -> None:
    """A dataset snapshot written ahead of global is not counted twice on replay."""
    events = [response("math" if i % 2 else "code", f"s{i}", completion=1) for i in range(10)]
    ledger = make_ledger()
    for off in range(4):
        ledger.on_response(events[off], "responses:0", off, 0.0)
    old = {s.scope: s for s in ledger.checkpoint(0.0)}
    for off in range(4, 8):
        ledger.on_response(events[off], "responses:0", off, 0.0)
    new = {s.scope: s for s in ledger.checkpoint(0.0)}
    # Only "code" (sorted first) of the second checkpoint reached the log.
    survived = [new["code"], old["math"], old[GLOBAL_SCOPE]]
    restored = make_ledger()
    seek = restored.restore(survived, 0.0)
    assert seek == {"responses:0": 4}
    for off in range(4, 10):
        restored.on_response(events[off], "responses:0", off, 0.0)
    assert restored.scopes["code"].completion_tokens == 5
    assert restored.scopes["math"].completion_tokens == 5
    assert restored.scopes[GLOBAL_SCOPE].completion_tokens == 10


def test_inflight_survives_restore() -> None:
    ledger = make_ledger()
    ledger.on_request(request("math", "a", max_tokens=77), "requests:0", 0, 0.0)
    snaps = ledger.checkpoint(0.0)
    restored = make_ledger()
    restored.restore(snaps, 0.0)
    assert restored.inflight_tokens("math") == 77
    restored.on_response(response("math", "a"), "responses:0", 0, 0.0)
    assert restored.inflight_tokens("math") == 0


def test_raised_cap_resumes_a_budget_halt_but_never_a_persons() -> None:
    ledger = make_ledger({"math": Caps(completion_tokens=10)}, include_inflight=False)
    _, halts = ledger.on_response(response("math", completion=12), "responses:0", 0, 0.0)
    assert [h.scope for h in halts] == ["math"]
    snaps = ledger.checkpoint(0.0)
    assert {s.scope: s.cap_completion_tokens for s in snaps}["math"] == 10

    raised = make_ledger({"math": Caps(completion_tokens=100)}, include_inflight=False)
    raised.apply_control(halts[0])
    raised.restore(snaps, 1.0)
    resumes = raised.startup_resumes(1.0)
    assert [type(r) for r in resumes] == [Resume]
    assert resumes[0].scope == "math" and resumes[0].by == BUDGET_ACTOR

    same = make_ledger({"math": Caps(completion_tokens=10)}, include_inflight=False)
    same.apply_control(halts[0])
    same.restore(snaps, 1.0)
    assert same.startup_resumes(1.0) == []

    person = make_ledger({"math": Caps(completion_tokens=100)}, include_inflight=False)
    person.apply_control(Halt(scope="math", reason="look at the data", by="ann@host"))
    person.restore(snaps, 1.0)
    assert person.startup_resumes(1.0) == []
    assert person.evaluate(2.0) == []


def test_person_halt_is_not_replaced_by_budget() -> None:
    ledger = make_ledger({"math": Caps(completion_tokens=10)}, include_inflight=False)
    ledger.apply_control(Halt(scope="math", reason="manual", by="ann@host"))
    _, halts = ledger.on_response(response("math", completion=50), "responses:0", 0, 0.0)
    assert halts == []
    assert ledger.state("math") == "halted"


def test_a_prompt_dead_lettered_at_inference_is_no_longer_in_flight() -> None:
    ledger = make_ledger()
    feed = Feeder(ledger)
    feed.req(request("math", "a"))
    feed.req(request("math", "b"))
    assert ledger.inflight_tokens("math") == 200
    ledger.on_request_failed("math", "a", "dead-letter:0", 0)
    assert ledger.inflight_tokens("math") == 100
    assert ledger.inflight_tokens(GLOBAL_SCOPE) == 100
    assert ledger.offsets["dead-letter:0"] == 1


def _tally(ledger: Ledger, offsets: range) -> None:
    """Dead letters of two reasons and truncated answers, as the budget's shell feeds them."""
    for off in offsets:
        ledger.tally_dead_letter("dead-letter:0", off, "audit", "usage_matches" if off % 3 else "id_range")
        ledger.skip("dead-letter:0", off)
        ledger.tally_truncated("accepted:0", off, "math")
        ledger.skip("accepted:0", off)


def test_dead_letter_tally_checkpoints_with_its_offsets_and_counts_once() -> None:
    first = make_ledger()
    _tally(first, range(9))
    snaps = first.checkpoint(0.0)
    glob = snaps[-1]
    assert glob.dead_letters == {"audit": {"id_range": 3, "usage_matches": 6}}
    assert glob.accepted_truncated == {"math": 9}
    assert glob.offsets == {"dead-letter:0": 9, "accepted:0": 9}
    # A restart re-reads from the checkpoint; a record delivered again is not counted again.
    _tally(first, range(9, 12))
    second = make_ledger()
    seek = second.restore(snaps, 0.0)
    _tally(second, range(seek["dead-letter:0"] - 2, 12))
    again = second.checkpoint(0.0)[-1]
    assert again.dead_letters == {"audit": {"id_range": 4, "usage_matches": 8}}
    assert again.accepted_truncated == {"math": 12}


def test_a_ledger_restored_from_before_tallies_keeps_none() -> None:
    """A snapshot without tallies (an older budget): no partial tally that would undercount."""
    first = make_ledger()
    first.on_response(response("math", "s0", completion=5), "responses:0", 0, 0.0)
    old = [msgspec.structs.replace(s, dead_letters=None, accepted_truncated=None) for s in first.checkpoint(0.0)]
    second = make_ledger()
    second.restore(old, 0.0)
    _tally(second, range(3))
    snaps = second.checkpoint(0.0, everything=True)
    assert [s.scope for s in snaps] == ["provider:p", "math", GLOBAL_SCOPE]  # the provider's figures first
    assert all(s.dead_letters is None and s.accepted_truncated is None for s in snaps)
    assert snaps[-1].offsets["dead-letter:0"] == 3
