"""The simulator over real HTTP: response shape, every transient fault, stats, the CLI process.

No broker needed: these tests talk to a simulator started in-process (or as a subprocess)
through httpx / aiohttp clients on localhost. Ground truth is checked against things the
simulator did not make: Qwen3's special tokens put back by hand around the parsed fields,
and the official Qwen3 chat template from ``../shared/reference`` rendered by transformers.
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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from schemas import Message
from services.profiles import load_profile
from services.simulator.app import RunningSimulator, start_simulator
from services.simulator.options import SimulatorOptions
from services.simulator.server import KEY_HEADER
from tests.kafka_fixture import wait_until

PROFILE = load_profile("qwen3")
THINK_START, THINK_END, EOT = 151667, 151668, 151645  # Qwen3's ids (TOKENS.md)
REPO = Path(__file__).resolve().parents[2]
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

SimFactory = Callable[..., Awaitable[RunningSimulator]]


def official_qwen3_template() -> Path:
    """The official Qwen3 chat template (``$DRAFTSTREAM_REFERENCE_DIR`` or ``../shared/reference``)."""
    base = Path(os.environ.get("DRAFTSTREAM_REFERENCE_DIR") or REPO.parent / "shared" / "reference")
    path = base / "chat-templates" / "Qwen-Qwen3-0.6B.jinja"
    if not path.is_file():
        pytest.fail(f"reference template {path} not found (set DRAFTSTREAM_REFERENCE_DIR): the truth must come from it")
    return path


def hf_render(template: Path, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The generation prompt transformers renders from ``template`` (independent of the simulator)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=template.read_text(encoding="utf-8"),
        add_generation_prompt=True,
        **kwargs,
    )
    return str(rendered[0])


def put_back(message: dict[str, Any], calls: str = "") -> str:
    """Qwen3's raw answer from vLLM-parsed fields: the stripped specials put back by hand."""
    return "<think>" + (message["reasoning"] or "") + "</think>" + message["content"] + calls + "<|im_end|>"


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
    return {"model": "qwen/qwen3", "messages": [{"role": "user", "content": text}], **extra}


async def post(
    client: httpx.AsyncClient, sim: RunningSimulator, payload: dict[str, Any], **headers: str
) -> httpx.Response:
    """POST to the OpenRouter path of ``sim``."""
    return await client.post(f"{sim.url}/chat/completions", json=payload, headers=headers)


async def true_ids(client: httpx.AsyncClient, base_url: str, key: str) -> list[int]:
    """The true output ids of ``key``'s last full answer, from ``GET /_sim/truth`` (never from a body)."""
    r = await client.get(f"{base_url}/_sim/truth", params={"key": key})
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["true_ids"]
    return ids


async def answered(
    client: httpx.AsyncClient, sim: RunningSimulator, payload: dict[str, Any], **headers: str
) -> tuple[dict[str, Any], list[int]]:
    """POST under a fresh sample key: the answer's body and its true ids."""
    key = f"t:{uuid.uuid4().hex}"
    r = await post(client, sim, payload, **{KEY_HEADER: key, **headers})
    assert r.status_code == 200, r.text
    return r.json(), await true_ids(client, sim.base_url, key)


