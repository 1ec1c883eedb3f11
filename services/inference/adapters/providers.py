"""Provider clients behind one small interface: OpenRouter, OpenAI-compatible, SGLang, simulator.

Each provider turns a :class:`~schemas.PromptPublished` into one HTTP request
(:mod:`~services.inference.adapters.request_bodies`) and the answer into a
:class:`~services.inference.core.ProviderResult` (:mod:`~services.inference.adapters.wire`).
:func:`make_provider` builds the one ``provider.kind`` names.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from typing import Any, Protocol, cast

from schemas import PromptPublished, wire_messages
from services.common.config import DatasetSettings, Settings
from services.inference.adapters.preflight import PreflightProvider, key_rate_limit
from services.inference.adapters.request_bodies import (
    COMPLETIONS_PATH,
    chat_request_body,
    completions_request_body,
)
from services.inference.adapters.transport import HttpPoster, MaySend
from services.inference.adapters.wire import (
    MAX_ERROR_TEXT,
    parse_completions,
    parse_openai,
    parse_openrouter,
    parse_sglang,
)
from services.inference.core import ProviderCheck, ProviderFailure, ProviderResult
from services.inference.pacer import key_rate
from services.inference.tool_route import prompt_route, renders_tools

SIMULATOR_FAULT_HEADER = "X-Simulator-Fault"
# PromptPublished.metadata keys honoured only by the simulator provider (fault injection in tests).
SIMULATOR_FAULT_METADATA = "simulator_fault"
SIMULATOR_HEADERS_METADATA = "simulator_headers"


class Provider(Protocol):
    """One provider: sends a prompt, returns a :class:`ProviderResult` or raises ProviderFailure."""

    name: str

    async def complete(
        self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int, may_send: MaySend | None = None
    ) -> ProviderResult:
        """Send one request for ``prompt``; raises ProviderFailure on any failure.

        ``may_send`` is asked at the last moment before the request's first byte is written
        (a connection in hand); when it says no, nothing is sent and :class:`NotSent` is raised.
        """
        ...

    def tools_sent(self, prompt: PromptPublished, dataset: DatasetSettings) -> bool:
        """Whether the template renders the row's tools for the model (by whichever route: tool_route.py)."""
        ...

    def request_identity(self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int) -> dict[str, Any]:
        """What decides the answer to ``prompt``'s request (hashed into the response store key)."""
        ...

    async def check(self) -> ProviderCheck:
        """Whether the provider is reachable, the key valid and the model served (no cost)."""
        ...

    async def check_completions(self) -> ProviderCheck:
        """Completions mode: whether the provider serves ``POST .../completions`` (one 1-token request)."""
        ...


def _unrenderable(where: str, dataset: DatasetSettings, exc: Exception) -> ProviderFailure:
    """A prompt the dataset's template cannot render: a final ``chat_template_error`` (a dead letter)."""
    return ProviderFailure(
        reason="chat_template_error",
        message=f"{where}: profile {dataset.profile!r} cannot render the prompt: "
        f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT],
        retryable=False,
    )


