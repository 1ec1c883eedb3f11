"""Pre-flight checks of a provider, asked before any paid request: key, base URL, model, endpoint.

Each answers a :class:`~services.inference.core.ProviderCheck`: a server that cannot be reached
or answers 5xx is an outage; a refused key, a wrong base URL or a model not served is the
configuration's fault.
"""

from __future__ import annotations

from typing import Any

import httpx

from services.inference.adapters.http_provider import HttpProvider
from services.inference.adapters.request_bodies import COMPLETIONS_PATH
from services.inference.adapters.transport import transport_reason
from services.inference.core import ProviderCheck, ProviderFailure

MODELS_NOT_IMPLEMENTED = frozenset({404, 405, 501})
"""Statuses of ``GET /models`` from a server that has no model list: unknown, not down."""


def key_rate_limit(data: dict[str, Any]) -> str:
    """The rate limit OpenRouter's ``GET /key`` reports (``rate_limit: {requests, interval}``), as text."""
    limit = data.get("rate_limit")
    requests = limit.get("requests") if isinstance(limit, dict) else None  # topology: not a topic
    if not isinstance(limit, dict) or requests is None:
        return ""
    return f", rate limit {requests} request(s) per {limit.get('interval') or '?'}"


# Statuses that say "this server has no text-completions endpoint" (not "this request failed").
COMPLETIONS_REFUSED = frozenset({404, 405, 501})


class PreflightProvider(HttpProvider):
    """A provider client with its pre-flight checks: key, base URL, model and endpoint, at no cost."""

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._secret}"} if self._secret else {}

    async def _get_data(self, url: str, got: httpx.Response | ProviderCheck | None = None) -> Any:
        """GET ``url`` (unless ``got`` is its answer already) and return the ``data`` field of its
        JSON answer (None when absent or not JSON).

        A transport failure or a non-2xx answer comes back as the failed :class:`ProviderCheck`.
        """
        if got is None:
            got = await self._get(url)
        if isinstance(got, ProviderCheck):
            return got
        failed = self._status_check(url, got)
        if failed is not None:
            return failed
        try:
            return got.json().get("data")
        except (ValueError, AttributeError):
            return None

    async def _get(self, url: str) -> httpx.Response | ProviderCheck:
        """GET ``url``; a transport failure comes back as a failed (outage) check."""
        try:
            return await self._client.get(url, headers=self._auth_headers())
        except (httpx.TransportError, OSError) as exc:
            reason = transport_reason(exc)
            return ProviderCheck(
                ok=False,
                reason=reason,
                message=self._redact(f"cannot reach {url} ({reason}): {type(exc).__name__}: {exc}"),
                outage=True,
            )

    def _status_check(self, url: str, response: httpx.Response) -> ProviderCheck | None:
        """The failed check a non-2xx answer means, or None for a 2xx."""
        status = response.status_code
        if 200 <= status < 300:
            return None
        text = self._redact(response.text[:300])
        if status in (401, 403):
            return ProviderCheck(
                ok=False,
                reason="provider_key_rejected",
                message=f"the provider refused the API key: GET {url} answered HTTP {status}: {text}",
            )
        if status == 404:
            return ProviderCheck(
                ok=False,
                reason="provider_base_url_404",
                message=f"base URL answers 404: GET {url} answered HTTP 404 (check provider.base_url)",
                outage=True,
            )
        return ProviderCheck(
            ok=False,
            reason=f"provider_http_{status}",
            message=f"GET {url} answered HTTP {status}: {text}",
            outage=status >= 500 or status in (408, 429),
        )

    async def _models_check(self, url: str, *, require_model: bool) -> ProviderCheck:
        """``GET .../models`` answers, and (when asked) lists the configured model.

        A server that does not implement the list (404, 405, 501) is not down: when its
        completion endpoint is there, the check passes as ``unknown`` and the first real
        request decides. Whether it is there costs nothing to ask: a ``GET`` of the path
        the requests are POSTed to answers 405 (or any status but 404) on a server that
        serves it, and 404 under a wrong base URL, which is an outage.
        """
        got = await self._get(url)
        if not isinstance(got, ProviderCheck) and got.status_code in MODELS_NOT_IMPLEMENTED:
            endpoint = f"{self._base}{self.completion_path}"
            served = await self._get(endpoint)
            if isinstance(served, ProviderCheck):
                return served
            if served.status_code != 404:
                return ProviderCheck(
                    ok=True,
                    unknown=True,
                    reason=f"provider_models_http_{got.status_code}",
                    detail=(
                        f"GET {url} answered HTTP {got.status_code} (no model list), GET {endpoint} HTTP "
                        f"{served.status_code} (the endpoint is there): the first request decides"
                    ),
                )
            failed = self._status_check(endpoint, served)  # a 404: the base URL is wrong
            if failed is not None:
                return failed
        data = await self._get_data(url, got)
        if isinstance(data, ProviderCheck):
            return data
        listed = [str(m.get("id")) for m in data or [] if isinstance(m, dict)] if isinstance(data, list | None) else []
        model = self._provider.model
        if require_model and model not in listed:
            shown = ", ".join(listed[:10]) or "none"
            return ProviderCheck(
                ok=False,
                reason="provider_model_not_served",
                message=f"GET {url} does not list the model {model!r} (provider.model); it serves: {shown}",
            )
        return ProviderCheck(ok=True, detail=f"GET {url}: {len(listed)} model(s) listed")

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/models`` answers (the model listed is checked by OpenAI-compatible kinds)."""
        return await self._models_check(f"{self._base}/models", require_model=False)

    async def check_completions(self) -> ProviderCheck:
        """Completions mode: one 1-token ``POST <base_url>/completions``; 404/405/501 mean not served.

        Which upstreams serve text completions is not documented for every provider: only a
        request shows it (``OPENROUTER.md``). Any other failure says nothing about the
        endpoint (the outage checks deal with it) and passes.
        """
        url = f"{self._base}{COMPLETIONS_PATH}"
        body = {"model": self._provider.model, "prompt": "Hello", "max_tokens": 1}
        headers = {"Content-Type": "application/json", **self._auth_headers()}
        try:
            await self._post(COMPLETIONS_PATH, body, headers)
        except ProviderFailure as failure:
            if failure.http_status in COMPLETIONS_REFUSED:
                return ProviderCheck(
                    ok=False,
                    reason="completions_unsupported",
                    message=(
                        f"completions mode: the provider refuses POST {url} (HTTP {failure.http_status}: "
                        f"{failure.message[:200]}); set mode = \"chat\" for this dataset or use a provider "
                        "that serves text completions"
                    ),
                )
            return ProviderCheck(ok=True, detail=f"POST {url}: {failure} (not a refusal of the endpoint)")
        return ProviderCheck(ok=True, detail=f"POST {url} answers")
