"""The simulator over real HTTP: response shape, every transient fault, stats, the CLI process.

No broker needed: these tests talk to a simulator started in-process (or as a subprocess)
through httpx / aiohttp clients on localhost.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from schemas import Message
from services.profiles import load_profile
from services.simulator.app import RunningSimulator, SimulatorOptions, start_simulator

PROFILE = load_profile("deepseek-v3")
THINK_END = 128822
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

SimFactory = Callable[..., Awaitable[RunningSimulator]]


@pytest.fixture
async def sim_factory() -> AsyncIterator[SimFactory]:
    """Starts simulators with the given options and closes them after the test."""
    started: list[RunningSimulator] = []

    async def start(**options: Any) -> RunningSimulator:
        sim = await start_simulator(SimulatorOptions(**options), profile=PROFILE)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        await sim.close()


def body(text: str = "What is 12 * 34?", **extra: Any) -> dict[str, Any]:
    """A chat-completions request body."""
    return {"model": "deepseek/deepseek-v3", "messages": [{"role": "user", "content": text}], **extra}


async def post(
    client: httpx.AsyncClient, sim: RunningSimulator, payload: dict[str, Any], **headers: str
) -> httpx.Response:
    """POST to the OpenRouter path of ``sim``."""
    return await client.post(f"{sim.url}/chat/completions", json=payload, headers=headers)


async def test_response_shape_and_ground_truth(sim_factory: SimFactory) -> None:
    sim = await sim_factory(debug_true_ids=True)
    async with httpx.AsyncClient() as client:
        r = await post(client, sim, body(), **{"X-Draftstream-Key": "math:1", "Authorization": "Bearer sk-x"})
        again = await client.post(f"{sim.base_url}/v1/chat/completions", json=body())
    assert r.status_code == 200 and again.status_code == 200
    data = r.json()
    assert data["provider"] == "SimProvider" and data["model"] == "deepseek/deepseek-v3"
    choice = data["choices"][0]
    message = choice["message"]
    assert message["reasoning"] and message["content"]
    assert choice["finish_reason"] == "stop" and choice["native_finish_reason"] == "stop"
    assert choice["logprobs"] is None and "tool_calls" not in message
    true_ids = data["debug_true_ids"]
    rebuilt = PROFILE.encode(
        PROFILE.render_output(reasoning=message["reasoning"], content=message["content"])
    )
    assert rebuilt == true_ids
    usage = data["usage"]
    assert usage["completion_tokens"] == len(true_ids)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == true_ids.index(THINK_END)
    prompt = PROFILE.render_prompt([Message(role="user", content="What is 12 * 34?")], None)
    assert usage["prompt_tokens"] == len(PROFILE.encode(prompt))
    assert usage["cost"] == pytest.approx(len(true_ids) * 2e-6)
    assert again.json()["choices"][0]["message"] == message  # same prompt, same answer, other path
    assert "sk-x" not in json.dumps(sim.stats())


async def test_tool_calls_when_tools_are_sent(sim_factory: SimFactory) -> None:
    sim = await sim_factory(debug_true_ids=True)
    async with httpx.AsyncClient() as client:
        r = await post(client, sim, body("Weather in Oslo?", tools=[WEATHER_TOOL]))
    data = r.json()
    message = data["choices"][0]["message"]
    calls = message["tool_calls"]
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"]
    assert calls[0]["function"]["name"] == "get_weather"
    assert isinstance(calls[0]["function"]["arguments"], str)
    assert "city" in json.loads(calls[0]["function"]["arguments"])
    assert data["choices"][0]["finish_reason"] == "tool_calls"
    rebuilt = PROFILE.encode(
        PROFILE.render_output(reasoning=message["reasoning"], content=message["content"], tool_calls=calls)
    )
    assert rebuilt == data["debug_true_ids"]


async def test_logprobs_when_asked_or_forced(sim_factory: SimFactory) -> None:
    plain = await sim_factory(debug_true_ids=True)
    forced = await sim_factory(logprobs=True, debug_true_ids=True)
    async with httpx.AsyncClient() as client:
        asked = (await post(client, plain, body(logprobs=True, top_logprobs=1))).json()
        not_asked = (await post(client, plain, body())).json()
        by_flag = (await post(client, forced, body())).json()
    assert not_asked["choices"][0]["logprobs"] is None
    for data in (asked, by_flag):
        tokens = data["choices"][0]["logprobs"]["content"]
        assert [PROFILE.id_of_bytes(bytes(t["bytes"])) for t in tokens] == data["debug_true_ids"]
        assert tokens[-1]["token"] == PROFILE.end_of_turn
        assert "</think>" in [t["token"] for t in tokens]


async def test_max_tokens_gives_length(sim_factory: SimFactory) -> None:
    sim = await sim_factory(debug_true_ids=True)
    async with httpx.AsyncClient() as client:
        data = (await post(client, sim, body(max_tokens=7))).json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert len(data["debug_true_ids"]) == 7 == data["usage"]["completion_tokens"]


async def test_429_has_retry_after_and_a_retry_succeeds(sim_factory: SimFactory) -> None:
    sim = await sim_factory(retry_after_s=2)
    async with httpx.AsyncClient() as client:
        limited = await post(client, sim, body(), **{"X-Simulator-Fault": "429", "X-Draftstream-Key": "d:1"})
        retried = await post(client, sim, body(), **{"X-Draftstream-Key": "d:1"})
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2"
    assert limited.json()["error"]["code"] == 429
    assert retried.status_code == 200
    stats = sim.stats()
    assert stats["keys"] == {"d:1": 2} and stats["key_faults"] == {"d:1": ["429"]}


async def test_5xx(sim_factory: SimFactory) -> None:
    sim = await sim_factory()
    async with httpx.AsyncClient() as client:
        r = await post(client, sim, body(), **{"X-Simulator-Fault": "5xx"})
    assert r.status_code in (500, 502, 503)
    assert r.json()["error"]["code"] == r.status_code


async def test_timeout_stalls_past_the_client_deadline(sim_factory: SimFactory) -> None:
    sim = await sim_factory(timeout_sleep_s=30.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await post(client, sim, body(), **{"X-Simulator-Fault": "timeout"})
        ok = await post(client, sim, body())
    assert ok.status_code == 200
    assert sim.stats()["faults"] == {"timeout": 1}


async def test_drop_closes_the_connection_mid_body(sim_factory: SimFactory) -> None:
    sim = await sim_factory()
    async with httpx.AsyncClient() as client:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await post(client, sim, body(), **{"X-Simulator-Fault": "drop"})
        ok = await post(client, sim, body())
    assert ok.status_code == 200


async def test_malformed_is_invalid_json_with_200(sim_factory: SimFactory) -> None:
    sim = await sim_factory()
    async with httpx.AsyncClient() as client:
        r = await post(client, sim, body(), **{"X-Simulator-Fault": "malformed"})
    assert r.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.content)


async def test_error_in_200(sim_factory: SimFactory) -> None:
    sim = await sim_factory()
    async with httpx.AsyncClient() as client:
        r = await post(client, sim, body(), **{"X-Simulator-Fault": "error_in_200"})
    assert r.status_code == 200
    assert r.json()["error"]["code"] == 502 and "choices" not in r.json()


async def test_random_transient_faults_are_seeded_and_retries_succeed(sim_factory: SimFactory) -> None:
    outcomes = []
    for _ in range(2):
        sim = await sim_factory(seed=5, rate_429=0.3, rate_5xx=0.3, retry_after_s=0)
        async with httpx.AsyncClient() as client:
            codes = [(await post(client, sim, body(f"q{i}"))).status_code for i in range(20)]
            for i, code in enumerate(codes):
                attempts = 0
                while code != 200 and attempts < 50:
                    code = (await post(client, sim, body(f"q{i}"))).status_code
                    attempts += 1
                assert code == 200
        outcomes.append(codes)
    assert outcomes[0] == outcomes[1]  # same seed, same fault sequence
    assert {429, 200} <= set(outcomes[0]) and set(outcomes[0]) & {500, 502, 503}


async def test_content_faults_reproduce_on_retry(sim_factory: SimFactory) -> None:
    sim = await sim_factory(rate_truncate=0.5, debug_true_ids=True)
    async with httpx.AsyncClient() as client:
        first = [(await post(client, sim, body(f"p{i}"))).json() for i in range(12)]
        second = [(await post(client, sim, body(f"p{i}"))).json() for i in range(12)]
    reasons = [d["choices"][0]["finish_reason"] for d in first]
    assert reasons == [d["choices"][0]["finish_reason"] for d in second]
    assert "length" in reasons and "stop" in reasons
    for data in first:
        if data["choices"][0]["finish_reason"] == "length":
            assert THINK_END not in data["debug_true_ids"]
            assert data["choices"][0]["message"]["content"] == ""
    assert sim.stats()["faults"]["truncate"] == 2 * reasons.count("length")


async def test_forced_content_faults_over_http(sim_factory: SimFactory) -> None:
    sim = await sim_factory(debug_true_ids=True, logprobs=True)
    async with httpx.AsyncClient() as client:
        clean = (await post(client, sim, body())).json()
        same = (await post(client, sim, body(), **{"X-Simulator-Fault": "noncanonical_same"})).json()
        longer = (await post(client, sim, body(), **{"X-Simulator-Fault": "noncanonical_len"})).json()
        empty = (await post(client, sim, body(), **{"X-Simulator-Fault": "empty_reasoning"})).json()
        bad = (await post(client, sim, body(), **{"X-Simulator-Fault": "bad_usage"})).json()
    for data in (same, longer):
        assert data["choices"][0]["message"] == clean["choices"][0]["message"]  # text cannot tell
        assert PROFILE.decode(data["debug_true_ids"]) == PROFILE.decode(clean["debug_true_ids"])
    assert len(same["debug_true_ids"]) == len(clean["debug_true_ids"]) == same["usage"]["completion_tokens"]
    assert same["debug_true_ids"] != clean["debug_true_ids"]
    assert len(longer["debug_true_ids"]) == len(clean["debug_true_ids"]) + 1
    assert empty["choices"][0]["message"]["reasoning"] is None
    assert bad["usage"]["completion_tokens"] - len(bad["debug_true_ids"]) >= 1000


async def test_bad_requests_get_400(sim_factory: SimFactory) -> None:
    sim = await sim_factory()
    async with httpx.AsyncClient() as client:
        not_json = await client.post(f"{sim.url}/chat/completions", content=b"{oops")
        no_messages = await post(client, sim, {"model": "m"})
        bad_fault = await post(client, sim, body(), **{"X-Simulator-Fault": "gremlins"})
    assert [r.status_code for r in (not_json, no_messages, bad_fault)] == [400, 400, 400]
    assert "gremlins" in bad_fault.json()["error"]["message"]


async def test_stats_endpoint_and_requests_after(sim_factory: SimFactory) -> None:
    sim = await sim_factory()
    async with httpx.AsyncClient() as client:
        health = await client.get(f"{sim.base_url}/health")
        for i in range(3):
            await post(client, sim, body(), **{"X-Draftstream-Key": f"ds:{i % 2}"})
        mark = time.time()
        assert sim.requests_after(mark) == 0
        await post(client, sim, body(), **{"X-Draftstream-Key": "ds:9"})
        stats = (await client.get(f"{sim.base_url}/_sim/stats", params={"after": mark})).json()
        bad_after = await client.get(f"{sim.base_url}/_sim/stats", params={"after": "soon"})
    assert health.json()["status"] == "ok"
    assert stats["total_requests"] == 4
    assert stats["keys"] == {"ds:0": 2, "ds:1": 1, "ds:9": 1}
    assert stats["requests_after"] == 1 == sim.requests_after(mark)
    assert stats["last_request_at"] >= mark and len(stats["last_request_times"]) == 4
    assert bad_after.status_code == 400


async def test_thousand_concurrent_requests_at_two_seconds(sim_factory: SimFactory) -> None:
    import aiohttp

    n = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * n + 256  # client and server sockets live in this one process
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    sim = await sim_factory(latency_s=2.0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> int:
            async with session.post(f"{sim.url}/chat/completions", json=body(f"load {i % 50}")) as r:
                await r.read()
                return r.status

        await one(0)  # warm the generation cache for nothing but this prompt
        started = time.perf_counter()
        statuses = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - started
    print(f"\n{n} concurrent requests at 2 s latency finished in {elapsed:.2f} s")
    assert statuses.count(200) == n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_cli_serves_until_sigint(tmp_path: Any) -> None:
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "draftstream")
    log_path = tmp_path / "simulator.log"
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            exe,
            "simulate-provider",
            "--port",
            str(port),
            "--fault-rate",
            "error_in_200=1",
            stdout=log,
            stderr=log,
        )
        try:
            async with httpx.AsyncClient() as client:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert proc.returncode is None, log_path.read_text()
                    assert time.monotonic() < deadline, "simulator did not start"
                    await asyncio.sleep(0.2)
                r = await client.post(f"http://127.0.0.1:{port}/api/v1/chat/completions", json=body())
                assert r.json()["error"]["code"] == 502
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0, log_path.read_text()
    assert "simulator stopped" in log_path.read_text()
