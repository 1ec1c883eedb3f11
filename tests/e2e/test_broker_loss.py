"""Broker loss: the pipeline on a three-node cluster (replication factor 3, min.insync.replicas
2, producers with acks=all and idempotence) while one broker is SIGKILLed twice over.

A private three-node cluster of deploy/kafka/kafka.sh, the simulator over HTTP, two inference
workers and one of each other stage run as processes; 1,500 prompts of three datasets are
published over about a minute. While they flow:

1. the broker that leads the most partitions of ``responses`` and ``accepted`` is SIGKILLed
   and started again 15 s later; the test waits until no partition is under-replicated;
2. the active controller (the KRaft quorum's leader, from kafka-metadata-quorum) is SIGKILLed;
   while it is down, ``draftstream halt`` is issued and must stop every inference worker
   (no new provider request for 3 s); the node comes back 15 s after its kill and
   ``draftstream resume`` lets the run finish.

Asserted: topics were created with replication factor 3 (read from the cluster, not set);
every prompt accounted for (a row, or a dead letter), 0 lost, 0 duplicate rows, the budget
equal to the usage of every paid response; provider requests paid twice no more than were in
flight at the two kills and at the halt (which cancels what is in flight); the halt stopped
the workers (within a generous bound that only catches "never") and held back the prompts published meanwhile.
The counts and the halt time are printed.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from schemas import ACCEPTED_TOPIC, GLOBAL_SCOPE, RESPONSES_TOPIC
from services.common.config import Settings, load_settings
from services.common.kafka import describe_layout, ensure_topics
from tests.e2e.brokers import LocalCluster, Supervisor, free_port
from tests.e2e.harness import (
    Tally,
    accepted_keys,
    budget_caught_up,
    cli,
    dead_letters,
    pipeline_config,
    produce,
    prompt_value,
    read_all,
    run_cli,
    wait_http,
    wait_until,
)

DATASETS = ("alpha", "beta", "gamma")
PER_DATASET = 500
INFERENCE_WORKERS = ("inference-1", "inference-2")
SERVICES = (*INFERENCE_WORKERS, "reconstruct", "audit", "budget", "sink")
CONCURRENCY = 8  # per inference worker
PUBLISH_WINDOW_S = 70.0
DOWN_S = 15.0  # how long a killed broker stays down
QUIET_S = 3.0  # a halt has taken effect once no new provider request arrived for this long
HALT_BOUND_S = 120.0  # generous: catches a halt that never stops the workers, nothing finer


async def _sim_stats(http: httpx.AsyncClient, sim_port: int) -> dict[str, Any]:
    return dict((await http.get(f"http://127.0.0.1:{sim_port}/_sim/stats")).json())


async def _reports_global_halt(http: httpx.AsyncClient, metrics_port: int) -> bool:
    """Whether a worker's metrics say the global halt stands there."""
    try:
        text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    except httpx.HTTPError:
        return False  # not serving yet (or restarting): not halted as far as we know
    return f'draftstream_inference_halted{{scope="{GLOBAL_SCOPE}"}} 1.0' in text


def _in_flight(stats: dict[str, Any]) -> int:
    """Provider requests received and not yet answered."""
    return int(stats["total_requests"]) - sum(int(v) for v in stats["statuses"].values())


