"""The provider key's usage, read where the provider reports it (OpenRouter's ``GET /api/v1/key``).

``{"data": {"usage": <USD charged to the key>, "limit": ..., "limit_remaining": ...}}``: the
budget compares it with what the answers it read account for (services.budget.reconcile).
OpenRouter and the simulator answer it; self-hosted servers (``openai``, ``sglang``) report
nothing, and there the lost attempts' worst case stands.
"""

from __future__ import annotations

import logging

import httpx

from services.common.config import ProviderSettings

log = logging.getLogger(__name__)

REPORTING_KINDS = frozenset({"openrouter", "simulator"})
"""Provider kinds whose ``GET <base_url>/key`` reports the key's usage."""


class KeyUsageReader:
    """Reads ``data.usage`` (USD) of the configured key; None when it cannot be read."""

    def __init__(self, provider: ProviderSettings, client: httpx.AsyncClient) -> None:
        self._url = provider.base_url.rstrip("/") + "/key"
        secret = provider.api_key.get_secret_value() if provider.api_key is not None else ""
        # The simulator wants a bearer key of any value; OpenRouter the real one (never logged).
        self._headers = {"Authorization": f"Bearer {secret or 'simulator'}"}
        self._client = client

    async def read(self) -> float | None:
        """The dollars charged to the key so far, or None (logged) when the provider does not say."""
        try:
            response = await self._client.get(self._url, headers=self._headers)
            response.raise_for_status()
            usage = response.json().get("data", {}).get("usage")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning("budget: could not read the provider key's usage at %s: %s", self._url, type(exc).__name__)
            return None
        if isinstance(usage, bool) or not isinstance(usage, int | float):
            log.warning("budget: the provider key's usage at %s is not a number", self._url)
            return None
        return float(usage)
