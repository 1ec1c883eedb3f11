"""One local Kafka node (KRaft: broker and controller in one JVM), without Docker.

What ``deploy/kafka/kafka.sh`` used to do in bash for one node: resolve the jars with
Maven once, render ``server.properties`` from ``deploy/kafka/server.properties`` (with the
SASL_SSL listener and the ACL settings when asked), make the local CA, decide whether the
storage must be (re-)formatted, start ``kafka.Kafka`` in the background, wait until a
Metadata request lists it, and stop it. The decisions are pure functions (``render_config``,
``new_cluster_id``, ``format_decision``, ``metadata_request``/``metadata_ready``) with unit
tests; ``Node`` does the I/O. ``services.common.kafka_cluster`` builds the local cluster and
the command line from these parts.

Only the standard library is used, so that ``kafka.sh`` runs with any Python 3.11 (no
virtualenv, no pydantic): that is why this module reads its environment itself, once, in
``Options.from_env``, instead of through ``services.common.config``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

__all__ = [
    "DEPLOY_DIR",
    "FormatStamp",
    "KafkaScriptError",
    "Node",
    "NodePaths",
    "Options",
    "check_port",
    "die",
    "format_args",
    "format_decision",
    "log",
    "metadata_ready",
    "metadata_request",
    "new_cluster_id",
    "port_open",
    "render_config",
    "scram_digest",
]

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "kafka"
"""pom.xml, the server.properties template and log4j2.properties."""
REPO_ROOT = DEPLOY_DIR.parents[1]
LIBS_MARKER = ".draftstream-complete"
"""In the libs dir: sha256 of the pom it came from."""
STOP_TIMEOUT = 30
_SASL_USER_RE = re.compile(r"[A-Za-z0-9._-]+")
_SASL_PASSWORD_RE = re.compile(r"[A-Za-z0-9._~@%+:-]+")


class KafkaScriptError(Exception):
    """A command of kafka.sh failed: the message is printed as ``kafka.sh: error: ...``, exit 1."""


def log(message: str) -> None:
    """Progress and warnings go to stderr, prefixed as kafka.sh always did."""
    print(f"kafka.sh: {message}", file=sys.stderr, flush=True)


def die(message: str) -> NoReturn:
    """Fail the command with a message (exit code 1)."""
    raise KafkaScriptError(message)


def check_port(name: str, value: str | int) -> int:
    """A TCP port 1..65535, or a named error."""
    text = str(value)
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        die(f"{name} must be a TCP port, got '{text}'")
    return int(text)


# ---------------------------------------------------------------------------------------
# options: the environment, read once
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """Everything kafka.sh takes from its environment (see ``kafka_cluster`` for the list)."""

    run_dir: Path
    libs_dir: Path
    libs_dir_given: bool
    host: str = "127.0.0.1"
    port: str = "9092"
    controller_port: str = "9093"
    sasl_ssl_port: str = ""
    sasl_user: str = "draftstream"
    sasl_password: str = "draftstream-secret"  # noqa: S105  # the documented local default
    sasl_users: tuple[str, ...] = ()
    authorizer: str = "off"
    start_timeout: float = 60
    heap_opts: tuple[str, ...] = ("-Xmx512m", "-Xms256m")
    jvm_opts: tuple[str, ...] = ()
    cds: str = "on"
    java_home: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    """The raw environment, for the few "was it set at all" questions of the cluster."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Options:
        """Read KAFKA_* and friends with kafka.sh's defaults."""
        home = Path(env.get("DRAFTSTREAM_HOME") or REPO_ROOT)
        timeout = env.get("KAFKA_START_TIMEOUT") or "60"
        try:
            start_timeout = float(timeout)
        except ValueError:
            die(f"KAFKA_START_TIMEOUT must be a number of seconds, got '{timeout}'")
        return cls(
            # Absolute: the broker runs in its node dir, and its command line names its properties.
            run_dir=Path(env.get("KAFKA_RUN_DIR") or home / ".run" / "kafka").absolute(),
            libs_dir=Path(env.get("KAFKA_LIBS_DIR") or home / ".run" / "kafka" / "libs").absolute(),
            libs_dir_given=bool(env.get("KAFKA_LIBS_DIR")),
            host=env.get("KAFKA_HOST") or "127.0.0.1",
            port=env.get("KAFKA_PORT") or "9092",
            controller_port=env.get("KAFKA_CONTROLLER_PORT") or "9093",
            sasl_ssl_port=env.get("KAFKA_SASL_SSL_PORT", ""),
            sasl_user=env.get("KAFKA_SASL_USER") or "draftstream",
            sasl_password=env.get("KAFKA_SASL_PASSWORD") or "draftstream-secret",
            sasl_users=tuple(env.get("KAFKA_SASL_USERS", "").split()),
            authorizer=env.get("KAFKA_AUTHORIZER") or "off",
            start_timeout=start_timeout,
            heap_opts=tuple((env.get("KAFKA_HEAP_OPTS") or "-Xmx512m -Xms256m").split()),
            jvm_opts=tuple(env.get("KAFKA_JVM_OPTS", "").split()),
            cds=env.get("KAFKA_CDS") or "on",
            java_home=env.get("JAVA_HOME", ""),
            env=dict(env),
        )

    def check_sasl(self) -> None:
        """The SASL values end up in a JAAS string and in --add-scram: keep them plain."""
        if self.authorizer not in ("on", "off"):
            die(f"KAFKA_AUTHORIZER must be on or off, got '{self.authorizer}'")
        if self.authorizer == "on" and not self.sasl_ssl_port:
            die("KAFKA_AUTHORIZER=on needs KAFKA_SASL_SSL_PORT (clients authenticate there)")
        if self.sasl_ssl_port:
            if not _SASL_USER_RE.fullmatch(self.sasl_user):
                die("KAFKA_SASL_USER may only use A-Z a-z 0-9 . _ -")
            if not _SASL_PASSWORD_RE.fullmatch(self.sasl_password):
                die("KAFKA_SASL_PASSWORD may only use A-Z a-z 0-9 and . _ ~ @ % + : -")
        for entry in self.sasl_users:
            name, sep, password = entry.partition(":")
            if not (sep and _SASL_USER_RE.fullmatch(name) and _SASL_PASSWORD_RE.fullmatch(password)):
                die(f"KAFKA_SASL_USERS: '{name}' is not name:password (name: A-Z a-z 0-9 . _ -; "
                    "password: A-Z a-z 0-9 and . _ ~ @ % + : -)")

    @property
    def extra_users(self) -> list[tuple[str, str]]:
        """KAFKA_SASL_USERS as (name, password) pairs."""
        return [(e.partition(":")[0], e.partition(":")[2]) for e in self.sasl_users]

    @property
    def java(self) -> str:
        """The JVM: $JAVA_HOME/bin/java, else java on PATH."""
        return f"{self.java_home}/bin/java" if self.java_home else "java"

    @property
    def keytool(self) -> str:
        """keytool beside that JVM."""
        return f"{self.java_home}/bin/keytool" if self.java_home else "keytool"

    @property
    def cds_enabled(self) -> bool:
        """KAFKA_CDS is not off."""
        return self.cds not in ("off", "0")

    @property
    def tls_dir(self) -> Path:
        """The local CA and the broker's keystore (the single broker's only)."""
        return self.run_dir / "tls"


