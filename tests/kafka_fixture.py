"""pytest plugin: a real Kafka broker for the ``kafka`` and ``e2e`` tiers.

Loaded by ``tests/conftest.py`` (``pytest_plugins = ["tests.kafka_fixture"]``) or with
``-p tests.kafka_fixture``. The session fixture ``kafka_bootstrap`` finds a broker, in
this order:

1. ``KAFKA_BOOTSTRAP_SERVERS`` from the environment: used as is, never started or stopped;
2. a container of the official ``apache/kafka`` image through testcontainers, when a
   Docker *engine* answers a ping (a docker client binary alone is not enough); the image
   can be changed with ``DRAFTSTREAM_KAFKA_IMAGE``;
3. the local broker of ``deploy/kafka/kafka.sh`` (no Docker): the one the developer runs
   (``draftstream broker start``, ``.run/kafka``) if it is up, else one the fixture
   starts in ``.run/kafka-pytest`` on free ports and stops at the end of the session.

If none works the tests that need a broker are skipped, with the reasons; under ``CI=true``
they fail instead, since a CI run that silently skipped its integration tier would lie.

Under pytest-xdist (``-n``) each worker is a session of its own: the workers share one broker
only when ``KAFKA_BOOTSTRAP_SERVERS`` names it (``make test`` and ``make test-fast`` start one
and export it), so a worker without it fails rather than start a broker per worker.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import io
import os
import socket
import tarfile
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, for_code

from services.common import broker

DEFAULT_IMAGE = "apache/kafka:4.4.0"
REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


async def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.1,
    *,
    message: str = "condition",
) -> Any:
    """Poll ``predicate`` (sync or async) until it returns something truthy; return that.

    Raises ``TimeoutError`` naming ``message`` once ``timeout`` seconds have passed. An
    exception raised by the predicate propagates at once: a wait must not hide a bug.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            raise TimeoutError(f"{message} not reached within {timeout:.1f} s")
        await asyncio.sleep(interval)


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# ---------------------------------------------------------------------------------------
# broker sources
# ---------------------------------------------------------------------------------------


def _docker_engine_problem() -> str | None:
    """None when a Docker engine answers a ping, else why not."""
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return "no Docker engine (no DOCKER_HOST, no /var/run/docker.sock)"
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed"
    problem: str | None = None
    # docker-py leaks the socket of a failed connection; let it be collected here, with its
    # ResourceWarning silenced, rather than turn up (as an error) in some later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = docker.from_env(timeout=5)
            try:
                client.ping()
            finally:
                client.close()
        except Exception as exc:  # any failure here means: no usable engine
            problem = f"no Docker engine answers ({type(exc).__name__}: {exc})"
        gc.collect()
    return problem


def _start_container(image: str) -> tuple[Any, str]:
    """Start a single-node KRaft broker from the official image; return (container, bootstrap).

    testcontainers' ``KafkaContainer`` drives Confluent's ``cp-kafka`` start scripts, which
    the ``apache/kafka`` image does not have, so this uses a plain container the same way:
    the container waits for a file with the advertised listener, which is only known (host
    and mapped port) once it runs.
    """
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    env_file = "/tmp/draftstream-advertised.env"
    container = DockerContainer(image).with_exposed_ports(9092)
    for key, value in {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,BROKER://:9094,CONTROLLER://:9093",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_INTER_BROKER_LISTENER_NAME": "BROKER",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "10",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "true",
        "KAFKA_NUM_PARTITIONS": "3",
        "KAFKA_MESSAGE_MAX_BYTES": "16777216",
        "KAFKA_REPLICA_FETCH_MAX_BYTES": "16777216",
    }.items():
        container = container.with_env(key, value)
    container = container.with_command(
        [
            "sh",
            "-c",
            f"while [ ! -f {env_file} ]; do sleep 0.1; done; . {env_file}; exec /etc/kafka/docker/run",
        ]
    )
    container.start()
    try:
        host = container.get_container_host_ip()
        port = int(container.get_exposed_port(9092))
        content = f"export KAFKA_ADVERTISED_LISTENERS=PLAINTEXT://{host}:{port},BROKER://localhost:9094\n"
        data = content.encode()
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            info = tarfile.TarInfo(name=env_file.lstrip("/"))
            info.size = len(data)
            info.mtime = int(time.time())
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
        container.get_wrapped_container().put_archive("/", archive.getvalue())
        LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(120).wait_until_ready(container)
    except BaseException:
        container.stop()
        raise
    return container, f"{host}:{port}"


