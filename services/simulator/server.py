"""The simulator's HTTP shell: the request handlers of an aiohttp server speaking OpenRouter's dialect.

Endpoints: ``POST /api/v1/chat/completions`` and ``POST /v1/chat/completions``,
``GET /health``, ``GET /_sim/stats`` (``?after=<unix time>`` adds ``requests_after``),
``GET /_sim/truth`` (with ``keep_truth``: the true output ids of the last answer served
in full per sample key, the ``X-Draftstream-Key`` header the inference stage sends;
``?key=<dataset>:<sample_id>`` for one). The truth never travels in a response body, so
nothing downstream of the provider can read it: tests fetch it here and compare.
With a rate limit (``rate_limit_rps``, ``rate_limit_burst``, ``max_open``:
:mod:`services.simulator.limits`) a request beyond it is refused at once with HTTP 429, a
``Retry-After`` and OpenRouter's error body.
Generation is cached per prompt and latency is an ``asyncio.sleep``, so one core serves
thousands of concurrent requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
import uuid
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from services.common.metrics import SIMULATOR_CONTENT_FAULTS, SIMULATOR_REQUESTS
from services.profiles import ProfileLike
from services.simulator.core import (
    Generation,
    answer_cost,
    build_completion_body,
    build_response_body,
    error_body,
    generate,
)
from services.simulator.faults import (
    CONTENT_FAULTS,
    TRANSIENT_FAULTS,
    choose_content_faults,
    choose_transient_fault,
    parse_fault_header,
    prompt_digest,
)
from services.simulator.limits import RequestLimiter, retry_after_text
from services.simulator.options import SimulatorOptions
from services.simulator.prompts import compile_chat_template, profile_prompt_text, render_chat_template
from services.simulator.request import ChatRequest, RequestError, parse_completion_request, parse_request
from services.simulator.serving import provider_app
from services.simulator.stats import Stats

KEY_HEADER = "X-Draftstream-Key"
FAULT_HEADER = "X-Simulator-Fault"
_CACHE_MAX = 50_000
HOLD_TIMEOUT_S = 60.0
"""The longest an answer waits for ``hold_until_open`` requests to be open at once."""


def _strftime_now(fmt: str) -> str:
    """Today's local date for templates that print it (as transformers gives them)."""
    return datetime.now().strftime(fmt)  # noqa: DTZ005 - templates format the local date


