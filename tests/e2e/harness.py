"""Helpers shared by the reliability and security tests: produce, read back, run stages.

Subprocess helpers (``Processes``, ``cli``, ``run_cli``, ``wait_http``, ``accepted_keys``, ``sink_rows``,
``read_dead_letters``) are the demo's own, reused from :mod:`services.demo.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess  # noqa: S404 - runs our own CLI
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.admin import RecordsToDelete

from schemas import (
    DLQ_HEADERS,
    BudgetSnapshot,
    Halt,
    Message,
    PromptPublished,
    ResponseReceived,
    Resume,
    SchemaError,
    decode,
    decode_control,
    encode,
    sample_key,
)
from services.budget.core import estimate_usage
from services.common.config import Settings
from services.common.kafka import header, make_admin, make_consumer, make_producer
from services.common.service import Service
from services.common.topics import partitions_of as topic_partitions
from services.common.topics import read_to_end
from services.demo.run import Processes, accepted_keys, cli, read_dead_letters, run_cli, sink_rows, wait_http
from tests.kafka_fixture import wait_until

__all__ = [
    "DeadLetterRecord",
    "Tally",
    "Pipeline",
    "Processes",
    "accepted_keys",
    "sink_rows",
    "cli",
    "dead_letters",
    "delete_to_end",
    "budget_caught_up",
    "stage_caught_up",
    "pipeline_config",
    "produce",
    "prompt_value",
    "read_all",
    "responses",
    "control_events",
    "read_dead_letters",
    "run_cli",
    "run_side_by_side",
    "small_prompt",
    "wait_http",
    "wait_until",
]

REPO = Path(__file__).resolve().parents[2]

Record = ConsumerRecord[bytes, bytes]


def pipeline_config(
    run_dir: Path, bootstrap: str, sim_port: int, datasets: Iterable[str], *, prefix: str, concurrency: int,
    timeout_s: float,
) -> str:
    """The TOML of a whole-pipeline run against the simulator: fast retries, small stage
    batches, no metrics ports, the usage count checked exactly for every dataset."""
    sections = "\n".join(f"[datasets.{d}]\nmax_tokens = 512\naudit.usage_offset = 0\n" for d in datasets)
    return f"""
[kafka]
bootstrap_servers = "{bootstrap}"
topic_prefix = "{prefix}"

[provider]
kind = "simulator"
base_url = "http://127.0.0.1:{sim_port}/api/v1"
concurrency = {concurrency}
max_attempts = 3
backoff_initial_s = 0.05
backoff_max_s = 0.3
timeout_s = {timeout_s:g}

[sink]
out_dir = "{run_dir / "out"}"

[stage]
batch_max = 32
batch_timeout_ms = 50

[metrics]
inference_port = 0
reconstruct_port = 0
audit_port = 0
budget_port = 0
sink_port = 0
continuation_port = 0

{sections}
"""


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


async def responses(settings: Settings) -> list[ResponseReceived]:
    """Every record on ``responses``, decoded."""
    topic = settings.kafka.topic("responses")
    return [decode(r.value, ResponseReceived) for r in (await read_all(settings, topic))[topic]]


async def control_events(settings: Settings) -> list[Halt | Resume]:
    """Every record on ``control``, in order."""
    topic = settings.kafka.topic("control")
    return [decode_control(r.value) for r in (await read_all(settings, topic))[topic]]


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


def run_side_by_side(
    commands: Mapping[str, list[str]], env: dict[str, str], timeout: float = 120
) -> dict[str, subprocess.CompletedProcess[bytes]]:
    """Run short commands at the same time (each is mostly an interpreter starting); each one's result."""
    with ThreadPoolExecutor(max_workers=max(1, len(commands))) as pool:
        futures = {
            name: pool.submit(subprocess.run, args, env=env, capture_output=True, timeout=timeout)
            for name, args in commands.items()
        }
    return {name: future.result() for name, future in futures.items()}


async def delete_to_end(settings: Settings, topic: str) -> None:
    """Delete every record now on a physical topic: its log start moves to its end."""
    ends = await end_offsets(settings, topic)
    marks = {TopicPartition(topic, p): RecordsToDelete(before_offset=end) for p, end in ends.items() if end}
    admin = make_admin(settings.kafka)
    await admin.start()
    try:
        if marks:
            await admin.delete_records(marks, timeout_ms=10_000)
    finally:
        await admin.close()