# ---------------------------------------------------------------------------------------
# pure parts: config, cluster id, formatting, readiness
# ---------------------------------------------------------------------------------------


def render_config(template: str, opts: Options, *, port: int, controller_port: int, data_dir: Path,
                  storepass: str = "") -> str:
    """The server.properties of one node: the template's placeholders, plus SASL_SSL and ACLs when asked."""
    extra = f",SASL_SSL://{opts.host}:{opts.sasl_ssl_port}" if opts.sasl_ssl_port else ""
    text = (template.replace("@HOST@", opts.host).replace("@PORT@", str(port))
            .replace("@CONTROLLER_PORT@", str(controller_port)).replace("@EXTRA_LISTENERS@", extra)
            .replace("@LOG_DIR@", str(data_dir)))
    authorizer = opts.authorizer == "on"
    if opts.sasl_ssl_port:
        self_login = f' username="{opts.sasl_user}" password="{opts.sasl_password}"' if authorizer else ""
        plain_users = "".join(f' user_{name}="{password}"' for name, password in opts.extra_users)
        tls = opts.tls_dir
        text += f"""
# --- SASL_SSL listener (added by kafka.sh because KAFKA_SASL_SSL_PORT is set) ---------
listener.name.sasl_ssl.sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
# PLAIN users live in this JAAS config; SCRAM credentials were written into the cluster
# metadata at format time (kafka-storage format --add-scram).
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \
required{self_login} user_{opts.sasl_user}="{opts.sasl_password}"{plain_users};
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location={tls}/broker.p12
listener.name.sasl_ssl.ssl.keystore.password={storepass}
listener.name.sasl_ssl.ssl.key.password={storepass}
"""
    if authorizer:
        user, password, tls = opts.sasl_user, opts.sasl_password, opts.tls_dir
        # Appended: its keys override the template's (the last one wins).
        text += f"""
# --- ACLs (added by kafka.sh because KAFKA_AUTHORIZER=on) ------------------------------
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:{user}
allow.everyone.if.no.acl.found=false
# The broker talks to its controller and to itself as User:{user} over SASL (PLAIN),
# so the PLAINTEXT listener's clients are User:ANONYMOUS, with no ACL: refused.
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:SASL_PLAINTEXT,SASL_SSL:SASL_SSL
inter.broker.listener.name=SASL_SSL
sasl.mechanism.inter.broker.protocol=PLAIN
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \
required username="{user}" password="{password}" user_{user}="{password}";
listener.name.sasl_ssl.ssl.truststore.type=PKCS12
listener.name.sasl_ssl.ssl.truststore.location={tls}/broker.p12
listener.name.sasl_ssl.ssl.truststore.password={storepass}
"""
    return text


