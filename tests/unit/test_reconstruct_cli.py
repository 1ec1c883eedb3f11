"""``draftstream reconstruct FILE``: samples out, bad lines reported by number, a summary."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from schemas import SampleReconstructed, decode, encode
from services.cli import app
from tests.unit.test_reconstruct import response


def test_offline_reconstruct(tmp_path: Path) -> None:
    src = tmp_path / "responses.jsonl"
    src.write_bytes(
        encode(response(sample_id="a"))
        + b"\n{broken\n"
        + encode(response(sample_id="b", reasoning="", content=""))
        + b"\n"
        + encode(response(sample_id="c", profile="qwen3"))
        + b"\n"
    )
    out = tmp_path / "samples.jsonl"
    result = CliRunner().invoke(app, ["reconstruct", str(src), "--out", str(out)])
    assert result.exit_code == 0, result.output
    samples = [decode(line, SampleReconstructed) for line in out.read_bytes().splitlines()]
    assert [(s.sample_id, s.profile) for s in samples] == [("a", "qwen3"), ("c", "qwen3")]
    assert f"{src}:2: invalid_json" in result.output
    assert f"{src}:3: empty_response" in result.output
    assert "2/4 rebuilt" in result.output

    strict = CliRunner().invoke(app, ["reconstruct", str(src), "--out", str(out), "--strict"])
    assert strict.exit_code == 1


def test_offline_reconstruct_profile_override_and_errors(tmp_path: Path) -> None:
    src = tmp_path / "r.jsonl"
    src.write_bytes(encode(response(sample_id="a")) + b"\n")
    out = tmp_path / "s.jsonl"
    result = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "--profile", "qwen3"])
    assert result.exit_code == 0, result.output
    assert decode(out.read_bytes().strip(), SampleReconstructed).output_ids[-1] == 151645
    unknown = CliRunner().invoke(app, ["reconstruct", str(src), "--profile", "nope"])
    assert unknown.exit_code == 2 and "unknown_profile" in unknown.output
    missing = CliRunner().invoke(app, ["reconstruct", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2 and "is not a file" in missing.output
