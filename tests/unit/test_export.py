"""``draftstream export``: rows of either sink layout in, loadable folders out, bad rows refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from schemas import SampleAudited, decode
from services.cli import app
from services.common.errors import CommandError
from services.export.app import export
from services.export.core import SPECFORGE_TEMPLATES, RowError, row_from_builtins, row_from_line, specforge_loss_mask
from services.profiles import load_profile
from services.sink.core import TrainingRow, row_line, training_row

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "payloads" / "v1_audited.json"

# What the sink wrote before its schema was fixed (the layout users could not load as one table).
LEGACY = {
    "id": "math:a1", "dataset": "math", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1],
    "prompt_ids": [5, 6], "output_ids": [7, 8],
    "conversations": [
        {"role": "user", "content": "2+2?", "reasoning_content": None, "tool_calls": None},
        {"role": "tool", "content": "4", "reasoning_content": None, "tool_calls": None, "tool_call_id": "c1",
         "name": "add"},
        {"role": "assistant", "content": "4", "reasoning_content": "think",
         "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{\"a\":2}"}}]},
    ],
    "tools": None,
    "metadata": {
        "provider": "openrouter", "upstream_provider": None, "model": "m", "profile": "qwen3",
        "usage": {"completion_tokens": 2}, "finish_reason": "stop", "reconstruction_method": "native",
        "audit": {"passed": True, "checks": {"roundtrip": True, "finish_stop": True}, "notes": {"roundtrip": "exact"}},
    },
}  # fmt: skip


def test_rows_of_the_earlier_layout_are_upgraded() -> None:
    row = row_from_line(json.dumps(LEGACY).encode() + b"\n", "old.jsonl:1")
    assert row.tools == "[]"
    assert [t.tool_calls for t in row.conversations[:2]] == ["[]", "[]"]
    assert (row.conversations[1].tool_call_id, row.conversations[1].name) == ("c1", "add")
    assert json.loads(row.conversations[2].tool_calls)[0]["function"]["arguments"] == '{"a":2}'
    assert row.conversations[2].reasoning_content == "think" and row.conversations[0].reasoning_content == ""
    usage = row.metadata.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cost) == (-1, 2, -1.0)
    assert [(c.code, c.passed, c.message) for c in row.metadata.audit.checks] == [
        ("roundtrip", True, "exact"), ("finish_stop", True, ""),
    ]  # fmt: skip
    # Earlier Parquet parts held conversations / tools / metadata as JSON text.
    as_parquet = {**LEGACY, **{k: json.dumps(LEGACY[k]) for k in ("conversations", "tools", "metadata")}}
    assert row_from_builtins(as_parquet, "old.parquet: row 1") == row


def test_current_rows_convert_as_they_are() -> None:
    row = training_row(decode(FIXTURE.read_bytes(), SampleAudited))
    assert row_from_line(row_line(row), "x") == row


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"{not json\n", "x.jsonl:3: not JSON"),
        (b"[1, 2]\n", "x.jsonl:3: a row must be a JSON object, got list"),
        (b'{"id": "math:a", "input_ids": "nope"}\n', "x.jsonl:3: not a training row: Expected `array`, got `str`"),
    ],
)
def test_unreadable_rows_are_named(line: bytes, expected: str) -> None:
    with pytest.raises(RowError) as info:
        row_from_line(line, "x.jsonl:3")
    assert str(info.value).startswith(expected), str(info.value)


# ---- folders in, folders out ---------------------------------------------------------------------------------------

QWEN3_PROMPT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
)
QWEN3_OUTPUT = "<think>\nThe user wants a greeting.\n</think>\n\nHello there, friend!<|im_end|>"


def qwen3_row(sample_id: str, *, split_hello: bool = False) -> TrainingRow:
    """A row with real Qwen3 ids; ``split_hello``: "Hello" as two ids (a sequence text cannot give back)."""
    profile = load_profile("qwen3")
    prompt = profile.encode_prompt(QWEN3_PROMPT)
    output = profile.encode(QWEN3_OUTPUT)
    if split_hello:
        head, tail = QWEN3_OUTPUT.split("Hello")
        output = [*profile.encode(head), *profile.encode("Hel"), *profile.encode("lo"), *profile.encode(tail)]
        assert profile.decode(output) == QWEN3_OUTPUT and profile.encode(QWEN3_OUTPUT) != output
    base = training_row(decode(FIXTURE.read_bytes(), SampleAudited))
    return msgspec.structs.replace(
        base,
        id=f"chat:{sample_id}",
        dataset="chat",
        input_ids=[*prompt, *output],
        prompt_ids=prompt,
        output_ids=output,
        loss_mask=[0] * len(prompt) + [1] * len(output),
        metadata=msgspec.structs.replace(base.metadata, profile="qwen3"),
    )


def write_jsonl(path: Path, rows: list[TrainingRow], tail: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(row_line(r) for r in rows) + tail)


def read_jsonl(folder: Path, pattern: str = "*/part-*.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(folder.glob(pattern)) for line in p.read_bytes().splitlines()]


def test_specforge_refuses_a_row_whose_text_does_not_give_back_its_ids(tmp_path: Path) -> None:
    sink = tmp_path / "sink"
    write_jsonl(sink / "chat" / "part-00000.jsonl", [qwen3_row("good"), qwen3_row("split", split_hello=True)])
    report = export("specforge", sink, tmp_path / "out")
    assert report.rows_read == 2 and report.rows_written == 1
    assert len(report.refused) == 1 and report.refused[0].startswith("chat:split: its text does not re-encode")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "specforge.jsonl"]  # one file
    written = read_jsonl(tmp_path / "out", "specforge.jsonl")
    assert [r["id"] for r in written] == ["chat:good"]
    profile = load_profile("qwen3")
    assert written[0]["text"] == QWEN3_PROMPT + QWEN3_OUTPUT
    assert profile.encode_prompt(written[0]["text"]) == qwen3_row("good").input_ids
    assert report.mask_matches[("qwen3", "qwen3-thinking", True)] == 1
    assert "qwen3-thinking" in (tmp_path / "out" / "README.md").read_text(encoding="utf-8")


def test_specforge_mask_rule_covers_the_generated_turn_exactly() -> None:
    row = qwen3_row("good")
    profile = load_profile("qwen3")
    mask = specforge_loss_mask(QWEN3_PROMPT + QWEN3_OUTPUT, profile.encode_prompt, SPECFORGE_TEMPLATES["qwen3"],
                               last_turn_only=False)  # fmt: skip
    assert mask == row.loss_mask


def test_speculators_refuses_rows_a_trainer_would_drop_or_misalign(tmp_path: Path) -> None:
    good = qwen3_row("good")
    unsupervised = msgspec.structs.replace(qwen3_row("zero"), loss_mask=[0] * len(good.input_ids))
    short = msgspec.structs.replace(qwen3_row("short"), loss_mask=good.loss_mask[:-1])
    write_jsonl(tmp_path / "sink" / "chat" / "part-00000.jsonl", [good, unsupervised, short])
    report = export("speculators", tmp_path / "sink", tmp_path / "out")
    assert report.rows_written == 1
    assert sorted(r.split(":")[1] for r in report.refused) == ["short", "zero"]
    assert read_jsonl(tmp_path / "out") == [{"id": "chat:good", "input_ids": good.input_ids,
                                             "loss_mask": good.loss_mask, "truncated": False}]  # fmt: skip


def two_dataset_sink(sink: Path) -> list[TrainingRow]:
    """A sink folder of two datasets with two parts each (real Qwen3 ids); its rows in part order."""
    shards = {"chat/part-00000.jsonl": ["a", "b"], "chat/part-00001.jsonl": ["c"], "math/part-00000.jsonl": ["d"],
              "math/part-00003.jsonl": ["e", "f"]}  # fmt: skip
    rows: list[TrainingRow] = []
    for part, ids in shards.items():
        dataset = part.split("/")[0]
        group = [msgspec.structs.replace(qwen3_row(i), id=f"{dataset}:{i}", dataset=dataset) for i in ids]
        write_jsonl(sink / part, group)
        rows += group
    return rows


def shard_rows(sink: Path) -> list[tuple[str, list[int], list[int]]]:
    """(id, input_ids, loss_mask) of every row of the sink's shards, read from the files."""
    return [(r["id"], r["input_ids"], r["loss_mask"]) for r in read_jsonl(sink)]