def new_cluster_id(random_bytes: Iterator[bytes] | None = None) -> str:
    """A random 16-byte UUID in URL-safe base64 without padding (22 chars), as ``kafka-storage random-uuid``.

    Like Kafka's ``Uuid.randomUuid()``, draw again while it starts with "-": kafka-storage
    would read such an id as an option (1 in 64 draws); ``--cluster-id=ID`` is a second guard.
    """
    while True:
        raw = next(random_bytes) if random_bytes is not None else os.urandom(16)
        cluster_id = base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def scram_digest(opts: Options) -> str:
    """What the SCRAM credentials of a format were (a digest, never the passwords); "" without SASL."""
    if not opts.sasl_ssl_port:
        return ""
    text = f"{opts.sasl_user}\n{opts.sasl_password}\n{' '.join(opts.sasl_users)}\n"
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class FormatStamp:
    """What a node's storage was formatted for (``data/.draftstream-format``)."""

    controller: str
    scram: str
    cluster_id: str

    def dumps(self) -> str:
        """The stamp file's text."""
        return f"controller={self.controller}\nscram={self.scram}\ncluster_id={self.cluster_id}\n"

    @classmethod
    def loads(cls, text: str) -> FormatStamp:
        """Parse a stamp file (missing keys are empty)."""
        values = parse_state(text)
        return cls(values.get("controller", ""), values.get("scram", ""), values.get("cluster_id", ""))


def format_decision(have: FormatStamp | None, data_exists: bool, *, controller: str, scram: str,
                    cluster_id: str) -> str | None:
    """None when the storage may be kept, else why it must be (re-)formatted ("" for a fresh one).

    Storage is formatted when it is not formatted yet, or was formatted for another controller
    endpoint (the quorum remembers its voter's endpoint), other SCRAM credentials (``scram``
    not empty), or another cluster (``cluster_id`` not empty); then the old data goes.
    """
    if have is None:
        return "" if not data_exists else "no complete format stamp"
    if (have.controller == controller and (not scram or have.scram == scram)
            and (not cluster_id or have.cluster_id == cluster_id)):
        return None
    if have.controller != controller:
        return f"storage was formatted for controller {have.controller}, not {controller}"
    if scram and have.scram != scram:
        return "storage lacks the SCRAM credentials of the SASL user"
    return "storage belongs to another cluster"


def cds_archive_of(partial: str) -> str:
    """The archive a recording run writes: ``x.jsa.PID[.nodeI].partial`` -> ``x.jsa``."""
    head, sep, _ = partial.rpartition(".jsa.")
    return head + ".jsa" if sep else partial


