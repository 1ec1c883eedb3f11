"""A request whose ``may_send`` says no is never sent: the provider clients over real HTTP.

No broker needed. The worker's HTTP client (:func:`make_http_client`, aiohttp's pool) talks
to the simulator started in-process (chat providers) or to a bare aiohttp server that
records every request it receives (SGLang's ``/generate``, which the simulator does not
serve). What reached the server is read from the server, not from the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from schemas import Message, PromptPublished
from services.common.config import Settings, load_settings
from services.inference.adapters.providers import Provider, make_provider
from services.inference.adapters.transport import make_http_client
from services.inference.calls import release_frames
from services.inference.core import NotSent, ProviderFailure
from services.profiles import load_profile
from services.simulator.app import RunningSimulator, start_simulator
from services.simulator.options import SimulatorOptions
from tests.bare_server import bare_server
from tests.gc_census import unreachable

PROFILE = load_profile("qwen3")


def _prompt(sample_id: str) -> PromptPublished:
    return PromptPublished(
        dataset="chat", sample_id=sample_id, messages=[Message(role="user", content="what is 2+2?")]
    )


def _settings(kind: str, base_url: str) -> Settings:
    return load_settings(None, provider={"kind": kind, "base_url": base_url, "concurrency": 4})


class Answers:
    """``may_send`` that answers yes for its first ``yes`` calls, then no; counts its calls."""

    def __init__(self, yes: int) -> None:
        self.yes = yes
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls <= self.yes


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimulator]:
    """The simulator on a free local port."""
    running = await start_simulator(SimulatorOptions(), profile=PROFILE)
    try:
        yield running
    finally:
        await running.close()


def _chat_requests(sim: RunningSimulator) -> int:
    return int(sim.stats()["total_requests"])


async def _complete(provider: Provider, settings: Settings, sample_id: str, may_send: Callable[[], bool]) -> Any:
    return await provider.complete(_prompt(sample_id), settings.defaults, max_tokens=16, may_send=may_send)


# yes = 0: no at the first question (before the client is called); 1: no once a connection is
# in hand, before the headers; 2: no just before the first body chunk (headers still buffered).
@pytest.mark.parametrize("yes", [0, 1, 2])
@pytest.mark.parametrize(("kind", "path"), [("simulator", "/api/v1"), ("openai", "/v1")])
async def test_a_request_withheld_by_may_send_never_reaches_the_simulator(
    sim: RunningSimulator, kind: str, path: str, yes: int
) -> None:
    settings = _settings(kind, f"http://{sim.host}:{sim.port}{path}")
    client = make_http_client(settings)
    try:
        provider = make_provider(settings, client)
        # A first request over the pool (a connection to reuse), then the withheld one.
        await _complete(provider, settings, "warm", lambda: True)
        assert _chat_requests(sim) == 1
        answers = Answers(yes)
        with pytest.raises(NotSent) as info:
            await _complete(provider, settings, "withheld", answers)
        assert not isinstance(info.value, ProviderFailure)
        assert answers.calls == yes + 1
        assert _chat_requests(sim) == 1
        assert set(sim.stats()["keys"]) == {"chat:warm"}
        # The client still sends what may go out.
        result = await _complete(provider, settings, "after", lambda: True)
        assert result.content or result.reasoning
        assert _chat_requests(sim) == 2
    finally:
        await client.aclose()


@pytest.mark.parametrize("yes", [1, 2])
async def test_a_withheld_request_leaves_nothing_for_the_cycle_collector(sim: RunningSimulator, yes: int) -> None:
    # Withheld once a connection is in hand, aiohttp reports the hook's NotSent as a connection
    # error raised from it: what reaches the caller must not close that chain into a cycle, and
    # once the worker dropped its tracebacks nothing of it may wait for the collector (at a halt
    # with thousands in flight, each withheld request waited for a full collection).
    settings = _settings("simulator", f"http://{sim.host}:{sim.port}/api/v1")
    client = make_http_client(settings)
    try:
        provider = make_provider(settings, client)
        await _complete(provider, settings, "warm", lambda: True)
        with unreachable() as found:
            for i in range(20):
                with pytest.raises(NotSent) as info:
                    await _complete(provider, settings, f"withheld-{i}", Answers(yes))
                release_frames(info.value)  # what the worker does with a withheld request
        assert [type(o).__name__ for o in found if isinstance(o, BaseException)] == []
        assert _chat_requests(sim) == 1
    finally:
        await client.aclose()


async def test_a_request_that_may_go_is_asked_at_every_stage_and_sent(sim: RunningSimulator) -> None:
    settings = _settings("simulator", f"http://{sim.host}:{sim.port}/api/v1")
    client = make_http_client(settings)
    try:
        answers = Answers(yes=100)
        result = await _complete(make_provider(settings, client), settings, "asked", answers)
    finally:
        await client.aclose()
    assert result.usage.completion_tokens
    # Before the client, once a connection is in hand, before the first body chunk.
    assert answers.calls == 3
    assert _chat_requests(sim) == 1


@pytest.mark.parametrize("yes", [0, 1, 2])
async def test_sglang_withheld_by_may_send_sends_nothing(yes: int) -> None:
    received: list[str] = []

    async def generate(request: web.Request) -> web.Response:
        received.append(request.path)
        await request.read()
        reply = {"text": "4", "output_ids": [19], "meta_info": {"finish_reason": {"type": "stop"}}}
        return web.json_response(reply)

    async with bare_server("/generate", generate) as port:
        settings = _settings("sglang", f"http://127.0.0.1:{port}")
        client = make_http_client(settings)
        try:
            provider = make_provider(settings, client)
            await _complete(provider, settings, "warm", lambda: True)
            assert received == ["/generate"]
            with pytest.raises(NotSent):
                await _complete(provider, settings, "withheld", Answers(yes))
            assert received == ["/generate"]
            result = await _complete(provider, settings, "after", lambda: True)
            assert result.native_output_ids == [19]
            assert received == ["/generate", "/generate"]
        finally:
            await client.aclose()


async def test_the_worker_client_keeps_no_cookie_a_provider_sets() -> None:
    # A provider (or the CDN in front of it) sets a cookie on every answer; the worker's client
    # keeps none and never sends one back: each request is authenticated by its key alone.
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({"ok": True})
        response.set_cookie("__cf_bm", "tracking", path="/")
        return response

    async with bare_server("/v1/chat/completions", handler) as port:
        client = make_http_client(_settings("openai", f"http://127.0.0.1:{port}/v1"))
        try:
            for _ in range(2):
                response = await client.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", content=b"{}", headers={}
                )
                assert response.status_code == 200 and "set-cookie" in response.headers
            assert len(client.cookies) == 0
        finally:
            await client.aclose()
    assert seen == [None, None]


async def test_an_answer_and_its_body_are_freed_without_the_cycle_collector() -> None:
    """httpx binds a response's stream to the response: left alone, each answer (and its body,
    megabytes with the logprobs of a long answer) lived until the cycle collector ran, whose
    young collections then took 100-160 ms at 1,000 in flight. The worker's client unbinds it.
    (A refusal lives on in its exception's traceback until that is collected: rare, and small.)"""
    import gc

    import httpx

    sim = await start_simulator(SimulatorOptions(logprobs=True), profile=PROFILE)
    settings = _settings("simulator", f"http://{sim.host}:{sim.port}/api/v1")
    client = make_http_client(settings)
    provider = make_provider(settings, client)
    gc.collect()
    gc.disable()  # what is alive now is what reference counting left
    try:
        # Responses other tests of the session still hold (in their exceptions, say) are not ours.
        before = {id(o) for o in gc.get_objects() if isinstance(o, httpx.Response)}
        for i in range(5):
            await provider.complete(_prompt(f"s{i}"), settings.defaults, max_tokens=16)
        alive = [o for o in gc.get_objects() if isinstance(o, httpx.Response) and id(o) not in before]
    finally:
        gc.enable()
        await client.aclose()
        requests = _chat_requests(sim)
        await sim.close()
    assert requests == 5
    assert alive == []