def test_merged_speculators_file_holds_the_shards_rows_for_specforge_prompts_path(tmp_path: Path) -> None:
    sink, out = tmp_path / "sink", tmp_path / "out"
    two_dataset_sink(sink)
    report = export("speculators", sink, out, merge=True)
    assert not report.refused and report.rows_written == 6 and report.parts_read == 4
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "speculators.jsonl"]
    merged = read_jsonl(out, "speculators.jsonl")
    assert [(r["id"], r["input_ids"], r["loss_mask"]) for r in merged] == shard_rows(sink)
    readme = (out / "README.md").read_text(encoding="utf-8")
    assert f"prompts_path: {(out / 'speculators.jsonl').resolve()}" in readme


def test_merged_specforge_file_re_encodes_to_the_shards_ids_and_says_the_measured_route(tmp_path: Path) -> None:
    sink, out = tmp_path / "sink", tmp_path / "out"
    two_dataset_sink(sink)
    report = export("specforge", sink, out)
    assert not report.refused and report.rows_written == 6
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "specforge.jsonl"]
    merged = read_jsonl(out, "specforge.jsonl")
    profile = load_profile("qwen3")
    rebuilt = [(r["id"], profile.encode_prompt(r["text"])) for r in merged]
    assert rebuilt == [(i, ids) for i, ids, _ in shard_rows(sink)]
    # SpecForge's span rule on the merged text (the last turn) gives the shards' loss masks.
    masks = [specforge_loss_mask(r["text"], profile.encode_prompt, SPECFORGE_TEMPLATES["qwen3"], last_turn_only=True)
             for r in merged]  # fmt: skip
    assert masks == [mask for _, _, mask in shard_rows(sink)]
    readme = (out / "README.md").read_text(encoding="utf-8")
    for line in (f"train_data_path: {(out / 'specforge.jsonl').resolve()}", "is_preformatted: true",
                 "chat_template: qwen3-thinking", "train_only_last_turn: true", "prompts_path:"):  # fmt: skip
        assert line in readme, line
    with pytest.raises(CommandError, match="--merge is for --to speculators"):
        export("hf", sink, tmp_path / "hf", merge=True)