class SimulatorServer:
    """The aiohttp application and the state behind it (cache, RNG, stats)."""

    def __init__(self, options: SimulatorOptions, profile: ProfileLike) -> None:
        self.options = options
        self.profile = profile
        self.params = options.params()
        self.rates = options.fault_rates()
        self.rng = random.Random(options.seed)  # noqa: S311 - fault injection, not crypto
        self.stats = Stats()
        self.limiter = options.limiter()
        self.stats.over_cap.cap = options.max_open
        self._held = asyncio.Event()  # set once hold_until_open requests have been open at once
        self._cache: dict[tuple[Any, ...], Generation] = {}
        # Sample key -> true output ids of the last answer served in full (oldest evicted first).
        self.truth: OrderedDict[str, list[int]] | None = OrderedDict() if options.keep_truth else None
        self._prompt_texts: dict[tuple[bytes, str], str] = {}
        # The template file is read and compiled once (jinja2 compiles in milliseconds).
        self.template: Any = None
        if options.chat_template_file:
            source = Path(options.chat_template_file).expanduser().read_text(encoding="utf-8")
            self.template = compile_chat_template(source, strftime_now=_strftime_now)
        spec = getattr(profile, "spec", None)  # a loaded Profile knows its BOS; a bare ProfileLike may not
        self._bos_token: str = getattr(spec, "bos_token", "") or ""

    def set_rate_limit(self, rps: float | None, burst: float | None = None, max_open: int | None = None) -> None:
        """Replace the rate limit while serving (tests lift or tighten it; None: unlimited)."""
        options = dataclasses.replace(self.options, rate_limit_rps=rps, rate_limit_burst=burst, max_open=max_open)
        limiter = options.limiter()
        limiter.open = self.limiter.open  # requests admitted under the old limit are still open
        self.options, self.limiter = options, limiter
        self.stats.over_cap.cap = max_open

    def web_app(self) -> web.Application:
        """The aiohttp application with every route."""
        return provider_app(
            self.profile.name,
            chat=self.chat,
            health=self.health,
            stats=self.stats_view,
            limiter=lambda: self.limiter,
            usage=lambda: self.stats.billing.cost_usd,
            truth=self.truth_view,
        )

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: always ok once serving."""
        return web.json_response({"status": "ok", "profile": self.profile.name})

    async def stats_view(self, request: web.Request) -> web.Response:
        """Counters so out-of-process tests can assert on what reached the provider.

        ``?brief=1`` leaves out the per-key tables: at tens of thousands of keys encoding them
        takes the simulator's loop tens of milliseconds, which a benchmark polling every
        100 ms would see as provider latency and as late arrival stamps. ``now`` is the clock
        read where a chat request is stamped (the handler's start): a caller that knows when it
        sent this request learns how late the simulator stamps what arrives at that moment.
        """
        now = time.time()
        snap = self.stats.snapshot(brief=request.query.get("brief") == "1")
        snap["now"] = now
        after = request.query.get("after")
        if after is not None:
            try:
                snap["requests_after"] = self.stats.requests_after(float(after))
            except ValueError:
                return web.json_response(error_body(400, "'after' must be a unix time"), status=400)
        return web.json_response(snap)

    async def truth_view(self, request: web.Request) -> web.Response:
        """The true output ids, all (``{"truth": {key: ids}}``) or one key's (``?key=``)."""
        if self.truth is None:
            return _json(404, error_body(404, "this simulator keeps no truth: start it with keep_truth (--keep-truth)"))
        key = request.query.get("key")
        if key is None:
            return _json(200, {"truth": dict(self.truth)})
        ids = self.truth.get(key)
        if ids is None:
            return _json(404, error_body(404, f"no answer served in full for key {key!r} (sent as {KEY_HEADER})"))
        return _json(200, {"key": key, "true_ids": ids})

    def _keep_truth(self, key: str | None, generation: Generation) -> None:
        if self.truth is None or key is None:
            return
        self.truth[key] = generation.true_ids
        self.truth.move_to_end(key)
        if len(self.truth) > _CACHE_MAX:
            self.truth.popitem(last=False)

    def _prompt_text(self, request: ChatRequest, digest: bytes, kwargs_key: str) -> str:
        """The rendered prompt: the configured template file's, else the profile's own.

        A template file gets the request's ``chat_template_kwargs``, as vLLM passes them; the
        profile's own template is rendered with the profile's kwargs (the ones the inference
        stage sends), whatever the request says.
        """
        key = (digest, kwargs_key)
        if key not in self._prompt_texts:
            if len(self._prompt_texts) >= _CACHE_MAX:
                self._prompt_texts.clear()
            if self.template is not None:
                text = render_chat_template(
                    self.template, request, bos_token=self._bos_token, eos_token=self.profile.end_of_turn
                )
            else:
                text = profile_prompt_text(self.profile, request)
            self._prompt_texts[key] = text
        return self._prompt_texts[key]

    def _generation(self, request: ChatRequest, forced: list[str], prompt_text: str | None = None) -> Generation:
        digest = prompt_digest(request)
        faults = sorted(set(choose_content_faults(digest, self.options.seed, self.rates)) | set(forced))
        kwargs_key = json.dumps(request.chat_template_kwargs or {}, sort_keys=True, default=str)
        cache_key = (
            digest,
            kwargs_key,
            request.max_tokens,
            bool(request.tools),
            request.tool_choice == "none",
            *faults,
        )
        cached = self._cache.get(cache_key)
        if cached is None:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            cached = generate(
                self.profile,
                request,
                self.params,
                content_faults=faults,
                prompt_text=prompt_text if prompt_text is not None else self._prompt_text(request, digest, kwargs_key),
            )
            self._cache[cache_key] = cached
        return cached

    def _reply(self, status: int, body: dict[str, Any], key: str | None, **headers: str) -> web.Response:
        self.stats.statuses[str(status)] += 1
        return web.Response(
            status=status, body=msgspec.json.encode(body), content_type="application/json", headers=headers
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST .../chat/completions``: faults first, then the deterministic answer."""
        stats = self.stats
        key = request.headers.get(KEY_HEADER)
        stats.open += 1
        if key is not None:
            stats.open_keys[key] += 1
        stats.peak_open = max(stats.peak_open, stats.open)
        if self.options.hold_until_open is not None and stats.open >= self.options.hold_until_open:
            self._held.set()
        stats.over_cap.change(time.monotonic(), +1)
        try:
            return await self._chat(request, key)
        finally:
            stats.open -= 1
            if key is not None:
                stats.open_keys[key] -= 1
                if not stats.open_keys[key]:
                    del stats.open_keys[key]
            stats.over_cap.change(time.monotonic(), -1)

    async def _chat(self, request: web.Request, key: str | None) -> web.StreamResponse:
        at = time.time()
        self.stats.record(key, at, request.headers.get("Authorization"))
        limiter = self.limiter
        if limiter.active:
            refused = self._rate_limited(limiter, key)
            if refused is not None:
                return refused
            try:
                return await self._admitted(request, at, key)
            finally:
                limiter.done()
        return await self._admitted(request, at, key)

    def _rate_limited(self, limiter: RequestLimiter, key: str | None) -> web.Response | None:
        """The 429 a request beyond the limit gets (OpenRouter's body and headers), or None: admitted."""
        refusal = limiter.admit(time.monotonic())
        if refusal is None:
            return None
        self.stats.rate_limited += 1
        SIMULATOR_REQUESTS.labels("rate_limited").inc()
        retry_after = {"Retry-After": retry_after_text(refusal.retry_after_s)}
        if not limiter.headers:
            # A silent front (an upstream behind OpenRouter, a gateway): the error body and Retry-After only.
            body = error_body(429, "Provider returned error")
            raw = f"Rate limit exceeded, please retry shortly (simulated: {refusal.reason})"
            body["error"]["metadata"] = {"raw": raw}
            return self._reply(429, body, key, **retry_after)
        reset_ms = int((time.time() + refusal.retry_after_s) * 1000)
        headers = {"X-RateLimit-Limit": refusal.limit, "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset_ms)}
        body = error_body(429, f"Rate limit exceeded: {refusal.reason} (simulated)")
        body["error"]["metadata"] = {"headers": headers}
        return self._reply(429, body, key, **retry_after, **headers)

    async def _admitted(self, request: web.Request, at: float, key: str | None) -> web.StreamResponse:
        completions = not request.path.endswith("/chat/completions")  # POST .../completions: a rendered prompt
        prompt_text: str | None = None
        try:
            forced = parse_fault_header(request.headers.get(FAULT_HEADER))
            if completions:
                chat, prompt_text = parse_completion_request(await request.read())
            else:
                chat = parse_request(await request.read())
        except RequestError as exc:
            SIMULATOR_REQUESTS.labels("bad_request").inc()
            return self._reply(exc.status, error_body(exc.status, exc.message), key)

        forced_transient = [f for f in forced if f in TRANSIENT_FAULTS]
        drawn = choose_transient_fault(self.rng, self.rates)
        transient = forced_transient[0] if forced_transient else drawn
        if transient is not None:
            self.stats.fault(key, transient)
        SIMULATOR_REQUESTS.labels(transient or "ok").inc()
        self.stats.recent.append({"at": at, "key": key, "fault": transient})

        if transient == "429":
            retry_text = retry_after_text(self.options.retry_after_s)
            return self._reply(
                429, error_body(429, "Rate limit exceeded (simulated)"), key, **{"Retry-After": retry_text}
            )

        delay = self.options.latency_s
        if self.options.latency_jitter_s > 0:
            delay += self.rng.uniform(0.0, self.options.latency_jitter_s)
        if transient == "timeout":
            delay += self.options.timeout_sleep_s
        if delay > 0 or self.options.hold_until_open is not None:
            began = time.monotonic()
            try:
                await asyncio.sleep(delay)
                if not self._held.is_set() and self.options.hold_until_open is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._held.wait(), HOLD_TIMEOUT_S)
            except asyncio.CancelledError:
                if transient is None:  # the client went away: the provider generates, and bills, to the end
                    faults = [f for f in forced if f in CONTENT_FAULTS]
                    self.stats.billing.bill_when_done(
                        delay - (time.monotonic() - began), lambda: self._charge(chat, faults, prompt_text)
                    )
                raise

        if transient == "5xx":
            status = self.rng.choice((500, 502, 503))
            return self._reply(status, error_body(status, "Upstream error (simulated)"), key)
        if transient == "error_in_200":
            return self._reply(200, error_body(502, "Provider returned error (simulated)"), key)

        try:
            generation = self._generation(chat, [f for f in forced if f in CONTENT_FAULTS], prompt_text)
        except RequestError as exc:
            return self._reply(exc.status, error_body(exc.status, exc.message), key)
        for name in generation.faults:
            self.stats.fault(key, name)
            SIMULATOR_CONTENT_FAULTS.labels(name).inc()
        for name in generation.fallbacks:
            self.stats.fault(key, f"{name}_fallback")

        provider, response_id = self.options.provider_name, f"gen-sim-{uuid.uuid4().hex[:20]}"
        if completions:
            reply = build_completion_body(
                self.profile, generation, chat, self.params, provider=provider, response_id=response_id, created=int(at)
            )
        else:
            reply = build_response_body(
                self.profile,
                generation,
                chat,
                self.params,
                provider=provider,
                response_id=response_id,
                created=int(at),
                logprobs=chat.logprobs or self.options.logprobs,
            )
        body = msgspec.json.encode(reply)
        if transient == "malformed":
            self.stats.statuses["200"] += 1
            broken = body[: max(1, len(body) // 2)] + b"\x00<html>oops"
            return web.Response(status=200, body=broken, content_type="application/json")
        if transient == "drop":
            return await self._drop(request, body)
        self.stats.statuses["200"] += 1
        self.stats.billing.bill(generation.completion_tokens, answer_cost(generation, self.params))
        self._keep_truth(key, generation)
        return web.Response(status=200, body=body, content_type="application/json")

    def _charge(self, chat: ChatRequest, faults: list[str], prompt_text: str | None) -> tuple[int, float] | None:
        """What an answer is charged (tokens, dollars); None when it could not be generated."""
        try:
            generation = self._generation(chat, faults, prompt_text)
        except RequestError:
            return None
        return generation.completion_tokens, answer_cost(generation, self.params)

    async def _drop(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Promise the whole body, send half of it, then cut the connection."""
        self.stats.statuses["drop"] += 1
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        transport = request.transport
        if transport is not None:
            transport.abort()
        return response


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")
