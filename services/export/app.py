"""``draftstream export``: a sink folder → a folder a trainer loads as it is.

Reads every ``<dataset>/part-NNNNN.{jsonl,parquet}`` of a sink folder (the current row
schema, or the sink's earlier layout, upgraded), converts each row with
:mod:`services.export.core` and writes ``OUT/<dataset>/part-NNNNN.<ext>``, one output
part per input part (SpecForge, and speculators with ``merge``: one ``OUT/<target>.jsonl``),
plus a ``README.md``: the Hugging Face dataset card computed from the rows written
(services/export/card.py) and how to load them, into SpecForge too. A row that
cannot be exported (unreadable, ids and mask disagreeing, or for SpecForge a text that
does not re-encode to its ids) is never written: it is listed in the report, and the
command exits non-zero.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from services.common.config import Settings
from services.common.errors import CommandError
from services.export.card import TARGET_FEATURES, CardStats, card_body, card_header, row_features
from services.export.core import (
    SPECFORGE_TEMPLATES,
    TARGETS,
    RowError,
    Target,
    hf_row,
    row_from_builtins,
    row_from_line,
    specforge_loss_mask,
    specforge_row,
    speculators_row,
)
from services.sink.core import TrainingRow, part_number, row_arrow_schema, row_builtins, row_line

FORMATS = ("jsonl", "parquet")
_encoder = msgspec.json.Encoder()


@dataclass
class ExportReport:
    """What an export read, wrote and refused."""

    target: str
    out_dir: Path
    parts_read: int = 0
    rows_read: int = 0
    rows_written: int = 0
    refused: list[str] = field(default_factory=list)  # one line per refused row: where and why
    per_dataset: Counter[str] = field(default_factory=Counter)
    # specforge: rows whose loss mask SpecForge's template rule reproduces, per (profile, template, last-turn-only)
    mask_matches: Counter[tuple[str, str, bool]] = field(default_factory=Counter)
    mask_rows: Counter[str] = field(default_factory=Counter)
    profiles: set[str] = field(default_factory=set)
    files: list[Path] = field(default_factory=list)
    merged: bool = False  # every row in one OUT/<target>.jsonl (merged_name)
    left_out: int = 0  # rows of other providers than the one asked for (``provider``)
    card: CardStats = field(default_factory=CardStats)  # the figures of the rows written


def merged_name(target: str) -> str:
    """The one file a merged export writes: ``speculators.jsonl``, ``specforge.jsonl``."""
    return f"{target}.jsonl"


def sink_parts(sink_dir: Path) -> list[Path]:
    """Every part file of a sink folder, in dataset then part order; a clear error when there is none."""
    if not sink_dir.is_dir():
        raise CommandError(f"--from {sink_dir}: not a folder (give the sink's output folder, [sink] out_dir)")
    parts = sorted(
        p for d in sink_dir.iterdir() if d.is_dir() for p in d.iterdir() if part_number(p.name) is not None
    )
    if not parts:
        raise CommandError(f"--from {sink_dir}: no <dataset>/part-NNNNN.jsonl or .parquet files in it")
    return parts


def count_rows(part: Path) -> int:
    """Rows in one part (complete lines of a JSONL part; the footer's count of a Parquet part)."""
    if part.suffix == ".jsonl":
        with part.open("rb") as f:
            return sum(1 for line in f if line.strip() and line.endswith(b"\n"))
    import pyarrow.parquet as pq

    try:
        return int(pq.read_metadata(part).num_rows)
    except Exception:  # noqa: BLE001 - an unreadable part is reported when it is read
        return 0


def read_part(part: Path, report: ExportReport) -> Iterator[TrainingRow]:
    """The rows of one part; unreadable rows are added to ``report.refused``."""
    if part.suffix == ".jsonl":
        with part.open("rb") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{part}:{n}"
                if not line.endswith(b"\n"):  # a write in progress (or torn): never half a row
                    report.refused.append(f"{where}: incomplete last line (the sink may still be writing it)")
                    continue
                try:
                    yield row_from_line(line, where)
                except RowError as exc:
                    report.refused.append(str(exc))
        return
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(part).to_pylist()
    except Exception as exc:  # noqa: BLE001 - an unreadable file is reported with its reason
        report.refused.append(f"{part}: unreadable Parquet part: {exc}")
        return
    for n, record in enumerate(records, start=1):
        try:
            yield row_from_builtins(record, f"{part}: row {n}")
        except RowError as exc:
            report.refused.append(str(exc))


def _check_out_dir(out_dir: Path, sink_dir: Path) -> None:
    if out_dir.resolve() == sink_dir.resolve() or sink_dir.resolve() in out_dir.resolve().parents:
        raise CommandError(f"OUT_DIR {out_dir} is inside the sink folder {sink_dir}: choose a folder outside it")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CommandError(f"OUT_DIR {out_dir} exists and is not empty: give a new or empty folder")


@dataclass
class SpecforgeTokenizers:
    """Per profile: decode ids to text, and encode text the way SpecForge's tokenizer call does."""

    settings: Settings | None

    def profile(self, name: str) -> Any:
        """The verified profile ``name`` (services.profiles caches it)."""
        from services.profiles import ProfileError, load_profile

        try:
            return load_profile(name, self.settings)
        except ProfileError as exc:
            raise CommandError(
                f"rows of profile {name!r} need its tokenizer to be checked, and it cannot be loaded "
                f"({exc.reason}): {exc.message}"
            ) from None


class _PartWriter:
    """One output file, written to ``<name>.tmp`` and renamed when complete.

    JSONL rows are written as they come (a merged file of a whole sink folder is never held
    in memory); Parquet rows are kept until :meth:`close` writes the one table.
    """

    def __init__(self, path: Path, fmt: str) -> None:
        self.path = path
        self.fmt = fmt
        self.tmp = path.with_name(path.name + ".tmp")
        self.rows: list[Any] = []
        self.written = 0
        self._file: BinaryIO | None = None

    def add(self, row: Any) -> None:
        if self.fmt == "parquet":
            self.rows.append(row)
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.tmp.open("wb")
        self._file.write(row_line(row) if isinstance(row, TrainingRow) else _encoder.encode(row) + b"\n")
        self.written += 1

    def close(self) -> bool:
        """Finish the file (False, and no file, when it holds no row)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        elif not self.rows:
            return False
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            self.path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(self.rows[0], TrainingRow):
                table = pa.Table.from_pylist([row_builtins(r) for r in self.rows], schema=row_arrow_schema())
            else:
                table = pa.Table.from_pylist(self.rows)
            pq.write_table(table, self.tmp)
        self.tmp.rename(self.path)
        return True


def _specforge_convert(
    rows: list[TrainingRow], tokenizers: SpecforgeTokenizers, report: ExportReport, writer: _PartWriter
) -> None:
    by_profile: dict[str, list[TrainingRow]] = {}
    for row in rows:
        by_profile.setdefault(row.metadata.profile, []).append(row)
    for name, group in by_profile.items():
        report.profiles.add(name)
        profile = tokenizers.profile(name)
        texts: list[str] = profile.decode_batch([r.input_ids for r in group])
        encoded: list[list[int]] = profile.encode_prompt_batch(texts)
        template = SPECFORGE_TEMPLATES.get(name)
        for row, text, ids in zip(group, texts, encoded, strict=True):
            try:
                writer.add(specforge_row(row, text, ids))
            except RowError as exc:
                report.refused.append(str(exc))
                continue
            report.rows_written += 1
            report.per_dataset[row.dataset] += 1
            report.card.add(row)
            if template is None:
                continue
            report.mask_rows[name] += 1
            for last_only in (False, True):
                mask = specforge_loss_mask(text, profile.encode_prompt, template, last_turn_only=last_only)
                report.mask_matches[(name, template.name, last_only)] += mask == row.loss_mask


def export(
    target: Target,
    sink_dir: Path,
    out_dir: Path,
    *,
    fmt: str = "jsonl",
    merge: bool = False,
    settings: Settings | None = None,
    progress: Callable[[int], None] | None = None,
    dead_letters: Counter[tuple[str, str, str]] | None = None,
    provider: str | None = None,
) -> ExportReport:
    """Export every row of ``sink_dir`` to ``out_dir`` for ``target``; see the module docstring.

    ``merge`` (always for SpecForge, which takes one file) writes every row into one
    ``OUT/<target>.jsonl`` instead of one part per input part. ``progress(n)`` is called
    after every part with the rows it held. ``dead_letters`` ((dataset, stage, reason) -> count,
    read by the caller from the dead-letter topic) go into the card for the sink folder's datasets.
    ``provider``: only the rows this configured provider answered (``metadata.provider_name``; a row
    written before names were recorded matches by its ``metadata.provider`` kind).
    """
    if target not in TARGETS:
        raise CommandError(f"--to {target!r}: choose one of {', '.join(TARGETS)}")
    if fmt not in FORMATS:
        raise CommandError(f"--format {fmt!r}: choose jsonl or parquet")
    if fmt == "parquet" and target != "hf":
        raise CommandError(f"--format parquet is for --to hf; {target} reads JSONL")
    if merge and target == "hf":
        raise CommandError("--merge is for --to speculators (--to specforge always writes one file)")
    parts = sink_parts(sink_dir)
    _check_out_dir(out_dir, sink_dir)
    report = ExportReport(target=target, out_dir=out_dir, merged=merge or target == "specforge")
    if dead_letters is not None:
        folders = {p.parent.name for p in parts}
        report.card.dead_letters = Counter({k: n for k, n in dead_letters.items() if k[0] in folders})
    tokenizers = SpecforgeTokenizers(settings)
    merged = _PartWriter(out_dir / merged_name(target), fmt) if report.merged else None
    for part in parts:
        refused_before = len(report.refused)
        rows = list(read_part(part, report))
        report.parts_read += 1
        report.rows_read += len(rows) + len(report.refused) - refused_before
        if provider is not None:
            kept = [row for row in rows if (row.metadata.provider_name or row.metadata.provider) == provider]
            report.left_out += len(rows) - len(kept)
            rows = kept
        writer = merged or _PartWriter(out_dir / part.parent.name / part.with_suffix(f".{fmt}").name, fmt)
        if target == "specforge":
            _specforge_convert(rows, tokenizers, report, writer)
        else:
            convert = hf_row if target == "hf" else speculators_row
            for row in rows:
                try:
                    writer.add(convert(row))
                except RowError as exc:
                    report.refused.append(str(exc))
                    continue
                report.rows_written += 1
                report.per_dataset[row.dataset] += 1
                report.card.add(row)
        if merged is None and writer.close():
            report.files.append(writer.path)
        if progress is not None:
            progress(len(rows))
    if merged is not None and merged.close():
        report.files.append(merged.path)
    if report.files:
        (out_dir / "README.md").write_text(readme(report, fmt), encoding="utf-8")
    return report


SPECFORGE_CHECKED = "sgl-project/SpecForge @ a6b6b02"
"""The SpecForge code the training route below was read in and run against (docs/audit.md)."""


def prompts_path_yaml(speculators_file: str) -> str:
    """SpecForge's config for pre-tokenized rows: the merged speculators file as ``data.prompts_path``."""
    return f"```yaml\ndata:\n  prompts_path: {speculators_file}\n```\n"


def specforge_route(*, speculators_file: str, specforge_file: str, template: str) -> str:
    """The two ways into SpecForge that train on exactly our ids, with their YAML."""
    return (
        f"Both routes below were read in and run against {SPECFORGE_CHECKED} (draftstream's docs/audit.md, "
        "\"Into SpecForge\", has the dated measurement). Give them to `specforge train --config train.yaml`; "
        "the rest of the config (model, output, hyper-parameters) is as in SpecForge's examples.\n\n"
        "1. Pre-tokenized, independent of any chat template: the one file of "
        "`draftstream export --to speculators --merge` as `data.prompts_path`.\n\n"
        + prompts_path_yaml(speculators_file)
        + "\n2. Preformatted text: the one file `draftstream export --to specforge` writes, with the chat "
        "template that locates the supervised spans. Without `train_only_last_turn: true` the masks of rows "
        "whose prompts hold earlier assistant turns differ (the table below counts them in this export).\n\n"
        f"```yaml\ndata:\n  train_data_path: {specforge_file}\n  is_preformatted: true\n"
        f"  chat_template: {template}\n  train_only_last_turn: true\n```\n\n"
        "What does not work there: the offline `scripts/prepare_hidden_states.py --is-preformatted` "
        "(its loader keeps only `conversations`/`tools`: \"Expected 'text' column\"), the command-line flag "
        "`--train-only-last-turn` (now the YAML key above), and a folder as `data.train_data_path` (one file "
        "only). The conversation path re-renders `conversations` and loses the reasoning.\n"
    )


_SPECULATORS_HEAD = (
    "# draftstream rows for vLLM speculators\n\nPre-tokenized rows (`input_ids`, `loss_mask`): speculators "
    "passes them through without re-rendering. "
)


def readme(report: ExportReport, fmt: str) -> str:
    """The README.md written beside the exported files: the dataset card and how to load the rows."""
    pattern = merged_name(report.target) if report.merged else f"*/part-*.{fmt}"
    fields = row_features() if report.target == "hf" else TARGET_FEATURES[report.target]
    figures = report.card.figures()
    size = sum(p.stat().st_size for p in report.files)
    head = card_header(fields, figures, data_files=pattern, num_bytes=size) + "\n"
    return head + _how_to_load(report, fmt, pattern) + "\n" + card_body(figures)


def _how_to_load(report: ExportReport, fmt: str, pattern: str) -> str:
    out = report.out_dir.resolve()
    if report.target == "hf":
        builder = "parquet" if fmt == "parquet" else "json"
        return (
            "# draftstream training rows\n\nEvery part has the same row schema (see draftstream's docs/audit.md, "
            f"\"The sink\").\n\n```python\nimport datasets\nOUT = \"{out}\"  # this folder\n"
            "ds = datasets.load_dataset(OUT, split=\"train\")  # by the configs above\n"
            f"ds = datasets.load_dataset(\"{builder}\", data_files=f\"{{OUT}}/{pattern}\", split=\"train\")\n```\n"
        )
    if report.target == "speculators":
        if report.merged:
            where = f"`{out / pattern}` holds every row; for SpecForge (`specforge train --config`):\n\n"
            return _SPECULATORS_HEAD + where + prompts_path_yaml(str(out / pattern))
        return _SPECULATORS_HEAD + (
            "Give this folder as vLLM speculators' training data path (its directory input loads every "
            "`*.jsonl` under it). SpecForge takes one file: export with `--merge`.\n"
        )
    templates = sorted({SPECFORGE_TEMPLATES[p].name for p in report.mask_rows})
    lines = [
        "# draftstream rows for SpecForge\n",
        f"`{out / pattern}` holds every row. `text` is the decode of the sample's exact token ids; every row was "
        "checked to re-encode to those ids with the model's tokenizer (no special tokens added). The table says "
        "which SpecForge chat template locates the supervised spans of each profile's rows, and for how many rows "
        "its rule reproduces `loss_mask`, for every assistant turn and for the last one only.\n",
        specforge_route(
            speculators_file="SPEC_OUT/speculators.jsonl",
            specforge_file=str(out / pattern),
            template=templates[0] if len(templates) == 1 else "<the template of the table below>",
        ),
        "| profile | SpecForge chat template | loss mask reproduced | with train_only_last_turn |",
        "|---|---|---|---|",
    ]
    for profile, total in sorted(report.mask_rows.items()):
        template = SPECFORGE_TEMPLATES[profile].name
        all_turns = report.mask_matches[(profile, template, False)]
        last = report.mask_matches[(profile, template, True)]
        lines.append(f"| {profile} | {template} | {all_turns}/{total} | {last}/{total} |")
    unmapped = sorted({p for p in report.profiles if p not in SPECFORGE_TEMPLATES})
    if unmapped:
        lines.append(
            f"\nNo registered SpecForge template ends its assistant header where the prompts of {', '.join(unmapped)} "
            "end: register one whose `assistant_header` is the end of the generation prompt, or the loss mask will "
            "differ from `loss_mask`."
        )
    return "\n".join(lines) + "\n"