def format_args(opts: Options, props: Path, cluster_id: str, *, static_quorum: bool) -> list[str]:
    """The kafka-storage format command line (main class first) for one node's storage.

    ``--cluster-id=ID`` keeps even an id starting with "-" one argument. Static voters
    (controller.quorum.voters) need no quorum option; one node formats a dynamic quorum of
    itself (``--standalone``). With SASL_SSL, every user's SCRAM credentials are written.
    """
    args = ["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "--config", str(props)]
    if not static_quorum:
        args.append("--standalone")
    if opts.sasl_ssl_port:
        for name, password in [(opts.sasl_user, opts.sasl_password), *opts.extra_users]:
            for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
                args += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
    return args


def parse_state(text: str) -> dict[str, str]:
    """key=value lines (cluster.state, kafka.state, the format stamp)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def metadata_request(client_id: bytes = b"draftstream-kafka-sh") -> bytes:
    """A framed Metadata v1 request (api key 3, correlation id 1) for no topics."""
    req = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", 0)
    return struct.pack(">i", len(req)) + req


def metadata_ready(response: bytes, port: int) -> bool:
    """True when a framed Metadata v1 response lists a broker on ``port`` and names a controller.

    Raises:
        struct.error: the response is truncated or malformed.
    """
    off = 8  # size, correlation id
    (count,) = struct.unpack_from(">i", response, off)
    off += 4
    ports = []
    for _ in range(count):
        (host_len,) = struct.unpack_from(">h", response, off + 4)
        off += 6 + host_len
        ports.append(struct.unpack_from(">i", response, off)[0])
        (rack_len,) = struct.unpack_from(">h", response, off + 4)
        off += 6 + max(rack_len, 0)
    (controller,) = struct.unpack_from(">i", response, off)
    return controller >= 0 and port in ports


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """A bare TCP connect (the address is local: no hang to fear)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def probe_ready(host: str, port: int) -> bool:
    """The port answers AND a Metadata request lists this broker and a controller."""
    try:
        with socket.create_connection((host, port), timeout=2) as sock:
            sock.settimeout(5)
            sock.sendall(metadata_request())
            buf = b""
            while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return False
                buf += chunk
        return metadata_ready(buf, port)
    except (OSError, struct.error):
        return False


# ---------------------------------------------------------------------------------------
# files and processes
# ---------------------------------------------------------------------------------------


def write_private(path: Path, text: str) -> None:
    """Write ``path`` atomically, readable by its owner only (it may hold passwords)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def _ps(pid: int, field_name: str) -> str | None:
    done = subprocess.run(["ps", "-ww", "-o", f"{field_name}=", "-p", str(pid)],  # noqa: S603, S607
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def is_alive(pid: int) -> bool:
    """True when process ``pid`` exists and is not a zombie."""
    stat = _ps(pid, "stat")
    return stat is not None and not stat.startswith("Z")


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, timeout: float = 180) -> Iterator[None]:
    """One command at a time per run dir (two test sessions starting at once)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".lock", "w") as handle:  # noqa: PTH123
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    die(f"another kafka.sh is still busy with {run_dir}")
                time.sleep(0.2)
        yield


def _elapsed(started: float) -> str:
    return f"{time.monotonic() - started:.3f}s"


@dataclass(frozen=True)
class NodePaths:
    """Where one node keeps its files: the run dir, or ``run_dir/node-I`` in a cluster.

    ``data`` is the storage (log dir), ``props`` the rendered server.properties, ``state_file``
    the running broker's ports (written at start), ``format_stamp`` what the storage was
    formatted for.
    """

    root: Path
    data: Path
    props: Path
    pid_file: Path
    state_file: Path
    log_file: Path
    format_log: Path
    format_stamp: Path

    @classmethod
    def at(cls, root: Path) -> NodePaths:
        """The files of the node whose directory is ``root``."""
        return cls(root, root / "data", root / "server.properties", root / "kafka.pid", root / "kafka.state",
                   root / "kafka.log", root / "format.log", root / "data" / ".draftstream-format")


# ---------------------------------------------------------------------------------------
# the JVM: jars, java, class-data sharing, tools
# ---------------------------------------------------------------------------------------