async def test_response_shape_and_ground_truth(sim_factory: SimFactory) -> None:
    sim = await sim_factory(keep_truth=True)
    async with httpx.AsyncClient() as client:
        r = await post(client, sim, body(), **{"X-Draftstream-Key": "math:1", "Authorization": "Bearer sk-x"})
        again = await client.post(f"{sim.base_url}/v1/chat/completions", json=body())
        truth = await true_ids(client, sim.base_url, "math:1")
    assert r.status_code == 200 and again.status_code == 200
    data = r.json()
    assert data["provider"] == "SimProvider" and data["model"] == "qwen/qwen3"
    choice = data["choices"][0]
    message = choice["message"]
    assert message["reasoning"] and message["content"]
    assert choice["finish_reason"] == "stop" and choice["native_finish_reason"] == "stop"
    assert choice["logprobs"] is None and "tool_calls" not in message
    assert "token_ids" not in choice and "prompt_token_ids" not in data  # only on return_token_ids
    assert PROFILE.encode(put_back(message)) == truth
    assert truth[0] == THINK_START and truth[-1] == EOT
    usage = data["usage"]
    assert usage["completion_tokens"] == len(truth)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == truth.index(THINK_END)
    prompt = PROFILE.render_prompt([Message(role="user", content="What is 12 * 34?")], None)
    assert usage["prompt_tokens"] == len(PROFILE.encode_prompt(prompt))
    assert usage["cost"] == pytest.approx(len(truth) * 2e-6)
    assert again.json()["choices"][0]["message"] == message  # same prompt, same answer, other path
    assert "sk-x" not in json.dumps(sim.stats())



async def test_truth_is_served_apart_per_sample_key(sim_factory: SimFactory) -> None:
    """GET /_sim/truth: the last answer served in full per key; faulted answers never count."""
    sim = await sim_factory(keep_truth=True)
    silent = await sim_factory()
    async with httpx.AsyncClient() as client:
        ok = await post(client, sim, body("one"), **{KEY_HEADER: "d:ok"})
        cut = await post(client, sim, body("two"), **{KEY_HEADER: "d:cut", "X-Simulator-Fault": "malformed"})
        limited = await post(client, sim, body("two"), **{KEY_HEADER: "d:429", "X-Simulator-Fault": "429"})
        every = await client.get(f"{sim.base_url}/_sim/truth")
        unknown = await client.get(f"{sim.base_url}/_sim/truth", params={"key": "d:cut"})
        off = await client.get(f"{silent.base_url}/_sim/truth", params={"key": "d:ok"})
        one = await true_ids(client, sim.base_url, "d:ok")
    assert ok.status_code == 200 and cut.status_code == 200 and limited.status_code == 429
    assert every.status_code == 200 and every.json() == {"truth": {"d:ok": one}} == {"truth": sim.truth()}
    message = ok.json()["choices"][0]["message"]
    assert PROFILE.encode(put_back(message)) == one  # the ids of the text this very answer carried
    assert "debug_true_ids" not in ok.json() and "debug_true_ids" not in message
    assert unknown.status_code == 404 and "'d:cut'" in unknown.json()["error"]["message"]
    assert off.status_code == 404 and "keep_truth" in off.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="keep_truth"):
        silent.truth()


async def test_tool_calls_when_tools_are_sent(sim_factory: SimFactory) -> None:
    sim = await sim_factory(keep_truth=True)
    async with httpx.AsyncClient() as client:
        data, truth = await answered(client, sim, body("Weather in Oslo?", tools=[WEATHER_TOOL]))
    message = data["choices"][0]["message"]
    calls = message["tool_calls"]
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"]
    assert calls[0]["function"]["name"] == "get_weather"
    assert isinstance(calls[0]["function"]["arguments"], str)
    assert "city" in json.loads(calls[0]["function"]["arguments"])
    assert data["choices"][0]["finish_reason"] == "tool_calls"
    name, arguments = calls[0]["function"]["name"], calls[0]["function"]["arguments"]
    native = f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    assert PROFILE.encode(put_back(message, native)) == truth


async def test_logprobs_when_asked_or_forced(sim_factory: SimFactory) -> None:
    plain = await sim_factory(keep_truth=True)
    forced = await sim_factory(logprobs=True, keep_truth=True)
    async with httpx.AsyncClient() as client:
        asked = await answered(client, plain, body(logprobs=True, top_logprobs=1))
        not_asked = (await post(client, plain, body())).json()
        by_flag = await answered(client, forced, body())
    assert not_asked["choices"][0]["logprobs"] is None
    for data, truth in (asked, by_flag):
        tokens = data["choices"][0]["logprobs"]["content"]
        assert [PROFILE.id_of_bytes(bytes(t["bytes"])) for t in tokens] == truth
        assert tokens[-1]["token"] == PROFILE.end_of_turn
        assert "</think>" in [t["token"] for t in tokens]