class OpenRouterProvider(PreflightProvider):
    """OpenRouter's chat completions (reasoning, routing options passed through)."""

    name = "openrouter"
    native_ids = False
    # OpenRouter takes thinking switches through its own `reasoning` parameter (extra_body).
    sends_template_kwargs = False
    # vLLM-style servers take `add_special_tokens` on text completions (OpenRouter does not).
    vllm_style = False
    _load_profile: ProfileLoader | None = None

    def completion_prompt(self, prompt: PromptPublished, dataset: DatasetSettings) -> str:
        """Completions mode: the prompt rendered by the dataset profile's template, tools included.

        A template that cannot render this prompt is the prompt's fault: a final
        ``chat_template_error`` (a dead letter), never a crash.
        """
        tools = prompt.tools if renders_tools(prompt) else None
        try:
            profile = self._profile(dataset)
            return profile.render_prompt(prompt.messages, tools, reasoning=prompt.conversation is not None)
        except Exception as exc:  # noqa: BLE001 - jinja2 and profile errors alike: this prompt cannot be sent
            raise _unrenderable("completions mode", dataset, exc) from None

    def _profile(self, dataset: DatasetSettings) -> PromptEncoder:
        if self._load_profile is None:
            self._load_profile = default_profile_loader(self._settings)
        return self._load_profile(dataset.profile)

    def tools_in_text(self, prompt: PromptPublished, dataset: DatasetSettings) -> list[dict[str, Any]] | None:
        """Chat mode, ``tool_route = "prompt"``: the messages with the row's tools in the system text, as sent.

        They render (without tools) to the text the template renders with the tools as the
        server hands them over (its convention's null fields), which is what reconstruction
        renders. None: the route is another (the ``tools`` parameter where the template cannot
        write its tool block in system text, or the row's own text carries them).
        """
        if prompt_route(self._settings, dataset, prompt) != "prompt_text" or not prompt.tools:
            return None
        from services.profiles.conventions import convention_for
        from services.profiles.tooltext import server_tools, tools_in_system_text

        reasoning = prompt.conversation is not None
        nulls = convention_for(self.name, self._settings.provider.convention).tool_null_fields
        try:
            profile = self._profile(dataset)
            written = tools_in_system_text(
                lambda m, t: profile.render_prompt(m, t, reasoning=reasoning),
                prompt.messages,
                server_tools(prompt.tools, nulls),
            )
        except Exception as exc:  # noqa: BLE001 - jinja2 and profile errors alike: this prompt cannot be sent
            raise _unrenderable("tools in the prompt text", dataset, exc) from None
        return None if written is None else wire_messages(written, reasoning=reasoning)

    def _completions(self, dataset: DatasetSettings) -> bool:
        return self._settings.mode_of(dataset) == "completions"

    def template_kwargs(self, dataset: DatasetSettings) -> dict[str, Any] | None:
        """The dataset profile's ``chat_template_kwargs`` (thinking on/off), for servers that take them."""
        if not self.sends_template_kwargs:
            return None
        from services.profiles import ProfileError, profile_spec

        try:
            return profile_spec(dataset.profile, self._settings).render_kwargs() or None
        except ProfileError:
            return None  # an unknown profile is refused by pre-flight and reconstruct, not here

    def _body(self, prompt: PromptPublished, dataset: DatasetSettings, max_tokens: int) -> dict[str, Any]:
        if self._completions(dataset):
            return completions_request_body(
                self.completion_prompt(prompt, dataset),
                model=self._provider.model,
                max_tokens=max_tokens,
                extra_body=self._provider.extra_body,
                vllm_style=self.vllm_style,
                native_ids=self.native_ids,
            )
        return chat_request_body(
            prompt,
            dataset,
            model=self._provider.model,
            max_tokens=max_tokens,
            extra_body=self._provider.extra_body,
            logprobs=self._provider.request_logprobs,
            native_ids=self.native_ids,
            template_kwargs=self.template_kwargs(dataset),
            messages=self.tools_in_text(prompt, dataset),
        )

    def request_identity(self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int) -> dict[str, Any]:
        """The request body exactly as sent (messages or the rendered prompt, tools, model, sampling, max_tokens).

        In completions mode the identity also names the mode: a chat and a completions request
        for the same prompt are different requests (their bodies differ too: ``prompt`` text).
        """
        mode = {"mode": "completions"} if self._completions(dataset) else {}
        try:
            return {"provider": self.name, **mode, "body": self._body(prompt, dataset, max_tokens)}
        except ProviderFailure as failure:  # complete() raises it again: a dead letter, nothing paid
            return {"provider": self.name, **mode, "unrenderable": failure.message}

    async def complete(
        self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int, may_send: MaySend | None = None
    ) -> ProviderResult:
        """Send one chat- or text-completions request for ``prompt`` (unless ``may_send`` says no: :class:`NotSent`)."""
        body = self._body(prompt, dataset, max_tokens)
        completions = self._completions(dataset)
        path = COMPLETIONS_PATH if completions else self.completion_path
        data = await self._post(path, body, self._headers(prompt), may_send)
        if not completions:
            return self._parse(data)
        try:
            return parse_completions(data, native_ids=self.native_ids, sent_prompt=body["prompt"])
        except ProviderFailure as failure:
            failure.message = self._redact(failure.message)
            raise

    async def check(self) -> ProviderCheck:
        """A key is set and valid (``GET /key``: its credit limit and usage are logged)."""
        if not self._secret:
            return ProviderCheck(
                ok=False,
                reason="provider_key_missing",
                message=(
                    "OpenRouter needs an API key and none is set: export OPENROUTER_API_KEY "
                    "(or DRAFTSTREAM_PROVIDER__API_KEY) before starting inference"
                ),
            )
        url = f"{self._base}/key"
        data = await self._get_data(url)
        if isinstance(data, ProviderCheck):
            return data
        if not isinstance(data, dict):
            data = {}
        limit, usage, remaining = data.get("limit"), data.get("usage"), data.get("limit_remaining")
        detail = (
            f"OpenRouter key {data.get('label') or '?'}: credit limit "
            f"{'none' if limit is None else f'${limit}'}, usage ${usage if usage is not None else '?'}"
            + (f", remaining ${remaining}" if remaining is not None else "")
            + key_rate_limit(data)
        )
        if remaining is not None and isinstance(remaining, int | float) and remaining <= 0:
            return ProviderCheck(
                ok=False, reason="provider_credit_exhausted", message=f"{detail}: no credit left on this key"
            )
        return ProviderCheck(ok=True, detail=detail, rate_limit_rps=key_rate(data))

    parse_body: Callable[[Any], ProviderResult] = staticmethod(parse_openrouter)

    def _parse(self, data: Any) -> ProviderResult:
        try:
            return self.parse_body(data)
        except ProviderFailure as failure:
            failure.message = self._redact(failure.message)
            raise


