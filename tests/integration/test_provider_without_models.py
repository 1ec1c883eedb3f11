"""A provider without ``GET /models`` is unknown, not down: the worker on a real broker.

A bare aiohttp server serves ``POST /v1/chat/completions`` (handed to the simulator over
HTTP) and answers ``GET /v1/models`` with a fixed status. 404, 405 and 501 mean the server
has no model list: pre-flight goes on and every prompt is answered. 401 still halts at
pre-flight, before a single chat request is sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from schemas import Halt, decode_control, encode
from services.common.config import Settings
from services.common.kafka import ensure_topics
from services.inference.core import PREFLIGHT_ACTOR
from services.simulator.app import RunningSimulator
from tests.integration.test_inference_worker import (  # the worker tests' helpers
    Collector,
    prompt,
    provider_cfg,
    publish,
    running,
    sim_factory,  # noqa: F401 - a fixture
)
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka


class ChatOnly:
    """A server with chat completions and a fixed answer to ``GET /v1/models``; counts both."""

    def __init__(self, sim: RunningSimulator, models_status: int) -> None:
        self.sim = sim
        self.models_status = models_status
        self.models_asked = 0
        self.chats = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def chat(self, request: web.Request) -> web.Response:
        self.chats += 1
        async with httpx.AsyncClient() as client:
            upstream = await client.post(
                f"http://{self.sim.host}:{self.sim.port}/v1/chat/completions",
                content=await request.read(),
                headers={k: v for k, v in request.headers.items() if k.lower().startswith("x-")},
            )
        return web.Response(status=upstream.status_code, body=upstream.content, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        return web.json_response({"error": {"message": "not here"}}, status=self.models_status)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture
async def chat_only(sim_factory: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:  # noqa: F811
    """Starts :class:`ChatOnly` servers in front of a simulator; closes them after the test."""
    started: list[ChatOnly] = []

    async def start(models_status: int) -> tuple[ChatOnly, str]:
        server = ChatOnly(await sim_factory(), models_status)
        started.append(server)
        return server, await server.start()

    yield start
    for server in started:
        if server.runner is not None:
            await server.runner.cleanup()


async def _started(chat_only: Callable[..., Any], factory: Callable[..., Settings], status: int, n: int) -> Any:
    """A :class:`ChatOnly` server answering ``status`` on the model list, settings for it, n prompts sent."""
    server, url = await chat_only(status)
    settings = factory(provider=provider_cfg(server.sim, kind="openai", base_url=url, concurrency=4))
    await ensure_topics(settings.kafka, ["chat"])
    prompts = [prompt("chat", i) for i in range(n)]
    await publish(settings, "chat", [(p.sample_id, encode(p)) for p in prompts])
    return server, settings, prompts


@pytest.mark.parametrize("status", [501, 404, 405])
async def test_a_provider_without_a_model_list_runs_to_the_end(
    settings_factory: Callable[..., Settings], chat_only: Callable[..., Any], status: int
) -> None:
    server, settings, prompts = await _started(chat_only, settings_factory, status, 10)
    async with Collector(settings, "responses", "dead-letter", "control") as out, running(settings) as worker:
        await wait_until(lambda: len(out.finished_keys()) >= 10, timeout=60, message="all 10 answered")
        assert worker.halted_scopes == []
    assert server.models_asked >= 1
    assert out.dead_letters() == []
    assert {r.sample_id for r in out.responses()} == {p.sample_id for p in prompts}
    assert server.chats == 10
    assert out.records["control"] == []  # nothing halted, so nothing to resume


async def test_a_provider_refusing_the_key_on_the_model_list_still_halts_at_preflight(
    settings_factory: Callable[..., Settings], chat_only: Callable[..., Any]
) -> None:
    server, settings, prompts = await _started(chat_only, settings_factory, 401, 3)
    async with Collector(settings, "responses", "dead-letter", "control") as out, running(settings) as worker:
        await wait_until(lambda: out.records["control"], timeout=30, message="pre-flight halt published")
        halt = decode_control(out.records["control"][0].value)
        scope = f"provider:{settings.provider.label}"
        assert isinstance(halt, Halt) and halt.scope == scope and halt.by == PREFLIGHT_ACTOR
        assert "401" in halt.reason
        await wait_until(lambda: worker.halted_scopes == [scope], timeout=10, message="worker halted")
    assert server.chats == 0
    assert out.responses() == [] and out.dead_letters() == []
