"""A local Kafka broker, or a local cluster of several (KRaft, no Docker), for development and tests.

A thin shell over the launcher ``services.local_kafka`` (what ``deploy/kafka/kafka.sh`` runs for
the Makefile and the shell scripts), which does the work: it fetches the jars with Maven once,
formats the storage, starts ``kafka.Kafka`` in the background under ``.run/kafka/`` (one node)
or ``.run/kafka/node-<id>/`` (a cluster) and waits until a Metadata request succeeds. This
module runs its commands in-process and turns their answers into values and exceptions for
``draftstream broker start|stop|status`` and the pytest fixtures. Each command is bounded by
the launcher's own deadlines (``KAFKA_START_TIMEOUT``, the 30 s stop, the run-dir lock)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services import local_kafka
from services.common.errors import CommandError

__all__ = ["BrokerError", "BrokerStatus", "NodeStatus", "QuorumStatus", "quorum", "start", "status", "stop"]


class BrokerError(CommandError):
    """A command of the launcher failed: its reason in one line when it gave one, else its output.

    A :class:`~services.common.errors.CommandError`: every command prints it as one line, exit 2.
    """


@dataclass(frozen=True)
class NodeStatus:
    """One node of a local cluster, as ``kafka.sh status`` reports it."""

    node_id: int
    running: bool
    port: int
    controller_port: int
    pid: int | None = None


@dataclass(frozen=True)
class QuorumStatus:
    """The KRaft quorum as its controllers report it (``kafka-metadata-quorum describe``)."""

    leader: int
    """Node id of the active controller."""
    epoch: int | None
    voters: tuple[int, ...]


@dataclass(frozen=True)
class BrokerStatus:
    """What ``kafka.sh status`` reports. Everything but ``running`` is None when stopped.

    For a cluster, ``running`` means at least one node runs, ``bootstrap`` lists every
    node, and ``nodes`` holds one entry per node (it is empty for the single broker).
    """

    running: bool
    pid: int | None = None
    bootstrap: str | None = None
    port: int | None = None
    controller_port: int | None = None
    sasl_ssl_port: int | None = None
    cafile: str | None = None
    """PEM certificate of the local CA, for clients of the SASL_SSL listener."""
    version: str | None = None
    """Kafka version from the broker log, e.g. ``"4.4.0"``."""
    nodes: tuple[NodeStatus, ...] = ()

    @property
    def running_nodes(self) -> tuple[NodeStatus, ...]:
        """The nodes of a cluster that run now."""
        return tuple(node for node in self.nodes if node.running)

    def node(self, node_id: int) -> NodeStatus:
        """One node of a cluster, by id.

        Raises:
            BrokerError: no such node.
        """
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise BrokerError(f"no node {node_id} in this cluster (nodes: {[n.node_id for n in self.nodes]})")


def start(
    *,
    port: int | None = None,
    controller_port: int | None = None,
    sasl_ssl_port: int | None = None,
    sasl_password: str | None = None,
    run_dir: Path | None = None,
    jvm_opts: str | None = None,
    cds: str | None = None,
    nodes: int | None = None,
    node: int | None = None,
    authorizer: bool = False,
    sasl_users: Mapping[str, str] | None = None,
) -> BrokerStatus:
    """Start the broker unless it already runs, wait until it serves metadata, return its status.

    Arguments left as None fall back to the script's defaults (port 9092, controller 9093,
    no SASL_SSL listener, run dir ``.run/kafka``) or to the caller's ``KAFKA_*``
    environment. ``jvm_opts`` adds JVM flags; ``cds`` ("on", "reuse", "off") governs the
    class-data sharing archive that makes later starts faster (see kafka.sh).
    ``authorizer`` enforces ACLs (needs ``sasl_ssl_port``); ``sasl_users`` (name to
    password) are SASL users besides the admin (KAFKA_AUTHORIZER, KAFKA_SASL_USERS).
    ``nodes`` > 1 starts a local cluster (node i on ``port + i - 1``); ``node`` starts one
    node of the cluster the run dir holds. The very first run includes resolving the jars
    with Maven. If the broker already runs, it is left as it is, even on other ports: see
    the returned status.

    Raises:
        BrokerError: the launcher failed (its output is in the message).
    """
    overrides = {
        "KAFKA_PORT": port,
        "KAFKA_CONTROLLER_PORT": controller_port,
        "KAFKA_SASL_SSL_PORT": sasl_ssl_port,
        "KAFKA_SASL_PASSWORD": sasl_password,
        "KAFKA_RUN_DIR": run_dir,
        "KAFKA_JVM_OPTS": jvm_opts,
        "KAFKA_CDS": cds,
        "KAFKA_AUTHORIZER": "on" if authorizer else None,
        "KAFKA_SASL_USERS": " ".join(f"{n}:{p}" for n, p in sasl_users.items()) if sasl_users else None,
        "KAFKA_NODES": nodes,
    }
    output = _run("start", overrides, _node_args(node))
    found = _parse_status(output)
    if not found.running:
        raise BrokerError(f"kafka.sh start succeeded but reported no running broker:\n{output}")
    return found


def stop(*, run_dir: Path | None = None, node: int | None = None) -> bool:
    """Stop the broker, every node of a cluster, or one ``node`` (SIGTERM, then SIGKILL
    after 30 s, or 90 s while it records its class-data archive). Return whether one was
    running.

    Raises:
        BrokerError: the launcher failed.
    """
    output = _run("stop", {"KAFKA_RUN_DIR": run_dir}, _node_args(node))
    return any(line.strip() and "was not running" not in line for line in output.splitlines())


def quorum(*, run_dir: Path | None = None) -> QuorumStatus:
    """Ask the running controllers which node leads the KRaft quorum (costs a JVM start).

    Raises:
        BrokerError: nothing runs, or the quorum has no leader.
    """
    output = _run("quorum", {"KAFKA_RUN_DIR": run_dir})
    return _parse_quorum(output)


def status(*, run_dir: Path | None = None) -> BrokerStatus:
    """Report whether the broker runs, and where.

    Raises:
        BrokerError: the launcher failed in an unexpected way.
    """
    completed = _call("status", {"KAFKA_RUN_DIR": run_dir})
    if completed.returncode not in (0, 1):
        raise BrokerError(_failure("status", completed))
    return _parse_status(completed.stdout)


def _node_args(node: int | None) -> tuple[str, ...]:
    return () if node is None else ("--node", str(node))


@dataclass(frozen=True)
class _Done:
    """What one command of the launcher printed, and its exit code."""

    returncode: int
    stdout: str
    stderr: str


def _run(command: str, overrides: Mapping[str, object | None], args: tuple[str, ...] = ()) -> str:
    completed = _call(command, overrides, args)
    if completed.returncode != 0:
        raise BrokerError(_failure(command, completed))
    return completed.stdout


def _call(command: str, overrides: Mapping[str, object | None], args: tuple[str, ...] = ()) -> _Done:
    """Run one command of the launcher in this process, its output captured."""
    # The launcher gets the caller's environment (JAVA_HOME, PATH, KAFKA_* set by the user)
    # plus the explicit arguments, as a mapping: os.environ is neither read for this module's
    # own use nor changed.
    env = dict(os.environ)
    env.update({key: str(value) for key, value in overrides.items() if value is not None})
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = local_kafka.run([command, *args], env)
        except local_kafka.KafkaScriptError as exc:
            print(f"kafka.sh: error: {exc}", file=err)
            code = 1
    return _Done(code, out.getvalue(), err.getvalue())


_ERROR_PREFIX = "kafka.sh: error: "


def _failure(command: str, completed: _Done) -> str:
    """Why a launcher command failed: its own error line (``kafka.sh: error: ...``), else its output."""
    lines = [line.strip() for part in (completed.stderr, completed.stdout) for line in part.splitlines()]
    reasons = [line.removeprefix(_ERROR_PREFIX) for line in lines if line.startswith(_ERROR_PREFIX)]
    if reasons:
        return f"broker {command}: {reasons[-1]}"
    details = "\n".join(line for line in lines if line)
    return f"kafka.sh {command} failed with exit code {completed.returncode}:\n{details[-4000:]}"


def _fields(words: list[str]) -> dict[str, str]:
    return dict(word.split("=", 1) for word in words if "=" in word)


def _parse_status(output: str) -> BrokerStatus:
    """Parse the script's status: a cluster's ``node=`` and ``cluster`` lines, or the last
    ``running key=value ...`` or ``stopped`` line of a single broker."""
    lines = output.splitlines()
    if any(line.startswith("cluster ") for line in lines):
        return _parse_cluster_status(lines)
    for line in reversed(lines):
        words = line.split()
        if not words or words[0] not in ("running", "stopped"):
            continue
        if words[0] == "stopped":
            return BrokerStatus(running=False)
        fields = _fields(words[1:])
        return BrokerStatus(
            running=True,
            pid=_int(fields.get("pid")),
            bootstrap=fields.get("bootstrap") or None,
            port=_int(fields.get("port")),
            controller_port=_int(fields.get("controller_port")),
            sasl_ssl_port=_int(fields.get("sasl_ssl_port")),
            cafile=fields.get("cafile") or None,
            version=fields.get("version") or None,
        )
    raise BrokerError(f"unexpected output from kafka.sh:\n{output}")


def _parse_cluster_status(lines: list[str]) -> BrokerStatus:
    nodes: list[NodeStatus] = []
    versions: list[str] = []
    cluster: dict[str, str] = {}
    for line in lines:
        words = line.split()
        if line.startswith("cluster "):
            cluster = _fields(words[1:])
        elif words and words[0].startswith("node=") and len(words) > 1 and words[1] in ("running", "stopped"):
            fields = _fields(words)
            node_id, port, controller_port = (_int(fields.get(k)) for k in ("node", "port", "controller_port"))
            if node_id is None or port is None or controller_port is None:
                raise BrokerError(f"unexpected node line from kafka.sh: {line}")
            nodes.append(NodeStatus(node_id, words[1] == "running", port, controller_port, _int(fields.get("pid"))))
            versions += [fields["version"]] if fields.get("version") else []
    running = [n for n in nodes if n.running]
    return BrokerStatus(
        running=bool(running),
        pid=running[0].pid if running else None,
        bootstrap=cluster.get("bootstrap") or None,
        port=nodes[0].port if nodes else None,
        controller_port=nodes[0].controller_port if nodes else None,
        version=versions[0] if versions else None,
        nodes=tuple(nodes),
    )


def _parse_quorum(output: str) -> QuorumStatus:
    for line in reversed(output.splitlines()):
        if line.startswith("quorum "):
            fields = _fields(line.split()[1:])
            leader = _int(fields.get("leader"))
            if leader is None:
                break
            voters = tuple(int(v) for v in fields.get("voters", "").split(",") if v.isdigit())
            return QuorumStatus(leader=leader, epoch=_int(fields.get("epoch")), voters=voters)
    raise BrokerError(f"unexpected output from kafka.sh quorum:\n{output}")


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None
