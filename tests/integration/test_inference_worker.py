"""The inference worker on a real broker against the real simulator over HTTP.

Covers: N prompts in → N responses + dead letters out; bad prompts dead-lettered without a
provider call; retries through every transient fault; the dead-letter reason of each fault
after the last attempt; a worker SIGKILLed mid-run loses nothing; halts (published while
running, standing before start, dataset-scoped), resume; a 401 halts everything.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from schemas import (
    DLQ_HEADERS,
    Halt,
    Message,
    RequestStarted,
    Resume,
    decode,
    decode_control,
    encode,
    sample_key,
)
from services.common.config import Settings
from services.common.kafka import ensure_topics, header, make_producer
from services.inference.app import INTAKE_BATCH, InferenceWorker
from services.simulator.app import RunningSimulator, start_simulator
from services.simulator.options import SimulatorOptions
from tests.integration.inference_harness import (
    FAST,
    PROFILE,
    Collector,
    committed_all,
    prompt,
    provider_cfg,
    publish,
    publish_control,
    running,
)
from tests.kafka_fixture import wait_until

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def sim_factory() -> AsyncIterator[Callable[..., Any]]:
    """Starts simulators with options; closes them after the test."""
    started: list[RunningSimulator] = []

    async def start(**options: Any) -> RunningSimulator:
        sim = await start_simulator(SimulatorOptions(**{**FAST, **options}), profile=PROFILE)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        await sim.close()


async def test_n_prompts_in_n_responses_and_dead_letters_out(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    sim = await sim_factory()
    settings = settings_factory(provider=provider_cfg(sim, max_prompt_chars=500))
    await ensure_topics(settings.kafka, ["chat"])
    good = [prompt("chat", i) for i in range(40)]
    values = [(p.sample_id, encode(p)) for p in good]
    long_prompt = prompt("chat", 900, messages=[Message(role="user", content="x" * 501)])
    no_user = prompt("chat", 901, messages=[Message(role="system", content="nobody asks")])
    values += [("s0900", encode(long_prompt)), ("s0901", encode(no_user)), ("s0902", b"{broken json")]
    await publish(settings, "chat", values)

    async with Collector(settings, "responses", "dead-letter", "requests") as out, running(settings) as worker:
        await wait_until(lambda: len(out.finished_keys()) >= 43, timeout=60, message="43 outputs")
        await wait_until(lambda: committed_all(settings, worker, "chat"), timeout=20, message="commit")
        await wait_until(lambda: len(out.records["requests"]) >= 40, timeout=10, message="request events")

    responses = out.responses()
    assert sorted(r.sample_id for r in responses) == sorted(p.sample_id for p in good)
    for r in responses:
        assert r.provider == "simulator" and r.profile == "qwen3"
        assert r.request_max_tokens == 64 and r.attempt == 1 and r.tools_sent is False
        assert r.reasoning and r.usage.completion_tokens and r.upstream_provider == "SimProvider"
        assert r.prompt.sample_id == r.sample_id
    assert {(r.key or b"").decode() for r in out.records["responses"]} == {f"chat:{p.sample_id}" for p in good}
    reasons = {
        (d.key or b"").decode(): header(d.headers, DLQ_HEADERS.REASON) for d in out.dead_letters()
    }
    assert reasons == {"chat:s0900": "prompt_too_long", "chat:s0901": "no_user_turn", "chat:s0902": "invalid_json"}
    broken = next(d for d in out.dead_letters() if d.key == b"chat:s0902")
    assert broken.value == b"{broken json"  # byte for byte
    assert header(broken.headers, DLQ_HEADERS.STAGE) == "inference"
    # bad prompts never reached the provider; every good one did, announced by a RequestStarted
    keys = sim.stats()["keys"]
    assert set(keys) == {f"chat:{p.sample_id}" for p in good}
    started = [decode(r.value, RequestStarted) for r in out.records["requests"]]
    assert {s.sample_id for s in started} == {p.sample_id for p in good}
    assert all(s.max_tokens == 64 and s.worker == worker.worker_id for s in started)


async def test_transient_faults_are_retried_until_success(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    faults = ("429", "5xx", "timeout", "drop", "malformed", "error_in_200")
    sim = await sim_factory(
        seed=7, retry_after_s=0.05, timeout_sleep_s=3.0, **{f"rate_{f}": 0.08 for f in faults}
    )
    settings = settings_factory(provider=provider_cfg(sim, max_attempts=15, timeout_s=0.5))
    await ensure_topics(settings.kafka, ["chat"])
    prompts = [prompt("chat", i) for i in range(60)]
    await publish(settings, "chat", [(p.sample_id, encode(p)) for p in prompts])
    async with Collector(settings, "responses", "dead-letter") as out, running(settings):
        await wait_until(lambda: len(out.finished_keys()) >= 60, timeout=120, message="60 outputs")
    assert out.dead_letters() == []
    responses = out.responses()
    assert {r.sample_id for r in responses} == {p.sample_id for p in prompts}
    seen = sim.stats()["faults"]
    assert set(faults) <= set(seen), seen  # every fault kind happened and was survived
    retried = [r for r in responses if r.attempt > 1]
    assert retried and all(r.attempt == len(sim.stats()["key_faults"][f"chat:{r.sample_id}"]) + 1
                           for r in retried)


async def test_each_fault_dead_letters_with_its_reason_after_the_last_attempt(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    # A 429 is not among them: it is never a dead letter (tests/integration/test_rate_limits.py).
    expected = {
        "5xx": ("provider_http_5xx", None),
        "timeout": ("provider_timeout", None),
        "drop": ("provider_connection_closed", None),
        "malformed": ("provider_malformed_json", "200"),
        "error_in_200": ("provider_error_in_body", "200"),
    }
    sim = await sim_factory(retry_after_s=0.05, timeout_sleep_s=3.0)
    # No outage halt: six outage-class failures in a row (5xx, timeout, drop, twice each) would
    # make one and start those prompts over (a 429 prompt, answered by a provider that is up,
    # used to break the streak; a 429 is no longer a dead letter, so it is not among them).
    settings = settings_factory(
        provider=provider_cfg(sim, max_attempts=2, timeout_s=0.5, outage_after=100, probe_interval_s=0.2)
    )
    await ensure_topics(settings.kafka, ["faults"])
    prompts = [prompt("faults", i, metadata={"simulator_fault": f}) for i, f in enumerate(expected)]
    prompts.append(prompt("faults", 99))
    await publish(settings, "faults", [(p.sample_id, encode(p)) for p in prompts])
    async with Collector(settings, "responses", "dead-letter") as out, running(settings):
        await wait_until(lambda: len(out.finished_keys()) >= 6, timeout=60, message="6 outputs")
    assert [r.sample_id for r in out.responses()] == ["s0099"]
    by_key = {(d.key or b"").decode(): d for d in out.dead_letters()}
    assert len(by_key) == 5
    keys = sim.stats()["keys"]
    for i, (fault, (reason, status)) in enumerate(expected.items()):
        d = by_key[f"faults:s{i:04d}"]
        assert header(d.headers, DLQ_HEADERS.REASON) == reason, fault
        assert header(d.headers, DLQ_HEADERS.ATTEMPT) == "2"
        assert header(d.headers, DLQ_HEADERS.STAGE) == "inference"
        assert header(d.headers, DLQ_HEADERS.MESSAGE), fault
        if fault == "5xx":
            assert header(d.headers, DLQ_HEADERS.HTTP_STATUS) in {"500", "502", "503"}
        else:
            assert header(d.headers, DLQ_HEADERS.HTTP_STATUS) == status, fault
        assert d.value == encode(prompts[i])
        # Exactly max_attempts requests; for a timeout, a drop or a 5xx with nobody else
        # answered meanwhile, a free check (GET /models) told the failure was the request's own.
        assert keys[f"faults:s{i:04d}"] == 2


@pytest.mark.long
async def test_worker_killed_mid_run_loses_nothing(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    sim = await sim_factory(latency_s=0.05, latency_jitter_s=0.3, rate_5xx=0.05)
    settings = settings_factory(provider=provider_cfg(sim, concurrency=16, max_attempts=10))
    await ensure_topics(settings.kafka, ["crash"])
    prompts = [prompt("crash", i) for i in range(150)]
    await publish(settings, "crash", [(p.sample_id, encode(p)) for p in prompts])
    env = {
        **os.environ,
        "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "DRAFTSTREAM_PROVIDER__BASE_URL": sim.url,
        "DRAFTSTREAM_PROVIDER__CONCURRENCY": "16",
        "DRAFTSTREAM_PROVIDER__MAX_ATTEMPTS": "10",
        "DRAFTSTREAM_PROVIDER__BACKOFF_INITIAL_S": "0.01",
        "DRAFTSTREAM_METRICS__INFERENCE_PORT": "0",
    }
    async with Collector(settings, "responses", "dead-letter") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "run", "inference", cwd=REPO, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        try:
            await wait_until(lambda: len(out.responses()) >= 20, timeout=60, message="first responses")
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        done_at_kill = len(out.finished_keys())
        assert done_at_kill < 150, "the worker finished before it was killed: nothing was tested"
        async with running(settings):
            await wait_until(lambda: len(out.finished_keys()) >= 150, timeout=120, message="all 150")
    assert out.finished_keys() == {f"crash:{p.sample_id}" for p in prompts}
    assert out.dead_letters() == []


@pytest.mark.serial  # the halt is checked within a second of wall time: a busy CPU beside it delays the worker
async def test_halt_stops_requests_within_a_second_and_resume_completes(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    sim = await sim_factory(latency_s=0.2, latency_jitter_s=0.2)
    settings = settings_factory(provider=provider_cfg(sim, concurrency=8))
    await ensure_topics(settings.kafka, ["chat"])
    prompts = [prompt("chat", i) for i in range(120)]
    await publish(settings, "chat", [(p.sample_id, encode(p)) for p in prompts])
    async with Collector(settings, "responses", "dead-letter") as out, running(settings) as worker:
        await wait_until(lambda: len(out.responses()) >= 10, timeout=60, message="first responses")
        halted_at = time.time()
        await publish_control(settings, "global", encode(Halt(scope="global", reason="test", by="test")))
        await wait_until(lambda: worker.halted_scopes == ["global"], timeout=5, message="halt seen")
        # wait past the one-second bound plus the slowest request, then look back
        await wait_until(lambda: time.time() > halted_at + 2.5, timeout=5, message="2.5 s after halt")
        assert sim.requests_after(halted_at + 1.0) == 0
        assert worker.paused_partitions() == worker.assigned_partitions() != set()
        stopped_at = len(out.finished_keys())
        assert stopped_at < 120
        await publish_control(settings, "global", encode(Resume(scope="global", by="test")))
        await wait_until(lambda: len(out.finished_keys()) >= 120, timeout=90, message="all 120 after resume")
    assert {r.sample_id for r in out.responses()} == {p.sample_id for p in prompts}


async def test_a_worker_whose_loop_is_behind_takes_no_new_prompt_until_it_catches_up(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    # A wave of answers holds a worker's one event loop; new prompts taken meanwhile only
    # wait in the same queue while their slots are idle at the provider. Here a task holds
    # the loop 60 ms at a go (three times the lateness that counts as behind).
    sim = await sim_factory()
    settings = settings_factory(provider=provider_cfg(sim))
    await ensure_topics(settings.kafka, ["chat"])
    prompts = [prompt("chat", i) for i in range(INTAKE_BATCH + 40)]
    holding = True

    async def hold_the_loop() -> None:
        while holding:
            time.sleep(0.06)
            await asyncio.sleep(0)

    async with Collector(settings, "responses") as out, running(settings) as worker:
        hog = asyncio.create_task(hold_the_loop())
        held_from = time.monotonic()  # a fetch the worker began before (200 ms at most) ends empty
        await wait_until(lambda: time.monotonic() > held_from + 0.5, timeout=10, message="0.5 s held")
        await publish(settings, "chat", [(p.sample_id, encode(p)) for p in prompts])
        published = time.monotonic()
        await wait_until(lambda: time.monotonic() > published + 2.0, timeout=10, message="2 s with prompts waiting")
        assert worker.lateness.behind()
        assert sim.stats()["total_requests"] == 0 and len(worker.inflight) == 0  # not one prompt taken
        holding = False
        await hog
        await wait_until(lambda: len(out.responses()) >= len(prompts), timeout=60, message="every prompt answered")
    assert {r.sample_id for r in out.responses()} == {p.sample_id for p in prompts}


async def test_worker_started_during_a_dataset_halt_stays_halted(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    sim = await sim_factory()
    settings = settings_factory(provider=provider_cfg(sim))
    await ensure_topics(settings.kafka, ["held", "free"])
    await publish_control(settings, "held", encode(Halt(scope="held", reason="budget", by="budget")))
    # a record that is not a control event must be ignored, never read as a resume
    await publish_control(settings, "held", b'{"action": "unhalt", "scope": "held"}')
    held = [prompt("held", i) for i in range(10)]
    free = [prompt("free", i) for i in range(10)]
    await publish(settings, "held", [(p.sample_id, encode(p)) for p in held])
    await publish(settings, "free", [(p.sample_id, encode(p)) for p in free])
    async with Collector(settings, "responses", "dead-letter") as out, running(settings) as worker:
        assert worker.halted_scopes == ["held"]  # known before the first fetch
        await wait_until(lambda: len(out.finished_keys()) >= 10, timeout=60, message="free dataset done")
        assert {r.dataset for r in out.responses()} == {"free"}
        held_topic = settings.kafka.prompts_topic("held")
        assert {tp.topic for tp in worker.paused_partitions()} == {held_topic}
        assert REGISTRY.get_sample_value("draftstream_inference_halted", {"scope": "held"}) == 1
        assert not any(k.startswith("held:") for k in sim.stats()["keys"])
        await publish_control(settings, "held", encode(Resume(scope="held", by="test")))
        await wait_until(lambda: len(out.finished_keys()) >= 20, timeout=60, message="held dataset done")
    assert {r.sample_id for r in out.responses() if r.dataset == "held"} == {p.sample_id for p in held}


async def test_401_halts_globally_and_resumes_without_losing_the_prompt(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    sim = await sim_factory()
    secret = "sk-test-never-log-me-42"
    allow = asyncio.Event()
    seen_auth: list[str] = []

    async def gate(request: web.Request) -> web.StreamResponse:
        """A key check in front of the simulator: 401 until the key is 'fixed'."""
        seen_auth.append(request.headers.get("Authorization", ""))
        if not allow.is_set():
            return web.json_response({"error": {"code": 401, "message": "No auth credentials found"}}, status=401)
        async with httpx.AsyncClient() as client:
            upstream = await client.post(
                f"{sim.url}/chat/completions", content=await request.read(),
                headers={k: v for k, v in request.headers.items() if k.lower().startswith("x-")},
            )
        return web.Response(status=upstream.status_code, body=upstream.content, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        """The key passes pre-flight: it is revoked only after the run started."""
        return web.json_response({"data": [{"id": "qwen/qwen3-8b"}]})

    app = web.Application()
    app.router.add_post("/api/v1/chat/completions", gate)
    app.router.add_get("/api/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        settings = settings_factory(
            provider=provider_cfg(sim, base_url=f"http://127.0.0.1:{port}/api/v1", api_key=secret, concurrency=4)
        )
        await ensure_topics(settings.kafka, ["chat"])
        prompts = [prompt("chat", i) for i in range(12)]
        await publish(settings, "chat", [(p.sample_id, encode(p)) for p in prompts])
        async with Collector(settings, "responses", "dead-letter", "control") as out, running(settings) as worker:
            await wait_until(lambda: out.records["control"], timeout=30, message="halt published")
            halt = decode_control(out.records["control"][0].value)
            scope = f"provider:{settings.provider.label}"
            assert isinstance(halt, Halt) and halt.scope == scope and halt.by == "inference"
            assert "401" in halt.reason and secret not in halt.reason
            assert worker.halted_scopes == [scope]
            calls = len(seen_auth)
            assert REGISTRY.get_sample_value("draftstream_inference_halted", {"scope": scope}) == 1
            assert out.responses() == [] and out.dead_letters() == []
            allow.set()
            await publish_control(settings, scope, encode(Resume(scope=scope, by="operator")))
            await wait_until(lambda: len(out.finished_keys()) >= 12, timeout=60, message="all 12 after resume")
        assert calls <= 4  # no more than the requests already in flight when the first 401 came
        assert seen_auth[0] == f"Bearer {secret}"
        assert out.dead_letters() == []
        assert {r.sample_id for r in out.responses()} == {p.sample_id for p in prompts}
        for record in out.records["responses"] + out.records["control"]:
            assert secret.encode() not in (record.value or b"")
    finally:
        await runner.cleanup()


@pytest.mark.serial  # 1,000 requests open at once: at the parallel piece's idle priority they wait long for a core
async def test_holds_a_thousand_requests_in_flight_and_no_more(
    settings_factory: Callable[..., Settings], unused_tcp_port: int
) -> None:
    # The simulator runs in its own process here: generating 1,000 answers in the test's
    # event loop would starve the worker being measured. No answer comes before 1,000 requests
    # were open at once at the provider (60 s at most): how soon the worker gets them all there,
    # on two cores shared with a broker under load, is not what this test measures.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "simulate-provider", "--port", str(unused_tcp_port),
        "--metrics-port", "0", "--hold-until-open", "1000",
        "--latency", "0.5", "--reasoning-tokens", "4-12", "--content-tokens", "4-12",
        cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{unused_tcp_port}"
    try:
        async with httpx.AsyncClient() as client:

            async def healthy() -> bool:
                try:
                    return (await client.get(f"{base}/health")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_until(healthy, timeout=60, message="simulator up")
            settings = settings_factory(
                provider={"base_url": f"{base}/api/v1", "concurrency": 1000, "timeout_s": 60.0,
                          "backoff_initial_s": 0.01, "backoff_max_s": 0.2}
            )
            await ensure_topics(settings.kafka, ["bulk"])
            # One text for every prompt (each its own sample): the simulator renders and generates
            # an answer once and serves it from its cache after. Generated anew for each, the
            # answers cost its one process seconds of the two cores before the last of the 1,000
            # requests is taken in, and the first are answered by then.
            same = prompt("bulk", 0).messages
            prompts = [prompt("bulk", i, messages=same) for i in range(1100)]
            await publish(settings, "bulk", [(p.sample_id, encode(p)) for p in prompts])
            peak = 0

            def inflight(worker: InferenceWorker, target: int) -> bool:
                # requests at the provider; a task publishing its answer holds no slot
                nonlocal peak
                peak = max(peak, worker.inflight.at_provider)
                return worker.inflight.at_provider >= target

            async with Collector(settings, "responses", "dead-letter") as out, running(settings) as worker:
                await wait_until(lambda: inflight(worker, 1000), timeout=90, interval=0.05, message="1000 in flight")
                await wait_until(
                    lambda: inflight(worker, 10_000) or len(out.finished_keys()) >= 1100,
                    timeout=120, interval=0.05, message="all 1100",
                )
            stats = (await client.get(f"{base}/_sim/stats")).json()
    finally:
        proc.kill()
        await proc.wait()
    seen = {k: stats[k] for k in ("total_requests", "statuses", "faults", "peak_open_requests")}
    assert peak == 1000, seen
    assert stats["peak_open_requests"] == 1000, seen  # as the provider saw it
    assert out.dead_letters() == []
    assert len({r.sample_id for r in out.responses()}) == 1100
    assert stats["total_requests"] >= 1100


async def test_halt_pauses_survive_a_rebalance(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    sim = await sim_factory(latency_s=0.05)
    settings = settings_factory(provider=provider_cfg(sim, concurrency=8))
    await ensure_topics(settings.kafka, ["held", "free"])
    await publish_control(settings, "held", encode(Halt(scope="held", reason="budget", by="budget")))
    held = [prompt("held", i) for i in range(12)]
    free = [prompt("free", i) for i in range(60)]
    await publish(settings, "held", [(p.sample_id, encode(p)) for p in held])
    await publish(settings, "free", [(p.sample_id, encode(p)) for p in free])
    held_topic = settings.kafka.prompts_topic("held")
    async with Collector(settings, "responses", "dead-letter") as out, running(settings) as first:
        await wait_until(lambda: len(out.finished_keys()) >= 5, timeout=60, message="first responses")
        async with running(settings) as second:  # joins the group: every partition is reassigned
            await wait_until(
                lambda: second.assigned_partitions() and len(first.assigned_partitions()) < 6,
                timeout=60, message="rebalance onto two workers",
            )

            def paused_as_halted() -> bool:
                return all(
                    w.paused_partitions() == {tp for tp in w.assigned_partitions() if tp.topic == held_topic}
                    for w in (first, second)
                )

            await wait_until(paused_as_halted, timeout=10, message="held partitions paused on both workers")
            assert any(tp.topic == held_topic for tp in second.paused_partitions() | first.paused_partitions())
            await wait_until(lambda: len(out.finished_keys()) >= 60, timeout=60, message="free dataset done")
            assert not any(k.startswith("held:") for k in sim.stats()["keys"])
            await publish_control(settings, "held", encode(Resume(scope="held", by="test")))
            await wait_until(lambda: len(out.finished_keys()) >= 72, timeout=60, message="all 72")
    assert out.finished_keys() == {f"{p.dataset}:{p.sample_id}" for p in held + free}
    assert out.dead_letters() == []


async def test_a_worker_giving_up_partitions_lets_their_requests_finish_so_nobody_pays_twice(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    # Six partitions of about twelve prompts; the first worker takes sixty, so its requests
    # span at least five partitions, and a second worker joining takes three of the six:
    # partitions with requests at the provider move. Their new owner reads them again from
    # the committed offset; the first worker lets those requests be answered and committed
    # before it lets go, so none is paid for twice.
    sim = await sim_factory(latency_s=2.0)
    settings = settings_factory(kafka={"partitions": 6}, provider=provider_cfg(sim, concurrency=60))
    await ensure_topics(settings.kafka, ["chat"])
    prompts = [prompt("chat", i) for i in range(72)]
    await publish(settings, "chat", [(p.sample_id, encode(p)) for p in prompts])
    async with Collector(settings, "responses", "dead-letter") as out, running(settings) as first:
        await wait_until(lambda: sim.stats()["total_requests"] >= 60, timeout=60, message="sixty requests sent")
        busy = first.inflight.partitions()
        async with running(settings) as second:  # joins the group: partitions move
            await wait_until(second.assigned_partitions, timeout=60, message="the second worker's partitions")
            moved = busy & second.assigned_partitions()
            await wait_until(lambda: len(out.finished_keys()) >= 72, timeout=120, message="all 72")
    keys = sim.stats()["keys"]
    assert out.dead_letters() == []
    assert moved  # partitions with requests at the provider went to the second worker
    assert set(keys) == {sample_key("chat", p.sample_id) for p in prompts}
    assert {k: n for k, n in keys.items() if n > 1} == {}  # no prompt paid for twice


async def test_a_paid_request_is_answered_from_the_store_unless_repay_is_asked(
    settings_factory: Callable[..., Settings], sim_factory: Callable[..., Any]
) -> None:
    from services.inference.core import REPAY_HEADER

    sim = await sim_factory()
    settings = settings_factory(provider=provider_cfg(sim))
    await ensure_topics(settings.kafka, ["chat"])
    prompts = [prompt("chat", i) for i in range(10)]
    values = [(p.sample_id, encode(p)) for p in prompts]
    await publish(settings, "chat", values)
    async with Collector(settings, "responses", "dead-letter") as out:
        async with running(settings):
            await wait_until(lambda: len(out.responses()) >= 10, timeout=60, message="10 responses")
        assert sum(sim.stats()["keys"].values()) == 10
        # The same prompts again; two of them carry the repay header.
        await publish(settings, "chat", values)
        producer = make_producer(settings.kafka)
        await producer.start()
        try:
            for p in prompts[:2]:
                topic = settings.kafka.prompts_topic("chat")
                key = sample_key("chat", p.sample_id).encode()
                await (await producer.send(topic, encode(p), key=key, headers=[(REPAY_HEADER, b"1")]))
        finally:
            await producer.stop()
        async with running(settings) as second:
            await wait_until(lambda: len(out.responses()) >= 22, timeout=60, message="22 responses")
            assert second.answers.reused == 10
        assert sum(sim.stats()["keys"].values()) == 12  # only the two asked for were paid again
        # --repay: everything is paid again on purpose.
        await publish(settings, "chat", values)
        async with running(settings, repay=True) as third:
            await wait_until(lambda: len(out.responses()) >= 32, timeout=60, message="32 responses")
            assert third.answers.reused == 0
        assert sum(sim.stats()["keys"].values()) == 22
    reused = [r for r in out.responses() if r.reused]
    assert len(reused) == 10 and all(r.request_hash for r in out.responses())
    assert out.dead_letters() == []
