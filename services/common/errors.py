"""Errors a person running a command can act on, printed by the CLI as one line (exit 2)."""

from __future__ import annotations


class CommandError(Exception):
    """A failure with a one-line message that says what to do; the CLI exits 2 without a traceback."""


class BrokerUnreachable(CommandError):
    """Kafka did not answer at the configured bootstrap servers."""


class PortInUse(CommandError):
    """A port the command must listen on is taken by another process."""


class DirectoryLocked(CommandError):
    """Another running process holds the lock on a directory this one must own."""


class AccessDenied(CommandError):
    """Kafka's authorizer refused this principal an operation on a topic, a group or the cluster."""


__all__ = ["AccessDenied", "BrokerUnreachable", "CommandError", "DirectoryLocked", "PortInUse"]
