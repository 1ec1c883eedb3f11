"""Apply the ACL set with Kafka's own ``kafka-acls`` tool, as the admin.

aiokafka 0.14's admin client has no ``create_acls`` (only protocol structs, and Kafka 4
dropped CreateAcls v0), so the set goes through ``kafka-acls`` (the class
``org.apache.kafka.tools.AclCommand``): the distribution's ``kafka-acls.sh`` when given or
on PATH, else the jars that ``deploy/kafka/kafka.sh fetch`` put under ``.run/kafka/libs``.
Adding an ACL that exists changes nothing, so applying twice is harmless.

The admin's SASL password goes into a client properties file readable by this user only,
deleted afterwards; it is never on a command line (``ps`` would show it) nor printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess  # noqa: S404 - runs Kafka's own tool with arguments we build
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.common.acls import AclBinding, kafka_acls_arguments
from services.common.config import KafkaSettings
from services.common.errors import CommandError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_LIBS = REPO / ".run" / "kafka" / "libs"
ACL_COMMAND_CLASS = "org.apache.kafka.tools.AclCommand"
_JAAS_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}

Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def _jaas_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def admin_client_properties(kafka: KafkaSettings) -> str:
    """The Java client properties (``--command-config``) for these settings' user."""
    lines = [f"security.protocol={kafka.security_protocol}"]
    if kafka.security_protocol.startswith("SASL"):
        mechanism = kafka.sasl_mechanism or "PLAIN"
        if not kafka.sasl_username or kafka.sasl_password is None:
            raise CommandError(
                "acls apply runs as the admin: set [kafka] sasl_username and DRAFTSTREAM_KAFKA__SASL_PASSWORD"
            )
        password = kafka.sasl_password.get_secret_value()
        lines += [
            f"sasl.mechanism={mechanism}",
            f"sasl.jaas.config={_JAAS_MODULES[mechanism]} required username={_jaas_quote(kafka.sasl_username)} "
            f"password={_jaas_quote(password)};",
        ]
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        if kafka.ssl_cafile:
            lines += ["ssl.truststore.type=PEM", f"ssl.truststore.location={kafka.ssl_cafile}"]
        if not kafka.ssl_check_hostname:
            lines.append("ssl.endpoint.identification.algorithm=")
    return "\n".join(lines) + "\n"


def acl_tool(kafka_acls: Path | None = None, libs_dir: Path | None = None) -> list[str]:
    """The command that runs kafka-acls: the given script, one on PATH, or the jars with java."""
    if kafka_acls is not None:
        if not kafka_acls.is_file():
            raise CommandError(f"--kafka-acls {kafka_acls}: no such file")
        return [str(kafka_acls)]
    if libs_dir is None:
        for name in ("kafka-acls.sh", "kafka-acls"):
            found = shutil.which(name)
            if found:
                return [found]
    libs = libs_dir or DEFAULT_LIBS
    if not any(libs.glob("kafka-tools-*.jar")):
        raise CommandError(
            f"no kafka-acls: none on PATH and no Kafka jars in {libs}; run `deploy/kafka/kafka.sh fetch`, "
            "or pass --kafka-acls /path/to/kafka/bin/kafka-acls.sh"
        )
    java = shutil.which("java")
    if java is None:
        raise CommandError("java not found: kafka-acls from the jars needs Java 17 or newer")
    command = [java, "-Xmx256m", "-XX:TieredStopAtLevel=1"]
    # The broker's class-data archive (kafka.sh records it) holds these classes too: a
    # second off each start. One recorded by another JVM build is ignored by this one.
    archives = sorted((libs / ".cds").glob("kafka-*.jsa"), key=lambda p: p.stat().st_mtime)
    if archives:
        command += [f"-XX:SharedArchiveFile={archives[-1]}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
    return [
        *command, "-cp", f"{libs}/*",
        f"-Dlog4j2.configurationFile={REPO / 'deploy' / 'kafka' / 'log4j2.properties'}",
        ACL_COMMAND_CLASS,
    ]


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)  # noqa: S603


def apply_acls(
    bindings: Sequence[AclBinding],
    kafka: KafkaSettings,
    *,
    tool: Sequence[str],
    runner: Runner = _run,
) -> int:
    """Add every binding (idempotent) as the user of ``kafka``; returns how many kafka-acls runs it took.

    Raises:
        CommandError: kafka-acls failed; the message carries the end of its output.
    """
    invocations = kafka_acls_arguments(bindings)
    fd, name = tempfile.mkstemp(prefix="draftstream-acls-", suffix=".properties")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:  # mkstemp: mode 0600
            handle.write(admin_client_properties(kafka))
        commands = [
            [*tool, "--bootstrap-server", kafka.bootstrap_servers, "--command-config", name, *args]
            for args in invocations
        ]
        # Two at a time: each run is mostly a JVM starting.
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(runner, commands))
        for args, done in zip(invocations, results, strict=True):
            if done.returncode != 0:
                tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-4:])
                raise CommandError(f"kafka-acls {' '.join(args)} failed (exit {done.returncode}): {tail}")
    finally:
        os.unlink(name)
    return len(invocations)


__all__ = ["ACL_COMMAND_CLASS", "acl_tool", "admin_client_properties", "apply_acls"]
