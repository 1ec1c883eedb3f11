"""An OpenRouter-like router over several simulated upstreams with different habits.

OpenRouter serves one model through several upstream providers and picks one per request:
by default it spreads requests over them (load balancing), ``provider.order`` tries the
named upstreams first, in that order, ``provider.only`` / ``provider.ignore`` filter them,
and with ``provider.allow_fallbacks = false`` no other upstream is tried when those fail
(https://openrouter.ai/docs/features/provider-routing). The reply names the upstream that
answered in ``provider``. This router does the same over simulator upstreams, each a
:class:`~services.simulator.server.SimulatorServer` with its own options, so a test can route a
dataset to a lossy upstream and then pin a lossless one:

- ``lossless``: text exactly as generated, logprobs when asked, every token counted;
- ``stripping``: reasoning and content ``.strip()``-ed (the legacy SGLang parser);
- ``logprobs-null``: logprobs asked for and answered with ``null``;
- ``eot-uncounted``: ``usage.completion_tokens`` leaves out the end-of-turn token;
- ``wrong-usage``: the usage count is wrong on a share of the answers.

:func:`habit_upstreams` builds those five; :func:`start_router` serves any list of
:class:`Upstream`. ``GET /_sim/stats`` counts requests in total, per sample key and per
upstream; ``GET /_sim/router`` lists the upstreams and their habits (the truth a probe's
findings are compared with).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from services.profiles import ProfileLike
from services.simulator.core import error_body
from services.simulator.options import SimulatorOptions, get_profile
from services.simulator.server import KEY_HEADER, SimulatorServer
from services.simulator.serving import RunningServer, provider_app, serve_app
from services.simulator.stats import Stats

__all__ = [
    "HABITS",
    "RouteError",
    "RouterServer",
    "RunningRouter",
    "Upstream",
    "choose_upstreams",
    "habit_upstreams",
    "start_router",
]

log = logging.getLogger(__name__)

# Statuses after which OpenRouter tries the next upstream (when fallbacks are allowed).
_FALLBACK_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Upstream:
    """One upstream behind the router: its name (the reply's ``provider``), options and habits."""

    name: str
    options: SimulatorOptions = field(default_factory=SimulatorOptions)
    serves_logprobs: bool = True
    weight: float = 1.0

    def habits(self) -> dict[str, Any]:
        """What this upstream does to an answer, as facts a probe can establish."""
        return {
            "whitespace": "stripped" if self.options.parser == "sglang-legacy" else "kept",
            "logprobs": "present" if self.serves_logprobs else "null",
            "end_of_turn_counted": self.options.count_end_of_turn,
            "bad_usage_rate": self.options.rate_bad_usage,
        }


HABITS: dict[str, dict[str, Any]] = {
    "lossless": {},
    "stripping": {"parser": "sglang-legacy"},
    "logprobs-null": {"serves_logprobs": False},
    "eot-uncounted": {"count_end_of_turn": False},
    "wrong-usage": {"rate_bad_usage": 0.3},
}
"""The habits of :func:`habit_upstreams`, by upstream name (options beyond the base ones)."""


def habit_upstreams(base: SimulatorOptions | None = None, names: Sequence[str] | None = None) -> list[Upstream]:
    """The router's standard upstreams (all of :data:`HABITS`, or those named), on ``base`` options."""
    base = base or SimulatorOptions()
    out: list[Upstream] = []
    for i, name in enumerate(names or HABITS):
        habit = dict(HABITS[name])
        serves = bool(habit.pop("serves_logprobs", True))
        options = dataclasses.replace(base, provider_name=name, seed=base.seed + i, **habit)
        out.append(Upstream(name, options, serves_logprobs=serves))
    return out


class RouteError(ValueError):
    """No upstream can serve the request under its ``provider`` preferences (OpenRouter answers 404)."""


def _names(value: Any, field_name: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RouteError(f"provider.{field_name} must be a list of provider names")
    return list(value)


def choose_upstreams(preferences: Any, upstreams: Sequence[Upstream], rng: random.Random) -> list[str]:
    """The upstreams to try for one request, in order, under OpenRouter's ``provider`` preferences.

    Without ``order`` the first is drawn by weight (load balancing) and the others follow in
    the same way; with ``order`` the named ones come first, in that order. ``only`` and
    ``ignore`` filter; ``allow_fallbacks = false`` keeps only the first candidate (with
    ``order``: only the ordered ones). Raises :class:`RouteError` when none is left.
    """
    prefs = preferences if isinstance(preferences, dict) else {}
    if preferences is not None and not isinstance(preferences, dict):
        raise RouteError("provider must be an object")
    known = {u.name: u for u in upstreams}
    order = _names(prefs.get("order"), "order") or []
    only = _names(prefs.get("only"), "only")
    ignore = set(_names(prefs.get("ignore"), "ignore") or [])
    allowed = [u.name for u in upstreams if (only is None or u.name in only) and u.name not in ignore]
    first = [n for n in order if n in allowed]
    rest = [n for n in allowed if n not in first]
    drawn: list[str] = []
    pool = [known[n] for n in rest]
    while pool:
        pick = rng.choices(pool, weights=[max(u.weight, 1e-9) for u in pool])[0]
        drawn.append(pick.name)
        pool.remove(pick)
    candidates = first + drawn
    if prefs.get("allow_fallbacks") is False:
        candidates = first if first else candidates[:1]
    if not candidates:
        raise RouteError("No allowed providers are available for the selected model.")
    return candidates


class RouterServer:
    """The aiohttp application of the router and its upstream simulators."""

    def __init__(self, upstreams: Sequence[Upstream], profile: ProfileLike, *, seed: int = 0) -> None:
        if not upstreams or len({u.name for u in upstreams}) != len(upstreams):
            raise ValueError("a router needs at least one upstream, each with its own name")
        self.upstreams = list(upstreams)
        self.servers = {u.name: SimulatorServer(u.options, profile) for u in upstreams}
        self.profile = profile
        self.rng = random.Random(seed)  # noqa: S311 - routing, not crypto
        self.stats = Stats()
        self.chosen: Counter[str] = Counter()
        self.key_upstreams: dict[str, list[str]] = {}

    def web_app(self) -> web.Application:
        """The application: chat completions (routed), health, stats, the router's configuration."""
        return provider_app(
            self.profile.name, chat=self.chat, health=self.health, stats=self.stats_view, router=self.router_view
        )

    async def health(self, request: web.Request) -> web.Response:
        """Liveness."""
        return web.json_response({"status": "ok", "profile": self.profile.name, "router": True})

    def snapshot(self) -> dict[str, Any]:
        """Requests in total and per key (as a simulator's stats), and per upstream."""
        snap = self.stats.snapshot()
        snap["upstreams"] = {name: server.stats.snapshot() for name, server in self.servers.items()}
        snap["chosen"] = dict(self.chosen)
        snap["key_upstreams"] = dict(self.key_upstreams)
        return snap

    async def stats_view(self, request: web.Request) -> web.Response:
        """``GET /_sim/stats``."""
        return web.json_response(self.snapshot())

    def configuration(self) -> dict[str, Any]:
        """Every upstream's habits, by name."""
        return {u.name: u.habits() for u in self.upstreams}

    async def router_view(self, request: web.Request) -> web.Response:
        """``GET /_sim/router``: the upstreams and their habits."""
        return web.json_response({"upstreams": self.configuration()})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """Route one chat request to an upstream (falling back as allowed) and relay its answer."""
        key = request.headers.get(KEY_HEADER)
        self.stats.record(key, time.time(), request.headers.get("Authorization"))
        body = await request.read()  # aiohttp keeps it: each upstream reads it again
        try:
            preferences = json.loads(body).get("provider")
        except (ValueError, AttributeError):
            preferences = None  # the upstream answers the malformed body itself
        try:
            candidates = choose_upstreams(preferences, self.upstreams, self.rng)
        except RouteError as exc:
            self.stats.statuses["404"] += 1
            return web.json_response(error_body(404, str(exc)), status=404)
        response: web.StreamResponse | None = None
        for i, name in enumerate(candidates):
            self.chosen[name] += 1
            if key is not None:
                self.key_upstreams.setdefault(key, []).append(name)
            response = await self.servers[name].chat(request)
            last = i == len(candidates) - 1
            if response.status not in _FALLBACK_STATUSES or last or response.prepared:
                break
        assert response is not None  # noqa: S101 - candidates is never empty
        self.stats.statuses[str(response.status)] += 1
        upstream = next(u for u in self.upstreams if u.name == name)
        if not upstream.serves_logprobs and isinstance(response, web.Response) and response.status == 200:
            return _without_logprobs(response)
        return response


def _without_logprobs(response: web.Response) -> web.Response:
    """The answer with ``logprobs: null`` on every choice (an upstream that ignores the parameter)."""
    raw = response.body
    if not isinstance(raw, bytes):
        return response
    try:
        data = json.loads(raw)
        for choice in data.get("choices", []):
            choice["logprobs"] = None
    except (ValueError, AttributeError, TypeError):
        return response  # a malformed answer (simulated fault) goes out as it is
    return web.Response(status=200, body=msgspec.json.encode(data), content_type="application/json")


class RunningRouter(RunningServer):
    """A router serving on a port, for tests and the probe."""

    def __init__(self, server: RouterServer, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner, host, port)
        self.server = server

    def stats(self) -> dict[str, Any]:
        """The same counters ``GET /_sim/stats`` returns."""
        return self.server.snapshot()

    def configuration(self) -> dict[str, Any]:
        """The upstreams and their habits (``GET /_sim/router``)."""
        return self.server.configuration()

    def requests_after(self, t: float) -> int:
        """How many chat requests arrived after unix time ``t``."""
        return self.server.stats.requests_after(t)


async def start_router(
    upstreams: Sequence[Upstream] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    seed: int = 0,
    profile: ProfileLike | None = None,
) -> RunningRouter:
    """Start a router on ``host:port`` (0: any free port) over ``upstreams`` (default: every habit)."""
    upstreams = list(upstreams or habit_upstreams())
    if profile is None:
        profile = await asyncio.to_thread(get_profile, upstreams[0].options.profile)
    server = RouterServer(upstreams, profile, seed=seed)
    runner, bound = await serve_app(server.web_app(), host, port)
    log.info("router over %s listening on %s:%d", ", ".join(u.name for u in upstreams), host, bound)
    return RunningRouter(server, runner, host, bound)
