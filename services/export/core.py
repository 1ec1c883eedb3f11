"""Training rows in the shapes trainers read as they are: Hugging Face ``datasets``, speculators, SpecForge.

Pure functions over :class:`~services.sink.core.TrainingRow`; the tokenizer is passed in as
functions, so nothing here loads files or models.

- ``hf``: the sink's fixed row schema (older sink rows are upgraded to it), so
  ``datasets.load_dataset("json", data_files=<every part>)`` loads a whole folder at once.
- ``speculators``: ``{id, input_ids, loss_mask}`` rows. vLLM's speculators passes rows that
  carry both ``input_ids`` and ``loss_mask`` straight through, without re-rendering
  (``src/speculators/data_generation/preprocessing.py``: ``build_eagle3_dataset`` /
  ``_passthrough_pretokenized``, vllm-project/speculators @ 04319940), and drops a row with
  no supervised token or mismatched lengths; both are refused here instead.
- ``specforge``: ``{id, text}`` rows for SpecForge's preformatted path
  (``build_eagle3_dataset(..., is_preformatted=True)``), the only one that keeps our ids:
  its conversation path re-renders ``conversations`` through a chat template and loses the
  reasoning. ``text`` is the decode of ``input_ids``; a row is written only when encoding
  ``text`` the way SpecForge does gives back exactly ``input_ids``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from services.sink.core import NO_JSON_LIST, NOT_REPORTED, TrainingRow

Target = Literal["hf", "speculators", "specforge"]
TARGETS: tuple[Target, ...] = ("hf", "speculators", "specforge")

Encode = Callable[[str], list[int]]


class RowError(ValueError):
    """A stored row that cannot be read or exported; the message names the row and what is wrong."""


# ---- reading rows (the current schema, or the sink's earlier free-form one) ---------------------------------------


def _json_list(value: Any) -> str:
    """Earlier sinks stored tools / tool_calls as null, a list, or (Parquet) JSON text."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")) if value else NO_JSON_LIST


def _nested(value: Any) -> Any:
    """Earlier Parquet parts stored conversations / metadata as JSON text."""
    return json.loads(value) if isinstance(value, str) else value


def _upgrade_turn(turn: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": turn.get("role") or "",
        "content": turn.get("content") or "",
        "reasoning_content": turn.get("reasoning_content") or "",
        "tool_calls": _json_list(turn.get("tool_calls")),
        "tool_call_id": turn.get("tool_call_id") or "",
        "name": turn.get("name") or "",
    }


def _upgrade_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    usage = meta.get("usage") or {}
    audit = meta.get("audit") or {}
    checks = audit.get("checks") or []
    if isinstance(checks, dict):  # earlier: {code: passed} plus notes {code: message}
        notes = audit.get("notes") or {}
        checks = [{"code": code, "passed": ok, "message": notes.get(code, "")} for code, ok in checks.items()]

    def count(name: str) -> Any:
        value = usage.get(name)
        return NOT_REPORTED if value is None else value

    return {
        "provider": meta.get("provider") or "",
        "upstream_provider": meta.get("upstream_provider") or "",
        "model": meta.get("model") or "",
        "profile": meta.get("profile") or "",
        "usage": {
            "prompt_tokens": count("prompt_tokens"),
            "completion_tokens": count("completion_tokens"),
            "reasoning_tokens": count("reasoning_tokens"),
            "cost": float(count("cost")),
        },
        "finish_reason": meta.get("finish_reason") or "",
        "reconstruction_method": meta.get("reconstruction_method") or "",
        "audit": {"passed": bool(audit.get("passed")), "checks": checks},
        "conversation_id": meta.get("conversation_id") or "",
        "turn": NOT_REPORTED if meta.get("turn") is None else meta["turn"],
    }


def upgrade_row(obj: dict[str, Any]) -> dict[str, Any]:
    """A row of the sink's earlier layout (nulls, dict-valued checks, JSON-text Parquet columns) in today's."""
    return {
        **obj,
        "conversations": [_upgrade_turn(t) for t in _nested(obj.get("conversations")) or []],
        "tools": _json_list(obj.get("tools")),
        "metadata": _upgrade_metadata(_nested(obj.get("metadata")) or {}),
    }


def row_from_builtins(obj: Any, where: str) -> TrainingRow:
    """A decoded row (a JSONL line's object or a Parquet record) as a :class:`TrainingRow`.

    Rows of the current schema convert as they are; rows the sink wrote before the schema
    was fixed are upgraded first. Raises :class:`RowError` naming ``where`` and the field.
    """
    if not isinstance(obj, dict):
        raise RowError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
    try:
        return msgspec.convert(obj, TrainingRow)
    except msgspec.ValidationError as current:
        try:
            return msgspec.convert(upgrade_row(obj), TrainingRow)
        except (msgspec.ValidationError, ValueError, TypeError, AttributeError):
            raise RowError(f"{where}: not a training row: {current}") from None