@dataclass(frozen=True)
class DeadLetterRecord:
    """One dead letter, with its headers parsed; ``value`` None when the failed record was a tombstone."""

    key: str
    value: bytes | None
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
                value=r.value,
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

    async def start_stages(self, settings: Settings, *names: str) -> None:
        """Start the named stages (inference, reconstruct, audit, sink, budget) at the same time, as
        separate processes would: each runs as soon as it has started (a worker's start may wait
        on a running budget: its probe's requests need leases). If one fails to start, the others
        of this call are stopped and closed, and its error is raised."""
        from services.audit.app import create_app as audit_app
        from services.budget.app import create_app as budget_app
        from services.continuation.app import create_app as continuation_app
        from services.inference.app import create_app as inference_app
        from services.probe.app import probe_first
        from services.reconstruct.app import create_app as reconstruct_app
        from services.sink.app import create_app as sink_app

        apps: dict[str, Callable[[Settings], Any]] = {
            "inference": lambda settings: inference_app(settings, probe=probe_first),
            "reconstruct": reconstruct_app,
            "audit": audit_app,
            "sink": sink_app,
            "budget": budget_app,
            "continuation": continuation_app,
        }
        services = {name: apps[name](settings) for name in names}
        started = await asyncio.gather(
            *(self.start(name, service) for name, service in services.items()), return_exceptions=True
        )
        failed = [outcome for outcome in started if isinstance(outcome, BaseException)]
        if failed:
            running = [name for name in reversed(names) if name in self.tasks and self.services[name] is services[name]]
            for name in running:
                self.services[name].stop()
            for name in running:
                await self._wait_and_close(name)
                del self.services[name], self.tasks[name]
            raise failed[0]

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
            await self._wait_and_close(name)

    async def _wait_and_close(self, name: str) -> None:
        """Wait for a stopped service's run() to end (cancel it after 40 s), then close it."""
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


async def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    """The end offset of each partition of a physical topic."""
    tps = await partitions_of(settings, topic)
    consumer = make_consumer(settings.kafka, group_id=None)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    return {tp.partition: end for tp, end in ends.items()}


async def budget_caught_up(settings: Settings) -> BudgetSnapshot | None:
    """The latest global budget snapshot, once it has counted every response record."""
    state = settings.kafka.topic("budget-state")
    responses = settings.kafka.topic("responses")
    snaps = [decode(r.value, BudgetSnapshot) for r in (await read_all(settings, state))[state] if r.value]
    totals = [s for s in snaps if s.scope == "global"]
    if not totals:
        return None
    latest = totals[-1]
    ends = await end_offsets(settings, responses)
    if all(latest.offsets.get(f"responses:{p}", 0) >= end for p, end in ends.items()):
        return latest
    return None


async def stage_caught_up(settings: Settings, stage: str) -> bool:
    """Whether the consumer group of ``stage`` has committed every record of its input topic (a
    stage commits only what it has handled and whose outputs the broker acknowledged)."""
    from schemas import topology

    topic = settings.kafka.topic(topology.STAGE_INPUT[stage])
    ends = await end_offsets(settings, topic)
    admin = make_admin(settings.kafka)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(settings.kafka.group(topology.GROUPS[stage]))
    finally:
        await admin.close()
    done = {tp.partition: meta.offset for tp, meta in committed.items() if tp.topic == topic}
    return all(done.get(partition, 0) >= end for partition, end in ends.items())


# Simulator faults after which the provider billed nothing (the request is sent again).
TRANSIENT_FAULTS = frozenset({"429", "5xx", "timeout", "drop", "malformed", "error_in_200"})