class OpenAIProvider(OpenRouterProvider):
    """Any OpenAI-compatible server; asks for output token ids (vLLM ``return_token_ids``)."""

    name = "openai"
    native_ids = True
    sends_template_kwargs = True
    vllm_style = True
    parse_body = staticmethod(parse_openai)

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/models`` answers and lists ``provider.model``."""
        return await self._models_check(f"{self._base}/models", require_model=True)


class SimulatorProvider(OpenRouterProvider):
    """The local simulator: OpenRouter's shape, plus test-only fault headers from metadata."""

    name = "simulator"
    sends_template_kwargs = True
    vllm_style = True

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/models`` answers (the simulator serves any model name)."""
        return await PreflightProvider.check(self)

    def _headers(self, prompt: PromptPublished) -> dict[str, str]:
        headers = super()._headers(prompt)
        fault = prompt.metadata.get(SIMULATOR_FAULT_METADATA)
        if isinstance(fault, str) and fault:
            headers[SIMULATOR_FAULT_HEADER] = fault
        extra = prompt.metadata.get(SIMULATOR_HEADERS_METADATA)
        if isinstance(extra, dict):
            for name, value in extra.items():
                if isinstance(name, str) and name.lower().startswith("x-simulator-"):
                    headers[name] = str(value)
        return headers


class PromptEncoder(Protocol):
    """What the SGLang provider needs from a model profile."""

    def render_prompt(self, messages: Any, tools: Any, *, reasoning: bool = False) -> str:
        """The chat-template text of a prompt, ending where the assistant turn starts."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, as the server tokenizes it."""
        ...


ProfileLoader = Callable[[str], PromptEncoder]


