"""The Hugging Face dataset card of an export, every figure counted from the rows it describes.

``datasets.load_dataset(OUT)`` reads the card's YAML header: the features, the ``train``
split's row count and size, and the ``configs`` that name the files. The header also holds
``draftstream``, one JSON object with every figure the text states, so a reader (or a test)
can recount the rows and compare. Nothing here is a figure from another run.

Pure: the shell (services/export/app.py) feeds :class:`CardStats` the rows it writes and the
sizes of the files, and writes the text this returns.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec.inspect as mi

from services.sink.core import NOT_REPORTED, TrainingRow

# A feature as the card's YAML lists it: a dtype name, ("list", feature) or ("struct", fields).
Feature = str | tuple[str, Any]

_DTYPES: dict[type[mi.Type], str] = {mi.StrType: "string", mi.IntType: "int64", mi.FloatType: "float64",
                                     mi.BoolType: "bool"}  # fmt: skip


def _feature(info: mi.Type) -> Feature:
    if type(info) in _DTYPES:
        return _DTYPES[type(info)]
    if isinstance(info, mi.ListType):
        return ("list", _feature(info.item_type))
    if isinstance(info, mi.StructType):
        return ("struct", [(f.encode_name, _feature(f.type)) for f in info.fields])
    raise TypeError(f"no dataset feature for {info!r}")


def row_features() -> list[tuple[str, Feature]]:
    """The features of the sink's fixed row schema (the ``hf`` target's rows)."""
    struct = _feature(mi.type_info(TrainingRow))
    assert isinstance(struct, tuple)  # noqa: S101 - a Struct's type info is a StructType
    fields: list[tuple[str, Feature]] = struct[1]
    return fields


TARGET_FEATURES: dict[str, list[tuple[str, Feature]]] = {
    "speculators": [("id", "string"), ("input_ids", ("list", "int64")), ("loss_mask", ("list", "int64")),
                    ("truncated", "bool")],
    "specforge": [("id", "string"), ("text", "string"), ("truncated", "bool")],
}  # fmt: skip


def _features_yaml(fields: list[tuple[str, Feature]], indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for name, feature in fields:
        lines.append(f"{pad}- name: {name}")
        lines += _feature_body(feature, indent + 2)
    return lines


def _feature_body(feature: Feature, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(feature, str):
        return [f"{pad}dtype: {feature}"]
    kind, inner = feature
    if kind == "list" and isinstance(inner, str):
        return [f"{pad}list: {inner}"]
    if kind == "list":
        inner_kind, fields = inner
        if inner_kind != "struct":
            raise TypeError(f"a list of {inner_kind} has no card feature here")
        return [f"{pad}list:", *_features_yaml(fields, indent)]
    return [f"{pad}struct:", *_features_yaml(inner, indent)]


@dataclass
class CardStats:
    """Figures of the rows an export wrote, counted one row at a time."""

    rows: int = 0
    per_dataset_turn: Counter[tuple[str, int]] = field(default_factory=Counter)
    tokens: Counter[str] = field(default_factory=Counter)
    models: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (model, provider, upstream)
    profiles: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (profile, tokenizer, template)
    versions: Counter[str] = field(default_factory=Counter)
    methods: Counter[str] = field(default_factory=Counter)
    checks_run: Counter[str] = field(default_factory=Counter)
    checks_passed: Counter[str] = field(default_factory=Counter)
    cost_usd: float = 0.0
    cost_rows: int = 0
    truncated: int = 0
    # (dataset, stage, reason) -> dead letters, when the export read the dead-letter topic; else None.
    dead_letters: Counter[tuple[str, str, str]] | None = None

    def add(self, row: TrainingRow) -> None:
        """Count one written row."""
        m = row.metadata
        self.rows += 1
        self.per_dataset_turn[(row.dataset, m.turn)] += 1
        self.tokens["input"] += len(row.input_ids)
        self.tokens["prompt"] += len(row.prompt_ids)
        self.tokens["output"] += len(row.output_ids)
        self.tokens["supervised"] += sum(row.loss_mask)
        self.models[(m.model, m.provider, m.upstream_provider)] += 1
        self.profiles[(m.profile, m.tokenizer_sha256, m.chat_template_sha256)] += 1
        self.versions[m.draftstream_version] += 1
        self.methods[m.reconstruction_method] += 1
        for check in m.audit.checks:
            self.checks_run[check.code] += 1
            self.checks_passed[check.code] += check.passed
        if m.usage.cost != float(NOT_REPORTED):
            self.cost_usd += m.usage.cost
            self.cost_rows += 1
        self.truncated += m.truncated

    def figures(self) -> dict[str, Any]:
        """Every figure the card states, as plain data (the header's ``draftstream`` object)."""
        return {
            "rows": self.rows,
            "rows_per_dataset_turn": [
                {"dataset": d, "turn": t, "rows": n} for (d, t), n in sorted(self.per_dataset_turn.items())
            ],
            "tokens": {k: self.tokens[k] for k in ("input", "prompt", "output", "supervised")},
            "models": [
                {"model": mo, "provider": p, "upstream": u, "rows": n} for (mo, p, u), n in sorted(self.models.items())
            ],
            "profiles": [
                {"profile": p, "tokenizer_sha256": t, "chat_template_sha256": c, "rows": n}
                for (p, t, c), n in sorted(self.profiles.items())
            ],
            "draftstream_versions": dict(sorted(self.versions.items())),
            "reconstruction_methods": dict(sorted(self.methods.items())),
            "audit_checks": {
                code: {"passed": self.checks_passed[code], "rows": n} for code, n in sorted(self.checks_run.items())
            },
            "cost_usd": round(self.cost_usd, 6),
            "cost_rows": self.cost_rows,
            "cost_usd_per_row": round(self.cost_usd / self.cost_rows, 6) if self.cost_rows else None,
            "truncated": self.truncated,
            "dead_letters": None if self.dead_letters is None else [
                {"dataset": d, "stage": stage, "reason": r, "count": n}
                for (d, stage, r), n in sorted(self.dead_letters.items())
            ],
        }


def card_header(
    fields: list[tuple[str, Feature]], figures: dict[str, Any], *, data_files: str, num_bytes: int
) -> str:
    """The YAML header ``datasets`` reads: licence placeholder, features, the train split, configs."""
    lines = [
        "---",
        "license: other  # a placeholder: the terms of the prompts' sources and of the model's outputs",
        "pretty_name: draftstream training rows",
        "tags:",
        "- speculative-decoding",
        "- draftstream",
        "dataset_info:",
        "  features:",
        *_features_yaml(fields, 2),
        "  splits:",
        "  - name: train",
        f"    num_bytes: {num_bytes}",
        f"    num_examples: {figures['rows']}",
        f"  download_size: {num_bytes}",
        f"  dataset_size: {num_bytes}",
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        f"    path: {json.dumps(data_files)}",
        f"draftstream: {json.dumps(figures, sort_keys=True)}",
        "---",
    ]
    return "\n".join(lines) + "\n"


def _turn(turn: int) -> str:
    return "-" if turn == NOT_REPORTED else str(turn)


def _or_none(text: str) -> str:
    return f"`{text}`" if text else "not recorded"


def card_body(figures: dict[str, Any]) -> str:
    """What the rows are, in tables: every number from ``figures`` (see :meth:`CardStats.figures`)."""
    tokens = figures["tokens"]
    out = [
        "## What this export holds",
        "",
        f"Counted from the {figures['rows']} row(s) written here (a row the export refused is not among them).",
        "",
        "| dataset | turn | rows |",
        "|---|---|---|",
        *(f"| {r['dataset']} | {_turn(r['turn'])} | {r['rows']} |" for r in figures["rows_per_dataset_turn"]),
        "",
        f"Tokens: {tokens['input']} input ({tokens['prompt']} prompt, {tokens['output']} output), "
        f"{tokens['supervised']} supervised (loss_mask 1).",
        "",
        "| model | provider | upstream | rows |",
        "|---|---|---|---|",
        *(f"| {r['model']} | {r['provider']} | {r['upstream'] or '-'} | {r['rows']} |" for r in figures["models"]),
        "",
        "| profile | tokenizer sha256 | chat template sha256 | rows |",
        "|---|---|---|---|",
        *(f"| {r['profile']} | {_or_none(r['tokenizer_sha256'])} | {_or_none(r['chat_template_sha256'])} "
          f"| {r['rows']} |" for r in figures["profiles"]),
        "",
        "| draftstream version | rows |",
        "|---|---|",
        *(f"| {v or 'not recorded'} | {n} |" for v, n in figures["draftstream_versions"].items()),
        "",
        "| reconstruction method | rows |",
        "|---|---|",
        *(f"| {m or '-'} | {n} |" for m, n in figures["reconstruction_methods"].items()),
        "",
        "| audit check | passed | rows checked |",
        "|---|---|---|",
        *(f"| {c} | {v['passed']} | {v['rows']} |" for c, v in figures["audit_checks"].items()),
        "",
    ]  # fmt: skip
    if figures["cost_rows"]:
        out.append(
            f"Spent on these rows: ${figures['cost_usd']:.6f} over the {figures['cost_rows']} row(s) whose provider "
            f"reported a cost, ${figures['cost_usd_per_row']:.6f} per row."
        )
    else:
        out.append("Spent on these rows: no row's provider reported a cost.")
    out += [f"Truncated rows (accepted at max_tokens, `metadata.truncated`): {figures['truncated']}.", ""]
    dead = figures["dead_letters"]
    if dead is None:
        out.append(
            "Dead letters were not read for this card (`draftstream export --dead-letters` counts them from the "
            "dead-letter topic; `draftstream dlq list` lists them); `draftstream budget` shows the money spent on "
            "every answer, accepted or not."
        )
    else:
        out += [
            f"Prompts of these datasets dead-lettered when this export was made: {sum(r['count'] for r in dead)} "
            f"(one per key, by its latest dead letter; none for a key a replay got accepted).",
            "",
            "| dataset | stage | reason | dead letters |",
            "|---|---|---|---|",
            *(f"| {r['dataset']} | {r['stage']} | {r['reason']} | {r['count']} |" for r in dead),
        ]
    out.append("")
    return "\n".join(out)


__all__ = ["TARGET_FEATURES", "CardStats", "Feature", "card_body", "card_header", "row_features"]