async def test_max_tokens_gives_length(sim_factory: SimFactory) -> None:
    sim = await sim_factory(keep_truth=True)
    async with httpx.AsyncClient() as client:
        data, truth = await answered(client, sim, body(max_tokens=7))
    assert data["choices"][0]["finish_reason"] == "length"
    assert len(truth) == 7 == data["usage"]["completion_tokens"]


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


async def test_a_rate_limit_refuses_beyond_its_bucket_and_its_open_cap_like_openrouter(
    sim_factory: SimFactory,
) -> None:
    sim = await sim_factory(rate_limit_rps=1.0, rate_limit_burst=2.0, max_open=1, retry_after_s=1.0, latency_s=0.3)
    async with httpx.AsyncClient() as client:
        # Two at once: the open cap (1) refuses the second while the first is answered.
        first, second = await asyncio.gather(post(client, sim, body()), post(client, sim, body()))
        third = await post(client, sim, body())  # the bucket's second token
        fourth = await post(client, sim, body())  # 0.6 of a token left: 0.4 s to the next
        key = (await client.get(f"{sim.url}/key", headers={"Authorization": "Bearer x"})).json()["data"]
    statuses = sorted([first.status_code, second.status_code])
    assert statuses == [200, 429] and third.status_code == 200 and fourth.status_code == 429
    capped = first if first.status_code == 429 else second
    assert capped.headers["Retry-After"] == "1" and capped.headers["X-RateLimit-Limit"] == "1"
    error = capped.json()["error"]
    assert error["code"] == 429 and "open at once" in error["message"]
    assert error["metadata"]["headers"]["X-RateLimit-Remaining"] == "0"
    assert 0 < float(fourth.headers["Retry-After"]) <= 0.5 and fourth.headers["X-RateLimit-Limit"] == "1/s"
    assert "per second" in fourth.json()["error"]["message"]
    stats = sim.stats()
    assert stats["rate_limited"] == 2 and stats["statuses"] == {"200": 2, "429": 2}
    assert stats["max_open_requests"] == 1 and stats["peak_open_requests"] == 2  # the refused one, a moment
    assert key["rate_limit"] == {"requests": 1.0, "interval": "1s"}  # topology: not a topic
    sim.server.set_rate_limit(None)  # lifted while serving
    async with httpx.AsyncClient() as client:
        assert all(r.status_code == 200 for r in await asyncio.gather(*(post(client, sim, body()) for _ in range(5))))


async def test_the_simulator_is_quiet_only_while_few_requests_are_open() -> None:
    """Its full cycle collections wait for a quiet spell (QuietCollector): not with many open."""
    from services.simulator.app import QUIET_OPEN, SimulatorService

    service = SimulatorService(SimulatorOptions(hold_until_open=QUIET_OPEN + 2), "127.0.0.1", 0, PROFILE)
    assert service.quiet()  # not started: nothing open
    await service.start()
    sim = service.running
    assert sim is not None
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
            # The answers are held until QUIET_OPEN + 2 are open at once.
            answers = asyncio.gather(*(post(client, sim, body()) for _ in range(QUIET_OPEN + 1)))
            await wait_until(lambda: sim.server.stats.open > QUIET_OPEN, 10, message="the requests open")
            assert not service.quiet()
            assert (await post(client, sim, body())).status_code == 200  # the last one: all are answered
            assert all(r.status_code == 200 for r in await answers)
        assert sim.server.stats.open == 0 and service.quiet()
    finally:
        await service.close()


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
    sim = await sim_factory(rate_truncate=0.5, keep_truth=True)
    async with httpx.AsyncClient() as client:
        first = [await answered(client, sim, body(f"p{i}")) for i in range(12)]
        second = [(await post(client, sim, body(f"p{i}"))).json() for i in range(12)]
    reasons = [d["choices"][0]["finish_reason"] for d, _ in first]
    assert reasons == [d["choices"][0]["finish_reason"] for d in second]
    assert "length" in reasons and "stop" in reasons
    for data, truth in first:
        if data["choices"][0]["finish_reason"] == "length":
            assert THINK_END not in truth
            message = data["choices"][0]["message"]
            assert message["content"] == ""  # cut inside the reasoning: reasoning only
            assert PROFILE.encode("<think>" + message["reasoning"]) == truth
    assert sim.stats()["faults"]["truncate"] == 2 * reasons.count("length")


