"""Kafka security for real: a second broker with a SASL_SSL listener (PLAIN and SCRAM, a
certificate generated at test time with keytool), started and stopped by this test.

Shows that a client without credentials, and one with a wrong password, are refused; and
that draftstream with credentials creates its topics and runs publish -> inference (against
the simulator) -> responses through the SASL_SSL listener, with SCRAM-SHA-512 through the
real CLI processes and with PLAIN in process.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaError

from schemas import ResponseReceived, decode
from services.common.config import Settings, load_settings
from services.common.kafka import ensure_topics
from services.inference.app import create_app as inference_app
from services.publish.app import publish
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.e2e.brokers import LocalBroker, free_port
from tests.e2e.harness import Pipeline, Processes, cli, read_all, run_cli, wait_until

# One broker of their own for the module's tests (a module fixture): kept on one worker.
pytestmark = [pytest.mark.e2e, pytest.mark.own_broker, pytest.mark.long(60, together=True)]

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "services" / "demo" / "data"
USER = "draftstream"
N = 12


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """A private broker with a SASL_SSL listener; stopped at the end of the module."""
    instance = LocalBroker(
        run_dir=tmp_path_factory.mktemp("kafka-sasl"),
        sasl_ssl_port=free_port(),
        sasl_password=f"pw-{uuid.uuid4().hex[:16]}",
    )
    status = instance.start()
    try:
        assert status.sasl_ssl_port == instance.sasl_ssl_port and status.cafile, status
        yield instance
    finally:
        instance.stop()


def _secure(broker: LocalBroker, prefix: str, **kafka: Any) -> Settings:
    assert broker.status is not None
    base = {
        "bootstrap_servers": f"127.0.0.1:{broker.sasl_ssl_port}",
        "topic_prefix": prefix,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": USER,
        "sasl_password": broker.sasl_password,
        "ssl_cafile": broker.status.cafile,
        **kafka,
    }
    return load_settings(None, kafka=base, metrics={"inference_port": 0})


async def _refused(settings: Settings) -> str:
    """Try to create topics; return why it failed (the test fails if it succeeds)."""
    try:
        await asyncio.wait_for(ensure_topics(settings.kafka, ["x"]), timeout=60)
    except (KafkaError, OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    raise AssertionError(f"a client with {settings.kafka.security_protocol}/{settings.kafka.sasl_mechanism} got in")


async def test_clients_without_valid_credentials_are_refused(
    secure_broker: LocalBroker, report: Callable[..., str]
) -> None:
    """TLS without SASL, a wrong SCRAM password, a wrong PLAIN password, plaintext to TLS: refused."""
    prefix = f"sec{uuid.uuid4().hex[:6]}."
    no_sasl = _secure(secure_broker, prefix, security_protocol="SSL", sasl_mechanism=None, sasl_username=None,
                      sasl_password=None)
    wrong_scram = _secure(secure_broker, prefix, sasl_password="not-the-password")
    wrong_plain = _secure(secure_broker, prefix, sasl_mechanism="PLAIN", sasl_password="not-the-password")
    plaintext = _secure(secure_broker, prefix, security_protocol="PLAINTEXT")
    reasons = {
        "tls_without_sasl": await _refused(no_sasl),
        "wrong_scram_password": await _refused(wrong_scram),
        "wrong_plain_password": await _refused(wrong_plain),
        "plaintext_to_tls": await _refused(plaintext),
    }
    report(refused=len(reasons), **{k: v.split(":")[0] for k, v in reasons.items()})
    # With the right password the same client gets in (so the refusals are about credentials).
    ok = _secure(secure_broker, prefix)
    created = await asyncio.wait_for(ensure_topics(ok.kafka, ["x"]), timeout=60)
    assert ok.kafka.prompts_topic("x") in created


async def test_pipeline_over_sasl_ssl_scram_through_the_cli(
    secure_broker: LocalBroker, tmp_path: Path, report: Callable[..., str]
) -> None:
    """SCRAM-SHA-512 + TLS: topics create, run inference, publish, all as CLI processes."""
    sim = await start_simulator(SimulatorOptions(reasoning_tokens=(4, 12), content_tokens=(4, 12)))
    assert secure_broker.status is not None
    prefix = f"scram{uuid.uuid4().hex[:6]}."
    config = tmp_path / "draftstream.toml"
    config.write_text(
        f"""
