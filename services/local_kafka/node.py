"""One node: a broker+controller JVM, started in the background, waited for, stopped; the single
broker's commands."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.local_kafka.files import NodePaths, _elapsed, _ps, is_alive, reap, write_private
from services.local_kafka.jvm import Jvm, ensure_tls
from services.local_kafka.options import (
    DEPLOY_DIR,
    STOP_TIMEOUT,
    Options,
    check_port,
    die,
    log,
)
from services.local_kafka.props import (
    FormatStamp,
    cds_archive_of,
    format_args,
    format_decision,
    new_cluster_id,
    parse_state,
    render_config,
    scram_digest,
)
from services.local_kafka.readiness import port_open, probe_ready


@dataclass
class Node:
    """One broker+controller JVM: the single broker (paths = the run dir) or node I of a cluster."""

    opts: Options
    jvm: Jvm
    paths: NodePaths
    port: int
    controller_port: int
    node_id: int | None = None
    """None for the single broker."""
    voters: str = ""
    """controller.quorum.voters of a cluster; "" for the single broker (a standalone quorum)."""

    def state(self) -> dict[str, str]:
        """The state file written at start ({} when absent)."""
        try:
            return parse_state(self.paths.state_file.read_text())
        except OSError:
            return {}

    def is_our_broker(self, pid: int) -> bool:
        """``pid`` is a live process whose command line is our broker (not a recycled pid)."""
        if not is_alive(pid):
            return False
        args = _ps(pid, "args")
        return args is not None and re.search(r"kafka\.Kafka.*" + re.escape(str(self.paths.props)), args) is not None

    def running_pid(self) -> int | None:
        """The pid of this node's running broker, else None."""
        try:
            text = self.paths.pid_file.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() and self.is_our_broker(int(text)) else None

    def version(self) -> str:
        """Kafka's version from the broker's log ("" before it printed it)."""
        try:
            match = re.search(r"Kafka version: (\S*)", self.paths.log_file.read_text(errors="replace"))
        except OSError:
            return ""
        return match.group(1) if match else ""

    def storepass(self) -> str:
        """The keystore password of the local CA ("" without SASL_SSL)."""
        if not self.opts.sasl_ssl_port:
            return ""
        try:
            return (self.opts.tls_dir / "storepass").read_text().strip()
        except FileNotFoundError:
            return ""  # `config` before the first start made the CA

    def render(self, template: str) -> str:
        """This node's server.properties as a start would write it."""
        return render_config(template, self.opts, port=self.port, controller_port=self.controller_port,
                             data_dir=self.paths.data, storepass=self.storepass())

    def ensure_formatted(self, cluster_id: str = "") -> None:
        """Format the storage (cluster id, quorum, SCRAM users) only when ``format_decision`` says so."""
        controller = self.voters or f"{self.opts.host}:{self.controller_port}"
        scram = scram_digest(self.opts)
        stamp_file, data = self.paths.format_stamp, self.paths.data
        have = None
        if (data / "meta.properties").is_file() and stamp_file.is_file():
            have = FormatStamp.loads(stamp_file.read_text())
        reason = format_decision(have, data.exists(), controller=controller, scram=scram, cluster_id=cluster_id)
        if reason is None:
            return
        if reason:
            log(f"{reason}: re-formatting {data} (its topics are deleted)")
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        cluster_id = cluster_id or new_cluster_id()
        done = self.jvm.tool(*format_args(self.opts, self.paths.props, cluster_id, static_quorum=bool(self.voters)))
        write_private(self.paths.format_log, done.stdout)
        if done.returncode != 0:
            sys.stderr.write(done.stdout)
            die("formatting the storage failed (see above)")
        stamp_file.write_text(FormatStamp(controller, scram, cluster_id).dumps())

    def launch(self) -> int:
        """Start kafka.Kafka on this node's properties in the background; its pid."""
        tag = f".node{self.node_id}" if self.node_id is not None else ""
        cds, partial = self.jvm.cds_opts(tag)
        log_file = self.paths.log_file
        if log_file.is_file():
            os.replace(log_file, f"{log_file}.1")
        # A new session: the broker must outlive this command and ignore the Ctrl-C of the
        # terminal (or pytest) that started it. close_fds: it does not inherit the lock.
        with open(log_file, "wb") as out:  # noqa: PTH123
            proc = subprocess.Popen(  # noqa: S603
                [self.opts.java, *self.opts.heap_opts, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                 "-XX:+ExplicitGCInvokesConcurrent", "-Djava.awt.headless=true", *cds, *self.opts.jvm_opts,
                 f"-Dlog4j2.configurationFile={DEPLOY_DIR / 'log4j2.properties'}",
                 f"-Dkafka.logs.dir={self.paths.root}", "-cp", f"{self.opts.libs_dir}/*", "kafka.Kafka",
                 str(self.paths.props)],
                cwd=self.paths.root, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True)
        proc.returncode = 0  # never waited for here: it outlives us (and no "still running" warning)
        self.paths.pid_file.write_text(f"{proc.pid}\n")
        self.paths.state_file.write_text(
            f"host={self.opts.host}\nport={self.port}\ncontroller_port={self.controller_port}\n"
            f"sasl_ssl_port={self.opts.sasl_ssl_port}\ncds_partial={partial}\n")
        return proc.pid

    def _tail_log(self) -> None:
        with contextlib.suppress(OSError):
            sys.stderr.write("".join(self.paths.log_file.read_text(errors="replace").splitlines(True)[-40:]))

    def wait_ready(self, pid: int, deadline: float) -> None:
        """Wait until the broker just launched serves metadata that lists it, or fail at ``deadline``."""
        while not (port_open(self.opts.host, self.port) and probe_ready(self.opts.host, self.port)):
            if not is_alive(pid):
                self.paths.pid_file.unlink(missing_ok=True)
                self.paths.state_file.unlink(missing_ok=True)
                self._tail_log()
                die(f"the broker exited during startup (log: {self.paths.log_file})")
            if time.monotonic() >= deadline:
                self._tail_log()
                self.stop()
                die(f"the broker was not ready within {self.opts.start_timeout:g}s (log: {self.paths.log_file})")
            time.sleep(0.1)

    def stop(self) -> str:
        """SIGTERM, up to 30 s (90 s while recording the CDS archive), then SIGKILL; the line to print."""
        pid = self.running_pid()
        if pid is None:
            self.paths.pid_file.unlink(missing_ok=True)
            self.paths.state_file.unlink(missing_ok=True)
            return "stopped (was not running)"
        partial = self.state().get("cds_partial", "")
        # Writing the class-data archive at exit takes 5 s on an idle machine, more on a busy one.
        wait_s = STOP_TIMEOUT * 3 if partial else STOP_TIMEOUT
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        killed = not self._wait_gone(pid, wait_s)
        if killed:
            log(f"no exit {wait_s}s after SIGTERM; sending SIGKILL to {pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_gone(pid, 5)
        # A clean exit has written the class-data archive the broker was recording.
        if partial and os.path.isfile(partial):
            if not killed and os.path.getsize(partial) > 0:
                os.replace(partial, cds_archive_of(partial))
            else:
                os.unlink(partial)
        self.paths.pid_file.unlink(missing_ok=True)
        self.paths.state_file.unlink(missing_ok=True)
        return f"stopped (pid {pid})"

    def _wait_gone(self, pid: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.is_our_broker(pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        reap(pid)
        return True

    def running_line(self, pid: int) -> str:
        """``running pid=.. bootstrap=HOST:PORT port=.. controller_port=.. [sasl_ssl_port=.. cafile=..] version=..``."""
        state = self.state()
        port = state.get("port", "")
        line = (f"running pid={pid} bootstrap={state.get('host', '')}:{port} port={port} "
                f"controller_port={state.get('controller_port', '')}")
        if state.get("sasl_ssl_port"):
            line += f" sasl_ssl_port={state['sasl_ssl_port']} cafile={self.opts.tls_dir / 'ca.pem'}"
        return f"{line} version={self.version()}"


def single_node(opts: Options, jvm: Jvm) -> Node:
    """The single broker of the run dir, on KAFKA_PORT / KAFKA_CONTROLLER_PORT."""
    return Node(opts, jvm, NodePaths.at(opts.run_dir), port=check_port("KAFKA_PORT", opts.port),
                controller_port=check_port("KAFKA_CONTROLLER_PORT", opts.controller_port))


def start_single(opts: Options, jvm: Jvm) -> int:
    """``kafka.sh start`` for the single broker: prints the running line; the exit code."""
    node = single_node(opts, jvm)
    pid = node.running_pid()
    if pid is not None:
        running_port = node.state().get("port", "")
        if opts.env.get("KAFKA_PORT") and running_port != opts.env["KAFKA_PORT"]:
            log(f"already running, on port {running_port} (not KAFKA_PORT={opts.env['KAFKA_PORT']}): "
                "use restart to move it")
        else:
            log("already running")
        print(node.running_line(pid))
        return 0
    ports = [node.port, node.controller_port]
    if opts.sasl_ssl_port:
        ports.append(check_port("KAFKA_SASL_SSL_PORT", opts.sasl_ssl_port))
    opts.check_sasl()
    for port in ports:
        if port_open(opts.host, port):
            die(f"port {opts.host}:{port} is already in use by another process")
    started = time.monotonic()
    jvm.fetch()
    jvm.check_java()
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    if opts.sasl_ssl_port:
        ensure_tls(opts)
    write_private(node.paths.props, node.render((DEPLOY_DIR / "server.properties").read_text()))
    node.ensure_formatted()
    pid = node.launch()
    deadline = time.monotonic() + opts.start_timeout
    node.wait_ready(pid, deadline)
    if opts.sasl_ssl_port:
        while not port_open(opts.host, int(opts.sasl_ssl_port)):
            if time.monotonic() >= deadline:
                die(f"the SASL_SSL listener on {opts.sasl_ssl_port} did not open")
            time.sleep(0.1)
    log(f"Kafka {node.version() or '?'} ready on {opts.host}:{node.port} in {_elapsed(started)} "
        f"(pid {pid}, log {node.paths.log_file})")
    print(node.running_line(pid))
    return 0


def status_single(node: Node) -> int:
    """``kafka.sh status`` for the single broker: exit 0 when running, 1 when stopped."""
    pid = node.running_pid()
    if pid is None:
        print("stopped")
        return 1
    print(node.running_line(pid))
    return 0


def jvm_tool_lines(jvm: Jvm, args: Sequence[str]) -> str:
    """A tool's output, or a failure naming its last lines."""
    done = jvm.tool(*args)
    if done.returncode != 0:
        die(f"{args[0]} failed: {''.join(done.stdout.splitlines(True)[-5:])}")
    return done.stdout
