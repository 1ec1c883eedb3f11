"""What the e2e tests run of their own: free ports, private Kafka brokers and clusters, supervised services."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import broker

# Where free_port_block looks: below Linux's default ephemeral range (32768-60999), so that
# no outgoing connection's source port takes a listener's port between the pick and the bind.
_BLOCK_RANGE = (20000, 32000)


def _port_range() -> tuple[int, int] | None:
    """``DRAFTSTREAM_TEST_PORTS=LO-HI``: every port the e2e helpers pick lies in it (for
    machines where port ranges are shared out between several test runs)."""
    span = os.environ.get("DRAFTSTREAM_TEST_PORTS", "").strip()
    if not span:
        return None
    lo, _, hi = span.partition("-")
    if not (lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi) < 65536):
        raise ValueError(f"DRAFTSTREAM_TEST_PORTS must be LO-HI, got {span!r}")
    return int(lo), int(hi)


def _bindable(port: int) -> bool:
    # No SO_REUSEADDR: a port still in TIME_WAIT counts as taken, as it does for the JVM.
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    if _port_range() is not None:
        return free_port_block(1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive ports that are all free right now."""
    lo, hi = _port_range() or _BLOCK_RANGE
    bases = list(range(lo, hi - n + 2))
    random.shuffle(bases)
    for base in bases[:500]:
        if all(_bindable(port) for port in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {lo}-{hi}")


@dataclass
class LocalBroker:
    """A private broker instance of deploy/kafka/kafka.sh (own run dir and ports)."""

    run_dir: Path
    port: int = field(default_factory=free_port)
    controller_port: int = field(default_factory=free_port)
    sasl_ssl_port: int | None = None
    sasl_password: str | None = None
    authorizer: bool = False
    sasl_users: dict[str, str] = field(default_factory=dict)
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
            authorizer=self.authorizer,
            sasl_users=self.sasl_users,
        )
        return self.status

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL)."""
        broker.stop(run_dir=self.run_dir)

    def restart(self) -> broker.BrokerStatus:
        """Stop and start again on the same ports and storage."""
        self.stop()
        return self.start()


@dataclass
class LocalCluster:
    """A private local cluster of deploy/kafka/kafka.sh: ``nodes`` combined broker+controller
    nodes, node i on client port ``port + i - 1`` and controller port ``port + nodes + i - 1``."""

    run_dir: Path
    nodes: int = 3
    port: int = 0
    status: broker.BrokerStatus | None = None

    @property
    def bootstrap(self) -> str:
        """Every node's PLAINTEXT address."""
        return ",".join(f"127.0.0.1:{self.port + i}" for i in range(self.nodes))

    @staticmethod
    def _jvm_opts() -> str:
        return os.environ.get("KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=1")

    def start(self, attempts: int = 3) -> broker.BrokerStatus:
        """Start every node on a fresh block of free ports (another block when a port was
        taken between the pick and the JVM's bind) and wait until each serves metadata."""
        for attempt in range(1, attempts + 1):
            self.port = free_port_block(2 * self.nodes)
            try:
                self.status = broker.start(
                    port=self.port, controller_port=self.port + self.nodes, run_dir=self.run_dir,
                    nodes=self.nodes, jvm_opts=self._jvm_opts(), cds="reuse",
                )
                return self.status
            except broker.BrokerError as exc:
                broker.stop(run_dir=self.run_dir)
                if "Address already in use" not in str(exc) or attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    def node_status(self) -> broker.BrokerStatus:
        """What kafka.sh status says now."""
        return broker.status(run_dir=self.run_dir)

    def kill(self, node: int) -> None:
        """SIGKILL one node (no controlled shutdown) and wait until it is gone."""
        pid = self.node_status().node(node).pid
        if pid is None:
            raise AssertionError(f"node {node} is not running")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.node_status().node(node).running:
            time.sleep(0.1)

    def start_node(self, node: int) -> broker.BrokerStatus:
        """Start one node again, on its ports and storage, and wait until it serves metadata."""
        return broker.start(run_dir=self.run_dir, node=node, jvm_opts=self._jvm_opts(), cds="reuse")

    def quorum_leader(self) -> int:
        """The node that is the active controller now."""
        return broker.quorum(run_dir=self.run_dir).leader

    def stop(self) -> None:
        """Stop every node."""
        broker.stop(run_dir=self.run_dir)


@dataclass
class Supervisor:
    """Service processes that can be SIGKILLed and restarted, and are restarted when they die.

    Each service's output is appended to ``<log_dir>/<name>.log`` across restarts.
    """

    log_dir: Path
    env: dict[str, str]
    commands: dict[str, list[str]] = field(default_factory=dict)
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    procs: dict[str, Any] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)
    unplanned_exits: list[tuple[str, int]] = field(default_factory=list)

    def start(self, name: str, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        """Start (or start again) one service; ``env`` adds to the shared environment (kept for restarts)."""
        import subprocess

        if args is not None:
            self.commands[name] = args
        if env is not None:
            self.extra_env[name] = env
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise RuntimeError(f"{name} is already running (pid {running.pid})")
        log = (self.log_dir / f"{name}.log").open("ab")
        try:
            env = {**self.env, **self.extra_env.get(name, {})}
            self.procs[name] = subprocess.Popen(  # noqa: S603 - our own CLI
                self.commands[name], stdout=log, stderr=subprocess.STDOUT, env=env
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
