"""The simulator's HTTP shell: an aiohttp server speaking OpenRouter's chat-completions dialect.

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
import bisect
import dataclasses
import hashlib
import json
import logging
import math
import random
import time
import uuid
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from services.common.config import Settings
from services.common.metrics import SIMULATOR_CONTENT_FAULTS, SIMULATOR_REQUESTS
from services.simulator.billing import Billing
from services.simulator.core import (
    Generation,
    GenerationParams,
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
from services.simulator.formats import PARSERS
from services.simulator.limits import OverCap, RequestLimiter, retry_after_text
from services.simulator.profile_like import ProfileLike
from services.simulator.prompts import compile_chat_template, profile_prompt_text, render_chat_template
from services.simulator.request import ChatRequest, RequestError, parse_completion_request, parse_request
from services.simulator.shapes import shaped

__all__ = [
    "FAULT_HEADER",
    "KEY_HEADER",
    "RunningServer",
    "RunningSimulator",
    "SimulatorOptions",
    "SimulatorServer",
    "SimulatorService",
    "add_model_routes",
    "create_app",
    "get_profile",
    "provider_app",
    "serve_app",
    "start_simulator",
]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

KEY_HEADER = "X-Draftstream-Key"
FAULT_HEADER = "X-Simulator-Fault"
_CACHE_MAX = 50_000
_RECENT = 100


@dataclass(frozen=True)
class SimulatorOptions:
    """Everything the simulator can be told: profile, latency, lengths, fault rates, flags.

    ``parser`` is the inference server whose parse of the raw output is emulated (``vllm``:
    no whitespace stripped; ``sglang-legacy``: reasoning and content stripped).
    ``chat_template_file``: render prompts (prompt_tokens, whether the prompt opens the think
    block, ``prompt_token_ids``) from this Hugging Face chat template instead of the
    profile's own, e.g. a model's official template as independent truth.
    ``keep_truth``: remember the true output ids per sample key and serve them on
    ``GET /_sim/truth`` (off by default: a long run would hold every answer's ids).
    """

    profile: str = "qwen3"
    seed: int = 0
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    reasoning_tokens: tuple[int, int] = (40, 200)
    content_tokens: tuple[int, int] = (20, 120)
    rate_429: float = 0.0
    retry_after_s: float = 0.1
    rate_5xx: float = 0.0
    rate_timeout: float = 0.0
    timeout_sleep_s: float = 30.0
    rate_drop: float = 0.0
    rate_malformed: float = 0.0
    rate_error_in_200: float = 0.0
    rate_truncate: float = 0.0
    rate_empty_reasoning: float = 0.0
    rate_bad_usage: float = 0.0
    rate_noncanonical_len: float = 0.0
    rate_noncanonical_same: float = 0.0
    count_end_of_turn: bool = True
    count_think_end: bool = True
    logprobs: bool = False
    keep_truth: bool = False
    price_per_token: float = 2e-6
    prompt_price_per_token: float = 0.0
    provider_name: str = "SimProvider"
    parser: str = "vllm"
    chat_template_file: str | None = None
    # A key's limit: requests per second (token bucket of ``rate_limit_burst``, default the
    # rate rounded up) and requests open at once; None: unlimited.
    rate_limit_rps: float | None = None
    rate_limit_burst: float | None = None
    max_open: int | None = None
    # Other shapes (services.simulator.shapes): a fixed window of requests, a rate that changes.
    rate_limit_window: int | None = None
    rate_limit_window_s: float = 60.0
    rate_limit_schedule: str | None = None
    answer_tokens: tuple[int, int] | None = None  # log-uniform answer length (see GenerationParams)
    reasoning_share: tuple[float, float] = (0.80, 0.95)
    parallel_tool_calls: bool = False  # every offered tool called once, in order (see GenerationParams)

    def __post_init__(self) -> None:
        if self.parser not in PARSERS:
            raise ValueError(f"unknown parser {self.parser!r}; known: {', '.join(PARSERS)}")
        self.limiter()  # refuses a bad limit now

    def limiter(self) -> RequestLimiter:
        """The request limiter these options set (inactive without a limit)."""
        rps = self.rate_limit_rps
        burst = self.rate_limit_burst if self.rate_limit_burst is not None else float(math.ceil(rps or 0))
        base = RequestLimiter(rps=rps, burst=burst, max_open=self.max_open, open_retry_after_s=self.retry_after_s)
        return shaped(
            base, per_window=self.rate_limit_window, window_s=self.rate_limit_window_s,
            schedule=self.rate_limit_schedule,
        )

    def fault_rates(self) -> dict[str, float]:
        """Rate of every fault by its name (``429``, ``5xx``, ..., ``noncanonical_same``)."""
        return {name: float(getattr(self, f"rate_{name}")) for name in TRANSIENT_FAULTS + CONTENT_FAULTS}

    def with_fault_rates(self, rates: dict[str, float]) -> SimulatorOptions:
        """A copy with some fault rates replaced; raises ValueError on unknown names or bad rates."""
        changes: dict[str, Any] = {}
        for name, rate in rates.items():
            if name not in TRANSIENT_FAULTS and name not in CONTENT_FAULTS:
                raise ValueError(f"unknown fault {name!r}; known: {', '.join(TRANSIENT_FAULTS + CONTENT_FAULTS)}")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate for {name!r} must be within 0..1, got {rate}")
            changes[f"rate_{name}"] = rate
        return dataclasses.replace(self, **changes)

    def params(self) -> GenerationParams:
        """The generation parameters these options imply."""
        return GenerationParams(
            seed=self.seed,
            reasoning_tokens=self.reasoning_tokens,
            content_tokens=self.content_tokens,
            count_end_of_turn=self.count_end_of_turn,
            count_think_end=self.count_think_end,
            price_per_token=self.price_per_token,
            prompt_price_per_token=self.prompt_price_per_token,
            parser=self.parser,
            answer_tokens=self.answer_tokens,
            reasoning_share=self.reasoning_share,
            parallel_tool_calls=self.parallel_tool_calls,
        )


def _strftime_now(fmt: str) -> str:
    """Today's local date for templates that print it (as transformers gives them)."""
    return datetime.now().strftime(fmt)  # noqa: DTZ005 - templates format the local date


def get_profile(name: str, settings: Settings | None = None) -> ProfileLike:
    """Load a model profile (``services.profiles`` caches it per process: about a second once)."""
    from services.profiles import load_profile

    return load_profile(name, settings)


class _Stats:
    """Request accounting for ``/_sim/stats`` and :meth:`RunningSimulator.requests_after`."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self.total = 0
        self.times: list[float] = []
        self.keys: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.key_faults: defaultdict[str, list[str]] = defaultdict(list)
        self.statuses: Counter[str] = Counter()
        self.open = 0  # requests received and not yet answered (or abandoned)
        self.billing = Billing()  # what the key was charged (answers served, or abandoned mid-generation)
        self.peak_open = 0  # the most of those at once
        # Seconds during which more requests were open than the rate limit's max_open.
        self.over_cap = OverCap(cap=None)
        self.rate_limited = 0  # requests refused by the rate limit (429)
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)
        # SHA-256 of each Authorization header seen (never the header itself), so a test can
        # prove a key reached the provider without the simulator ever storing the key.
        self.auth_sha256: Counter[str] = Counter()

    def record(self, key: str | None, at: float, authorization: str | None = None) -> None:
        self.total += 1
        if authorization:
            self.auth_sha256[hashlib.sha256(authorization.encode("utf-8")).hexdigest()] += 1
        self.times.append(at)
        if key is not None:
            self.keys[key] += 1

    def fault(self, key: str | None, name: str) -> None:
        self.faults[name] += 1
        if key is not None:
            self.key_faults[key].append(name)

    def requests_after(self, t: float) -> int:
        return len(self.times) - bisect.bisect_right(self.times, t)

    def snapshot(self, *, brief: bool = False) -> dict[str, Any]:
        """The counters; ``brief`` leaves out the tables that grow with every key served."""
        if brief:
            return {
                "started_at": self.started_at,
                "total_requests": self.total,
                "open_requests": self.open,
                "peak_open_requests": self.peak_open,
                "statuses": dict(self.statuses),
                "faults": dict(self.faults),
                "rate_limited": self.rate_limited,
                **self.billing.figures(),
                "last_request_at": self.times[-1] if self.times else None,
            }
        return {
            "started_at": self.started_at,
            "total_requests": self.total,
            "keys": dict(self.keys),
            "faults": dict(self.faults),
            "key_faults": dict(self.key_faults),
            "statuses": dict(self.statuses),
            "peak_open_requests": self.peak_open,
            "max_open_requests": self.over_cap.cap,
            "seconds_over_max_open": round(self.over_cap.over_s, 6),
            "rate_limited": self.rate_limited,
            **self.billing.figures(),
            "last_request_at": self.times[-1] if self.times else None,
            "last_request_times": self.times[-_RECENT:],
            "recent": list(self.recent),
            "auth_sha256": dict(self.auth_sha256),
        }


class SimulatorServer:
    """The aiohttp application and the state behind it (cache, RNG, stats)."""

    def __init__(self, options: SimulatorOptions, profile: ProfileLike) -> None:
        self.options = options
        self.profile = profile
        self.params = options.params()
        self.rates = options.fault_rates()
        self.rng = random.Random(options.seed)  # noqa: S311 - fault injection, not crypto
        self.stats = _Stats()
        self.limiter = options.limiter()
        self.stats.over_cap.cap = options.max_open
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
        100 ms would see as provider latency and as late arrival stamps.
        """
        snap = self.stats.snapshot(brief=request.query.get("brief") == "1")
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
        stats.open += 1
        stats.peak_open = max(stats.peak_open, stats.open)
        stats.over_cap.change(time.monotonic(), +1)
        try:
            return await self._chat(request)
        finally:
            stats.open -= 1
            stats.over_cap.change(time.monotonic(), -1)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        at = time.time()
        key = request.headers.get(KEY_HEADER)
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
        reset_ms = int((time.time() + refusal.retry_after_s) * 1000)
        headers = {"X-RateLimit-Limit": refusal.limit, "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset_ms)}
        body = error_body(429, f"Rate limit exceeded: {refusal.reason} (simulated)")
        body["error"]["metadata"] = {"headers": headers}
        return self._reply(429, body, key, **{"Retry-After": retry_after_text(refusal.retry_after_s)}, **headers)

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
        if delay > 0:
            began = time.monotonic()
            try:
                await asyncio.sleep(delay)
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


def provider_app(
    profile_name: str,
    *,
    chat: Handler,
    health: Handler,
    stats: Handler,
    limiter: Callable[[], RequestLimiter] | None = None,
    usage: Callable[[], float] | None = None,
    **more: Handler,
) -> web.Application:
    """An OpenRouter-shaped app: chat and text completions, health, ``/_sim/stats``, ``/_sim/<name>`` of ``more``."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/api/v1/chat/completions", chat)
    app.router.add_post("/v1/chat/completions", chat)
    # Text completions (``prompt`` rendered by the client): the same handler, the raw text back.
    app.router.add_post("/api/v1/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/_sim/stats", stats)
    for name, handler in more.items():
        app.router.add_get(f"/_sim/{name}", handler)
    add_model_routes(app, profile_name, limiter, usage)
    return app


def add_model_routes(
    app: web.Application,
    profile_name: str,
    limiter: Callable[[], RequestLimiter] | None = None,
    usage: Callable[[], float] | None = None,
) -> None:
    """The inference pre-flight and outage probes: never counted as requests.

    ``GET /api/v1/models`` and ``GET /v1/models``: the OpenAI-style model list (the simulator
    answers any model name; it lists its profile). ``GET /api/v1/key``: OpenRouter's key
    check (401 without a bearer key; no credit limit; ``rate_limit`` while ``limiter`` sets a rate),
    with ``usage`` (and its daily/weekly/monthly figures) the dollars charged so far, answers
    generated for clients that went away included.
    """

    async def models(request: web.Request) -> web.Response:
        entry = {"id": profile_name, "object": "model", "created": 0, "owned_by": "draftstream-simulator"}
        return web.json_response({"object": "list", "data": [entry]})

    async def key(request: web.Request) -> web.Response:
        if not request.headers.get("Authorization", "").startswith("Bearer "):
            return web.json_response(error_body(401, "No auth credentials found"), status=401)
        spent = usage() if usage is not None else 0.0
        data: dict[str, Any] = {
            "label": "simulator", "limit": None, "usage": spent, "usage_daily": spent, "usage_weekly": spent,
            "usage_monthly": spent, "limit_remaining": None, "limit_reset": None, "is_free_tier": False,
        }
        rate_limit = limiter() if limiter is not None else None
        if rate_limit is not None and rate_limit.rps is not None:
            data["rate_limit"] = {"requests": rate_limit.rps, "interval": "1s"}  # topology: not a topic
        return web.json_response({"data": data})

    app.router.add_get("/api/v1/models", models)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/api/v1/key", key)


class RunningServer:
    """An aiohttp runner serving on ``host:port``: its URLs, and how to stop it."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port
        self.base_url = f"http://{host}:{port}"
        self.url = f"{self.base_url}/api/v1"

    async def close(self) -> None:
        """Stop serving; in-flight handlers are cancelled."""
        await self._runner.cleanup()


class RunningSimulator(RunningServer):
    """A simulator serving on a port, for tests, benchmarks and the demo."""

    def __init__(self, server: SimulatorServer, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner, host, port)
        self.server = server

    def stats(self) -> dict[str, Any]:
        """The same counters ``GET /_sim/stats`` returns."""
        return self.server.stats.snapshot()

    def requests_after(self, t: float) -> int:
        """How many chat requests arrived after unix time ``t``."""
        return self.server.stats.requests_after(t)

    def truth(self) -> dict[str, list[int]]:
        """What ``GET /_sim/truth`` serves: sample key -> true output ids of its last full answer."""
        if self.server.truth is None:
            raise RuntimeError("this simulator keeps no truth: start it with SimulatorOptions(keep_truth=True)")
        return dict(self.server.truth)


async def serve_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve an aiohttp application on ``host:port`` (0: any free port); the runner and the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = port
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            bound = int(address[1])
            break
    return runner, bound


async def start_simulator(
    options: SimulatorOptions | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    profile: ProfileLike | None = None,
) -> RunningSimulator:
    """Start a simulator on ``host:port`` (0: any free port) and return once it accepts requests."""
    options = options or SimulatorOptions()
    if profile is None:
        profile = await asyncio.to_thread(get_profile, options.profile)
    server = SimulatorServer(options, profile)
    runner, bound = await serve_app(server.web_app(), host, port)
    log.info("simulator (%s) listening: set [provider] base_url = \"http://%s:%d/api/v1\"", profile.name, host, bound)
    return RunningSimulator(server, runner, host, bound)


class SimulatorService:
    """The simulator as a long-lived :class:`services.common.service.Service`."""

    def __init__(self, options: SimulatorOptions, host: str, port: int, profile: ProfileLike | None) -> None:
        self.options = options
        self.host = host
        self.port = port
        self._profile = profile
        self._running: RunningSimulator | None = None
        self._stopped = asyncio.Event()

    @property
    def running(self) -> RunningSimulator | None:
        """The live server once started."""
        return self._running

    async def start(self) -> None:
        """Load the profile and start listening."""
        self._running = await start_simulator(self.options, self.host, self.port, profile=self._profile)

    async def run(self) -> None:
        """Serve until :meth:`stop`."""
        await self._stopped.wait()

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stopped.set()

    async def close(self) -> None:
        """Stop listening."""
        if self._running is not None:
            await self._running.close()
            self._running = None


def create_app(
    settings: Settings,
    *,
    options: SimulatorOptions | None = None,
    host: str = "127.0.0.1",
    port: int = 8099,
    profile: ProfileLike | None = None,
) -> SimulatorService:
    """Composition root: a simulator service (``settings`` reserved for metrics and defaults)."""
    del settings  # the simulator needs nothing from the pipeline's settings yet
    return SimulatorService(options or SimulatorOptions(), host, port, profile)