def row_from_line(line: bytes, where: str) -> TrainingRow:
    """One JSONL line as a :class:`TrainingRow` (see :func:`row_from_builtins`)."""
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise RowError(f"{where}: not JSON: {exc}") from None
    return row_from_builtins(obj, where)


def check_row(row: TrainingRow) -> None:
    """Refuse a row whose ids and mask disagree (a trainer would silently shift the mask)."""
    if len(row.input_ids) != len(row.loss_mask):
        raise RowError(f"{row.id}: input_ids has {len(row.input_ids)} ids but loss_mask {len(row.loss_mask)}")
    if row.input_ids != [*row.prompt_ids, *row.output_ids]:
        raise RowError(f"{row.id}: input_ids is not prompt_ids + output_ids")
    if not any(row.loss_mask):
        raise RowError(f"{row.id}: no supervised token (loss_mask is all 0)")


# ---- the three targets ---------------------------------------------------------------------------------------------


def hf_row(row: TrainingRow) -> TrainingRow:
    """The row for the ``hf`` target: the fixed schema itself."""
    check_row(row)
    return row


def speculators_row(row: TrainingRow) -> dict[str, Any]:
    """The row for speculators' pre-tokenized pass-through."""
    check_row(row)
    return {"id": row.id, "input_ids": row.input_ids, "loss_mask": row.loss_mask, "truncated": row.metadata.truncated}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def specforge_row(row: TrainingRow, text: str, encoded: Sequence[int]) -> dict[str, Any]:
    """The row for SpecForge's preformatted path, given ``text`` = decode(input_ids) and its re-encoding.

    Raises :class:`RowError` when the re-encoding is not exactly ``input_ids``: SpecForge
    would train on other ids than the model produced.
    """
    check_row(row)
    if list(encoded) != row.input_ids:
        at = first_difference(encoded, row.input_ids)
        raise RowError(
            f"{row.id}: its text does not re-encode to its input_ids (first difference at position {at} of "
            f"{len(row.input_ids)}: {row.input_ids[at:at + 3]} became {list(encoded[at:at + 3])})"
        )
    return {"id": row.id, "text": text, "truncated": row.metadata.truncated}


# ---- SpecForge's loss mask over preformatted text ------------------------------------------------------------------


@dataclass(frozen=True)
class SpecForgeTemplate:
    """A SpecForge chat template's strings that locate the supervised spans of preformatted text."""

    name: str
    assistant_header: str
    end_of_turn: str
    ignore: tuple[str, ...] = ()


# Registered in SpecForge's specforge/data/template.py (sgl-project/SpecForge @ 031c0d6b): the
# template whose assistant header ends exactly where our profile's generation prompt ends.
SPECFORGE_TEMPLATES: dict[str, SpecForgeTemplate] = {
    "qwen3": SpecForgeTemplate("qwen3-thinking", "<|im_start|>assistant\n", "<|im_end|>\n"),
    "qwen3-thinking-2507": SpecForgeTemplate("qwen3-next-thinking", "<|im_start|>assistant\n<think>\n", "<|im_end|>\n"),
    "kimi-k2": SpecForgeTemplate("kimi-k2-instruct", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
    "kimi-k2-thinking": SpecForgeTemplate("kimi-k2-thinking", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
}


def specforge_loss_mask(text: str, encode: Encode, template: SpecForgeTemplate, *, last_turn_only: bool) -> list[int]:
    """The loss mask SpecForge derives for preformatted ``text``.

    Its rule (``GeneralParser.parse`` in specforge/data/parse.py, sgl-project/SpecForge @
    078940a1): each span from an assistant header up to and including the next end-of-turn
    (or the end of the text) is supervised; a span's token range is the length of the
    encoded text before it and up to its end; ``ignore`` strings are then unmasked;
    ``train_only_last_turn`` keeps the last span only.
    """
    pattern = re.escape(template.assistant_header) + r"([\s\S]*?(?:" + re.escape(template.end_of_turn) + "|$))"
    n = len(encode(text))
    mask = [0] * n
    spans = [(m.start(1), m.end(1)) for m in re.finditer(pattern, text)]
    if last_turn_only:
        spans = spans[-1:]
    for start, end in spans:
        for i in range(min(len(encode(text[:start])), n), min(len(encode(text[:end])), n)):
            mask[i] = 1
    for token in template.ignore:
        for m in re.finditer(re.escape(token), text):
            for i in range(min(len(encode(text[: m.start()])), n), min(len(encode(text[: m.end()])), n)):
                mask[i] = 0
    return mask


__all__ = [
    "SPECFORGE_TEMPLATES",
    "TARGETS",
    "RowError",
    "SpecForgeTemplate",
    "Target",
    "check_row",
    "first_difference",
    "hf_row",
    "row_from_builtins",
    "row_from_line",
    "specforge_loss_mask",
    "specforge_row",
    "speculators_row",
    "upgrade_row",
]
