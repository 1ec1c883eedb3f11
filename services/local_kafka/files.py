"""A node's files and processes: private writes, whether a pid lives, one command per run dir."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.local_kafka.options import (
    die,
)


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
    if stat is not None and stat.startswith("Z"):
        reap(pid)
        return False
    return stat is not None


def reap(pid: int) -> None:
    """Collect the exit of ``pid`` if it is this process's child: a node this process started
    (``services.common.broker`` runs the launcher in-process) would stay a zombie until it ends."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


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