def default_profile_loader(settings: Settings) -> ProfileLoader:
    """Load profiles through services.profiles (its cache keeps each one, or its load error)."""
    # Imported by name: services.profiles is optional until a sglang provider needs it.
    profiles = importlib.import_module("services.profiles")
    return lambda name: cast(PromptEncoder, profiles.load_profile(name, settings))


class SGLangProvider(PreflightProvider):
    """SGLang's native ``/generate`` with ``input_ids`` from the profile's chat template."""

    name = "sglang"
    completion_path = "/generate"

    def __init__(
        self, settings: Settings, client: HttpPoster, profile_loader: ProfileLoader | None = None
    ) -> None:
        super().__init__(settings, client)
        self._load_profile = profile_loader or default_profile_loader(settings)

    def tools_sent(self, prompt: PromptPublished, dataset: DatasetSettings) -> bool:
        """Whether the chat template renders the row's tools into ``input_ids`` (unless its own text carries them)."""
        return renders_tools(prompt)

    async def input_ids(self, prompt: PromptPublished, dataset: DatasetSettings) -> list[int]:
        """The prompt's token ids under the dataset's profile (rendered off the event loop)."""
        profile = await asyncio.to_thread(self._load_profile, dataset.profile)

        def render() -> list[int]:
            tools = prompt.tools if self.tools_sent(prompt, dataset) else None
            text = profile.render_prompt(prompt.messages, tools, reasoning=prompt.conversation is not None)
            return profile.encode_prompt(text)

        return await asyncio.to_thread(render)

    def _sampling(self, max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
        extra = dict(self._provider.extra_body)
        sampling: dict[str, Any] = {"max_new_tokens": max_tokens, "skip_special_tokens": False}
        sampling.update(extra.pop("sampling_params", {}) or {})
        return sampling, extra

    def request_identity(self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int) -> dict[str, Any]:
        """What the ``input_ids`` are rendered from (messages, tools, profile) plus the sampling."""
        sampling, extra = self._sampling(max_tokens)
        return {
            "provider": self.name,
            "model": self._provider.model,
            "messages": prompt.wire,
            "tools": prompt.tools if self.tools_sent(prompt, dataset) else None,
            "profile": dataset.profile,
            "sampling_params": sampling,
            "extra_body": extra,
        }

    async def check(self) -> ProviderCheck:
        """``GET <base_url>/v1/models`` answers (SGLang names the model by its path)."""
        return await self._models_check(f"{self._base}/v1/models", require_model=False)

    async def check_completions(self) -> ProviderCheck:
        """SGLang's native ``/generate`` is raw text from ``input_ids`` already: nothing to check."""
        return ProviderCheck(ok=True, detail="sglang /generate takes rendered input_ids: raw text by construction")

    async def complete(
        self, prompt: PromptPublished, dataset: DatasetSettings, *, max_tokens: int, may_send: MaySend | None = None
    ) -> ProviderResult:
        """Send one ``/generate`` request for ``prompt`` (unless ``may_send`` says no: :class:`NotSent`)."""
        ids = await self.input_ids(prompt, dataset)
        sampling, extra = self._sampling(max_tokens)
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling, "stream": False}
        body.update(extra)
        data = await self._post(self.completion_path, body, self._headers(prompt), may_send)
        try:
            return parse_sglang(data)
        except ProviderFailure as failure:
            failure.message = self._redact(failure.message)
            raise


def make_provider(
    settings: Settings, client: HttpPoster, *, profile_loader: ProfileLoader | None = None
) -> Provider:
    """The provider named by ``settings.provider.kind``."""
    kind = settings.provider.kind
    if kind == "openrouter":
        return OpenRouterProvider(settings, client)
    if kind == "openai":
        return OpenAIProvider(settings, client)
    if kind == "sglang":
        return SGLangProvider(settings, client, profile_loader)
    return SimulatorProvider(settings, client)
