"""Several providers under one budget (services.budget.providers, config, halts): pure parts.

The truth is arithmetic the test does itself: what was sent to which provider, what each
provider's key says it charged, and the price its answers' ``usage.cost`` states.
"""

from __future__ import annotations

import pytest

from schemas import Halt, Message, PromptPublished, RequestStarted, ResponseReceived, Usage, decode, encode
from services.budget.core import Ledger
from services.budget.totals import Caps
from services.common.config import ConfigError, Settings
from services.common.halts import HaltState

PRICE = 2e-6  # USD per completion token in the paid provider's usage.cost
MAX = 10_000


def _sent(ledger: Ledger, provider: str, i: int, started_at: float) -> None:
    event = RequestStarted(dataset="d", sample_id=f"{provider}{i}", max_tokens=MAX, worker=f"w-{provider}",
                           started_at=started_at, attempt_id=f"a-{provider}{i}", provider_name=provider)
    ledger.on_request(event, "requests:0", i + (0 if provider == "paid" else 100), started_at)


def _answered(ledger: Ledger, provider: str, kind: str, i: int, completion: int, cost: float | None, at: float) -> None:
    response = ResponseReceived(
        dataset="d", sample_id=f"{provider}-answered{i}", provider=kind, provider_name=provider, model="m",
        prompt=PromptPublished(dataset="d", sample_id=f"x{i}", messages=[Message(role="user", content="q")]),
        usage=Usage(prompt_tokens=0, completion_tokens=completion, cost=cost),
    )
    ledger.on_response(response, "responses:0", i + (0 if provider == "paid" else 100), at)


def test_each_key_releases_only_its_own_providers_lost_attempts_at_the_price_its_answers_state() -> None:
    ledger = Ledger(caps_for=lambda _: Caps(completion_tokens=100 * MAX), inflight_ttl_s=30.0)
    for i in range(2):  # answered: the paid provider's at $2 per million tokens, the local one's free
        _answered(ledger, "paid", "openrouter", i, 5_000, 5_000 * PRICE, 10.0)
        _answered(ledger, "local", "openai", i, 5_000, None, 10.0)
    ledger.reconcile(3.0, 10.0, "paid")  # the key's usage then: before this run, and the two answers
    for i in range(3):
        _sent(ledger, "paid", i, 20.0)
        _sent(ledger, "local", i, 20.0)
    ledger.mark_lost([("d", f"d:{p}{i}#a-{p}{i}") for p in ("paid", "local") for i in range(3)])
    assert ledger.lost_tokens("d") == 6 * MAX  # nothing read since: every worst case stands
    # The paid key says its lost attempts cost 12,000 tokens' worth; nothing speaks for the local ones.
    ledger.reconcile(3.0 + 12_000 * PRICE, 100.0, "paid")
    assert ledger.lost_tokens("d") == 12_000 + 3 * MAX
    assert ledger.book.usd_per_token("paid") == pytest.approx(PRICE)  # from usage.cost, no [budget.prices]
    assert ledger.book.usd_per_token("local") is None
    local = ledger.provider_snapshot("local", 100.0)
    paid = ledger.provider_snapshot("paid", 100.0)
    assert (paid.lost_tokens, local.lost_tokens) == (12_000, 3 * MAX)
    assert (paid.completion_tokens, local.completion_tokens, paid.cost_usd, local.cost_usd) == (
        10_000, 10_000, pytest.approx(10_000 * PRICE), 0.0)
    assert paid.unreconciled == "" and "not read" in local.unreconciled
    assert {held.worker for held in local.attempts.values()} == {"w-local"}


def test_provider_checkpoints_restore_their_totals_and_key_readings() -> None:
    first = Ledger(caps_for=lambda _: Caps(), inflight_ttl_s=30.0)
    _answered(first, "paid", "openrouter", 0, 4_000, 4_000 * PRICE, 1.0)
    first.reconcile(1.5, 2.0, "paid")
    snaps = first.checkpoint(2.0, everything=True)
    assert [s.scope for s in snaps] == ["provider:paid", "d", "global"]
    second = Ledger(caps_for=lambda _: Caps(), inflight_ttl_s=30.0)
    second.restore([decode(encode(s), type(s)) for s in snaps], 3.0)
    again = second.provider_snapshot("paid", 3.0)
    assert (again.completion_tokens, again.key_usage_base_usd) == (4_000, pytest.approx(1.5 - 4_000 * PRICE))
    _answered(second, "paid", "openrouter", 0, 4_000, 4_000 * PRICE, 4.0)  # read again: not counted twice
    assert second.provider_snapshot("paid", 4.0).completion_tokens == 4_000


def test_a_provider_halt_holds_its_workers_only() -> None:
    state = HaltState()
    state.apply(Halt(scope="provider:local"))
    assert state.is_halted("math", "provider:local") and not state.is_halted("math", "provider:openrouter")


def test_for_provider_picks_a_section_and_refuses_to_guess() -> None:
    settings = Settings(providers={"local": {"kind": "openai"}, "openrouter": {"kind": "openrouter"}})
    assert settings.for_provider("local").provider.label == "local"
    assert settings.for_provider("local").provider.kind == "openai"
    with pytest.raises(ConfigError, match="several providers are configured"):
        settings.for_provider(None)
    with pytest.raises(ConfigError, match="no provider 'nope'"):
        settings.for_provider("nope")
    single = Settings()
    assert single.for_provider(None) is single and single.all_providers() == {"simulator": single.provider}
