"""A closed provider connection is freed by reference counting, not left to the cycle collector.

Real sockets, a real aiohttp server in this process, the worker's own HTTP client: the census
is the collector's own list of what it found unreachable (``gc.DEBUG_SAVEALL``). The server
closes every connection after its answer, so each request opens and loses one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from services.common.config import load_settings
from services.inference.adapters.transport import make_http_client
from tests.bare_server import bare_server
from tests.gc_census import unreachable

REQUESTS = 40


@pytest.fixture
async def closing_server() -> AsyncIterator[int]:
    """An HTTP server answering ``ok`` and closing the connection; yields its port."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(text="ok", headers={"Connection": "close"})

    async with bare_server("/", answer) as port:
        yield port


async def unreachable_client_transports(port: int, send: Callable[[], Awaitable[None]]) -> int:
    """Send :data:`REQUESTS` requests; how many client-side socket transports the collector then found unreachable."""
    with unreachable() as found:
        for _ in range(REQUESTS):
            await send()
        await asyncio.sleep(0.05)  # the transports' connection_lost callbacks run
    return sum(
        1 for o in found if isinstance(o, asyncio.Transport) and (o.get_extra_info("peername") or ("", 0))[1] == port
    )


async def test_the_worker_client_leaves_no_cycle_per_closed_connection(closing_server: int) -> None:
    url = f"http://127.0.0.1:{closing_server}/"
    client = make_http_client(load_settings(None, provider={"base_url": url, "concurrency": 8}))

    async def send() -> None:
        response = await client.post(url, content=b"{}", headers={})
        assert response.status_code == 200 and response.text == "ok"

    try:
        assert await unreachable_client_transports(closing_server, send) == 0
    finally:
        await client.aclose()


async def test_a_plain_aiohttp_session_leaves_one_per_closed_connection(closing_server: int) -> None:
    # What the test above guards against, seen with aiohttp's own protocol: the census counts it.
    url = f"http://127.0.0.1:{closing_server}/"
    async with aiohttp.ClientSession() as session:

        async def send() -> None:
            async with session.post(url, data=b"{}") as response:
                assert response.status == 200 and await response.text() == "ok"

        assert await unreachable_client_transports(closing_server, send) == REQUESTS
