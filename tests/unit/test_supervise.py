"""``run all``'s supervisor: children stopped together, within the grace period, whatever they do with SIGINT."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from services.common.config import load_settings
from services.common.supervise import Supervisor, services_for

STUBBORN = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
POLITE = "import time; print('up', flush=True); time.sleep(60)"


def test_the_services_a_config_needs() -> None:
    single = load_settings(None, datasets={"math": {}})
    multi = load_settings(None, datasets={"math": {}, "chat": {"turns": "all"}})
    assert services_for(single) == ["budget", "inference", "reconstruct", "audit", "sink"]
    assert services_for(multi) == ["budget", "inference", "reconstruct", "audit", "sink", "continuation"]


def test_a_child_that_ignores_sigint_is_killed_at_the_end_of_the_grace_period(tmp_path: Path) -> None:
    said: list[str] = []
    code = {"polite": POLITE, "stubborn": STUBBORN}
    sup = Supervisor(lambda name: [sys.executable, "-c", code[name]], tmp_path, grace_s=2.0, say=said.append)
    sup.start(["polite", "stubborn"])
    time.sleep(0.5)
    started = time.monotonic()
    assert sup.stop() is False  # one had to be killed
    assert time.monotonic() - started < 3.0
    assert all(c.process.poll() is not None for c in sup.children)
    assert sup.children[0].process.returncode in (-signal.SIGINT, 1)  # KeyboardInterrupt
    assert sup.children[1].process.returncode == -signal.SIGKILL
    assert "killed stubborn after 2 s" in said
    assert (tmp_path / "polite.log").read_text().startswith("up")


def test_a_child_that_exits_stops_the_others(tmp_path: Path) -> None:
    said: list[str] = []
    code = {"short": "import sys; print('error: cannot reach Kafka'); sys.exit(3)", "long": POLITE}
    sup = Supervisor(lambda name: [sys.executable, "-c", code[name]], tmp_path, grace_s=5.0, say=said.append)
    assert sup.run(["long", "short"], poll_s=0.05) == 1
    assert any(line.startswith("short exited with status 3 (error: cannot reach Kafka): stopping the others")
               for line in said), said
    assert all(c.process.poll() is not None for c in sup.children)
