"""Least privilege for real: a broker that enforces ACLs, one SASL user per service.

A private broker (deploy/kafka/kafka.sh with ``KAFKA_AUTHORIZER=on``: KRaft's
StandardAuthorizer, nothing allowed without an ACL, one super user) gets a SCRAM user per
role of ``schemas/topology.py``. ``draftstream acls apply`` (the real CLI, as the admin)
grants the generated set and ``draftstream topics create`` (as the admin) makes the topics.

- The pipeline runs end to end with each service as its own user: publish → inference
  (the simulator over HTTP) → reconstruct → audit → sink, the budget reading along; every
  prompt is accounted for.
- An audit stage run as a user that may read ``samples`` but not write ``accepted`` stops
  with one line naming the principal, the operation and the topic, commits nothing, and the
  real audit user then processes every sample: nothing is lost.
- Every role is refused one write and one read outside its ACLs, with that one line, and
  the refused write leaves the topic as it was.
- A service started with another service's user is refused at start.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition

from schemas.topology import ROLES
from services.audit.app import create_app as audit_app
from services.budget.app import create_app as budget_app
from services.common import broker
from services.common.acls import ADMIN_ROLE, AclBinding
from services.common.acls_apply import acl_tool, apply_acls
from services.common.config import Settings, load_settings
from services.common.errors import AccessDenied
from services.common.kafka import Outgoing, make_admin, make_consumer, make_producer, publish_all, refused_as
from services.common.topics import ready_partitions
from services.inference.app import create_app as inference_app
from services.publish.app import publish
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from tests.e2e.brokers import LocalBroker, free_port_block
from tests.e2e.harness import Pipeline, cli, dead_letters, read_all, run_cli, sink_rows, wait_until

# One broker of their own for the module's tests (a module fixture): kept on one worker.
pytestmark = [pytest.mark.e2e, pytest.mark.own_broker, pytest.mark.long(200, together=True)]

ADMIN = "draftstream"  # kafka.sh's KAFKA_SASL_USER: the super user
INTRUDER = "intruder"  # reads samples in the audit group, may not write accepted
SERVICE_ROLES = [name for name in ROLES if name != ADMIN_ROLE]
DATASET = "acl"
N = 16

# One topic each role may not write and one it may not read (logical names).
FORBIDDEN: dict[str, tuple[str, str]] = {
    "publish": ("responses", "control"),
    "inference": ("accepted", "samples"),
    "reconstruct": ("accepted", "samples"),
    "audit": ("control", f"prompts.{DATASET}"),
    "sink": ("control", "samples"),
    "budget": ("accepted", "samples"),
    "dlq": ("control", "accepted"),
    "status": ("control", "responses"),
    "operator": ("responses", f"prompts.{DATASET}"),
    "demo": ("dead-letter", "accepted"),
    "continuation": ("control", "samples"),
}


def _ports(n: int) -> list[int]:
    """``n`` consecutive ports free right now, from a random place (two sessions setting this
    module up at once do not pick the same ones; ``DRAFTSTREAM_TEST_PORTS`` bounds them)."""
    base = free_port_block(n)
    return list(range(base, base + n))


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """A private broker enforcing ACLs, with a SCRAM user per role (and the intruder)."""
    users = {name: f"pw-{uuid.uuid4().hex[:16]}" for name in [*SERVICE_ROLES, INTRUDER]}
    for attempt in range(3):
        port, controller, sasl = _ports(3)
        instance = LocalBroker(
            run_dir=tmp_path_factory.mktemp("kafka-acls"),
            port=port,
            controller_port=controller,
            sasl_ssl_port=sasl,
            sasl_password=f"admin-{uuid.uuid4().hex[:16]}",
            authorizer=True,
            sasl_users=users,
        )
        try:
            status = instance.start()
            break
        except broker.BrokerError as exc:
            # The range overlaps the kernel's ephemeral ports: a client socket elsewhere may
            # take a port between the check and the broker's bind. Other ports, once more.
            if "already in use" not in str(exc) and "exited during startup" not in str(exc) or attempt == 2:
                raise
    try:
        assert status.sasl_ssl_port == sasl and status.cafile, status
        yield instance
    finally:
        instance.stop()


def as_user(broker: LocalBroker, prefix: str, user: str, **sections: Any) -> Settings:
    """Settings of one SASL user on the module's broker."""
    assert broker.status is not None and broker.sasl_ssl_port is not None
    password = broker.sasl_password if user == ADMIN else broker.sasl_users[user]
    kafka = {
        "bootstrap_servers": f"127.0.0.1:{broker.sasl_ssl_port}",
        "topic_prefix": prefix,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": user,
        "sasl_password": password,
        "ssl_cafile": broker.status.cafile,
    }
    metrics = {f"{n}_port": 0 for n in ("inference", "reconstruct", "audit", "budget", "sink", "simulator")}
    return load_settings(None, kafka=kafka, metrics=metrics, **sections)


