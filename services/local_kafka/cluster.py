"""A real Apache Kafka broker, or a local cluster of them (KRaft), without Docker: kafka.sh's commands.

    deploy/kafka/kafka.sh fetch     resolve the jars once (skipped when already complete)
    deploy/kafka/kafka.sh start     fetch, format storage if needed, start, wait until ready
    deploy/kafka/kafka.sh stop      SIGTERM, up to 30 s (90 s while recording the CDS
                                    archive, see KAFKA_CDS), then SIGKILL
    deploy/kafka/kafka.sh status    "running pid=.. port=.." (exit 0) or "stopped" (exit 1)
    deploy/kafka/kafka.sh restart
    deploy/kafka/kafka.sh config    print the server.properties a start would write
    deploy/kafka/kafka.sh quorum    the KRaft quorum: "quorum leader=ID epoch=N voters=1,2,3"
    deploy/kafka/kafka.sh cluster-id   a new cluster id

The jars come from Maven Central (deploy/kafka/pom.xml), the JVM is the host's (Java 17+).

A local cluster (KAFKA_NODES=3, or --nodes 3 after the command): N combined
broker+controller nodes on $KAFKA_HOST, a static quorum of N voters, replication
factor min(N,3) and min.insync.replicas 2 (1 below three nodes). Node i (1..N) listens
for clients on KAFKA_PORT+i-1 and for the quorum on KAFKA_CONTROLLER_PORT+i-1 (when
KAFKA_CONTROLLER_PORT is unset: KAFKA_PORT+N+i-1), keeps its files in
$KAFKA_RUN_DIR/node-i/ and its heap at KAFKA_HEAP_OPTS (default -Xmx384m -Xms128m).
The cluster's shape is remembered in $KAFKA_RUN_DIR/cluster.state, so later commands
on that run dir need no --nodes. One node at a time: --node I (start, stop, config).

    deploy/kafka/kafka.sh start --nodes 3     start (or complete) a three-node cluster
    deploy/kafka/kafka.sh stop --node 2       stop node 2 only; start --node 2 brings it back
    deploy/kafka/kafka.sh status              one line per node, then the cluster line

Environment (all optional):
  DRAFTSTREAM_HOME       root of the run state (default: the repository root)
  KAFKA_RUN_DIR          pid, log, config and data (default: $DRAFTSTREAM_HOME/.run/kafka)
  KAFKA_LIBS_DIR         the jars (default: $DRAFTSTREAM_HOME/.run/kafka/libs)
  KAFKA_HOST             address to listen on and advertise (default: 127.0.0.1)
  KAFKA_PORT             PLAINTEXT client port (default: 9092)
  KAFKA_CONTROLLER_PORT  KRaft controller port (default: 9093)
  KAFKA_SASL_SSL_PORT    when set, also open a SASL_SSL listener there (PLAIN and
                         SCRAM-SHA-256/512, self-signed TLS under $KAFKA_RUN_DIR/tls)
  KAFKA_SASL_USER        SASL user (default: draftstream)
  KAFKA_SASL_PASSWORD    SASL password (default: draftstream-secret)
  KAFKA_SASL_USERS       more SASL users, "name:password name:password ..." (SCRAM
                         credentials written at format time, and PLAIN users)
  KAFKA_AUTHORIZER       "on": ACLs are enforced (StandardAuthorizer, nothing allowed
                         without an ACL); KAFKA_SASL_USER is the only super user, and
                         the broker reaches itself and its controller as that user
                         over SASL, so the PLAINTEXT listener's anonymous clients get
                         nothing. Needs KAFKA_SASL_SSL_PORT. Default: off
  KAFKA_NODES            nodes of a local cluster (default: 1, or what cluster.state says)
  KAFKA_START_TIMEOUT    seconds to wait for readiness (default: 60; 180 for a cluster)
  KAFKA_HEAP_OPTS        JVM heap flags (default: -Xmx512m -Xms256m; per cluster node
                         -Xmx384m -Xms128m)
  KAFKA_JVM_OPTS         extra JVM flags, e.g. -XX:TieredStopAtLevel=1 (starts ~1 s
                         faster on 2 cores, runs slower: fine for tests, not for bench)
  KAFKA_CDS              class-data sharing archive of the Kafka classes, kept in
                         $KAFKA_LIBS_DIR/.cds: "on" (default: use it, or record it
                         during the first run; that run starts ~1.5 s and stops ~5 s
                         slower, later starts ~2 s faster), "reuse" (use it only if it
                         exists), "off"
  JAVA_HOME              which JVM to use (default: `java` on PATH)

Run as ``python -m services.local_kafka COMMAND [--nodes N] [--node I]`` (what
``deploy/kafka/kafka.sh`` does). One node's parts live in the other modules of ``services.local_kafka``.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from services.local_kafka.files import NodePaths, run_dir_lock, write_private
from services.local_kafka.jvm import Jvm
from services.local_kafka.node import Node, jvm_tool_lines, single_node, start_single, status_single
from services.local_kafka.options import DEPLOY_DIR, KafkaScriptError, Options, check_port, die, log
from services.local_kafka.props import FormatStamp, format_decision, new_cluster_id, parse_state
from services.local_kafka.readiness import port_open

__all__ = [
    "ClusterShape",
    "Invocation",
    "cluster_props",
    "edit_props",
    "main",
    "parse_args",
    "resolve_nodes",
    "resolve_shape",
]

COMMANDS = ("fetch", "cluster-id", "start", "stop", "status", "restart", "config", "quorum")


@dataclass(frozen=True)
class Invocation:
    """The command and its --nodes / --node options."""

    command: str
    nodes: str = ""
    only_node: str = ""


def parse_args(argv: Sequence[str]) -> Invocation:
    """``COMMAND [--nodes N] [--node I]`` (``--nodes=N`` and ``--node=I`` too)."""
    command, rest = (argv[0], list(argv[1:])) if argv else ("", [])
    nodes = only = ""
    while rest:
        arg = rest.pop(0)
        if arg in ("--nodes", "--node"):
            if not rest:
                die(f"{arg} needs a value")
            value = rest.pop(0)
        elif arg.startswith(("--nodes=", "--node=")):
            arg, _, value = arg.partition("=")
        else:
            die(f"unknown option '{arg}' (see kafka.sh help)")
        if arg == "--nodes":
            nodes = value
        else:
            only = value
    return Invocation(command, nodes, only)


def _state_of(path: Path) -> dict[str, str]:
    try:
        return parse_state(path.read_text())
    except OSError:
        return {}


def resolve_nodes(inv: Invocation, opts: Options, cluster_state: Mapping[str, str]) -> int:
    """The node count from --nodes, KAFKA_NODES or the run dir's cluster.state (else 1), checked."""
    have = cluster_state.get("nodes", "")
    want = inv.nodes or opts.env.get("KAFKA_NODES") or have or "1"
    if not re.fullmatch(r"[1-9]", want):
        die(f"the number of nodes must be 1..9, got '{want}'")
    nodes = int(want)
    if nodes == 1:
        if have:
            die(f"{opts.run_dir} holds a {have}-node cluster ({opts.run_dir / 'cluster.state'}): use another "
                f"KAFKA_RUN_DIR for a single broker, or stop the cluster and remove {opts.run_dir}")
        if inv.only_node:
            die("--node needs a cluster (--nodes N or KAFKA_NODES=N, N > 1)")
        return 1
    if inv.only_node and not (re.fullmatch(r"[1-9]", inv.only_node) and int(inv.only_node) <= nodes):
        die(f"--node must be one of 1..{nodes}, got '{inv.only_node}'")
    return nodes


