"""The README's demo output shows the datasets and columns `draftstream demo` prints, and no machine path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.demo.run import CONVERSATION_COLUMNS, DATASETS, MULTI_TURN, SERVICES, SUMMARY_COLUMNS

README = Path(__file__).resolve().parents[2] / "README.md"


def demo_block() -> list[str]:
    """The lines of the README's demo excerpt (the ```text block that runs `draftstream demo`)."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```text\n(\$ [^\n]*draftstream demo\n.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README has one demo excerpt"
    return blocks[0].splitlines()


def table(lines: list[str], title: str) -> tuple[list[str], list[list[str]]]:
    """The header cells and body rows of the Rich table titled ``title`` (its first occurrence)."""
    at = next(i for i, line in enumerate(lines) if line.strip() == title)
    header = [c.strip() for c in lines[at + 2].strip("┃").split("┃")]
    rows = []
    for line in lines[at + 4 :]:
        if not line.startswith("│"):
            break
        rows.append([c.strip() for c in line.strip("│").split("│")])
    return header, rows


def test_the_summary_table_has_the_demo_datasets_and_columns() -> None:
    header, rows = table(demo_block(), "draftstream demo: where every prompt ended")
    assert tuple(header) == SUMMARY_COLUMNS
    shown = [r[0].removesuffix(" (turns)") for r in rows]
    assert shown == list(DATASETS)
    assert [r[0] for r in rows if r[0].endswith(" (turns)")] == [f"{d} (turns)" for d in MULTI_TURN]
    assert all(r[-1] == "yes" for r in rows), rows


def test_the_multi_turn_table_has_its_columns_and_datasets() -> None:
    header, rows = table(demo_block(), "multi-turn conversations: one row per regenerated turn")
    assert tuple(header) == CONVERSATION_COLUMNS
    assert [r[0] for r in rows] == list(MULTI_TURN)


def test_every_dataset_is_published_and_every_service_started() -> None:
    lines = demo_block()
    for name in DATASETS:
        assert any(re.search(rf"sent to \S+\.prompts\.{name}, skipped", line) for line in lines), name
    started = next(line for line in lines if line.startswith("started simulator"))
    assert re.search(r"and (.*) \(logs in", started).group(1).split(", ") == list(SERVICES)  # type: ignore[union-attr]


@pytest.mark.parametrize("pattern", [r"(?:^|[\s(`])/[\w.-]+/", r"[A-Za-z]:\\"])
def test_no_absolute_machine_path(pattern: str) -> None:
    found = [line for line in demo_block() if re.search(pattern, line)]
    assert not found, found
