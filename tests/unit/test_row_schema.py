"""One row schema for every training row: the same keys and the same column types whatever the sample held.

``datasets.load_dataset("json", ...)`` takes the column types of the first rows it reads
and casts every later file to them, so a row whose JSON infers differently (a null, an
empty list, a dict keyed by data) breaks loading a whole folder. These tests infer the
Arrow schema of single-row JSONL files with pyarrow's own JSON reader (what ``datasets``
uses) and require it to be identical across every combination of optional content.
"""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.json as paj
import pyarrow.parquet as pq
import pytest

from schemas import CheckResult, Message, SampleAudited, ToolCall, ToolFunction, Usage, decode
from services.sink.core import row_arrow_schema, row_line, training_row
from services.sink.shards import ShardWriter

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "payloads" / "v1_audited.json"
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}}}}},
    {"type": "function", "function": {"name": "geo", "parameters": {"properties": {"lat": {"type": "number"}}}}},
]
CALL = ToolCall(id="c9", function=ToolFunction(name="geo", arguments='{"lat": 1.5}'))
# Each flag switches one optional part of a sample on or off.
FLAGS = ("tools_sent", "tool_calls", "reasoning", "tool_turn", "usage", "notes")


def variant(i: int, **on: bool) -> SampleAudited:
    """The v1 fixture with the optional parts chosen by ``on``."""
    base = decode(FIXTURE.read_bytes(), SampleAudited)
    response = base.sample.response
    messages = list(response.prompt.messages)
    if on["tool_turn"]:
        messages += [
            Message(role="assistant", content="", tool_calls=[CALL]),
            Message(role="tool", content="42", tool_call_id="c9", name="geo"),
        ]
    prompt = msgspec.structs.replace(response.prompt, messages=messages, tools=TOOLS if on["tools_sent"] else None)
    response = msgspec.structs.replace(
        response,
        prompt=prompt,
        tools_sent=on["tools_sent"],
        tool_calls=[CALL] if on["tool_calls"] else [],
        reasoning="think" if on["reasoning"] else "",
        usage=Usage(prompt_tokens=10, completion_tokens=3, reasoning_tokens=1, cost=0.5) if on["usage"] else Usage(),
        upstream_provider="Up" if on["usage"] else None,
        finish_reason="stop" if on["usage"] else None,
    )
    results = [CheckResult(code="roundtrip", passed=True, message="exact" if on["notes"] else "", value=1.0)]
    sample = msgspec.structs.replace(base.sample, response=response, sample_id=f"v{i}")
    return msgspec.structs.replace(base, sample=sample, sample_id=f"v{i}", results=results)


def all_variants() -> list[SampleAudited]:
    """Every on/off combination of the optional parts."""
    combos = itertools.product((False, True), repeat=len(FLAGS))
    return [variant(i, **dict(zip(FLAGS, combo, strict=True))) for i, combo in enumerate(combos)]


def keys_and_types(value: Any, path: str = "$") -> set[tuple[str, str]]:
    """Every (path, Python type name) in a decoded JSON value; list items share one path."""
    out = {(path, type(value).__name__)}
    if isinstance(value, dict):
        for k, v in value.items():
            out |= keys_and_types(v, f"{path}.{k}")
    elif isinstance(value, list):
        for v in value:
            out |= keys_and_types(v, f"{path}[]")
    return out


def nullable(t: pa.DataType) -> pa.DataType:
    """``t`` with every nested field nullable (JSON inference never says "not null")."""
    if pa.types.is_list(t):
        return pa.list_(nullable(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, nullable(f.type)) for f in t])
    return t


def test_every_variant_has_the_same_keys_and_value_types() -> None:
    shapes = {frozenset(keys_and_types(json.loads(row_line(training_row(a))))) for a in all_variants()}
    assert len(shapes) == 1, [sorted(s ^ next(iter(shapes))) for s in shapes]
    (shape,) = shapes
    assert ("$.tools", "str") in shape and ("$.metadata.usage.cost", "float") in shape
    assert not any(t == "NoneType" for _, t in shape), sorted(p for p, t in shape if t == "NoneType")


def test_json_inferred_arrow_schema_is_identical_and_equals_the_declared_one() -> None:
    variants = all_variants()
    assert len(variants) == 2 ** len(FLAGS)
    inferred = {paj.read_json(io.BytesIO(row_line(training_row(a)))).schema for a in variants}
    assert len(inferred) == 1, [str(s) for s in inferred]
    declared = row_arrow_schema()
    (schema,) = inferred
    assert schema.names == declared.names
    for field in declared:
        assert schema.field(field.name).type == nullable(field.type), field.name


def test_parquet_parts_share_one_explicit_schema(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, fmt="parquet")
    writer.scan()
    variants = all_variants()
    for a in variants:  # one batch per row: one part per row, each with different optional content
        row = training_row(a)
        assert writer.write([("math", row.id, row)]) == 1
    parts = sorted((tmp_path / "math").glob("part-*.parquet"))
    assert len(parts) == len(variants)
    schemas = {pq.read_schema(p).remove_metadata() for p in parts}
    assert schemas == {row_arrow_schema()}
    table = pa.concat_tables([pq.read_table(p) for p in parts])  # no promotion needed
    assert table.num_rows == len(variants)


def test_optional_content_is_carried_not_dropped() -> None:
    on = dict.fromkeys(FLAGS, True)
    row = training_row(variant(0, **on))
    assert json.loads(row.tools) == TOOLS
    turns = row.conversations
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(turns[2].tool_calls)[0]["function"] == {"name": "geo", "arguments": '{"lat": 1.5}'}
    assert (turns[3].tool_call_id, turns[3].name) == ("c9", "geo")
    assert json.loads(turns[-1].tool_calls)[0]["id"] == "c9" and turns[-1].reasoning_content == "think"
    assert row.metadata.usage.cost == 0.5 and row.metadata.upstream_provider == "Up"
    assert [(c.code, c.passed, c.message) for c in row.metadata.audit.checks] == [("roundtrip", True, "exact")]
    off = training_row(variant(1, **dict.fromkeys(FLAGS, False)))
    assert off.tools == "[]" and off.conversations[-1].tool_calls == "[]"
    assert off.metadata.usage.prompt_tokens == -1 and off.metadata.usage.cost == -1.0
    assert off.metadata.finish_reason == "" and off.metadata.upstream_provider == ""


@pytest.mark.parametrize("tools", [None, []])
def test_tools_not_sent_or_empty_is_the_empty_json_list(tools: list[dict[str, Any]] | None) -> None:
    base = variant(0, **dict.fromkeys(FLAGS, False))
    prompt = msgspec.structs.replace(base.sample.response.prompt, tools=tools)
    response = msgspec.structs.replace(base.sample.response, prompt=prompt, tools_sent=True)
    row = training_row(msgspec.structs.replace(base, sample=msgspec.structs.replace(base.sample, response=response)))
    assert row.tools == "[]"
