"""Issue 56's rough edges, each as a person meets it on the command line.

``estimate`` says which rows it left out and why, exactly as ``publish`` would; ``config show``
refuses a profile ``estimate`` refuses; a broker that cannot start (a port in use) is one line
and exit 2, from ``broker start`` and from ``demo`` alike, never a traceback.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app

ROOT = Path(__file__).resolve().parents[2]
BAD_ROWS = ROOT / "tests" / "fixtures" / "datasets" / "bad_rows.jsonl"
NO_BROKER = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "COLUMNS": "200"}


def test_estimate_names_the_rows_it_skips_with_publishs_reasons() -> None:
    estimated = CliRunner().invoke(app, ["estimate", str(BAD_ROWS), "-d", "rough"], env=NO_BROKER)
    published = CliRunner().invoke(app, ["publish", str(BAD_ROWS), "-d", "rough", "--dry-run"], env=NO_BROKER)
    assert estimated.exit_code == 0 and published.exit_code == 0, estimated.output + published.output
    # publish --dry-run's outcome table: "skipped: <reason> | <rows>"
    by_publish = {m[1]: int(m[2]) for m in re.finditer(r"skipped: (\w+)\s+\S\s+(\d+)", published.stdout)}
    line = next(ln for ln in estimated.stdout.splitlines() if ln.startswith("skipped "))
    found = re.match(r"skipped (\d+) row\(s\) of rough, as publish would: (.*)$", line)
    assert found is not None, line
    by_estimate = {reason: int(n) for reason, n in (part.rsplit(" ", 1) for part in found[2].split(", "))}
    assert by_estimate == by_publish and int(found[1]) == sum(by_publish.values()) == 6
    assert f"{BAD_ROWS}:3: no_user_turn: no user turn to answer" in estimated.stdout  # where, as publish says it
    prompts = next(ln for ln in estimated.stdout.splitlines() if ln.startswith("│ rough"))
    assert prompts.split("│")[3].strip() == "2"


def test_config_show_refuses_the_unknown_profile_estimate_refuses(tmp_path: Path) -> None:
    config = tmp_path / "draftstream.toml"
    config.write_text('[datasets.math]\nprofile = "qwen-3"\n')
    shown = CliRunner().invoke(app, ["config", "show", "-c", str(config)])
    estimated = CliRunner().invoke(app, ["estimate", str(BAD_ROWS), "-d", "math", "-c", str(config)], env=NO_BROKER)
    for result in (shown, estimated):
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
    assert shown.stderr.strip().splitlines() == [
        "error: dataset math: profile qwen-3: unknown profile 'qwen-3': built in are qwen3, qwen3-thinking-2507, "
        "deepseek-r1, deepseek-v3.1, deepseek-v3, deepseek-v4, kimi-k2, kimi-k2-thinking, kimi-k2.5; "
        "others need a [profiles.qwen-3] section"
    ]
    assert shown.stdout == ""  # nothing printed as if it were fine
    config.write_text('[datasets.math]\nprofile = "qwen3"\n')
    assert CliRunner().invoke(app, ["config", "show", "-c", str(config)]).exit_code == 0
    assert CliRunner().invoke(app, ["config", "show", "-d", "other", "-c", str(config)]).exit_code == 0


@pytest.fixture
def port_in_use() -> Iterator[int]:
    """A port this test listens on: a broker asked to start there finds it taken."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command", [["broker", "start"], ["demo"]], ids=["broker-start", "demo"])
def test_a_broker_that_cannot_start_is_one_line_and_exit_2(
    command: list[str], port_in_use: int, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "COLUMNS")}
    # A run directory of its own: no broker runs there, and nothing of another broker is touched.
    env.update(KAFKA_RUN_DIR=str(tmp_path / "kafka"), KAFKA_PORT=str(port_in_use), PYTHONPATH=str(ROOT))
    done = subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "services.cli", *command], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: broker start: port 127.0.0.1:{port_in_use} is already in use by another process"
    ], done.stderr