@dataclass(frozen=True)
class ClusterShape:
    """Nodes, host and ports of a local cluster; node I has port+I-1 and controller_port+I-1."""

    nodes: int
    host: str
    port: int
    controller_port: int

    @property
    def voters(self) -> str:
        """controller.quorum.voters: ``1@host:cport,2@host:cport+1,...``."""
        return ",".join(f"{i}@{self.host}:{self.controller_port + i - 1}" for i in range(1, self.nodes + 1))

    @property
    def bootstrap(self) -> str:
        """Every node's client address."""
        return ",".join(f"{self.host}:{self.port + i - 1}" for i in range(1, self.nodes + 1))

    def state_text(self, cluster_id: str) -> str:
        """The cluster.state file."""
        return (f"nodes={self.nodes}\nhost={self.host}\nport={self.port}\ncontroller_port={self.controller_port}\n"
                f"voters={self.voters}\ncluster_id={cluster_id}\n")


def resolve_shape(nodes: int, opts: Options, cluster_state: Mapping[str, str], *, from_env: bool) -> ClusterShape:
    """Host and ports of the cluster.

    "start" (of the whole cluster) and "config" take KAFKA_HOST / KAFKA_PORT /
    KAFKA_CONTROLLER_PORT when set (``from_env``); everything else, and whatever is unset,
    comes from cluster.state, then from the defaults (controller ports right after the
    client ports).
    """
    env = opts.env
    state_port = cluster_state.get("port", "")
    base = opts.port if (from_env and env.get("KAFKA_PORT")) or not state_port else state_port
    if from_env and env.get("KAFKA_CONTROLLER_PORT"):
        controller: str | int = env["KAFKA_CONTROLLER_PORT"]
    elif base == state_port and cluster_state.get("nodes") == str(nodes):
        controller = cluster_state.get("controller_port", "")
    else:
        controller = check_port("KAFKA_PORT", base) + nodes
    host = opts.host if from_env and env.get("KAFKA_HOST") else (cluster_state.get("host") or opts.host)
    port = check_port("KAFKA_PORT", base)
    cport = check_port("KAFKA_CONTROLLER_PORT", controller)
    check_port("the last node's client port", port + nodes - 1)
    check_port("the last node's controller port", cport + nodes - 1)
    if cport < port + nodes and port < cport + nodes:
        die(f"client ports {port}..{port + nodes - 1} and controller ports {cport}..{cport + nodes - 1} overlap")
    return ClusterShape(nodes, host, port, cport)