def test_hf_readme_loads_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, out = tmp_path / "sink", tmp_path / "out"
    rows = two_dataset_sink(sink)
    export("hf", sink, out)
    snippet = (out / "README.md").read_text(encoding="utf-8").split("```python\n")[1].split("```")[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the README's code, run from another folder, loads every row
    cache = str(tmp_path / "cache")
    scope: dict[str, Any] = {}
    exec(snippet.replace('split="train")', f'split="train", cache_dir={cache!r})'), scope)  # noqa: S102
    assert sorted(scope["ds"]["id"]) == sorted(r.id for r in rows)


def test_hf_export_mixes_layouts_into_one_schema(tmp_path: Path) -> None:
    import datasets

    sink = tmp_path / "sink"
    write_jsonl(sink / "chat" / "part-00000.jsonl", [qwen3_row("new")])
    (sink / "old").mkdir()
    (sink / "old" / "part-00000.jsonl").write_text(json.dumps(LEGACY) + "\n", encoding="utf-8")
    legacy_parquet = {**LEGACY, "id": "old:p1", **{k: json.dumps(LEGACY[k]) for k in ("conversations", "tools",
                                                                                       "metadata")}}  # fmt: skip
    pq.write_table(pa.Table.from_pylist([legacy_parquet]), sink / "old" / "part-00001.parquet")
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"out-{fmt}"
        report = export("hf", sink, out, fmt=fmt)
        assert not report.refused and report.rows_written == 3
        ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))  # README's config
        assert sorted(ds["id"]) == ["chat:new", "math:a1", "old:p1"]


def test_cli_exit_codes_and_messages(tmp_path: Path) -> None:
    runner = CliRunner()
    sink = tmp_path / "sink"
    write_jsonl(sink / "chat" / "part-00000.jsonl", [qwen3_row("a")], tail=b'{"id": "chat:b", "inp')
    done = runner.invoke(app, ["export", "--to", "speculators", "--from", str(sink), str(tmp_path / "out")])
    assert done.exit_code == 1, done.output
    assert "exported 1 of 2 row(s)" in done.stdout and "refused 1" in done.stdout
    assert "part-00000.jsonl:2: incomplete last line" in done.stderr

    again = runner.invoke(app, ["export", "--to", "hf", "--from", str(sink), str(tmp_path / "out")])
    assert again.exit_code == 2 and "exists and is not empty" in again.stderr
    missing = runner.invoke(app, ["export", "--to", "hf", "--from", str(tmp_path / "nope"), str(tmp_path / "o2")])
    assert missing.exit_code == 2 and "not a folder" in missing.stderr
    wrong = runner.invoke(app, ["export", "--to", "eagle", "--from", str(sink), str(tmp_path / "o3")])
    assert wrong.exit_code == 2 and "choose one of hf, speculators, specforge" in wrong.stderr
    inside = runner.invoke(app, ["export", "--to", "hf", "--from", str(sink), str(sink / "x")])
    assert inside.exit_code == 2 and "inside the sink folder" in inside.stderr
