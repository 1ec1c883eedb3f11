"""Logging set-up with secret redaction: no configured secret ever reaches a log line."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Annotated, Any

import typer

from services.common.config import Settings, check_log_level

REDACTED = "**********"

LogLevelOption = Annotated[
    str | None,
    typer.Option(
        "--log-level",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: the log_level setting, INFO)",
        show_default=False,
    ),
]
"""The ``--log-level`` option every service command takes (validated by :func:`setup_logging`)."""


class RedactingFilter(logging.Filter):
    """Replaces every known secret value in a record's final message."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self._secrets = [s for s in secrets if s and len(s) >= 4]

    def filter(self, record: logging.LogRecord) -> bool:
        """Render the message, mask secrets, and keep the record."""
        if not self._secrets:
            return True
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        for secret in self._secrets:
            message = message.replace(secret, REDACTED)
            if record.exc_text:
                record.exc_text = record.exc_text.replace(secret, REDACTED)
        record.msg, record.args = message, None
        return True


def secrets_of(settings: Settings) -> list[str]:
    """The secret values present in the settings."""
    found = []
    if settings.provider.api_key is not None:
        found.append(settings.provider.api_key.get_secret_value())
    if settings.kafka.sasl_password is not None:
        found.append(settings.kafka.sasl_password.get_secret_value())
    return found


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler on whatever ``sys.stderr`` is when a record is written.

    A handler bound to the ``sys.stderr`` of the moment it was made keeps writing to that
    stream after it is replaced and closed (a CLI run in-process under a test runner), and
    every record then fails with a logging error printed into the new stream.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """The stream is always the current ``sys.stderr``; what ``StreamHandler`` sets is ignored."""


def setup_logging(settings: Settings, level: str | None = None) -> None:
    """Log to stderr with timestamps, every secret redacted.

    ``level`` (e.g. from ``--log-level``) wins over the ``log_level`` setting; an unknown
    name raises :class:`ConfigError` before anything is changed.
    """
    resolved = check_log_level(level if level is not None else settings.log_level)
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter(secrets_of(settings)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(resolved)
    for noisy in ("aiokafka", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
