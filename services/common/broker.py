"""A local single-node Kafka broker (KRaft, no Docker) for development and tests.

A thin shell over ``deploy/kafka/kafka.sh``, which does the work: it fetches the jars
with Maven once, formats the storage, starts ``kafka.Kafka`` in the background under
``.run/kafka/`` and waits until a Metadata request succeeds. This module runs it and
turns its answers into values and exceptions for ``draftstream broker start|stop|status``
and the pytest fixture.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BrokerError", "BrokerStatus", "SCRIPT", "start", "status", "stop"]

SCRIPT = Path(__file__).resolve().parents[2] / "deploy/kafka/kafka.sh"
"""The script this module drives (from a source checkout; it is not packaged)."""


class BrokerError(RuntimeError):
    """The script is missing, failed, or did not finish in time."""


@dataclass(frozen=True)
class BrokerStatus:
    """What ``kafka.sh status`` reports. Everything but ``running`` is None when stopped."""

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


def start(
    *,
    port: int | None = None,
    controller_port: int | None = None,
    sasl_ssl_port: int | None = None,
    sasl_password: str | None = None,
    run_dir: Path | None = None,
    jvm_opts: str | None = None,
    cds: str | None = None,
    timeout: float = 300.0,
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
    ``timeout`` bounds the whole call, which on the very first run includes resolving
    the jars with Maven. If the broker already runs, it is left as it is, even on other
    ports: see the returned status.

    Raises:
        BrokerError: the script is missing or failed (its output is in the message).
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
    }
    output = _run("start", overrides, timeout)
    found = _parse_status(output)
    if not found.running:
        raise BrokerError(f"kafka.sh start succeeded but reported no running broker:\n{output}")
    return found


def stop(*, run_dir: Path | None = None, timeout: float = 120.0) -> bool:
    """Stop the broker (SIGTERM, then SIGKILL after 30 s, or 90 s while it records its
    class-data archive). Return whether one was running.

    Raises:
        BrokerError: the script is missing or failed.
    """
    output = _run("stop", {"KAFKA_RUN_DIR": run_dir}, timeout)
    return "was not running" not in output


def status(*, run_dir: Path | None = None) -> BrokerStatus:
    """Report whether the broker runs, and where.

    Raises:
        BrokerError: the script is missing or failed in an unexpected way.
    """
    completed = _call("status", {"KAFKA_RUN_DIR": run_dir}, timeout=30.0)
    if completed.returncode not in (0, 1):
        raise BrokerError(_failure("status", completed))
    return _parse_status(completed.stdout)


def _run(command: str, overrides: Mapping[str, object | None], timeout: float) -> str:
    completed = _call(command, overrides, timeout)
    if completed.returncode != 0:
        raise BrokerError(_failure(command, completed))
    return completed.stdout


def _call(command: str, overrides: Mapping[str, object | None], timeout: float) -> subprocess.CompletedProcess[str]:
    if not SCRIPT.is_file():
        raise BrokerError(f"{SCRIPT} not found: the local broker needs a source checkout of draftstream")
    # The child gets the caller's environment (JAVA_HOME, PATH, KAFKA_* set by the user)
    # plus the explicit arguments; nothing here is read for this module's own use.
    env = dict(os.environ)
    env.update({key: str(value) for key, value in overrides.items() if value is not None})
    try:
        return subprocess.run(  # noqa: S603 - a fixed script of this repository, constant arguments
            [str(SCRIPT), command],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(f"kafka.sh {command} did not finish within {timeout:.0f} s") from exc
    except OSError as exc:
        raise BrokerError(f"cannot run {SCRIPT}: {exc}") from exc


def _failure(command: str, completed: subprocess.CompletedProcess[str]) -> str:
    details = "\n".join(part.strip() for part in (completed.stderr, completed.stdout) if part.strip())
    return f"kafka.sh {command} failed with exit code {completed.returncode}:\n{details[-4000:]}"


def _parse_status(output: str) -> BrokerStatus:
    """Parse the last ``running key=value ...`` or ``stopped`` line of the script's output."""
    for line in reversed(output.splitlines()):
        words = line.split()
        if not words or words[0] not in ("running", "stopped"):
            continue
        if words[0] == "stopped":
            return BrokerStatus(running=False)
        fields = dict(word.split("=", 1) for word in words[1:] if "=" in word)
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


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None
