"""``export --dead-letters`` counts the datasets' dead letters on a real broker into the card."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from schemas import ACCEPTED_TOPIC, DEAD_LETTER_TOPIC, DLQ_HEADERS
from services.cli import app
from services.common.kafka import ensure_topics
from tests.e2e.harness import produce
from tests.unit.test_export_card import varied_sink

pytestmark = pytest.mark.kafka


def letter(key: str, stage: str, reason: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """A dead-letter record as the stages publish it: the failed value, stage and reason headers."""
    headers = [(DLQ_HEADERS.STAGE, stage.encode()), (DLQ_HEADERS.REASON, reason.encode())]
    return key.encode(), b"{}", headers


def test_export_reads_the_dead_letter_topic_into_the_card(settings_factory: Callable[..., Any], tmp_path: Path) -> None:
    settings = settings_factory()
    asyncio.run(ensure_topics(settings.kafka, []))
    # One prompt, one outcome: c9 failed again after a replay (counted once, by its latest reason);
    # m9 was replayed and accepted (not counted).
    sent = [letter("chat:c9", "audit", "usage_matches"), letter("chat:c8", "audit", "usage_matches"),
            letter("math:m9", "inference", "provider_http_5xx"), letter("elsewhere:x", "audit", "finish_stop"),
            letter("chat:c9", "audit", "roundtrip_mismatch"), letter("math:m8", "inference", "provider_http_5xx")]
    asyncio.run(produce(settings, settings.kafka.topic(DEAD_LETTER_TOPIC), sent))  # type: ignore[arg-type]
    asyncio.run(produce(settings, settings.kafka.topic(ACCEPTED_TOPIC), [(b"math:m9", b"{}", [])]))  # type: ignore[arg-type]
    config = tmp_path / "draftstream.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{settings.kafka.bootstrap_servers}"\n'
                      f'topic_prefix = "{settings.kafka.topic_prefix}"\n', encoding="utf-8")  # fmt: skip
    sink, out = tmp_path / "sink", tmp_path / "out"
    varied_sink(sink)
    result = CliRunner().invoke(
        app, ["export", str(out), "--to", "hf", "--from", str(sink), "--dead-letters", "-c", str(config)]
    )
    assert result.exit_code == 0, result.output
    header = yaml.safe_load((out / "README.md").read_text(encoding="utf-8").split("---\n")[1])
    assert header["draftstream"]["dead_letters"] == [
        {"dataset": "chat", "stage": "audit", "reason": "roundtrip_mismatch", "count": 1},
        {"dataset": "chat", "stage": "audit", "reason": "usage_matches", "count": 1},
        {"dataset": "math", "stage": "inference", "reason": "provider_http_5xx", "count": 1},
    ]
    assert "Prompts of these datasets dead-lettered when this export was made: 3" in (out / "README.md").read_text()
