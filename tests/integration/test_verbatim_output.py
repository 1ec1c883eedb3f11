"""The commands that read Kafka print what the data says as it is: no Rich markup, no emoji codes.

``publish`` (a bad row on line 100 of a file with a style tag and an emoji code in its name),
``dlq list`` / ``dlq show`` (a dead letter whose key, reason and message hold them) and
``status`` (that dead letter, and a halt whose reason holds them), on a real broker.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import Halt, encode
from services.cli import app
from services.common.kafka import ensure_topics, make_producer
from tests.integration.test_dlq_kafka import cli_config, put_dead_letters
from tests.unit.test_verbatim_output import MARKED, assert_verbatim

pytestmark = pytest.mark.kafka

KEY = f"math::100:{MARKED}"
REASON = f"odd{MARKED}"
MESSAGE = f"line :100: said {MARKED}"
HALT_REASON = f"stopped at :100: by {MARKED}"


async def _scenario(settings) -> None:
    await ensure_topics(settings.kafka, ["math"])
    await put_dead_letters(
        settings,
        [{"stage": "audit", "reason": REASON, "message": MESSAGE, "key": KEY,
          "topic": settings.kafka.topic("samples"), "value": b'{"sample_id": "' + MARKED.encode() + b'"}'}],
    )
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        halt = Halt(scope="math", reason=HALT_REASON, by="operator", at=1.0)
        await (await producer.send(settings.kafka.topic("control"), encode(halt), key=b"math"))
    finally:
        await producer.stop()


def test_publish_prints_bad_rows_and_names_verbatim(settings_factory, tmp_path: Path, monkeypatch) -> None:
    settings = settings_factory()
    config = str(cli_config(settings, tmp_path))
    monkeypatch.chdir(tmp_path)  # a short relative file name: nothing wraps
    name = f"p{MARKED}.jsonl"
    rows = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(99)]
    Path(name).write_text("\n".join([*rows, json.dumps({"messages": [{"role": "system", "content": "x"}]})]) + "\n")
    result = CliRunner().invoke(app, ["publish", name, "-d", "math", "-c", config], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert_verbatim(result.output, f"{name}:100: no_user_turn", "99 sent")


def test_dlq_list_show_and_status_print_keys_and_reasons_verbatim(settings_factory, tmp_path: Path) -> None:
    settings = settings_factory()
    asyncio.run(_scenario(settings))
    config = str(cli_config(settings, tmp_path))
    runner = CliRunner()
    listed = runner.invoke(app, ["dlq", "list", "-c", config], terminal_width=200)
    assert listed.exit_code == 0, listed.output
    assert_verbatim(listed.output, KEY, REASON)
    shown = runner.invoke(app, ["dlq", "show", "-c", config], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert_verbatim(shown.output, KEY, f"audit/{REASON}", MESSAGE, f'"sample_id": "{MARKED}"')
    status = runner.invoke(app, ["status", "-c", config], terminal_width=200)
    assert status.exit_code == 0, status.output
    assert_verbatim(status.output, REASON, HALT_REASON)
