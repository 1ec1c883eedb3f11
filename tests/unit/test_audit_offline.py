"""``draftstream audit FILE``: the same checks offline, failures tabulated by code."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from schemas import encode
from services.audit.offline import offline_audit
from services.cli import app
from services.common.config import AuditThresholds
from tests.unit.test_audit_checks import make
from tests.unit.test_audit_support import deepseek


def write_samples(path: Path) -> None:
    profile = deepseek()
    good = make(profile)
    truncated = make(profile, finish="length")
    truncated.sample_id = "cut"
    empty = make(profile, content="")
    empty.sample_id = "empty"
    stranger = make(profile)
    stranger.sample_id, stranger.profile = "stranger", "no-such-profile"
    lines = [encode(good), encode(truncated), b"{broken", b"", encode(empty), encode(stranger)]
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_offline_audit_counts_failures_by_code(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    write_samples(path)
    profile = deepseek()

    def load(name: str) -> object:
        if name != profile.name:
            raise KeyError(name)
        return profile

    with path.open("rb") as f:
        report = offline_audit(f, load, AuditThresholds())  # type: ignore[arg-type]
    assert report.total == 5 and report.passed == 1 and report.failed == 4
    assert report.failures == {"finish_stop": 1, "invalid_json": 1, "content_nonempty": 1,
                               "unknown_profile": 1}
    assert report.examples["finish_stop"] == "math:cut"
    assert report.examples["invalid_json"] == "line 3"


def test_cli_prints_table_and_strict_exits_non_zero(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    write_samples(path)
    runner = CliRunner()
    loose = runner.invoke(app, ["audit", str(path)], env={"COLUMNS": "200"})
    assert loose.exit_code == 0, loose.output
    assert "1/5 passed, 4 failed" in loose.output
    for code in ("finish_stop", "invalid_json", "content_nonempty", "unknown_profile", "math:cut"):
        assert code in loose.output
    strict = runner.invoke(app, ["audit", str(path), "--strict"], env={"COLUMNS": "200"})
    assert strict.exit_code == 1
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(encode(make(deepseek())) + b"\n")
    ok = runner.invoke(app, ["audit", str(clean), "--strict", "--profile", "deepseek-r1"])
    assert ok.exit_code == 0, ok.output
    missing = runner.invoke(app, ["audit", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2


def test_cli_out_writes_one_verdict_per_sample(tmp_path: Path) -> None:
    """``audit FILE --out DIR``: verdicts in input order, so two runs compare sample by sample."""
    path = tmp_path / "samples.jsonl"
    write_samples(path)
    result = CliRunner().invoke(app, ["audit", str(path), "--out", str(tmp_path / "v")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "v" / "verdicts.jsonl").read_text().splitlines()]
    assert [(r["line"], r["key"], r["verdict"]) for r in rows] == [
        (1, "math:s1", "accepted"),
        (2, "math:cut", "dead_lettered"),
        (3, "line 3", "dead_lettered"),
        (5, "math:empty", "dead_lettered"),
        (6, "math:stranger", "dead_lettered"),
    ]
    assert rows[1]["reasons"] == ["finish_stop"] and "finish reason" in rows[1]["message"]
    assert rows[2]["reasons"] == ["invalid_json"]
    assert rows[4]["reasons"] == ["unknown_profile"]