def cluster_props(node_id: int, shape: ClusterShape) -> list[str]:
    """What makes the single-node template node ``node_id`` of the cluster ("-KEY" removes KEY).

    The node id, the static quorum of every node, and replication that survives the loss of
    one node without losing an acknowledged write (acks=all needs min.insync.replicas copies).
    """
    rf = min(shape.nodes, 3)
    isr = 2 if rf >= 3 else 1
    return [
        f"node.id={node_id}",
        "-controller.quorum.bootstrap.servers",
        f"controller.quorum.voters={shape.voters}",
        f"default.replication.factor={rf}",
        f"min.insync.replicas={isr}",
        f"offsets.topic.replication.factor={rf}",
        f"transaction.state.log.replication.factor={rf}",
        f"transaction.state.log.min.isr={isr}",
        f"share.coordinator.state.topic.replication.factor={rf}",
        f"share.coordinator.state.topic.min.isr={isr}",
    ]


def edit_props(text: str, edits: Sequence[str], header: str = "") -> str:
    """Apply KEY=VALUE edits (replace KEY's line, or append) and -KEY edits (remove KEY) to properties text."""
    drop = {e[1:] for e in edits if e.startswith("-")}
    sets = {e.partition("=")[0]: e for e in edits if not e.startswith("-")}
    done: set[str] = set()
    out = [header] if header else []
    for line in text.splitlines():
        key = line.partition("=")[0]
        if line and not line.startswith("#") and key in drop:
            continue
        if line and not line.startswith("#") and key in sets:
            out.append(sets[key])
            done.add(key)
            continue
        out.append(line)
    missing = [line for key, line in sets.items() if key not in done]
    if missing:
        out += ["", "# --- cluster (added by kafka.sh for a local cluster) ---", *missing]
    return "\n".join(out) + "\n"


