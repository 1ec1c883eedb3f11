"""``draftstream run all``: every service a configuration needs, as child processes, stopped together.

Each service runs as ``draftstream run <name> --config X`` in a process of its own (its own
session, so a Ctrl-C in the terminal reaches only this supervisor, which passes it on once), with
its output in ``<log_dir>/<name>.log``. On SIGINT or SIGTERM every child gets SIGINT (it finishes
and commits the batch in hand); one still running after most of the grace period gets a second
SIGINT (the services stop at once on it), and SIGKILL at the end of it: every child is gone
within ``grace_s``. A child that exits on its own stops the others: a pipeline with a stage
missing would only pile up lag.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.common.config import Settings

STAGES = ("budget", "inference", "reconstruct", "audit", "sink")
"""What every configuration needs, the budget first (it announces the lease policy the workers wait for)."""
MULTI_TURN = "continuation"
"""Needed when a dataset regenerates every turn (``turns = "all"``)."""


def services_for(settings: Settings) -> list[str]:
    """The services ``settings`` needs, in the order they start."""
    names = list(STAGES)
    if any(settings.dataset(name).turns == "all" for name in settings.datasets):
        names.append(MULTI_TURN)
    return names


def last_line(path: Path, tail: int = 4096) -> str:
    """The last non-empty line of a log (a service's one-line error, when it failed to start)."""
    with path.open("rb") as log:
        log.seek(0, 2)
        log.seek(max(0, log.tell() - tail))
        lines = [line.strip() for line in log.read().decode("utf-8", "replace").splitlines()]
    return next((line for line in reversed(lines) if line), "")


@dataclass
class Child:
    """One service process and its log."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]


@dataclass
class Supervisor:
    """Starts the services as children and stops them all (see the module docstring)."""

    argv_of: Callable[[str], list[str]]
    log_dir: Path
    grace_s: float = 10.0
    say: Callable[[str], None] = print
    children: list[Child] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self, names: Iterable[str]) -> None:
        """Start one child per service, each writing to ``<log_dir>/<name>.log`` (appended)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            path = self.log_dir / f"{name}.log"
            log = path.open("ab")
            process = subprocess.Popen(  # noqa: S603 - our own CLI, argv built here
                self.argv_of(name), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.children.append(Child(name, process, path, log))
            self.say(f"started {name} (pid {process.pid}, log {path})")

    def request_stop(self, *_: object) -> None:
        """A signal handler: stop every child (from the main loop, not inside the handler)."""
        self._stop.set()

    def run(self, names: Iterable[str], poll_s: float = 0.2) -> int:
        """Start the services, wait for SIGINT/SIGTERM or a child's exit, then stop every child; the exit status."""
        previous = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start(names)
            while not self._stop.wait(poll_s):
                ended = next((c for c in self.children if c.process.poll() is not None), None)
                if ended is not None:
                    last = last_line(ended.log_path)
                    self.say(
                        f"{ended.name} exited with status {ended.process.returncode}"
                        f"{f' ({last})' if last else ''}: stopping the others (see {ended.log_path})"
                    )
                    self.stop()
                    return 1
            self.say(f"stopping {len(self.children)} service(s)")
            return 0 if self.stop() else 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self) -> bool:
        """SIGINT to every child, a second one late in the grace period, SIGKILL at its end; True if none was killed."""
        started = time.monotonic()
        deadline = started + self.grace_s
        second_at = started + 0.7 * self.grace_s
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGINT)
        nudged = False
        while any(c.process.poll() is None for c in self.children) and time.monotonic() < deadline:
            if not nudged and time.monotonic() >= second_at:
                nudged = True
                for child in self.children:
                    if child.process.poll() is None:
                        child.process.send_signal(signal.SIGINT)  # the services stop at once on a second one
            time.sleep(0.05)
        killed = [c for c in self.children if c.process.poll() is None]
        for child in killed:
            child.process.kill()
            child.process.wait()
        for child in self.children:
            child.log.close()
        elapsed = time.monotonic() - started
        if killed:
            self.say(f"killed {', '.join(c.name for c in killed)} after {self.grace_s:g} s")
        self.say(f"every service stopped in {elapsed:.1f} s")
        return not killed


__all__ = ["MULTI_TURN", "STAGES", "Child", "Supervisor", "last_line", "services_for"]
