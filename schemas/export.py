"""Generates the JSON Schema of every event and the AsyncAPI document from the Structs (never by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

import schemas as s
from schemas import asyncapi

EVENTS: dict[str, Any] = {
    "prompt_published": s.PromptPublished,
    "request_started": s.RequestStarted,
    "response_received": s.ResponseReceived,
    "sample_reconstructed": s.SampleReconstructed,
    "sample_audited": s.SampleAudited,
    "control_event": s.Halt | s.Resume,
    "budget_snapshot": s.BudgetSnapshot,
}


def render() -> dict[str, str]:
    """File name to JSON text for every event schema."""
    out = {}
    for name, type_ in EVENTS.items():
        schema = msgspec.json.schema(type_)
        out[f"{name}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    out["asyncapi.yaml"] = asyncapi.render()
    return out


def export(folder: Path) -> list[Path]:
    """Write every schema under ``folder``; returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, text in render().items():
        path = folder / file_name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