def _start_local_broker() -> tuple[str, Path | None]:
    """Return (bootstrap, run dir to stop at the end, or None when the broker is not ours)."""
    developer = broker.status()
    if developer.running and developer.bootstrap:
        return developer.bootstrap, None

    home = Path(os.environ.get("DRAFTSTREAM_HOME") or REPO_ROOT)
    run_dir = home / ".run" / "kafka-pytest"
    leftover = broker.status(run_dir=run_dir)
    if leftover.running and leftover.bootstrap:
        # Another session's broker (or one left by a killed session): use, do not stop.
        return leftover.bootstrap, None

    # Reuse the last session's ports when free: the storage stays formatted (it is tied to
    # the controller port), which saves a JVM run of the format tool.
    ports_file = run_dir / "pytest-ports"
    ports: list[int] = []
    if ports_file.is_file():
        ports = [int(word) for word in ports_file.read_text().split() if word.isdigit()]
    if len(ports) != 2 or ports[0] == ports[1] or not all(_port_is_free(p) for p in ports):
        ports = [_free_port(), _free_port()]
        while ports[1] == ports[0]:
            ports[1] = _free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    ports_file.write_text(f"{ports[0]} {ports[1]}\n")

    started = broker.start(
        port=ports[0],
        controller_port=ports[1],
        run_dir=run_dir,
        # C1-only JIT: ~1 s faster to start on small CI machines; tests load it lightly.
        jvm_opts=os.environ.get("KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=1"),
        # In CI (a fresh machine each time) recording the class-data archive would cost
        # more (~1.5 s at start, ~5 s at stop) than it saves; use one only if cached.
        cds=os.environ.get("KAFKA_CDS", "reuse" if _ci() else "on"),
    )
    if not started.bootstrap:
        raise broker.BrokerError(f"the local broker reported no bootstrap address: {started}")
    return started.bootstrap, run_dir


# ---------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of a real Kafka broker for the whole session (see the module doc)."""
    configured = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if configured:
        yield configured
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail(
            "pytest -n runs the tests in several processes, which must share one broker: start one "
            "(draftstream broker start) and export KAFKA_BOOTSTRAP_SERVERS, or run make test / make test-fast",
            pytrace=False,
        )

    problems: list[str] = []
    docker_problem = _docker_engine_problem()
    if docker_problem is None:
        image = os.environ.get("DRAFTSTREAM_KAFKA_IMAGE", DEFAULT_IMAGE)
        try:
            container, bootstrap = _start_container(image)
        except Exception as exc:
            problems.append(f"testcontainers ({image}) failed: {type(exc).__name__}: {exc}")
        else:
            try:
                yield bootstrap
            finally:
                container.stop()
            return
    else:
        problems.append(docker_problem)

    try:
        bootstrap, ours = _start_local_broker()
    except broker.BrokerError as exc:
        problems.append(f"the local broker (deploy/kafka/kafka.sh) failed: {exc}")
    else:
        try:
            yield bootstrap
        finally:
            if ours is not None:
                broker.stop(run_dir=ours)
        return

    reason = "no Kafka broker available: " + "; ".join(problems)
    if _ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


class TopicFactory(Protocol):
    """Creates a topic named ``<prefix>-<uuid4 hex>`` and returns its name."""

    async def __call__(
        self,
        prefix: str = "test",
        *,
        partitions: int = 3,
        configs: dict[str, str] | None = None,
    ) -> str: ...


@pytest.fixture
async def topic_factory(kafka_bootstrap: str) -> AsyncIterator[TopicFactory]:
    """Create unique topics for one test, ready to use (every partition has a leader).

    They are deleted after the test, best effort: a leftover topic has a unique name and
    harms nobody, so a failed deletion never fails the test.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=30_000)
    await admin.start()
    created: list[str] = []

    async def has_leaders(name: str, partitions: int) -> bool:
        (topic,) = await admin.describe_topics([name])
        found = topic.get("partitions") or []
        return (
            topic.get("error_code") == 0
            and len(found) == partitions
            and all(p.get("leader", -1) >= 0 for p in found)
        )

    async def make(
        prefix: str = "test", *, partitions: int = 3, configs: dict[str, str] | None = None
    ) -> str:
        name = f"{prefix}-{uuid.uuid4().hex}"
        response = await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs or {})])
        for topic, code, *rest in response.topic_errors:
            if code != 0:
                raise for_code(code)(f"cannot create topic {topic}: {rest[0] if rest else ''}")
        created.append(name)
        await wait_until(lambda: has_leaders(name, partitions), timeout=30, message=f"leaders for {name}")
        return name

    try:
        yield make
    finally:
        try:
            if created:
                await admin.delete_topics(created)
        except KafkaError:
            pass
        finally:
            await admin.close()


async def read_records(settings: Any, topic: str, count: int, timeout: float = 60.0) -> list[Any]:
    """Every record of a physical topic, once it holds at least ``count`` (read without a group).

    Raises ``TimeoutError`` when fewer arrive within ``timeout`` seconds.
    """
    from services.common.topics import read_to_end

    async def enough() -> tuple[list[Any]] | None:
        got: list[Any] = []
        await read_to_end(settings.kafka, topic, got.append, deadline_s=timeout)
        return (got,) if len(got) >= count else None

    (records,) = await wait_until(enough, timeout=timeout, interval=0.2, message=f"{count} record(s) on {topic}")
    return records


async def send_records(settings: Any, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    """Produce ``(key, value)`` records to a logical topic and wait for each acknowledgement."""
    from services.common.kafka import make_producer

    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(settings.kafka.topic(topic), value, key=key)
    finally:
        await producer.stop()
