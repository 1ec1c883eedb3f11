"""Helpers shared by the reliability and security tests: produce, read back, run stages.

Subprocess helpers (``Processes``, ``cli``, ``run_cli``, ``wait_http``, ``accepted_keys``,
``read_dead_letters``) are the demo's own, reused from :mod:`services.demo.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from schemas import DLQ_HEADERS, Message, PromptPublished, encode, sample_key
from services.common import broker
from services.common.config import Settings
from services.common.kafka import header, make_admin, make_producer
from services.common.service import Service
from services.common.topics import partitions_of as topic_partitions
from services.common.topics import read_to_end
from services.demo.run import Processes, accepted_keys, cli, read_dead_letters, run_cli, wait_http
from tests.kafka_fixture import wait_until

__all__ = [
    "DeadLetterRecord",
    "LocalBroker",
    "Pipeline",
    "Processes",
    "accepted_keys",
    "cli",
    "dead_letters",
    "free_port",
    "produce",
    "prompt_value",
    "read_all",
    "read_dead_letters",
    "run_cli",
    "small_prompt",
    "wait_http",
    "wait_until",
]

REPO = Path(__file__).resolve().parents[2]

Record = ConsumerRecord[bytes, bytes]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def small_prompt(dataset: str, i: int, **kw: Any) -> PromptPublished:
    """A short valid prompt with a short answer budget."""
    fields: dict[str, Any] = {
        "messages": [Message(role="system", content="Answer briefly."), Message(role="user", content=f"Q{i}: 2+{i}?")],
        "max_tokens": 256,
        **kw,
    }
    return PromptPublished(dataset=dataset, sample_id=f"s{i:05d}", **fields)


def prompt_value(dataset: str, i: int) -> tuple[bytes, bytes]:
    """(key, value) of :func:`small_prompt`."""
    p = small_prompt(dataset, i)
    return sample_key(dataset, p.sample_id).encode(), encode(p)


async def produce(
    settings: Settings,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None] | tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]],
) -> list[tuple[int, int]]:
    """Send raw (key, value[, headers]) records to a physical topic; return (partition, offset)s."""
    producer = make_producer(settings.kafka)
    try:
        await producer.start()
        futures = []
        for rec in records:
            key, value = rec[0], rec[1]
            headers = rec[2] if len(rec) > 2 else None  # type: ignore[misc]
            futures.append(await producer.send(topic, value, key=key, headers=headers))
        metas = await asyncio.gather(*futures)
        return [(m.partition, m.offset) for m in metas]
    finally:
        await producer.stop()


async def read_all(settings: Settings, *physical: str) -> dict[str, list[Record]]:
    """Every record currently on the given physical topics, read from the beginning (no group)."""
    out: dict[str, list[Record]] = {t: [] for t in physical}
    for topic in physical:
        await read_to_end(settings.kafka, topic, out[topic].append)
    return out


async def partitions_of(settings: Settings, *physical: str) -> list[TopicPartition]:
    """The partitions of existing topics (a consumer's own metadata may not know them yet)."""
    admin = make_admin(settings.kafka)
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        found = await topic_partitions(admin, [t for t in physical if t in existing])
    finally:
        await admin.close()
    return [TopicPartition(t, p) for t in physical for p in found.get(t, [])]


@dataclass(frozen=True)
class DeadLetterRecord:
    """One dead letter, with its headers parsed."""

    key: str
    value: bytes
    stage: str
    reason: str
    reasons: str
    topic: str
    partition: int
    offset: int
    headers: list[tuple[str, bytes]]


async def dead_letters(settings: Settings) -> list[DeadLetterRecord]:
    """Every dead letter on the test's dead-letter topic."""
    topic = settings.kafka.topic("dead-letter")
    out: list[DeadLetterRecord] = []
    for r in (await read_all(settings, topic))[topic]:
        hs = list(r.headers or ())
        out.append(
            DeadLetterRecord(
                key=(r.key or b"").decode("utf-8", "replace"),
                value=r.value or b"",
                stage=header(hs, DLQ_HEADERS.STAGE) or "?",
                reason=header(hs, DLQ_HEADERS.REASON) or "?",
                reasons=header(hs, DLQ_HEADERS.REASONS) or "",
                topic=header(hs, DLQ_HEADERS.TOPIC) or "?",
                partition=int(header(hs, DLQ_HEADERS.PARTITION) or -1),
                offset=int(header(hs, DLQ_HEADERS.OFFSET) or -1),
                headers=hs,
            )
        )
    return out


@dataclass
class Pipeline:
    """Services run in this process as asyncio tasks (start, run, stop, close)."""

    services: dict[str, Service] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def start(self, name: str, service: Service) -> Service:
        """Start a service and run it in the background."""
        await service.start()
        self.services[name] = service
        self.tasks[name] = asyncio.create_task(service.run(), name=name)
        return service

    def check_alive(self) -> None:
        """Raise if a service's run() ended (a crash) before it was asked to stop."""
        for name, task in self.tasks.items():
            if task.done():
                exc = task.exception() if not task.cancelled() else None
                raise AssertionError(f"service {name} stopped on its own: {exc!r}")

    async def wait(self, predicate: Callable[[], Awaitable[Any] | Any], timeout: float, message: str) -> Any:
        """wait_until, failing at once when a service died."""

        async def check() -> Any:
            self.check_alive()
            result = predicate()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return await wait_until(check, timeout=timeout, interval=0.3, message=message)

    async def stop(self) -> None:
        """Stop every service (reverse order) and close it."""
        for name in reversed(list(self.services)):
            self.services[name].stop()
        for name in reversed(list(self.services)):
            task = self.tasks[name]
            try:
                await asyncio.wait_for(task, timeout=40)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            except Exception:  # noqa: BLE001, S110 - the failure was already asserted by check_alive
                pass
            with contextlib.suppress(Exception):
                await self.services[name].close()


@dataclass
class LocalBroker:
    """A private broker instance of deploy/kafka/kafka.sh (own run dir and ports)."""

    run_dir: Path
    port: int = field(default_factory=free_port)
    controller_port: int = field(default_factory=free_port)
    sasl_ssl_port: int | None = None
    sasl_password: str | None = None
    status: broker.BrokerStatus | None = None

    @property
    def bootstrap(self) -> str:
        """The PLAINTEXT bootstrap address."""
        return f"127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = {
            "KAFKA_RUN_DIR": str(self.run_dir),
            "KAFKA_PORT": str(self.port),
            "KAFKA_CONTROLLER_PORT": str(self.controller_port),
            "KAFKA_JVM_OPTS": os.environ.get("KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=1"),
            "KAFKA_CDS": "reuse",
        }
        if self.sasl_ssl_port is not None:
            env["KAFKA_SASL_SSL_PORT"] = str(self.sasl_ssl_port)
        if self.sasl_password is not None:
            env["KAFKA_SASL_PASSWORD"] = self.sasl_password
        return env

    def start(self) -> broker.BrokerStatus:
        """Start (format on first start) and wait until it serves metadata."""
        self.status = broker.start(
            port=self.port,
            controller_port=self.controller_port,
            sasl_ssl_port=self.sasl_ssl_port,
            sasl_password=self.sasl_password,
            run_dir=self.run_dir,
            jvm_opts=os.environ.get("KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=1"),
            cds="reuse",
        )
        return self.status

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL)."""
        broker.stop(run_dir=self.run_dir)

    def restart(self) -> broker.BrokerStatus:
        """Stop and start again on the same ports and storage."""
        self.stop()
        return self.start()


def counts_by(items: Sequence[str]) -> dict[str, int]:
    """How often each string occurs, sorted by name."""
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def elapsed_since(t0: float) -> float:
    """Seconds since a monotonic time."""
    return time.monotonic() - t0


@dataclass
class Supervisor:
    """Service processes that can be SIGKILLed and restarted, and are restarted when they die.

    Each service's output is appended to ``<log_dir>/<name>.log`` across restarts.
    """

    log_dir: Path
    env: dict[str, str]
    commands: dict[str, list[str]] = field(default_factory=dict)
    procs: dict[str, Any] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)
    unplanned_exits: list[tuple[str, int]] = field(default_factory=list)

    def start(self, name: str, args: list[str] | None = None) -> None:
        """Start (or start again) one service."""
        import subprocess

        if args is not None:
            self.commands[name] = args
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise RuntimeError(f"{name} is already running (pid {running.pid})")
        log = (self.log_dir / f"{name}.log").open("ab")
        try:
            self.procs[name] = subprocess.Popen(  # noqa: S603 - our own CLI
                self.commands[name], stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        finally:
            log.close()  # the child holds its own descriptor
        self.starts[name] = self.starts.get(name, 0) + 1

    def kill(self, name: str) -> None:
        """SIGKILL one service (no shutdown hooks run) and reap it."""
        proc = self.procs.pop(name)  # down on purpose: revive() must not restart it
        proc.kill()
        proc.wait()
        self.kills[name] = self.kills.get(name, 0) + 1

    def revive(self) -> list[str]:
        """Restart every service that exited on its own; return their names."""
        revived = []
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.unplanned_exits.append((name, proc.returncode))
                self.start(name)
                revived.append(name)
        return revived

    def stop_all(self, timeout: float = 30.0) -> None:
        """SIGTERM everything, SIGKILL what is left after ``timeout``."""
        import signal
        import subprocess

        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
