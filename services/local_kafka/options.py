"""What the local Kafka launcher takes from its environment, read once (``Options``), and how it
fails: ``KafkaScriptError``, printed as ``kafka.sh: error: ...``, exit 1."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

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
