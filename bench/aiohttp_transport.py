"""Experiment: an httpx transport backed by aiohttp, and an inference worker that uses it.

httpx 0.28 / httpcore 1.0.9 spend O(connections) (O(connections^2) with idle ones) per
pool operation, so one process cannot keep hundreds of requests in flight (see
``bench/diag_http_client.py``). Plugging aiohttp in underneath httpx keeps the inference
adapter's httpx API (status classification, timeouts, tests with MockTransport) while
the connection pool becomes aiohttp's. ``python -m bench.aiohttp_transport --config F``
runs the inference worker with it, for benchmarks 3 and 4 with ``BENCH_HTTP=aiohttp``.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import httpx


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests sent over one aiohttp session (connection limit ``limit``)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=self._limit)
            # httpx decodes Content-Encoding itself: hand it the raw bytes.
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send one request and read the whole answer."""
        t = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in ("host", "content-length")]
        try:
            async with self._get_session().request(
                request.method, str(request.url), data=await request.aread(), headers=headers, timeout=timeout
            ) as response:
                content = await response.read()
                raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers]
                return httpx.Response(response.status, headers=raw, content=content, request=request)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(str(exc), request=request) from exc

    async def aclose(self) -> None:
        """Close the aiohttp session."""
        if self._session is not None:
            await self._session.close()


async def run_worker(config: str) -> None:
    """The inference worker of ``config`` with an aiohttp-backed httpx client."""
    from services.common.config import load_settings
    from services.common.logs import setup_logging
    from services.common.service import run_service
    from services.inference.app import create_app

    settings = load_settings(config)
    setup_logging(settings)
    p = settings.provider
    client = httpx.AsyncClient(
        transport=AiohttpTransport(p.concurrency), timeout=httpx.Timeout(p.timeout_s, connect=p.connect_timeout_s)
    )
    try:
        await run_service(create_app(settings, http_client=client), name="inference (aiohttp transport)")
    finally:
        await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    asyncio.run(run_worker(parser.parse_args().config))