class Cluster:
    """N combined broker+controller nodes, each in ``run_dir/node-I``."""

    def __init__(self, opts: Options, jvm: Jvm, shape: ClusterShape, only_node: str) -> None:
        self.opts, self.jvm, self.shape = opts, jvm, shape
        self.only = int(only_node) if only_node else None
        self.state_file = opts.run_dir / "cluster.state"

    def node(self, i: int) -> Node:
        """Node ``i`` of the cluster."""
        return Node(self.opts, self.jvm, NodePaths.at(self.opts.run_dir / f"node-{i}"), port=self.shape.port + i - 1,
                    controller_port=self.shape.controller_port + i - 1, node_id=i, voters=self.shape.voters)

    def ids(self) -> list[int]:
        """The node ids a command acts on: --node I, or all of them."""
        return [self.only] if self.only is not None else list(range(1, self.shape.nodes + 1))

    def render(self, node: Node, template: str) -> str:
        """Node's server.properties: the single-node template with the cluster's settings over it."""
        header = (f"# Node {node.node_id} of a local {self.shape.nodes}-node cluster: kafka.sh set node.id, "
                  "the static quorum and the replication settings below over the single-node template "
                  "(cluster_props).")
        assert node.node_id is not None  # noqa: S101  # a cluster's nodes have ids
        return edit_props(node.render(template), cluster_props(node.node_id, self.shape), header)

    def prepare(self) -> str:
        """Keep the cluster id when every node's storage belongs to this cluster; else draw a new one.

        Never while a node runs: a voter must not lose its log. Writes cluster.state.
        """
        if self.opts.sasl_ssl_port:
            die("KAFKA_SASL_SSL_PORT is for the single broker; the local cluster is PLAINTEXT only")
        single_pid = Node(self.opts, self.jvm, NodePaths.at(self.opts.run_dir), 0, 0).running_pid()
        if single_pid is not None:
            die(f"a single broker (pid {single_pid}) runs in {self.opts.run_dir}: stop it first, "
                "or use another KAFKA_RUN_DIR")
        stored_id = _state_of(self.state_file).get("cluster_id", "")
        all_formatted, running = True, []
        for i in range(1, self.shape.nodes + 1):
            node = self.node(i)
            stamp = node.paths.format_stamp
            have = None
            if (node.paths.data / "meta.properties").is_file() and stamp.is_file():
                have = FormatStamp.loads(stamp.read_text())
            if not stored_id or format_decision(have, True, controller=self.shape.voters, scram="",
                                                cluster_id=stored_id) is not None:
                all_formatted = False
            if node.running_pid() is not None:
                running.append(str(i))
        if all_formatted:
            cluster_id = stored_id
        else:
            if running:
                die(f"node(s) {' '.join(running)} run with other cluster settings or storage: "
                    "stop the cluster first (kafka.sh stop), then start re-formats every node")
            cluster_id = new_cluster_id()
            if stored_id:
                log(f"re-formatting the storage of all {self.shape.nodes} nodes "
                    "(a new cluster; old topics are deleted)")
        self.opts.run_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(self.shape.state_text(cluster_id))
        return cluster_id

    def start(self) -> int:
        """Start (or complete) the cluster, or one node of it; prints the status lines."""
        started = time.monotonic()
        self.jvm.fetch()
        self.jvm.check_java()
        cluster_id = self.prepare()
        template = (DEPLOY_DIR / "server.properties").read_text()
        launched: list[tuple[Node, int]] = []
        for i in self.ids():
            node = self.node(i)
            pid = node.running_pid()
            if pid is not None:
                log(f"node {i} already running (pid {pid})")
                continue
            for port in (node.port, node.controller_port):
                if port_open(self.shape.host, port):
                    die(f"port {self.shape.host}:{port} (node {i}) is already in use by another process")
            node.paths.root.mkdir(parents=True, exist_ok=True)
            write_private(node.paths.props, self.render(node, template))
            node.ensure_formatted(cluster_id)
            launched.append((node, node.launch()))
        deadline = time.monotonic() + self.opts.start_timeout
        # A node is ready once a quorum majority runs: all of them start before any is awaited.
        for node, pid in launched:
            node.wait_ready(pid, deadline)
        version = self.node(self.ids()[0]).version() or "?"
        log(f"Kafka {version}: node(s) {','.join(map(str, self.ids()))} of {self.shape.nodes} ready on "
            f"{self.shape.host} in {time.monotonic() - started:.3f}s (logs in {self.opts.run_dir}/node-*/kafka.log)")
        return self.status()

    def stop(self) -> int:
        """Stop the nodes in parallel (each controlled shutdown may take seconds)."""
        with ThreadPoolExecutor(max_workers=len(self.ids())) as pool:
            futures = [(i, pool.submit(self.node(i).stop)) for i in self.ids()]
        failed = False
        for i, future in futures:
            try:
                print(f"node={i} {future.result()}")
            except (OSError, KafkaScriptError) as exc:
                log(f"error: node {i}: {exc}")
                failed = True
        if failed:
            die("a node did not stop cleanly (see above)")
        return 0

    def status(self) -> int:
        """One line per node, then the cluster line; exit 0 when at least one node runs."""
        running = 0
        for i in range(1, self.shape.nodes + 1):
            node = self.node(i)
            pid = node.running_pid()
            if pid is not None:
                running += 1
                print(f"node={i} running pid={pid} bootstrap={self.shape.host}:{node.port} port={node.port} "
                      f"controller_port={node.controller_port} version={node.version()}")
            else:
                print(f"node={i} stopped port={node.port} controller_port={node.controller_port}")
        print(f"cluster nodes={self.shape.nodes} running={running} bootstrap={self.shape.bootstrap} "
              f"voters={self.shape.voters}")
        return 0 if running else 1


