"""What a file or a record says is printed as it is: no Rich markup, no emoji codes.

Rich reads ``[bold]`` as a style tag and ``:100:`` / ``:smile:`` as emoji codes in every
string it prints. The offline commands are fed file names, keys and messages holding all
three, and their output must hold them literally (and no emoji). The commands that read
Kafka (publish, dlq list/show, status) are in tests/integration/test_verbatim_output.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import encode
from services.cli import app
from tests.unit.test_audit_checks import make
from tests.unit.test_audit_support import deepseek
from tests.unit.test_reconstruct import response

MARKED = "[bold]x:smile:y"
"""A name with a style tag and an emoji code; with ``:100:`` from a line number, all three."""
EMOJI = ("\U0001f4af", "\U0001f604")  # what rich makes of :100: and :smile:


def assert_verbatim(output: str, *expected: str) -> None:
    """Every ``expected`` string stands in ``output`` as it is, and no emoji was made."""
    for text in expected:
        assert text in output, (text, output)
    for emoji in EMOJI:
        assert emoji not in output


def test_reconstruct_prints_file_line_and_names_verbatim(tmp_path: Path) -> None:
    src = tmp_path / f"responses{MARKED}.jsonl"
    # 99 good lines, then line 100 fails: the dead letter reads `<file>:100: ...`.
    lines = [encode(response(sample_id=f"s{i}")) for i in range(99)] + [b"{broken"]
    src.write_bytes(b"\n".join(lines) + b"\n")
    result = CliRunner().invoke(app, ["reconstruct", str(src), "--out", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 0, result.output
    assert_verbatim(result.output, f"{src}:100: invalid_json", "99/100 rebuilt")


def test_audit_prints_keys_and_messages_verbatim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = deepseek()
    cut = make(profile, finish="length")
    cut.sample_id = f":100:{MARKED}"
    monkeypatch.chdir(tmp_path)  # a short relative name: the table's title is not wrapped
    path = Path(f"samples{MARKED}.jsonl")
    path.write_bytes(encode(make(profile)) + b"\n" + encode(cut) + b"\n")
    result = CliRunner().invoke(app, ["audit", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert_verbatim(result.output, f"math::100:{MARKED}", f"samples{MARKED}.jsonl", "1/2 passed")