[kafka]
bootstrap_servers = "127.0.0.1:{secure_broker.sasl_ssl_port}"
topic_prefix = "{prefix}"
security_protocol = "SASL_SSL"
sasl_mechanism = "SCRAM-SHA-512"
sasl_username = "{USER}"
ssl_cafile = "{secure_broker.status.cafile}"

[provider]
kind = "simulator"
base_url = "{sim.url}"
concurrency = 8

[metrics]
inference_port = 0
""",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env["DRAFTSTREAM_KAFKA__SASL_PASSWORD"] = secure_broker.sasl_password or ""
    env["PYTHONUNBUFFERED"] = "1"
    settings = _secure(secure_broker, prefix)
    procs = Processes(tmp_path)
    try:
        created = run_cli(cli("topics", "create", "--config", str(config), "-d", "math"), env, "topics create")
        assert settings.kafka.topic("responses") in created
        procs.start("inference", cli("run", "inference", "--config", str(config)), env)
        out = await asyncio.to_thread(
            run_cli,
            cli("publish", str(DATA / "math.jsonl"), "-d", "math", "--limit", str(N), "--config", str(config)),
            env,
            "publish",
        )
        responses_topic = settings.kafka.topic("responses")

        async def answered() -> int:
            procs.check_alive()
            return len((await read_all(settings, responses_topic))[responses_topic]) >= N

        await wait_until(answered, timeout=180, interval=1.0, message="responses over SASL_SSL")
    finally:
        procs.stop_all()
        await sim.close()
    records = (await read_all(settings, responses_topic))[responses_topic]
    responses = [decode(r.value, ResponseReceived) for r in records]
    line = report(mechanism="SCRAM-SHA-512", prompts=N, responses=len(responses), publish=out.strip().splitlines()[-1:])
    assert {r.sample_id for r in responses} and len({r.sample_id for r in responses}) == N, line
    assert all(r.dataset == "math" for r in responses), line


async def test_pipeline_over_sasl_ssl_plain_in_process(
    secure_broker: LocalBroker, report: Callable[..., str]
) -> None:
    """PLAIN + TLS: publish and the inference worker in this process."""
    sim = await start_simulator(SimulatorOptions(reasoning_tokens=(4, 12), content_tokens=(4, 12)))
    prefix = f"plain{uuid.uuid4().hex[:6]}."
    base = _secure(secure_broker, prefix, sasl_mechanism="PLAIN")
    settings = load_settings(
        None,
        kafka=base.kafka.model_dump(),
        provider={"base_url": sim.url, "concurrency": 8},
        metrics={"inference_port": 0},
    )
    assert settings.kafka.sasl_password is not None
    await ensure_topics(settings.kafka, ["code"])
    pipeline = Pipeline()
    try:
        await pipeline.start("inference", inference_app(settings))
        published = await publish(settings, [DATA / "code.jsonl"], dataset="code", limit=N)
        responses_topic = settings.kafka.topic("responses")

        async def answered() -> bool:
            return len((await read_all(settings, responses_topic))[responses_topic]) >= N

        await pipeline.wait(answered, 180, "responses over SASL_SSL (PLAIN)")
    finally:
        await pipeline.stop()
        await sim.close()
    got = (await read_all(settings, responses_topic))[responses_topic]
    line = report(mechanism="PLAIN", prompts=published.published, responses=len(got))
    assert published.published == N, line
    assert len({r.key for r in got}) == N, line