@dataclass
class Tally:
    """What came out of a pipeline run, counted against what went in and what the provider billed.

    Exactly once means: every published prompt has one row in the training files or a dead
    letter; no key has two rows; nothing unpublished comes out; the budget equals the usage
    of every paid response record it covered (a ``reused`` record, re-sent from the response
    store, was paid once, when first answered).
    """

    expected: set[str]
    keys: Counter[str]
    dead_keys: Counter[str]
    dead_letters: int
    response_records: int
    covered: int
    undecodable: int
    paid: list[ResponseReceived]
    reused: int
    snapshot: BudgetSnapshot
    provider_requests: int
    paid_twice: int

    @classmethod
    def of(
        cls,
        expected: set[str],
        out_dir: Path,
        letters: Sequence[DeadLetterRecord],
        response_records: Sequence[Record],
        snapshot: BudgetSnapshot,
        sim_stats: dict[str, Any],
    ) -> Tally:
        """Count a finished run (``sim_stats``: the simulator's ``/_sim/stats``)."""
        # Exactly the records the snapshot covers (its offsets reached the end of the topic
        # when it was taken; a response re-sent after that would be counted by the next one).
        covered = [r for r in response_records if r.offset < snapshot.offsets.get(f"responses:{r.partition}", 0)]
        decoded: list[ResponseReceived] = []
        undecodable = 0
        for r in covered:
            try:
                decoded.append(decode(r.value, ResponseReceived))
            except SchemaError:
                undecodable += 1
        transient = {k: sum(1 for f in v if f in TRANSIENT_FAULTS) for k, v in sim_stats["key_faults"].items()}
        paid_per_key = {k: n - transient.get(k, 0) for k, n in sim_stats["keys"].items()}
        return cls(
            expected=expected,
            keys=accepted_keys(out_dir),
            dead_keys=Counter(d.key for d in letters),
            dead_letters=len(letters),
            response_records=len(response_records),
            covered=len(covered),
            undecodable=undecodable,
            paid=[r for r in decoded if not r.reused],
            reused=sum(1 for r in decoded if r.reused),
            snapshot=snapshot,
            provider_requests=int(sim_stats["total_requests"]),
            paid_twice=sum(max(0, n - 1) for n in paid_per_key.values()),
        )

    @property
    def lost(self) -> int:
        """Published prompts with neither a row nor a dead letter."""
        return len({k for k in self.expected if k not in self.keys and k not in self.dead_keys})

    @property
    def duplicate_rows(self) -> int:
        """Rows beyond the first of each key in the training files."""
        return sum(n - 1 for n in self.keys.values() if n > 1)

    def usage(self) -> tuple[int, int, float]:
        """(prompt tokens, completion tokens, cost) summed over the paid responses."""
        prompt = completion = 0
        cost = 0.0
        for resp in self.paid:
            p, c, _ = estimate_usage(resp)
            prompt += p
            completion += c
            cost += resp.usage.cost or 0.0
        return prompt, completion, cost

    def counts(self) -> dict[str, Any]:
        """The counts a report line shows."""
        prompt, completion, _ = self.usage()
        per_key = Counter(f"{r.dataset}:{r.sample_id}" for r in self.paid)
        return {
            "prompts": len(self.expected),
            "accounted": len(self.expected) - self.lost,
            "lost": self.lost,
            "accepted": len(self.keys),
            "dead_lettered_only": len(set(self.dead_keys) - set(self.keys)),
            "dead_letters": self.dead_letters,
            "accepted_and_dead_lettered": len(set(self.keys) & set(self.dead_keys)),
            "duplicate_rows": self.duplicate_rows,
            "response_records": self.response_records,
            "budget_covered_records": self.covered,
            "duplicate_responses": sum(n - 1 for n in per_key.values() if n > 1),
            "provider_requests": self.provider_requests,
            "repeated_paid_requests": self.paid_twice,
            "budget_completion": f"{self.snapshot.completion_tokens}/{completion}",
            "budget_prompt": f"{self.snapshot.prompt_tokens}/{prompt}",
            "budget_responses": f"{self.snapshot.responses}/{len(self.paid)}",
            "reused_responses": self.reused,
        }

    def assert_exactly_once(self, line: str) -> None:
        """Nothing lost, nothing twice, nothing foreign; the budget equals the bill."""
        assert self.lost == 0, f"prompts lost: {line}"
        assert all(n == 1 for n in self.keys.values()), f"a key written twice: {line}"
        foreign = (set(self.keys) | set(self.dead_keys)) - self.expected
        assert not foreign, f"keys nobody published: {line}"
        assert self.undecodable == 0, line
        prompt, completion, cost = self.usage()
        assert self.snapshot.responses == len(self.paid), f"budget counted responses wrongly: {line}"
        assert self.snapshot.completion_tokens == completion, f"budget completion tokens: {line}"
        assert self.snapshot.prompt_tokens == prompt, f"budget prompt tokens: {line}"
        assert math.isclose(self.snapshot.cost_usd, cost, rel_tol=1e-9, abs_tol=1e-12), f"budget cost: {line}"


def counts_by(items: Sequence[str]) -> dict[str, int]:
    """How often each string occurs, sorted by name."""
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def elapsed_since(t0: float) -> float:
    """Seconds since a monotonic time."""
    return time.monotonic() - t0


