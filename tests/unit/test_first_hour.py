"""The first hour of a new user: one clear line and exit 2 instead of a traceback, and no surprises."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import DLQ_HEADERS
from services.cli import app
from services.common.broker import BrokerStatus
from services.common.config import ConfigError, load_settings
from services.common.errors import DirectoryLocked
from services.dlq.core import DeadLetterRecord
from services.sink.shards import LOCK_FILE, OutputLock

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
DEMO = Path(__file__).resolve().parents[2] / "services" / "demo" / "data"
NO_BROKER = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}


def one_error_line(result, *, code: int = 2) -> str:
    """The single stderr line of a failed command (asserting there is exactly one, no traceback)."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ["publish", str(DATA / "alpaca.jsonl"), "-d", "demo"],
        ["dlq", "list"],
        ["dlq", "show"],
        ["dlq", "replay"],
        ["topics", "create"],
        ["status"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_no_broker_is_one_line_naming_the_address(args: list[str]) -> None:
    result = CliRunner().invoke(app, args, env=NO_BROKER)
    line = one_error_line(result)
    assert "cannot reach Kafka at 127.0.0.1:1" in line and "draftstream broker start" in line


def test_error_printer_keeps_rich_markup_verbatim(tmp_path: Path) -> None:
    config = tmp_path / "draftstream.toml"
    config.write_text('[datasets.x]\nprofile = "nope"\n')
    result = CliRunner().invoke(app, ["estimate", str(DATA / "alpaca.jsonl"), "-d", "x", "-c", str(config)])
    line = one_error_line(result)
    assert "[profiles.nope]" in line  # was eaten as a Rich style tag
    bad = CliRunner().invoke(app, ["publish", str(DATA / "alpaca.jsonl"), "-d", "a[b]c"])
    assert "'a[b]c'" in one_error_line(bad)


@pytest.mark.parametrize("command", ["sink", "budget", "inference", "reconstruct", "audit"])
def test_unknown_log_level_is_one_line(command: str) -> None:
    result = CliRunner().invoke(app, ["run", command, "--log-level", "LOUD"], env=NO_BROKER)
    line = one_error_line(result)
    assert "unknown log level 'LOUD'" in line and "DEBUG" in line


def test_log_level_setting_is_validated_and_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTSTREAM_LOG_LEVEL", "debug")
    assert load_settings(None).log_level == "DEBUG"
    monkeypatch.setenv("DRAFTSTREAM_LOG_LEVEL", "LOUD")
    with pytest.raises(ConfigError, match="unknown log level"):
        load_settings(None)


@pytest.mark.parametrize("command", ["sink", "budget", "inference", "reconstruct", "audit"])
def test_metrics_port_in_use_is_one_line(command: str, tmp_path: Path) -> None:
    extra = ["--out", str(tmp_path / "out")] if command == "sink" else []
    variable = f"DRAFTSTREAM_METRICS__{command.upper()}_PORT"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**NO_BROKER, variable: str(port)}
        result = CliRunner().invoke(app, ["run", command, *extra], env=env)
    line = one_error_line(result)
    assert f"127.0.0.1:{port}" in line and f"{command}_port" in line and variable in line


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("draftstream ") and result.stdout.split()[1][0].isdigit()


def test_broker_start_prints_the_export_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.common import broker

    status = BrokerStatus(running=True, pid=42, bootstrap="127.0.0.1:29092", port=29092, version="4.4.0")
    monkeypatch.setattr(broker, "start", lambda port=None, nodes=None, node=None: status)
    result = CliRunner().invoke(app, ["broker", "start"])
    assert result.exit_code == 0, result.output
    assert "export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:29092" in result.stdout.splitlines()


def test_bootstrap_default_follows_kafka_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS", "KAFKA_PORT"):
        monkeypatch.delenv(name, raising=False)  # make test exports KAFKA_PORT for its own broker
    monkeypatch.chdir(tmp_path)  # no draftstream.toml
    assert load_settings(None).kafka.bootstrap_servers == "127.0.0.1:9092"
    monkeypatch.setenv("KAFKA_PORT", "29092")
    assert load_settings(None).kafka.bootstrap_servers == "127.0.0.1:29092"
    config = tmp_path / "file.toml"
    config.write_text('[kafka]\nbootstrap_servers = "kafka.example:9092"\n')
    assert load_settings(config).kafka.bootstrap_servers == "kafka.example:9092"  # a file still wins
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "elsewhere:1234")
    assert load_settings(None).kafka.bootstrap_servers == "elsewhere:1234"
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    monkeypatch.setenv("KAFKA_PORT", "ninety")
    with pytest.raises(ConfigError, match="KAFKA_PORT='ninety' is not a TCP port"):
        load_settings(None)


