"""Spend per configured provider, and each provider key reconciled on its own: pure.

Several inference workers, each with its own provider (``[providers.NAME]``), share one
budget. Caps stay per dataset and global; what differs per provider is what a person reads
(spend, rate, yield, in flight) and what a lost attempt may have cost: each provider bills
its own key, so a key's reading releases only that provider's lost attempts, at that
provider's price per completion token:

- the configured one (``[budget.prices]`` of the provider's model), else
- the answers' own: their ``usage.cost`` over their prompt and completion tokens. Counting
  prompt tokens at the completion price makes that price a lower bound whenever a prompt
  token costs no more than a completion token (as every listed model's does): the dollars
  not explained then stand for more tokens, never fewer, and the cap holds.

Records of older workers name no provider: they are the default provider's (the single
``[provider]``, or the only one configured).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from schemas import HeldAttempt, provider_scope
from services.budget.reconcile import KeyUsage, lost_hold, may_release
from services.budget.totals import ScopeTotals


@dataclass
class ProviderBook:
    """Per provider: its totals (a :class:`ScopeTotals` of scope ``provider:<name>``), key reading and price."""

    default: str = ""
    configured_usd_per_token: Mapping[str, float] = field(default_factory=dict)
    totals: dict[str, ScopeTotals] = field(default_factory=dict)
    keys: dict[str, KeyUsage] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # why a provider's key cannot be read

    def name(self, provider: str) -> str:
        """The provider a record names ("": the default one)."""
        return provider or self.default

    def of(self, provider: str) -> ScopeTotals:
        """The totals of a provider (made on first use)."""
        name = self.name(provider)
        totals = self.totals.get(name)
        if totals is None:
            totals = self.totals[name] = ScopeTotals(provider_scope(name))
        return totals

    def key(self, provider: str) -> KeyUsage:
        """The key reading of a provider (made on first use)."""
        return self.keys.setdefault(self.name(provider), KeyUsage())

    def usd_per_token(self, provider: str) -> float | None:
        """Dollars per completion token: configured, else the answers' ``usage.cost`` per token (None: unknown)."""
        name = self.name(provider)
        configured = self.configured_usd_per_token.get(name)
        if configured:
            return configured
        totals = self.totals.get(name)
        tokens = totals.prompt_tokens + totals.completion_tokens if totals is not None else 0
        if totals is None or totals.cost_usd <= 0 or tokens <= 0:
            return None
        return totals.cost_usd / tokens

    def reconcile(self, provider: str, usage_usd: float, now: float) -> None:
        """A reading of a provider's key: what its answers do not explain bounds its lost attempts."""
        self.unreadable.pop(self.name(provider), None)
        self.key(provider).read(usage_usd, self.of(provider).cost_usd, now)

    def lost_hold(self, lost: Iterable[HeldAttempt], ttl_s: float) -> int:
        """What lost attempts hold, each provider's released by its own key's last reading."""
        by_provider: dict[str, list[HeldAttempt]] = {}
        for held in lost:
            by_provider.setdefault(self.name(held.provider), []).append(held)
        total = 0
        for name, attempts in by_provider.items():
            key = self.keys.get(name, KeyUsage())
            total += lost_hold(attempts, key.settled_before(ttl_s), key.tokens(self.usd_per_token(name)))
        return total

    def may_release(self, lost: Iterable[HeldAttempt], now: float, ttl_s: float) -> bool:
        """Whether a later reading of some provider's key may release some of these lost attempts."""
        by_provider: dict[str, list[HeldAttempt]] = {}
        for held in lost:
            by_provider.setdefault(self.name(held.provider), []).append(held)
        for name, attempts in by_provider.items():
            key = self.keys.get(name)
            if key is None:
                continue
            can_read = (
                key.base_usd is not None
                and bool(self.usd_per_token(name))
                and key.read_at is not None
                and now - key.read_at <= ttl_s
            )
            if may_release(attempts, key.settled_before(ttl_s), can_read):
                return True
        return False

    def unreconciled(self, provider: str, lost: int) -> str:
        """Why a provider's lost attempts cannot be released by its key ("" when they can, or none are lost)."""
        name = self.name(provider)
        if not lost:
            return ""
        if name in self.unreadable:
            return self.unreadable[name]
        key = self.keys.get(name)
        if key is None or key.base_usd is None:
            return "its key's usage is not read (a self-hosted server reports none): the worst case stands"
        if not self.usd_per_token(name):
            return ("no price per token: no [budget.prices] entry for its model and no usage.cost in its "
                    "answers: the worst case stands")
        return ""
