"""The OpenRouter-like router over real HTTP: routing preferences, the named upstream, habits.

No broker needed: the router and its upstream simulators run in-process; requests go over
localhost with httpx, shaped as OpenRouter documents them (``provider.order`` / ``only`` /
``ignore`` / ``allow_fallbacks``, https://openrouter.ai/docs/features/provider-routing).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.simulator.options import SimulatorOptions
from services.simulator.router import (
    RouteError,
    RunningRouter,
    Upstream,
    choose_upstreams,
    habit_upstreams,
    start_router,
)
from services.simulator.server import KEY_HEADER

UPSTREAMS = [Upstream("a"), Upstream("b"), Upstream("c")]


def test_load_balancing_spreads_requests_over_every_upstream() -> None:
    rng = random.Random(1)
    firsts = Counter(choose_upstreams(None, UPSTREAMS, rng)[0] for _ in range(300))
    assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) > 50
    assert sorted(choose_upstreams({}, UPSTREAMS, rng)) == ["a", "b", "c"]  # the others as fallbacks


def test_order_only_ignore_and_fallbacks() -> None:
    rng = random.Random(2)
    assert choose_upstreams({"order": ["c", "a"]}, UPSTREAMS, rng)[:2] == ["c", "a"]
    assert choose_upstreams({"order": ["c", "a"], "allow_fallbacks": False}, UPSTREAMS, rng) == ["c", "a"]
    assert choose_upstreams({"only": ["b"]}, UPSTREAMS, rng) == ["b"]
    assert set(choose_upstreams({"ignore": ["a"]}, UPSTREAMS, rng)) == {"b", "c"}
    assert len(choose_upstreams({"allow_fallbacks": False}, UPSTREAMS, rng)) == 1
    assert choose_upstreams({"order": ["x", "b"], "only": ["b", "c"]}, UPSTREAMS, rng)[0] == "b"


@pytest.mark.parametrize(
    "preferences",
    [{"only": ["nobody"]}, {"only": ["a"], "ignore": ["a"]}, {"order": "a"}, "lossless"],
)
def test_no_upstream_left_or_a_malformed_preference_is_a_route_error(preferences: Any) -> None:
    with pytest.raises(RouteError):
        choose_upstreams(preferences, UPSTREAMS, random.Random(0))


@pytest.fixture
async def router() -> AsyncIterator[RunningRouter]:
    running = await start_router(
        habit_upstreams(SimulatorOptions(seed=3, reasoning_tokens=(8, 20), content_tokens=(8, 20)))
        + [Upstream("flaky", SimulatorOptions(provider_name="flaky", rate_5xx=1.0))]
    )
    try:
        yield running
    finally:
        await running.close()


async def ask(router: RunningRouter, i: int, provider: Any = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {
        "model": "qwen/qwen3-8b",
        "messages": [{"role": "user", "content": f"What is {i} + 2?"}],
        "max_tokens": 64,
        **extra,
    }
    if provider is not None:
        body["provider"] = provider
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(f"{router.url}/chat/completions", json=body, headers={KEY_HEADER: f"r:s{i}"})


async def test_reply_names_the_upstream_the_preferences_chose(router: RunningRouter) -> None:
    for i, name in enumerate(("lossless", "stripping", "eot-uncounted", "wrong-usage")):
        reply = await ask(router, i, {"only": [name]})
        assert reply.status_code == 200 and reply.json()["provider"] == name
    reply = await ask(router, 9, {"order": ["stripping", "lossless"], "allow_fallbacks": False})
    assert reply.json()["provider"] == "stripping"
    stats = router.stats()
    assert stats["total_requests"] == 5
    assert stats["upstreams"]["stripping"]["total_requests"] == 2 and stats["key_upstreams"]["r:s9"] == ["stripping"]
    unknown = await ask(router, 10, {"only": ["nobody"]})
    assert unknown.status_code == 404 and "No allowed providers" in unknown.text


async def test_a_failing_upstream_falls_back_unless_fallbacks_are_off(router: RunningRouter) -> None:
    reply = await ask(router, 1, {"order": ["flaky", "lossless"]})
    assert reply.status_code == 200 and reply.json()["provider"] == "lossless"
    assert router.stats()["key_upstreams"]["r:s1"] == ["flaky", "lossless"]
    pinned = await ask(router, 2, {"order": ["flaky"], "allow_fallbacks": False})
    assert pinned.status_code >= 500


async def test_habits_show_in_the_answers(router: RunningRouter) -> None:
    with_logprobs = (await ask(router, 1, {"only": ["lossless"]}, logprobs=True)).json()
    assert with_logprobs["choices"][0]["logprobs"]["content"]
    null = (await ask(router, 1, {"only": ["logprobs-null"]}, logprobs=True)).json()
    assert null["provider"] == "logprobs-null" and null["choices"][0]["logprobs"] is None
    for i in range(8):
        message = (await ask(router, i, {"only": ["stripping"]})).json()["choices"][0]["message"]
        for text in (message.get("reasoning") or "", message.get("content") or ""):
            assert text == text.strip()
    assert router.configuration()["stripping"]["whitespace"] == "stripped"
    assert router.configuration()["eot-uncounted"]["end_of_turn_counted"] is False
    assert router.configuration()["logprobs-null"]["logprobs"] == "null"
