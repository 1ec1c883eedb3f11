"""What every provider client shares: auth, the sample-key header, POSTing JSON, classifying the answer.

Every failure is raised as a classified :class:`~services.inference.core.ProviderFailure`;
retrying is the worker's business, not the client's.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec

from schemas import PromptPublished, sample_key
from services.common.config import DatasetSettings, Settings
from services.inference.adapters.transport import (
    HttpPoster,
    MaySend,
    asking,
    exception_chain,
    transport_reason,
    unbind_stream,
)
from services.inference.adapters.wire import MAX_ERROR_TEXT, decode_json_body, error_text, error_upstream
from services.inference.core import NotSent, ProviderFailure, classify_status
from services.inference.pacer import stated_count, stated_rate
from services.inference.tool_route import renders_tools

KEY_HEADER = "X-Draftstream-Key"


class HttpProvider:
    """Shared HTTP plumbing: auth, the key header, status and transport classification."""

    name = "openrouter"
    completion_path = "/chat/completions"  # where requests are POSTed, under base_url

    def __init__(self, settings: Settings, client: HttpPoster) -> None:
        self._settings = settings
        self._provider = settings.provider
        self._client = client
        self._base = self._provider.base_url.rstrip("/")
        self._urls: dict[str, httpx.URL] = {}  # parsed once: httpx parses a str URL per request
        self._secret = self._provider.api_key.get_secret_value() if self._provider.api_key else None

    def tools_sent(self, prompt: PromptPublished, dataset: DatasetSettings) -> bool:
        """Whether the template renders the row's tools for the model (whatever the route: tool_route.py)."""
        return renders_tools(prompt)

    def _headers(self, prompt: PromptPublished) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            KEY_HEADER: sample_key(prompt.dataset, prompt.sample_id),
        }
        if self._secret:
            headers["Authorization"] = f"Bearer {self._secret}"
        return headers

    def _redact(self, text: str) -> str:
        if self._secret and len(self._secret) >= 4:
            return text.replace(self._secret, "**********")
        return text

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str], may_send: MaySend | None = None
    ) -> Any:
        """POST JSON; returns the decoded body or raises a classified ProviderFailure.

        ``may_send`` is asked now and, on the client of :func:`make_http_client`, again once a
        connection is in hand, just before the first byte is written; a no raises :class:`NotSent`.
        """
        with asking(may_send):
            try:
                url = self._urls.get(path) or self._urls.setdefault(path, httpx.URL(f"{self._base}{path}"))
                response = await self._client.post(url, content=msgspec.json.encode(body), headers=headers)
            except (httpx.TransportError, OSError) as exc:
                withheld = next((e for e in exception_chain(exc) if isinstance(e, NotSent)), None)
                if withheld is not None:
                    # A new one: re-raised here, the hook's own would take ``exc`` as its context,
                    # and ``exc`` was raised from it: a cycle only the collector frees.
                    raise NotSent(str(withheld)) from None
                raise ProviderFailure(
                    reason=transport_reason(exc),
                    message=self._redact(f"{type(exc).__name__}: {exc}"),
                    retryable=True,
                ) from None
        try:
            return self._decoded(response)
        finally:
            unbind_stream(response)

    def _decoded(self, response: httpx.Response) -> Any:
        """The body of a 2xx answer, decoded; a classified ProviderFailure for any other."""
        if not 200 <= response.status_code < 300:
            text, upstream = response.text[:MAX_ERROR_TEXT], None
            try:
                parsed = json.loads(text)
                if isinstance(parsed, dict) and parsed.get("error"):
                    text, upstream = error_text(parsed["error"]), error_upstream(parsed["error"])
            except ValueError:
                pass
            failure = classify_status(response.status_code, self._redact(text), response.headers.get("retry-after"))
            failure.upstream = upstream
            if response.status_code == 429:
                failure.stated_rps = stated_rate(response.headers)
                failure.stated_count = stated_count(response.headers)
            raise failure
        return decode_json_body(response.content)
