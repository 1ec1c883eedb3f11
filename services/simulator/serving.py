"""The HTTP face the simulator and the router share: OpenRouter's routes, and serving an app on a port.

:func:`provider_app` maps the chat and text-completions endpoints, ``/health``, ``/_sim/stats``
and the pre-flight probes (``/models``, ``/key``) onto handlers; :func:`serve_app` serves it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.simulator.core import (
    error_body,
)
from services.simulator.limits import RequestLimiter

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
