"""Generates the JSON Schema of every event and the AsyncAPI document from the Structs (never by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

import schemas as s
from schemas import asyncapi
from schemas.wire_rules import CONTRACT, DRAFT, apply_wire_rules

EVENTS: dict[str, Any] = {
    "prompt_published": s.PromptPublished,
    "request_started": s.RequestStarted,
    "response_received": s.ResponseReceived,
    "sample_reconstructed": s.SampleReconstructed,
    "sample_audited": s.SampleAudited,
    "control_event": s.Halt | s.Resume,
    "lease_event": s.LeaseEvent,
    "budget_snapshot": s.BudgetSnapshot,
    # Multi-turn regeneration.
    "conversation_progressed": s.ConversationProgressed,
    "store_index_event": s.ResponseIndexed | s.StoreCheckpointed,
    "provider_fact_recorded": s.ProviderFactRecorded,
}


def schema_of(type_: Any) -> dict[str, Any]:
    """The JSON Schema of one event type: msgspec's, plus the wire rules it cannot know."""
    schema: dict[str, Any] = {"$schema": DRAFT, "$comment": CONTRACT, **msgspec.json.schema(type_)}
    apply_wire_rules(schema, schema.get("$defs", {}))
    return schema


def render() -> dict[str, str]:
    """File name to JSON text for every event schema."""
    out = {
        f"{name}.schema.json": json.dumps(schema_of(type_), indent=2, sort_keys=True) + "\n"
        for name, type_ in EVENTS.items()
    }
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