async def test_forced_content_faults_over_http(sim_factory: SimFactory) -> None:
    sim = await sim_factory(keep_truth=True, logprobs=True)
    async with httpx.AsyncClient() as client:
        clean, clean_ids = await answered(client, sim, body())
        same, same_ids = await answered(client, sim, body(), **{"X-Simulator-Fault": "noncanonical_same"})
        longer, longer_ids = await answered(client, sim, body(), **{"X-Simulator-Fault": "noncanonical_len"})
        empty, empty_ids = await answered(client, sim, body(), **{"X-Simulator-Fault": "empty_reasoning"})
        bad, bad_ids = await answered(client, sim, body(), **{"X-Simulator-Fault": "bad_usage"})
    for data, ids in ((same, same_ids), (longer, longer_ids)):
        assert data["choices"][0]["message"] == clean["choices"][0]["message"]  # text cannot tell
        assert PROFILE.decode(ids) == PROFILE.decode(clean_ids)
    assert len(same_ids) == len(clean_ids) == same["usage"]["completion_tokens"]
    assert same_ids != clean_ids
    assert len(longer_ids) == len(clean_ids) + 1
    # Qwen3's empty think block is "<think>\n\n</think>": vLLM returns its newlines as the reasoning.
    assert empty["choices"][0]["message"]["reasoning"] == "\n\n"
    assert empty_ids[:3] == [THINK_START, *PROFILE.encode("\n\n"), THINK_END]
    assert bad["usage"]["completion_tokens"] - len(bad_ids) >= 1000


async def test_return_token_ids_gives_vllms_ids(sim_factory: SimFactory) -> None:
    sim = await sim_factory(keep_truth=True, chat_template_file=str(official_qwen3_template()))
    async with httpx.AsyncClient() as client:
        data, truth = await answered(client, sim, body("ids please", return_token_ids=True))
    choice = data["choices"][0]
    official = hf_render(official_qwen3_template(), [{"role": "user", "content": "ids please"}])
    assert data["prompt_token_ids"] == PROFILE.encode_prompt(official)
    assert choice["token_ids"] == truth == PROFILE.encode(put_back(choice["message"]))