def quorum(jvm: Jvm, endpoints: Sequence[str]) -> str:
    """The KRaft quorum as its controllers report it: ``quorum leader=ID epoch=N voters=1,2,3``."""
    jvm.check_java()
    with tempfile.NamedTemporaryFile("w", suffix=".properties") as cfg:
        # A quorum without a leader must fail the command, not hang it.
        cfg.write("request.timeout.ms=10000\ndefault.api.timeout.ms=20000\n")
        cfg.flush()
        out = jvm_tool_lines(jvm, ["org.apache.kafka.tools.MetadataQuorumCommand", "--command-config", cfg.name,
                                   "--bootstrap-controller", ",".join(endpoints), "describe", "--status"])
    return parse_quorum_tool(out)


def parse_quorum_tool(out: str) -> str:
    """kafka-metadata-quorum's ``describe --status`` as one line."""
    def value(key: str) -> str:
        match = re.search(rf"^{key}: *(.*)$", out, re.M)
        return match.group(1).strip() if match else ""

    leader = value("LeaderId")
    if not leader.isdigit():
        die(f"no leader in the quorum's answer: {out}")
    voters = ",".join(re.findall(r'"id": *([0-9]+)', value("CurrentVoters")))
    return f"quorum leader={leader} epoch={value('LeaderEpoch')} voters={voters}"