@pytest.fixture(scope="module")
def acl_prefix(acl_broker: LocalBroker, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A topic prefix whose ACLs and topics the admin created through the real CLI."""
    assert acl_broker.status is not None
    prefix = f"acl{uuid.uuid4().hex[:6]}."
    config = tmp_path_factory.mktemp("acl-config") / "draftstream.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = "127.0.0.1:{acl_broker.sasl_ssl_port}"\ntopic_prefix = "{prefix}"\n'
        f'security_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "{ADMIN}"\n'
        f'ssl_cafile = "{acl_broker.status.cafile}"\n',
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "DRAFTSTREAM_"))}
    env["DRAFTSTREAM_KAFKA__SASL_PASSWORD"] = acl_broker.sasl_password or ""
    applied = run_cli(cli("acls", "apply", "--config", str(config)), env, "acls apply")
    assert "applied" in applied and f"User:{ADMIN}" in applied, applied
    assert acl_broker.sasl_password not in applied
    created = run_cli(cli("topics", "create", "--config", str(config), "-d", DATASET), env, "topics create")
    assert f"{prefix}responses" in created, created
    return prefix


def _prompts_file(path: Path, n: int) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            row = {"id": f"q{i:03d}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]}
            f.write(json.dumps(row) + "\n")
    return path


async def _committed(admin_settings: Settings, group: str) -> dict[Any, Any]:
    admin = make_admin(admin_settings.kafka)
    await admin.start()
    try:
        return dict(await admin.list_consumer_group_offsets(group))
    finally:
        await admin.close()


@pytest.mark.timeout(900)
async def test_pipeline_runs_under_the_acls_and_a_refused_write_loses_nothing(
    acl_broker: LocalBroker, acl_prefix: str, tmp_path: Path, report: Callable[..., str]
) -> None:
    """Each service as its own user: every prompt accounted; a refused write commits nothing."""
    (sim_port,) = _ports(1)
    sim = await start_simulator(SimulatorOptions(reasoning_tokens=(8, 16), content_tokens=(4, 12)), port=sim_port)
    out_dir = tmp_path / "out"
    sections = {"provider": {"base_url": sim.url, "concurrency": 8}, "sink": {"out_dir": str(out_dir)}}
    users = {role: as_user(acl_broker, acl_prefix, role, **sections) for role in SERVICE_ROLES}
    admin = as_user(acl_broker, acl_prefix, ADMIN)
    kafka = admin.kafka
    audit_group = kafka.topic("draftstream-audit")
    # The intruder may read samples in the audit group and write dead letters, not accepted.
    intruder_acls = [
        AclBinding(f"User:{INTRUDER}", "TOPIC", "LITERAL", kafka.topic("samples"), "READ"),
        AclBinding(f"User:{INTRUDER}", "GROUP", "LITERAL", audit_group, "READ"),
        AclBinding(f"User:{INTRUDER}", "TOPIC", "LITERAL", kafka.topic("dead-letter"), "WRITE"),
    ]
    await asyncio.to_thread(apply_acls, intruder_acls, kafka, tool=acl_tool())

    pipeline = Pipeline()
    intruder = audit_app(as_user(acl_broker, acl_prefix, INTRUDER, **sections))
    try:
        budget = budget_app(users["budget"])
        await pipeline.start("budget", budget)
        await pipeline.start("inference", inference_app(users["inference"]))
        await pipeline.start("reconstruct", reconstruct_app(users["reconstruct"]))
        await pipeline.start("sink", sink_app(users["sink"]))
        await intruder.start()
        intruder_run = asyncio.create_task(intruder.run())
        published = await publish(users["publish"], [_prompts_file(tmp_path / "p.jsonl", N)], dataset=DATASET)
        assert published.published == N, published

        refused = await wait_until(lambda: intruder_run.done(), timeout=240, interval=0.3,
                                   message="the intruder's audit refused")
        assert refused
        error = intruder_run.exception()
        await intruder.close()
        assert isinstance(error, AccessDenied), repr(error)
        line = str(error)
        assert "\n" not in line, line
        assert f"User:{INTRUDER}" in line and "WRITE" in line and kafka.topic("accepted") in line, line
        # Nothing committed, nothing accepted: the refused batch is still to be done.
        committed = await _committed(admin, audit_group)
        assert not any(meta.offset > 0 for meta in committed.values()), committed
        assert (await read_all(admin, kafka.topic("accepted")))[kafka.topic("accepted")] == []

        await pipeline.start("audit", audit_app(users["audit"]))

        async def settled() -> bool:
            done = set([r["id"] for r in sink_rows(out_dir)]) | {d.key for d in await dead_letters(admin)}
            return len(done) >= N

        await pipeline.wait(settled, 240, "every prompt written by the sink or dead-lettered")
        await pipeline.wait(
            lambda: DATASET in budget.ledger.scopes and budget.ledger.scopes[DATASET].responses >= N,
            60,
            "the budget counted every response",
        )
    finally:
        await pipeline.stop()
        await sim.close()

    prompts = (await read_all(admin, kafka.prompts_topic(DATASET)))[kafka.prompts_topic(DATASET)]
    published_keys = {(r.key or b"").decode() for r in prompts}
    rows = [r["id"] for r in sink_rows(out_dir)]
    dead = {d.key for d in await dead_letters(admin)}
    line = report(prompts=N, published=len(published_keys), sink_rows=len(rows), dead_letters=len(dead),
                  refused=str(error).split(" (")[0])
    assert len(published_keys) == N, line
    assert len(rows) == len(set(rows)), f"a key written twice: {line}"
    assert set(rows) | dead == published_keys, f"prompts not accounted for: {line}"
    assert len(rows) == N, f"the simulator injects no fault here: every sample is accepted ({line})"


async def _refused_write(settings: Settings, topic: str) -> str:
    producer = make_producer(settings.kafka)
    try:
        with pytest.raises(AccessDenied) as refused, refused_as(settings.kafka, "WRITE"):
            await producer.start()
            await publish_all(producer, [Outgoing(topic, b"not allowed", key=b"acl:x")])
    finally:
        await producer.stop()
    return str(refused.value)


async def _refused_read(settings: Settings, topic: str) -> str:
    consumer = make_consumer(settings.kafka, group_id=None)
    await consumer.start()
    try:
        with pytest.raises(AccessDenied) as refused, refused_as(settings.kafka, "READ"):
            # How the group-less readers (inference's control and store) find partitions.
            tps = [TopicPartition(topic, p) for p in await ready_partitions(settings.kafka, topic)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            await consumer.getmany(*tps, timeout_ms=10_000)
    finally:
        await consumer.stop()
    return str(refused.value)


@pytest.mark.parametrize("role", SERVICE_ROLES)
async def test_each_role_is_refused_a_write_and_a_read_outside_its_acls(
    role: str, acl_broker: LocalBroker, acl_prefix: str, report: Callable[..., str]
) -> None:
    """A forbidden write and a forbidden read: one line naming principal, operation and topic."""
    settings = as_user(acl_broker, acl_prefix, role)
    admin = as_user(acl_broker, acl_prefix, ADMIN)
    write_topic, read_topic = (settings.kafka.topic(t) for t in FORBIDDEN[role])
    assert FORBIDDEN[role][0] not in ROLES[role].writes and FORBIDDEN[role][1] not in ROLES[role].reads
    before = len((await read_all(admin, write_topic))[write_topic])

    wrote = await asyncio.wait_for(_refused_write(settings, write_topic), 120)
    read = await asyncio.wait_for(_refused_read(settings, read_topic), 120)

    after = len((await read_all(admin, write_topic))[write_topic])
    report(role=role, write=wrote.split(" (")[0], read=read.split(" (")[0])
    for line in (wrote, read):
        assert "\n" not in line and f"User:{role}" in line, line
    if ROLES[role].writes:
        assert "WRITE on topic" in wrote and write_topic in wrote, wrote
    else:  # no WRITE anywhere: the idempotent producer cannot even get its producer id
        assert "IDEMPOTENT_WRITE" in wrote and "the cluster" in wrote, wrote
    assert "READ on topic" in read and read_topic in read, read
    assert after == before, f"{role} wrote to {write_topic} although refused"


async def test_a_service_started_as_another_services_user_is_refused(
    acl_broker: LocalBroker, acl_prefix: str, tmp_path: Path
) -> None:
    """inference as User:reconstruct, sink as User:audit: refused at start with one line."""
    inference = inference_app(as_user(acl_broker, acl_prefix, "reconstruct", datasets={DATASET: {}}))
    try:
        with pytest.raises(AccessDenied) as as_reconstruct:
            await asyncio.wait_for(inference.start(), 120)
    finally:
        await inference.close()
    sink = sink_app(as_user(acl_broker, acl_prefix, "audit", sink={"out_dir": str(tmp_path / "out")}))
    try:
        with pytest.raises(AccessDenied) as as_audit:
            await asyncio.wait_for(sink.start(), 120)
    finally:
        await sink.close()
    first, second = str(as_reconstruct.value), str(as_audit.value)
    assert "User:reconstruct" in first and "CREATE" in first and acl_prefix in first, first
    assert "User:audit READ on" in second and acl_prefix in second, second