async def test_official_template_drives_prompt_tokens_and_thinking(sim_factory: SimFactory) -> None:
    template = official_qwen3_template()
    sim = await sim_factory(keep_truth=True, chat_template_file=str(template))
    messages = [{"role": "system", "content": "Be brief. Café ≥ 5°C."}, {"role": "user", "content": "Hi, Ω?"}]
    async with httpx.AsyncClient() as client:
        on, on_ids = await answered(client, sim, {"model": "m", "messages": messages})
        off, off_ids = await answered(
            client, sim, {"model": "m", "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
        )
        tools = (await post(client, sim, {"model": "m", "messages": messages, "tools": [WEATHER_TOOL]})).json()
    assert on["usage"]["prompt_tokens"] == len(PROFILE.encode_prompt(hf_render(template, messages)))
    assert tools["usage"]["prompt_tokens"] == len(
        PROFILE.encode_prompt(hf_render(template, messages, tools=[WEATHER_TOOL]))
    )
    off_prompt = hf_render(template, messages, enable_thinking=False)
    assert off_prompt.endswith("<think>\n\n</think>\n\n")
    assert off["usage"]["prompt_tokens"] == len(PROFILE.encode_prompt(off_prompt))
    # Thinking off: the prompt closed the think block, the model answers straight away.
    message = off["choices"][0]["message"]
    assert message["reasoning"] is None and off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert PROFILE.encode(message["content"] + "<|im_end|>") == off_ids
    assert THINK_START not in off_ids and THINK_END not in off_ids
    assert PROFILE.encode(put_back(on["choices"][0]["message"])) == on_ids


async def test_sglang_legacy_parser_strips_the_fields(sim_factory: SimFactory) -> None:
    vllm = await sim_factory(keep_truth=True)
    legacy = await sim_factory(keep_truth=True, parser="sglang-legacy")
    async with httpx.AsyncClient() as client:
        a, a_ids = await answered(client, vllm, body("strip test"))
        b, b_ids = await answered(client, legacy, body("strip test"))
    assert a_ids == b_ids  # the same model output, parsed by another server
    raw, kept = a["choices"][0]["message"], b["choices"][0]["message"]
    assert kept["reasoning"] == raw["reasoning"].strip() != raw["reasoning"]
    assert kept["content"] == raw["content"].strip() != raw["content"]
    assert b["usage"]["completion_tokens"] == len(b_ids)  # the count still covers every id


async def test_a_template_refusing_the_prompt_is_a_400(sim_factory: SimFactory, tmp_path: Path) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}ok")
    sim = await sim_factory(chat_template_file=str(template))
    async with httpx.AsyncClient() as client:
        refused = await post(client, sim, body())
    assert refused.status_code == 400 and "system first" in refused.json()["error"]["message"]


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
            "--metrics-port",
            "0",
            "--parser",
            "sglang-legacy",
            "--chat-template-file",
            str(official_qwen3_template()),
            "--keep-truth",
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
                url = f"http://127.0.0.1:{port}/api/v1/chat/completions"
                r = await client.post(url, json=body(), headers={"X-Simulator-Fault": "error_in_200"})
                assert r.json()["error"]["code"] == 502
                ok = (await client.post(url, json=body(), headers={KEY_HEADER: "cli:1"})).json()
                message = ok["choices"][0]["message"]
                assert message["reasoning"] == message["reasoning"].strip() and message["content"].strip()
                official = hf_render(official_qwen3_template(), body()["messages"])
                assert ok["usage"]["prompt_tokens"] == len(PROFILE.encode_prompt(official))
                truth = await true_ids(client, f"http://127.0.0.1:{port}", "cli:1")
                assert PROFILE.decode(truth).startswith("<think>\n")
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0, log_path.read_text()
    assert "simulator stopped" in log_path.read_text()


async def test_an_answer_whose_client_went_away_is_billed_and_the_key_reports_what_was_charged(
    sim_factory: SimFactory,
) -> None:
    """As a provider bills a non-streaming answer generated for nobody; ``GET /api/v1/key`` in OpenRouter's shape."""
    sim = await sim_factory(latency_s=0.6)
    auth = {"Authorization": "Bearer sk-test"}
    async with httpx.AsyncClient(timeout=10.0) as client:
        whole = await post(client, sim, body("first"))
        cost = whole.json()["usage"]["cost"]
        key = (await client.get(f"{sim.url}/key", headers=auth)).json()["data"]
        assert key["usage"] == pytest.approx(cost) and cost > 0
        assert {"limit", "limit_remaining", "usage_daily", "is_free_tier"} <= set(key)
        with pytest.raises(httpx.TimeoutException):  # the client gives up while the answer is generated
            await client.post(f"{sim.url}/chat/completions", json=body("second"), timeout=0.2)
        await wait_until(lambda: sim.stats()["abandoned_billed"] == 1, 10, 0.05, message="abandoned answer billed")
        stats = sim.stats()
        key = (await client.get(f"{sim.url}/key", headers=auth)).json()["data"]
        assert stats["statuses"].get("200") == 1  # served once, billed twice
        assert key["usage"] == pytest.approx(stats["cost_usd"]) and key["usage"] > cost
        assert stats["completion_tokens"] > whole.json()["usage"]["completion_tokens"]
        assert (await client.get(f"{sim.url}/key")).status_code == 401