class Publisher:
    """Publishes the prompts in chunks over a window, retrying a chunk while a broker is down."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.values = [prompt_value(d, i) for i in range(PER_DATASET) for d in DATASETS]
        self.published: set[str] = set()
        self.retries = 0

    async def run(self) -> None:
        chunks = 35
        size = math.ceil(len(self.values) / chunks)
        for start in range(0, len(self.values), size):
            chunk = self.values[start : start + size]
            by_ds: dict[str, list[tuple[bytes, bytes]]] = {}
            for key, value in chunk:
                by_ds.setdefault(key.decode().split(":")[0], []).append((key, value))
            while True:
                try:
                    for ds, recs in by_ds.items():
                        await produce(self.settings, self.settings.kafka.prompts_topic(ds), recs)
                    break
                except Exception:  # noqa: BLE001 - a broker is down: the idempotent producer may retry
                    self.retries += 1
                    await asyncio.sleep(1.0)
            self.published |= {k.decode() for k, _ in chunk}
            await asyncio.sleep(PUBLISH_WINDOW_S / chunks)


@pytest.mark.long(140)
@pytest.mark.e2e
@pytest.mark.own_broker
@pytest.mark.timeout(1200)
async def test_losing_a_broker_and_the_controller_loses_nothing(tmp_path: Path, report: Callable[..., str]) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    cluster = LocalCluster(run_dir=tmp_path / "kafka", nodes=3)
    await asyncio.to_thread(cluster.start)
    sim_port = free_port()
    config = run_dir / "draftstream.toml"
    config.write_text(pipeline_config(run_dir, cluster.bootstrap, sim_port, DATASETS, prefix="loss.",
                                      concurrency=CONCURRENCY, timeout_s=10), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "DRAFTSTREAM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    settings = load_settings(config, kafka={"bootstrap_servers": cluster.bootstrap})
    sup = Supervisor(run_dir / "logs", env)
    out_dir = run_dir / "out"
    events: list[str] = []
    t0 = time.monotonic()

    def note(what: str) -> None:
        events.append(f"{time.monotonic() - t0:.1f}s {what}")

    publisher = Publisher(settings)
    publishing: asyncio.Task[None] | None = None
    inflight_at_kills: list[int] = []
    http = httpx.AsyncClient(timeout=10)
    try:
        await ensure_topics(settings.kafka, DATASETS)
        ours = [*settings.kafka.topics.values(), *map(settings.kafka.prompts_topic, DATASETS)]
        layout = await describe_layout(settings.kafka, ours)
        assert layout.brokers == (1, 2, 3)
        replication = {len(p.replicas) for p in layout.partitions}
        assert replication == {3}, f"topics were created with replication {replication}, not 3"

        sup.start(
            "simulator",
            cli(
                "simulate-provider", "--port", str(sim_port), "--seed", "7",
                "--reasoning-tokens", "8-40", "--content-tokens", "8-30", "--latency", "0.3", "--jitter", "0.3",
                "--fault-rate", "429=0.03", "--fault-rate", "truncate=0.01",
            ),
        )
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{sim_port}/health", 60)
        # Each inference worker serves its metrics: the halt counts as taken once every worker
        # reports it (draftstream_inference_halted), not merely when requests pause.
        metrics_ports = {name: free_port() for name in INFERENCE_WORKERS}
        for name in SERVICES:
            if name in INFERENCE_WORKERS:
                port_env = {"DRAFTSTREAM_METRICS__INFERENCE_PORT": str(metrics_ports[name])}
                sup.start(name, cli("run", "inference", "--config", str(config)), env=port_env)
            else:
                sup.start(name, cli("run", name, "--config", str(config)))
        publishing = asyncio.create_task(publisher.run())

        async def requests_reached(n: int) -> bool:
            return int((await _sim_stats(http, sim_port))["total_requests"]) >= n

        await wait_until(lambda: requests_reached(150), timeout=180, interval=0.5, message="150 provider requests")

        # Phase 1: the broker that leads most of responses and accepted.
        responses, accepted = settings.kafka.topic(RESPONSES_TOPIC), settings.kafka.topic(ACCEPTED_TOPIC)
        leaders = (await describe_layout(settings.kafka, [responses, accepted])).leaders_per_broker()
        victim = max((b for b in leaders if b > 0), key=lambda b: (leaders[b], -b))
        inflight_at_kills.append(_in_flight(await _sim_stats(http, sim_port)))
        await asyncio.to_thread(cluster.kill, victim)
        note(f"SIGKILL node {victim} (leads {leaders[victim]} of responses+accepted {leaders}; "
             f"{inflight_at_kills[-1]} requests in flight)")
        await asyncio.sleep(DOWN_S / 2)  # past the broker session timeout (9 s): the node is fenced
        down = await describe_layout(settings.kafka, ours)
        note(f"{len(down.under_replicated)} of {len(down.partitions)} partitions under-replicated")
        await asyncio.sleep(DOWN_S / 2)
        await asyncio.to_thread(cluster.start_node, victim)
        note(f"node {victim} back")

        async def fully_replicated() -> bool:
            return not (await describe_layout(settings.kafka, ours)).under_replicated

        await wait_until(fully_replicated, timeout=180, interval=1.0, message="every partition back in sync")
        note("every partition in sync again")

        # Phase 2: the active controller; a halt issued while it is down.
        controller = await asyncio.to_thread(cluster.quorum_leader)
        inflight_at_kills.append(_in_flight(await _sim_stats(http, sim_port)))
        await asyncio.to_thread(cluster.kill, controller)
        killed_at = time.monotonic()
        note(f"SIGKILL node {controller}, the active controller ({inflight_at_kills[-1]} requests in flight)")
        await asyncio.sleep(1.0)
        inflight_at_halt = _in_flight(await _sim_stats(http, sim_port))
        halt_issued = time.time()
        await asyncio.to_thread(
            run_cli, cli("halt", "--reason", "broker-loss test", "--config", str(config)), env, "draftstream halt"
        )
        halt_acked_s = time.time() - halt_issued
        note(f"halt acknowledged after {halt_acked_s:.1f}s")

        halted_at: dict[str, float] = {}

        async def workers_stopped() -> tuple[float] | None:
            for name, port in metrics_ports.items():
                if name not in halted_at and await _reports_global_halt(http, port):
                    halted_at[name] = time.time() - halt_issued
            stats = await _sim_stats(http, sim_port)
            last = max(halt_issued, float(stats["last_request_at"] or 0.0))
            # Every worker took the halt, and no new request reached the provider since
            # (a quiet spell alone could be a worker that cannot fetch prompts just now).
            if len(halted_at) == len(metrics_ports) and time.time() - last > QUIET_S:
                return (last - halt_issued,)  # a tuple: 0.0 s (no request after the halt) is an answer
            return None

        (halt_s,) = await wait_until(workers_stopped, timeout=HALT_BOUND_S, interval=0.2,
                                  message="no provider request after the halt")
        taken = ", ".join(f"{name} {at:.1f}s" for name, at in sorted(halted_at.items()))
        note(f"every inference worker stopped {halt_s:.1f}s after the halt (halt taken: {taken})")
        requests_at_stop = int((await _sim_stats(http, sim_port))["total_requests"])
        controller_still_down = not cluster.node_status().node(controller).running
        await asyncio.sleep(max(0.0, DOWN_S - (time.monotonic() - killed_at)))
        await asyncio.to_thread(cluster.start_node, controller)
        # The halt holds once the cluster is whole again and the workers could fetch (asking the
        # quorum who leads now is a JVM tool's start: it runs in that window).
        new_controller, _ = await asyncio.gather(asyncio.to_thread(cluster.quorum_leader), asyncio.sleep(QUIET_S + 2.0))
        note(f"node {controller} back; new controller node {new_controller}")
        stats = await _sim_stats(http, sim_port)
        requests_while_halted = int(stats["total_requests"]) - requests_at_stop
        # Prompts published and never requested while the halt stood (the workers keep up with
        # the publisher, so at the moment the halt took effect there may be none yet).
        waiting = len(publisher.published - set(stats["keys"]))
        await asyncio.to_thread(
            run_cli, cli("resume", "--reason", "broker back", "--config", str(config)), env, "draftstream resume"
        )
        note("resumed")

        await publishing
        expected = publisher.published

        async def accounted() -> bool:
            for name in sup.revive():
                note(f"{name} exited by itself; restarted")
            done = set(accepted_keys(out_dir)) | {d.key for d in await dead_letters(settings)}
            return expected <= done

        await wait_until(accounted, timeout=420, interval=2.0, message="every prompt accounted for")
        snapshot = await wait_until(lambda: budget_caught_up(settings), timeout=120, interval=1.0,
                                    message="budget caught up with every response")
        stats = await _sim_stats(http, sim_port)
        response_records = (await read_all(settings, responses))[responses]
        letters = await dead_letters(settings)
    finally:
        await http.aclose()  # on a failure too: a dropped client's socket warns in a later test
        if publishing is not None and not publishing.done():
            publishing.cancel()
        sup.stop_all()
        cluster.stop()

    tally = Tally.of(expected, out_dir, letters, response_records, snapshot, stats)
    # A request repeats when a broker loss made a worker re-read its prompt before the answer
    # was stored (at most what was in flight at a kill), or when the halt cancelled it.
    bound = sum(inflight_at_kills) + inflight_at_halt
    line = report(
        **tally.counts(),
        paid_twice=tally.paid_twice,
        inflight_at_kills="+".join(map(str, inflight_at_kills)),
        inflight_at_halt=inflight_at_halt,
        paid_twice_bound=bound,
        halt_stop_s=f"{halt_s:.1f}",
        halt_ack_s=f"{halt_acked_s:.1f}",
        waiting_while_halted=waiting,
        requests_while_halted=requests_while_halted,
        publish_retries=publisher.retries,
        unplanned_exits=len(sup.unplanned_exits),
        events="; ".join(events),
    )
    tally.assert_exactly_once(line)
    assert len(expected) == PER_DATASET * len(DATASETS), line
    assert tally.paid_twice <= bound, f"more requests paid twice than were in flight at the kills and the halt: {line}"
    assert controller_still_down, f"the halt was measured after the controller came back: {line}"
    assert waiting > 0, f"no prompt was held back by the halt, so it proved nothing: {line}"
    assert requests_while_halted == 0, f"a worker sent requests while halted: {line}"
    assert len(tally.keys) > len(expected) // 2, f"most prompts should pass the audit: {line}"