class Jvm:
    """The jars, the java binary and the class-data archive that every node shares."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.vm_id = ""  # java.vm.version, set by check_java

    def _pom_hash(self) -> str:
        return hashlib.sha256((DEPLOY_DIR / "pom.xml").read_bytes()).hexdigest()

    def libs_ready(self) -> bool:
        """The libs dir was filled from this pom, or by hand (KAFKA_LIBS_DIR set, no marker of ours)."""
        libs = self.opts.libs_dir
        marker = libs / LIBS_MARKER
        if marker.is_file() and marker.read_text().strip() == self._pom_hash():
            return True
        return self.opts.libs_dir_given and not marker.is_file() and any(libs.glob("kafka_2.13-*.jar"))

    def fetch(self) -> None:
        """Resolve the jars once with Maven into a fresh sibling dir, then swap it in."""
        if self.libs_ready():
            return
        if shutil.which("mvn") is None:
            die("mvn (Apache Maven) is needed once to download the Kafka jars")
        libs = self.opts.libs_dir
        libs.parent.mkdir(parents=True, exist_ok=True)
        # A failed or interrupted download never leaves a half-filled libs dir, and jars of
        # an older pom (say, a second slf4j-api) never linger next to the new ones.
        tmp = Path(tempfile.mkdtemp(prefix=libs.name + ".fetch.", dir=libs.parent))
        log(f"resolving Kafka jars with Maven into {libs} (once) ...")
        done = subprocess.run(["mvn", "-q", "-B", "-Dstyle.color=never", "-f", str(DEPLOY_DIR / "pom.xml"),  # noqa: S603, S607
                               "dependency:copy-dependencies", "-DincludeScope=runtime",
                               f"-DoutputDirectory={tmp}"], capture_output=True, text=True, check=False)
        # Maven prints stray colour codes even in batch mode.
        sys.stderr.write(re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr))
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            die("mvn dependency:copy-dependencies failed (see the output above)")
        if not any(tmp.glob("kafka_2.13-*.jar")):
            shutil.rmtree(tmp, ignore_errors=True)
            die("no kafka_2.13 jar was resolved")
        (tmp / LIBS_MARKER).write_text(self._pom_hash() + "\n")
        if libs.is_dir():
            if not (libs / LIBS_MARKER).is_file() and any(libs.iterdir()):
                shutil.rmtree(tmp, ignore_errors=True)
                die(f"{libs} exists and was not filled by kafka.sh; refusing to replace it")
            shutil.rmtree(libs)
        tmp.rename(libs)
        # `mvn -f` may leave deploy/kafka/target behind; nothing in it is needed.
        shutil.rmtree(DEPLOY_DIR / "target", ignore_errors=True)
        log(f"jars ready: {sum(1 for _ in libs.rglob('*.jar'))} files")

    def check_java(self) -> None:
        """Kafka 4 needs Java 17+; remember the JVM build for the class-data archive's name."""
        if shutil.which(self.opts.java) is None:
            die("java not found (Kafka 4 needs Java 17 or newer)")
        done = subprocess.run([self.opts.java, "-XshowSettings:properties", "-version"],  # noqa: S603
                              capture_output=True, text=True, check=False)
        settings = done.stdout + done.stderr
        spec = re.search(r"^ *java\.specification\.version = (.*)$", settings, re.M)
        version = spec.group(1).strip() if spec else ""
        major = version.split(".")[0]
        if not (major.isdigit() and int(major) >= 17):
            die(f"Kafka 4 needs Java 17 or newer; {self.opts.java} is {version}")
        vm = re.search(r"^ *java\.vm\.version = (.*)$", settings, re.M)
        self.vm_id = re.sub(r"[^A-Za-z0-9._-]", "_", vm.group(1).strip()) if vm else ""

    @property
    def cds_archive(self) -> Path:
        """The class-data archive of this JVM build (a new fetch drops it with the libs dir)."""
        return self.opts.libs_dir / ".cds" / f"kafka-{self.vm_id}.jsa"

    def cds_opts(self, tag: str) -> tuple[list[str], str]:
        """JVM flags that use the archive, or record it at exit (then also the partial file's path).

        Class-data sharing maps ~6000 Kafka/Scala classes at start instead of loading and
        verifying them one by one (start 5 s -> 3 s on 2 cores).
        """
        quiet = ["-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
        if not self.opts.cds_enabled or not self.vm_id:
            return [], ""
        jsa = self.cds_archive
        if jsa.is_file() and jsa.stat().st_size > 0:
            return [f"-XX:SharedArchiveFile={jsa}", *quiet], ""
        if self.opts.cds in ("on", "1"):
            with contextlib.suppress(OSError):
                jsa.parent.mkdir(parents=True, exist_ok=True)
            if jsa.parent.is_dir() and os.access(jsa.parent, os.W_OK):
                # Unique per run and node: several brokers may record at the same time.
                partial = f"{jsa}.{os.getpid()}{tag}.partial"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                return [f"-XX:ArchiveClassesAtExit={partial}", *quiet], partial
        return [], ""

    def tool(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run one of Kafka's command-line tools (a main class) in a small, quick JVM."""
        opts = ["-Xmx256m", "-XX:TieredStopAtLevel=1"]
        jsa = self.cds_archive
        # The broker's class-data archive holds the tools' classes too.
        if self.opts.cds_enabled and self.vm_id and jsa.is_file() and jsa.stat().st_size > 0:
            opts += [f"-XX:SharedArchiveFile={jsa}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
        return subprocess.run([self.opts.java, *opts, "-cp", f"{self.opts.libs_dir}/*",  # noqa: S603
                               f"-Dlog4j2.configurationFile={DEPLOY_DIR / 'log4j2.properties'}", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)


def ensure_tls(opts: Options) -> None:
    """A local CA and a broker certificate it signs (CN=localhost, SAN DNS:localhost and IP:127.0.0.1).

    Made once with the JDK's keytool. Clients trust ``tls/ca.pem``.
    """
    tls = opts.tls_dir
    if all((tls / name).is_file() for name in ("broker.p12", "ca.pem", "storepass")):
        return
    if shutil.which(opts.keytool) is None:
        die("keytool (from the JDK) is needed for the SASL_SSL listener")
    log(f"creating a local CA and broker certificate in {tls} ...")
    shutil.rmtree(tls, ignore_errors=True)
    tls.mkdir(parents=True)
    tls.chmod(0o700)
    password = re.sub(r"[^A-Za-z0-9]", "", base64.b64encode(os.urandom(24)).decode())
    kt = [opts.keytool, "-noprompt", "-storetype", "PKCS12", "-storepass", password]
    steps = [
        ["-genkeypair", "-keystore", "ca.p12", "-alias", "ca", "-keyalg", "EC", "-groupname", "secp256r1",
         "-dname", "CN=draftstream local CA", "-validity", "3650",
         "-ext", "BasicConstraints:critical=ca:true", "-ext", "KeyUsage:critical=keyCertSign,cRLSign"],
        ["-exportcert", "-rfc", "-keystore", "ca.p12", "-alias", "ca", "-file", "ca.pem"],
        ["-genkeypair", "-keystore", "broker.p12", "-alias", "broker", "-keyalg", "EC", "-groupname", "secp256r1",
         "-dname", "CN=localhost", "-validity", "3650"],
        ["-certreq", "-keystore", "broker.p12", "-alias", "broker", "-file", "broker.csr"],
        ["-gencert", "-keystore", "ca.p12", "-alias", "ca", "-infile", "broker.csr", "-outfile", "broker.pem", "-rfc",
         "-validity", "3650", "-ext", "SubjectAlternativeName=DNS:localhost,IP:127.0.0.1",
         "-ext", "KeyUsage:critical=digitalSignature", "-ext", "ExtendedKeyUsage=serverAuth"],
        ["-importcert", "-keystore", "broker.p12", "-alias", "ca", "-file", "ca.pem"],
        ["-importcert", "-keystore", "broker.p12", "-alias", "broker", "-file", "broker.pem"],
    ]
    with open(opts.run_dir / "keytool.log", "w") as out:  # noqa: PTH123
        for step in steps:
            if subprocess.run([*kt, *step], cwd=tls, stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                              check=False).returncode != 0:
                die(f"keytool failed, see {opts.run_dir / 'keytool.log'}")
    (tls / "broker.csr").unlink(missing_ok=True)
    write_private(tls / "storepass", password + "\n")


# ---------------------------------------------------------------------------------------
# one node
# ---------------------------------------------------------------------------------------


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
