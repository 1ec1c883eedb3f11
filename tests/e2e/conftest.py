"""e2e fixtures: a counts reporter whose lines show up in pytest's terminal summary."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

_LINES: list[str] = []


@pytest.fixture
def report(request: pytest.FixtureRequest, record_property: Callable[[str, object], None]) -> Callable[..., str]:
    """``report(**counts)``: print the counts to stderr, record them as properties, and list
    them in the terminal summary (pytest runs without ``-s``, so print alone is not seen).
    """

    def emit(**counts: Any) -> str:
        line = f"{request.node.name}: " + " ".join(f"{k}={v}" for k, v in counts.items())
        for key, value in counts.items():
            record_property(key, value)
        sys.stderr.write(line + "\n")
        print(line)
        _LINES.append(line)
        return line

    return emit


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Show every e2e count line at the end of the run."""
    if _LINES:
        terminalreporter.section("draftstream e2e counts")
        for line in _LINES:
            terminalreporter.write_line(line)
