"""Reading dataset files (JSONL, JSON arrays, Parquet) and refusing bad runs before any send."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.publish.adapters.files import FileError, iter_rows
from services.publish.app import PublishError, Rejection, publish, scan
from services.publish.core import INVALID_JSON, RowError

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def test_json_array_rows_carry_their_line_numbers() -> None:
    got = list(iter_rows(DATA / "sharegpt_chat.json"))
    assert [line for line, _ in got] == [2, 23]
    text = (DATA / "sharegpt_chat.json").read_text().splitlines()
    assert text[1].strip() == "{" and text[22].strip() == "{"


def test_malformed_json_array_is_a_file_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('[{"messages": []},\n {"messages": [}\n]')
    with pytest.raises(FileError, match="broken.json: not a valid JSON array"):
        list(iter_rows(path))


def test_jsonl_invalid_line_is_a_row_error_and_reading_continues(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{oops\n{"b": 2}\n')
    got = list(iter_rows(path))
    assert [line for line, _ in got] == [1, 3, 4]
    assert isinstance(got[1][1], RowError) and got[1][1].reason == INVALID_JSON
    assert got[2][1] == {"b": 2}


def test_gzipped_jsonl(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "x.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write('{"instruction": "Say hi"}\n')
    assert list(iter_rows(path)) == [(1, {"instruction": "Say hi"})]


def test_parquet_with_nested_messages(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {"id": "p1", "messages": [{"role": "user", "content": "Integrate x^2 from 0 to 3."}]},
            {
                "id": "p2",
                "messages": [
                    {"role": "user", "content": "Is 221 prime?"},
                    {"role": "assistant", "content": "No: 13*17."},
                ],
            },
        ]
    )
    path = tmp_path / "math.parquet"
    pq.write_table(table, path)
    assert [line for line, _ in iter_rows(path)] == [1, 2]


def test_unreadable_parquet_and_missing_file_are_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(FileError, match="bad.parquet: unreadable Parquet file"):
        list(iter_rows(bad))
    with pytest.raises(FileError, match="no such file"):
        list(iter_rows(tmp_path / "missing.jsonl"))
    with pytest.raises(FileError, match="unsupported file type"):
        other = tmp_path / "data.csv"
        other.write_text("a,b\n")
        list(iter_rows(other))


def test_scan_counts_and_limit(settings_factory) -> None:
    settings = settings_factory(provider={"max_prompt_chars": 4000})
    report = scan(settings, [DATA / "bad_rows.jsonl", DATA / "openai_math.jsonl"], dataset="mix")
    assert report.valid == 3
    assert report.skipped["duplicate"] == 1 and sum(report.skipped.values()) == 7
    limited = scan(settings, [DATA / "openai_math.jsonl", DATA / "alpaca.jsonl"], dataset="mix", limit=3)
    assert limited.valid == 3


async def test_strict_and_bad_arguments_fail_before_touching_kafka(settings_factory, tmp_path: Path) -> None:
    # The placeholder bootstrap (127.0.0.1:1) would make any send fail loudly.
    settings = settings_factory(provider={"max_prompt_chars": 4000})
    with pytest.raises(PublishError, match="--strict") as info:
        await publish(settings, [DATA / "bad_rows.jsonl"], dataset="demo", strict=True)
    assert info.value.report is not None and len(info.value.report.rejections) == 6
    with pytest.raises(PublishError, match="cannot be a topic name"):
        await publish(settings, [DATA / "alpaca.jsonl"], dataset="no/slashes")
    with pytest.raises(PublishError, match="unknown format"):
        await publish(settings, [DATA / "alpaca.jsonl"], dataset="demo", fmt="csv")
    with pytest.raises(PublishError, match="no such file"):
        await publish(settings, [DATA / "alpaca.jsonl", tmp_path / "nope.jsonl"], dataset="demo")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"garbage")
    with pytest.raises(PublishError, match="unreadable Parquet"):
        await publish(settings, [DATA / "alpaca.jsonl", bad], dataset="demo")
    dry = await publish(settings, [DATA / "alpaca.jsonl"], dataset="demo", dry_run=True)
    assert dry.dry_run and dry.valid == 2 and dry.published == 0


def test_cli_errors_are_one_line_and_non_zero(tmp_path: Path) -> None:
    from services.cli import app

    runner = CliRunner()
    missing = runner.invoke(app, ["publish", str(tmp_path / "nope.jsonl"), "--dataset", "demo"])
    assert missing.exit_code == 2
    assert "no such file" in missing.output and "Traceback" not in missing.output
    bad_name = runner.invoke(app, ["publish", str(DATA / "alpaca.jsonl"), "--dataset", "bad name!"])
    assert bad_name.exit_code == 2 and "cannot be a topic name" in bad_name.output
    bad_fmt = runner.invoke(app, ["publish", str(DATA / "alpaca.jsonl"), "-d", "demo", "--format", "xml"])
    assert bad_fmt.exit_code == 2 and "unknown format 'xml'" in bad_fmt.output
    strict = runner.invoke(app, ["publish", str(DATA / "bad_rows.jsonl"), "-d", "demo", "--strict"])
    assert strict.exit_code == 2 and "bad_rows.jsonl:2: invalid_json" in strict.output
    dry = runner.invoke(app, ["publish", str(DATA / "sharegpt_chat.json"), "-d", "demo", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "would be sent" in dry.output and "cost estimate" in dry.output


def test_bundled_demo_datasets_publish_cleanly(settings_factory) -> None:
    """The demo counts lines as prompts: every line must be a valid, distinct prompt."""
    from services.publish.app import iter_prompts
    from services.publish.core import NormaliseOptions

    demo = Path(__file__).resolve().parents[2] / "services" / "demo" / "data"
    settings = settings_factory()
    for name in ("math", "code", "tools"):
        path = demo / f"{name}.jsonl"
        lines = sum(1 for line in path.read_text().splitlines() if line.strip())
        report = scan(settings, [path], dataset=name)
        assert 50 <= lines <= 150
        assert report.valid == lines and not report.skipped, (name, report.skipped)
    tools = [p for p in iter_prompts([demo / "tools.jsonl"], NormaliseOptions(dataset="tools"))]
    assert all(p is not None and not isinstance(p, Rejection) and p.tools for p in tools)
    glaive = [p for p in tools if p.sample_id.startswith("glaive-")]
    assert glaive and all(
        p.messages[0].content.startswith("SYSTEM: You are a helpful assistant") for p in glaive
    )