def test_sink_lock_names_the_holder_and_is_released(tmp_path: Path) -> None:
    first = OutputLock(tmp_path)
    first.acquire()
    second = OutputLock(tmp_path)
    with pytest.raises(DirectoryLocked, match=f"in use by another sink \\(pid {os.getpid()} on "):
        second.acquire()
    first.release()
    second.acquire()  # free again
    second.release()


def test_sink_lock_held_by_another_process_refuses_run_sink(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(  # another process holding the lock, as a running sink would
        [sys.executable, "-c", (
            "import sys, time; from services.sink.shards import OutputLock; "
            f"OutputLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"
        )],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        env = {**NO_BROKER, "DRAFTSTREAM_METRICS__SINK_PORT": "0"}
        result = CliRunner().invoke(app, ["run", "sink", "--out", str(out)], env=env)
        line = one_error_line(result)
        assert f"pid {holder.pid} on {socket.gethostname()}" in line and "its own --out" in line
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    assert (out / LOCK_FILE).exists()
    OutputLock(out).acquire()  # the kernel released it when the holder died


def test_dead_letters_are_shown_verbatim(monkeypatch: pytest.MonkeyPatch) -> None:
    message = "profile [profiles.x] has no tokenizer: set [profiles.x] tokenizer = [bold]"
    record = DeadLetterRecord(
        partition=0, offset=7, timestamp_ms=0, key=b"ds:[id]", value=b'{"a": "[red]x[/red]"}',
        headers=((DLQ_HEADERS.STAGE, b"reconstruct"), (DLQ_HEADERS.REASON, b"tokenizer_missing"),
                 (DLQ_HEADERS.MESSAGE, message.encode())),
    )  # fmt: skip

    async def fake_read(settings, filters=None):
        return [record]

    async def none_accepted(settings):
        return set()

    monkeypatch.setattr("services.dlq.app.read_dead_letters", fake_read)
    monkeypatch.setattr("services.dlq.app.read_accepted_keys", none_accepted)
    shown = CliRunner().invoke(app, ["dlq", "show"], env={"COLUMNS": "400"})
    assert shown.exit_code == 0, shown.output
    assert message in shown.stdout and "ds:[id]" in shown.stdout and "[red]x[/red]" in shown.stdout
    listed = CliRunner().invoke(app, ["dlq", "list"], env={"COLUMNS": "400"})
    assert listed.exit_code == 0 and "ds:[id]" in listed.stdout


def test_publish_exits_non_zero_when_every_row_is_bad(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"x": 1}) + "\n" + json.dumps({"messages": []}) + "\n")
    result = CliRunner().invoke(app, ["publish", str(bad), "-d", "demo"], env=NO_BROKER)
    assert result.exit_code == 1, result.output
    assert "no usable prompt in 1 file(s): 2 bad row(s)" in result.stderr
    assert "Traceback" not in result.output


def test_publish_dry_run_without_a_broker_estimates_and_says_the_topic_was_not_checked() -> None:
    result = CliRunner().invoke(app, ["publish", str(DEMO / "math.jsonl"), "-d", "math", "--dry-run"], env=NO_BROKER)
    assert result.exit_code == 0, result.output
    assert "cost estimate" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        "topic not checked (broker unreachable), 100 would be sent to prompts.math, skipped 0"
    )


def test_publish_refuses_a_dataset_whose_profile_cannot_load(tmp_path: Path) -> None:
    """Pre-flight: no prompt is published for answers that could never be rebuilt (and paid for)."""
    config = tmp_path / "draftstream.toml"
    config.write_text('[kafka]\nbootstrap_servers = "127.0.0.1:1"\n[datasets.math]\nprofile = "no-such-model"\n',
                      encoding="utf-8")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["publish", str(rows), "-d", "math", "-c", str(config)])
    assert result.exit_code == 2
    assert "profile 'no-such-model' cannot be used (unknown_profile)" in result.output
    assert "nothing was published" in result.output


def test_the_default_base_url_is_where_the_simulator_answers() -> None:
    """`simulate-provider` on its default port serves /api/v1/chat/completions: the default base_url points there."""
    from services.common.config import load_settings as fresh

    assert fresh(None).provider.base_url == "http://127.0.0.1:8099/api/v1"


def test_every_service_takes_log_level() -> None:
    runner = CliRunner()
    for command in (["run", s] for s in ("inference", "reconstruct", "audit", "budget", "sink")):
        assert "--log-level" in runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).output, command
    assert "--log-level" in runner.invoke(app, ["simulate-provider", "--help"], env={"COLUMNS": "200"}).output
