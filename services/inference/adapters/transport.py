"""The HTTP transport the providers send through, and what its failures mean.

:func:`make_http_client` builds an httpx client on aiohttp's connection pool whose session asks
each request's ``may_send`` once more at the last moment before its first byte is written
(:func:`asking`): a halt that lands while a request waits for a connection or for the event loop
still stops it (:class:`~services.inference.core.NotSent`). :func:`transport_reason` names a
failure to reach the provider from its whole exception chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import socket
import ssl
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, Protocol

import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler
from httpx_aiohttp import HttpxAiohttpClient
from httpx_aiohttp.transport import AiohttpTransport

from services.common.config import Settings
from services.inference.core import NotSent

# --- transport failures ---


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 20:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def transport_reason(exc: BaseException) -> str:
    """The reason code of a failure to reach the provider, from the whole exception chain.

    httpx-aiohttp reports every connect failure as ``ConnectTimeout``; the cause underneath
    tells a refused connection from a DNS failure, a TLS error or a real timeout.
    """
    chain = exception_chain(exc)
    names = {type(e).__name__ for e in chain}
    if any(isinstance(e, socket.gaierror) for e in chain) or "ClientConnectorDNSError" in names:
        return "provider_dns"
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return "provider_connection_refused"
    if any(isinstance(e, ssl.SSLError | ssl.CertificateError) for e in chain) or names & {
        "ClientConnectorCertificateError",
        "ClientConnectorSSLError",
        "ClientSSLError",
    }:
        return "provider_tls"
    if names & {"ServerDisconnectedError", "RemoteProtocolError", "ClientPayloadError"} or any(
        isinstance(e, ConnectionResetError | BrokenPipeError) for e in chain
    ):
        return "provider_connection_closed"
    if names & {"ConnectTimeout", "ConnectionTimeoutError"}:
        return "provider_connect_timeout"
    if any(isinstance(e, httpx.TimeoutException | TimeoutError) for e in chain):
        return "provider_timeout"
    return "provider_connection"


MaySend = Callable[[], bool]


class HttpPoster(Protocol):
    """What a provider needs from an HTTP client: ``httpx.AsyncClient`` or a pool of them."""

    async def post(self, url: str | httpx.URL, *, content: bytes, headers: dict[str, str]) -> httpx.Response:
        """POST ``content`` to ``url``."""
        ...

    async def get(self, url: str, *, headers: dict[str, str]) -> httpx.Response:
        """GET ``url`` (pre-flight and outage probes)."""
        ...


# --- the last moment before a request is written ---

# The ``may_send`` of the request being sent: set by :func:`asking` in the request's own
# task, so aiohttp's trace callbacks (run in that task, or in the body-writing task it starts,
# which copies the task's context) read the right one.
_MAY_SEND: contextvars.ContextVar[MaySend | None] = contextvars.ContextVar("draftstream_may_send", default=None)


def unbind_stream(response: httpx.Response) -> None:
    """Break the reference cycle between an httpx response and its stream once the body is read.

    httpx binds the stream to its response (``response.stream._response is response``), so a
    response is freed only by the cycle collector, and its body with it. At 1,000 requests in
    flight with answers of thousands of tokens (and their logprobs) those bodies piled up between
    collections, and each young-generation collection freed thousands of them at once: 100-160 ms
    with nothing else running in the worker (the control follower's thread included).
    """
    response.stream = httpx.ByteStream(b"")


def _withhold_unless(may_send: MaySend | None) -> None:
    """Raise :class:`NotSent` when ``may_send`` says the request must not go out."""
    if may_send is not None and not may_send():
        raise NotSent("withheld before any byte of the request was written")


@contextlib.contextmanager
def asking(may_send: MaySend | None) -> Iterator[None]:
    """Ask ``may_send`` now (:class:`NotSent` on a no), then leave it for the trace hooks to ask
    again for the request sent inside the block, just before its first byte is written."""
    _withhold_unless(may_send)
    asked = _MAY_SEND.set(may_send)
    try:
        yield
    finally:
        _MAY_SEND.reset(asked)


async def _before_headers(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
    """A connection is in hand; aiohttp is about to serialise the headers (nothing written yet)."""
    _withhold_unless(_MAY_SEND.get())


async def _before_first_chunk(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
    """aiohttp is about to write the first body chunk; the headers still wait in its buffer.

    On Python < 3.12 the body is written by a task of its own, one event-loop turn after the
    headers were buffered: a halt applied meanwhile still stops the request here. aiohttp
    reports the raised NotSent as a connection error caused by it and closes the connection.
    """
    if getattr(ctx, "asked", False):
        return  # a later chunk: the request is on the wire already
    ctx.asked = True
    _withhold_unless(_MAY_SEND.get())


class _FreedOnClose(ResponseHandler):
    """aiohttp's protocol that lets a closed connection's socket transport be freed by reference counting.

    On Python 3.11 asyncio's socket transport keeps a bound method of its own (the read callback)
    after it closed: a cycle, so every closed connection (5 objects, its socket's with them)
    waited for a collection of the generation it had reached. A pooled connection lives for
    seconds, so that was the oldest: the worker's full collections, which scan everything alive,
    existed mostly for these. The callback is dropped once the connection is lost (nothing is
    read after that). Under TLS the socket transport is the one beneath the TLS protocol.
    """

    _socket_transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Remember the socket transport (beneath TLS, if any) to break its cycle at the end."""
        tls = getattr(transport, "_ssl_protocol", None)
        self._socket_transport = getattr(tls, "_transport", None) or transport
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        """aiohttp's handling, then the socket transport's read callback dropped."""
        socket_transport, self._socket_transport = self._socket_transport, None
        try:
            super().connection_lost(exc)
        finally:
            if socket_transport is not None and hasattr(socket_transport, "_read_ready_cb"):
                socket_transport._read_ready_cb = None  # noqa: SLF001 - see the class docstring


class _LastMomentTransport(AiohttpTransport):
    """httpx-aiohttp's transport whose session asks each request's ``may_send`` before writing it."""

    def get_client(self) -> aiohttp.ClientSession:
        """The aiohttp session (created once, on the first request): the pool plus the trace hooks."""
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_before_headers)
        trace.on_request_chunk_sent.append(_before_first_chunk)
        connector = aiohttp.TCPConnector(
            limit=self.limits.max_connections or 0,
            keepalive_timeout=self.limits.keepalive_expiry,
            ssl=self.ssl_context,
        )
        connector._factory = functools.partial(  # type: ignore[assignment]  # noqa: SLF001 - a ResponseHandler
            _FreedOnClose, loop=asyncio.get_running_loop()
        )
        return aiohttp.ClientSession(connector=connector, trace_configs=[trace])


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing a server sets."""

    def extract_cookies(self, response: httpx.Response) -> None:
        """Ignore the response's ``Set-Cookie`` headers."""


class _ProviderClient(HttpxAiohttpClient):  # type: ignore[misc]  # httpx-aiohttp ships no type stubs
    """httpx's client without a cookie jar: a provider authenticates each request with its key.

    httpx reads every response's cookies through urllib's cookie machinery (a urllib request
    built from the httpx one, the host parsed as an IP address): a tenth of the worker's
    time spent in httpx, for cookies (a CDN's, say) that no provider call needs.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._none = _NoCookies()

    @property  # type: ignore[override]
    def cookies(self) -> httpx.Cookies:
        """Always empty."""
        return self._none

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        """Nothing is kept."""


def make_http_client(settings: Settings) -> httpx.AsyncClient:
    """An httpx client on aiohttp's connection pool, sized for ``provider.concurrency``.

    httpcore's pool scans every connection for every request it schedules (O(n) per
    request, worse with idle ones), which caps one process far below 1,000 requests in
    flight; the ``httpx-aiohttp`` transport keeps httpx's API over aiohttp's pool. Its
    requests ask their ``may_send`` once a connection is in hand, before any byte is written
    (:meth:`HttpProvider._post`), so a halt applied while a request waited for a connection
    or for the event loop still stops it.
    """
    p = settings.provider
    limits = httpx.Limits(max_connections=p.concurrency, max_keepalive_connections=p.concurrency)
    return _ProviderClient(
        timeout=httpx.Timeout(p.timeout_s, connect=p.connect_timeout_s),
        limits=limits,
        transport=_LastMomentTransport(limits=limits),
    )