def _run_single(inv: Invocation, opts: Options, jvm: Jvm) -> int:
    if inv.command == "fetch":
        with run_dir_lock(opts.run_dir):
            jvm.fetch()
        log(f"jars in {opts.libs_dir}")
        return 0
    if inv.command == "cluster-id":
        print(new_cluster_id())
        return 0
    if inv.command == "config":
        print(single_node(opts, jvm).render((DEPLOY_DIR / "server.properties").read_text()), end="")
        return 0
    if inv.command == "quorum":
        node = single_node(opts, jvm)
        if node.running_pid() is None:
            die("the broker is not running")
        state = node.state()
        print(quorum(jvm, [f"{state.get('host', '')}:{state.get('controller_port', '')}"]))
        return 0
    if inv.command == "status":
        return status_single(single_node(opts, jvm))
    with run_dir_lock(opts.run_dir):
        if inv.command in ("stop", "restart"):
            print(single_node(opts, jvm).stop())
            if inv.command == "stop":
                return 0
        return start_single(opts, jvm)


def _run_cluster(inv: Invocation, opts: Options, jvm: Jvm, nodes: int) -> int:
    state_file = opts.run_dir / "cluster.state"
    state = _state_of(state_file)
    if inv.command in ("stop", "status", "quorum") and not state_file.is_file():
        if inv.command == "quorum":
            die(f"no cluster in {opts.run_dir}")
        print("stopped (was not running)" if inv.command == "stop" else "stopped")
        return 0 if inv.command == "stop" else 1
    if inv.command == "config":
        cluster = Cluster(opts, jvm, resolve_shape(nodes, opts, state, from_env=True), inv.only_node)
        template = (DEPLOY_DIR / "server.properties").read_text()
        for i in cluster.ids():
            print(f"# ==> node-{i}/server.properties <==")
            print(cluster.render(cluster.node(i), template), end="")
        return 0
    if inv.command in ("status", "quorum"):
        cluster = Cluster(opts, jvm, resolve_shape(nodes, opts, state, from_env=False), inv.only_node)
        if inv.command == "status":
            return cluster.status()
        endpoints = [f"{cluster.shape.host}:{cluster.node(i).controller_port}" for i in range(1, nodes + 1)
                     if cluster.node(i).running_pid() is not None]
        if not endpoints:
            die("no node of the cluster is running")
        print(quorum(jvm, endpoints))
        return 0
    with run_dir_lock(opts.run_dir):
        if inv.command in ("stop", "restart"):
            if state_file.is_file():
                Cluster(opts, jvm, resolve_shape(nodes, opts, state, from_env=False), inv.only_node).stop()
            else:
                print("stopped (was not running)")
            if inv.command == "stop":
                return 0
        if inv.only_node and not state_file.is_file():
            die(f"no cluster in {opts.run_dir} yet: start all of it first (start --nodes N)")
        # One node of a standing cluster comes back on the ports the cluster was made with,
        # whatever KAFKA_PORT / KAFKA_CONTROLLER_PORT the caller's environment holds.
        shape = resolve_shape(nodes, opts, _state_of(state_file), from_env=not inv.only_node)
        return Cluster(opts, jvm, shape, inv.only_node).start()


def run(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """One kafka.sh command; its exit code (errors raise KafkaScriptError)."""
    inv = parse_args(argv)
    if inv.command in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    if inv.command not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    opts = Options.from_env(env)
    nodes = 1
    if inv.command in ("start", "stop", "status", "restart", "config", "quorum"):
        nodes = resolve_nodes(inv, opts, _state_of(opts.run_dir / "cluster.state"))
    if nodes > 1:
        opts = replace(opts, heap_opts=opts.heap_opts if env.get("KAFKA_HEAP_OPTS") else ("-Xmx384m", "-Xms128m"),
                       start_timeout=opts.start_timeout if env.get("KAFKA_START_TIMEOUT") else 180)
        return _run_cluster(inv, opts, Jvm(opts), nodes)
    return _run_single(inv, opts, Jvm(opts))


def main(argv: Sequence[str] | None = None) -> int:
    """kafka.sh's entry point: ``kafka.sh: error: ...`` and exit 1 on failure."""
    # `kafka.sh status | head -1` ends quietly, as the bash script did.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return run(sys.argv[1:] if argv is None else argv, os.environ)
    except KafkaScriptError as exc:
        log(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
