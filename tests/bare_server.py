"""A bare aiohttp server on a free local port, for tests that need a real HTTP peer and no simulator."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web


@contextlib.asynccontextmanager
async def bare_server(path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    """Serve ``POST path`` with ``handler`` on 127.0.0.1; yields the port, stops the server after."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
