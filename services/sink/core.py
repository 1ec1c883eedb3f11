"""Training rows from accepted samples, and the pure parts of the shard bookkeeping.

A row has ONE fixed schema in every part of every dataset, JSONL or Parquet, so a whole
output folder loads as one table (``datasets.load_dataset("json", data_files=...)`` takes
its column types from the first rows it reads and casts every later file to them: a
column that is null, an empty list or a dict keyed by data in one file and something
else in another breaks the load). Hence:

- no nulls and no data-dependent keys: an absent string is ``""``, an unreported count
  is ``-1``;
- free-form JSON (the request's ``tools`` and a turn's ``tool_calls``, whose argument
  schemas differ per tool) is carried as JSON text, ``"[]"`` when there is none;
- audit results are a list of ``{code, passed, message}``.

:class:`TrainingRow` declares the schema once; the Parquet (Arrow) schema is derived from
it (:func:`row_arrow_schema`). No file I/O here: the shell writes the bytes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec
import msgspec.inspect as mi

from schemas import Message, SampleAudited, ToolCall, sample_key
from schemas.prefix import extends

if TYPE_CHECKING:
    import pyarrow as pa

PART_RE = re.compile(r"^part-(\d{5,})\.(jsonl|parquet)$")
NOT_REPORTED = -1  # a usage count the provider did not report
NO_JSON_LIST = "[]"  # tools / tool_calls when there are none


class TurnRow(msgspec.Struct, kw_only=True):
    """One conversation turn: every key always present (``""`` / ``"[]"`` when absent)."""

    role: str
    content: str
    reasoning_content: str = ""
    tool_calls: str = NO_JSON_LIST  # JSON text: [{"id", "type", "function": {"name", "arguments"}}]
    tool_call_id: str = ""
    name: str = ""


class UsageRow(msgspec.Struct, kw_only=True):
    """The provider's usage report; ``-1`` where it reported nothing."""

    prompt_tokens: int = NOT_REPORTED
    completion_tokens: int = NOT_REPORTED
    reasoning_tokens: int = NOT_REPORTED
    cost: float = float(NOT_REPORTED)


class CheckRow(msgspec.Struct, kw_only=True):
    """One audit check's verdict."""

    code: str
    passed: bool
    message: str = ""


class AuditRow(msgspec.Struct, kw_only=True):
    """The audit's verdict and every check it ran."""

    passed: bool
    checks: list[CheckRow]


class RowMetadata(msgspec.Struct, kw_only=True):
    """Where a row came from: provider, model, profile, usage, reconstruction, audit."""

    provider: str
    upstream_provider: str
    model: str
    profile: str
    usage: UsageRow
    finish_reason: str
    reconstruction_method: str
    audit: AuditRow
    # The answer was cut at the token limit (finish_reason "length"), accepted by the
    # dataset's accept_truncated: exact ids up to the cut. Default: rows written before it.
    truncated: bool = False
    # Multi-turn regeneration: the conversation and the regenerated turn (from 0) a
    # row is; "" and -1 for a single-turn prompt (defaults: rows of older sinks still decode).
    conversation_id: str = ""
    turn: int = NOT_REPORTED
    # True when prompt_ids begin with the previous turn's row's input_ids (an append-only template):
    # a trainer may pack the two rows into one sequence. False at turn 0 and where the template
    # rewrote the history (reasoning dropped): schemas.prefix.
    extends_previous_turn: bool = False
    # How the row was made (services/profiles/provenance.py): sha256 of the profile's tokenizer
    # file and of the chat template it rendered with, and the draftstream that wrote the row.
    # "" in rows written before they were recorded.
    tokenizer_sha256: str = ""
    chat_template_sha256: str = ""
    draftstream_version: str = ""
    # The configured provider that answered ([providers.NAME]; ``provider`` is its kind). ""
    # in rows written before it was recorded.
    provider_name: str = ""


class RowProvenance(msgspec.Struct, frozen=True, kw_only=True):
    """The provenance fields of every row of one profile (the sink computes them once per profile)."""

    tokenizer_sha256: str = ""
    chat_template_sha256: str = ""
    draftstream_version: str = ""


class TrainingRow(msgspec.Struct, kw_only=True):
    """One training row: the token-exact sequence, its loss mask and what produced it."""

    id: str
    dataset: str
    input_ids: list[int]
    loss_mask: list[int]
    prompt_ids: list[int]
    output_ids: list[int]
    conversations: list[TurnRow]
    tools: str  # JSON text of the tools the request sent, "[]" when it sent none
    metadata: RowMetadata


_json_encoder = msgspec.json.Encoder()
_row_decoder = msgspec.json.Decoder(TrainingRow)
_line_decoder = msgspec.json.Decoder(dict[str, Any])


def _json_text(value: Any) -> str:
    return _json_encoder.encode(value).decode("utf-8") if value else NO_JSON_LIST


def _tool_calls(calls: list[ToolCall] | None) -> str:
    return _json_text([
        {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls or ()
    ])


def _turn(m: Message, *, reasoning: bool = False) -> TurnRow:
    # A single-turn request never carries earlier turns' reasoning (schemas.wire_messages): the
    # model did not see it, so the row does not claim it did (a re-render would add ids input_ids
    # lack). A multi-turn regeneration's request carries the model's own (``reasoning``).
    return TurnRow(
        role=m.role,
        content=m.content,
        reasoning_content=(m.reasoning_content or "") if reasoning and m.role == "assistant" else "",
        tool_calls=_tool_calls(m.tool_calls),
        tool_call_id=m.tool_call_id or "",
        name=m.name or "",
    )


def _reported(value: int | None) -> int:
    return NOT_REPORTED if value is None else value


def training_row(audited: SampleAudited, provenance: RowProvenance | None = None) -> TrainingRow:
    """The training row of one accepted sample, with the provenance of its profile when given."""
    s = audited.sample
    r = s.response
    conv = r.prompt.conversation
    conversations = [_turn(m, reasoning=conv is not None) for m in r.prompt.messages]
    generated = TurnRow(
        role="assistant", content=r.content, reasoning_content=r.reasoning, tool_calls=_tool_calls(r.tool_calls)
    )
    conversations.append(generated)
    u = r.usage
    return TrainingRow(
        id=sample_key(s.dataset, s.sample_id),
        dataset=s.dataset,
        input_ids=[*s.prompt_ids, *s.output_ids],
        loss_mask=list(s.loss_mask),
        prompt_ids=list(s.prompt_ids),
        output_ids=list(s.output_ids),
        conversations=conversations,
        tools=_json_text(r.prompt.tools) if r.tools_sent else NO_JSON_LIST,  # only what the model saw
        metadata=RowMetadata(
            provider=r.provider,
            upstream_provider=r.upstream_provider or "",
            provider_name=r.provider_name or r.provider,
            model=r.model,
            profile=s.profile,
            usage=UsageRow(
                prompt_tokens=_reported(u.prompt_tokens),
                completion_tokens=_reported(u.completion_tokens),
                reasoning_tokens=_reported(u.reasoning_tokens),
                cost=float(NOT_REPORTED) if u.cost is None else float(u.cost),
            ),
            finish_reason=r.finish_reason or "",
            truncated=r.finish_reason == "length",
            reconstruction_method=s.method,
            audit=AuditRow(
                passed=audited.passed,
                checks=[CheckRow(code=c.code, passed=c.passed, message=c.message) for c in audited.results],
            ),
            conversation_id=conv.conversation_id if conv is not None else "",
            turn=conv.turn if conv is not None else NOT_REPORTED,
            extends_previous_turn=conv is not None
            and extends(s.prompt_ids, conv.previous_length, conv.previous_digest),
            **msgspec.structs.asdict(provenance or RowProvenance()),
        ),
    )


def _arrow_type(info: mi.Type) -> pa.DataType:
    import pyarrow as pa

    simple: dict[type[mi.Type], pa.DataType] = {
        mi.StrType: pa.string(), mi.IntType: pa.int64(), mi.FloatType: pa.float64(), mi.BoolType: pa.bool_(),
    }  # fmt: skip
    if type(info) in simple:
        return simple[type(info)]
    if isinstance(info, mi.ListType):
        # "element": the list item name Parquet writes (a read-back schema then equals this one).
        return pa.list_(pa.field("element", _arrow_type(info.item_type), nullable=False))
    if isinstance(info, mi.StructType):
        return pa.struct([pa.field(f.encode_name, _arrow_type(f.type), nullable=False) for f in info.fields])
    raise TypeError(f"no Arrow type for {info!r} in the training row schema")


def row_arrow_schema() -> pa.Schema:
    """The Arrow schema of :class:`TrainingRow` (every Parquet part is written with it)."""
    import pyarrow as pa

    struct = _arrow_type(mi.type_info(TrainingRow))
    return pa.schema([struct.field(i) for i in range(struct.num_fields)])


def row_line(row: TrainingRow) -> bytes:
    """One JSONL line (newline included) for a row."""
    return _json_encoder.encode(row) + b"\n"


def row_builtins(row: TrainingRow) -> dict[str, Any]:
    """A row as plain Python values (what a Parquet table is built from)."""
    out: dict[str, Any] = msgspec.to_builtins(row)
    return out


def decode_row(line: bytes) -> TrainingRow:
    """A stored JSONL line as a row; ``msgspec.ValidationError`` / ``DecodeError`` name what is wrong."""
    return _row_decoder.decode(line)


def parse_line(line: bytes) -> str | None:
    """The ``id`` of a stored JSONL line, or None when the line is corrupt."""
    try:
        obj = _line_decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    key = obj.get("id")
    return key if isinstance(key, str) and key else None


def part_number(filename: str) -> int | None:
    """The NNNNN of ``part-NNNNN.<ext>``, or None for other files."""
    m = PART_RE.match(filename)
    return int(m.group(1)) if m else None


def part_name(number: int, fmt: str) -> str:
    """The file name of part ``number``."""
    return f"part-{number:05d}.{fmt}"


def torn_tail(data: bytes) -> int:
    """How many bytes at the end of a JSONL part follow its last newline (a torn write)."""
    if not data or data.endswith(b"\n"):
        return 0
    return len(data) - (data.rfind(b"\n") + 1)


__all__ = [
    "NOT_REPORTED",
    "NO_JSON_LIST",
    "AuditRow",
    "CheckRow",
    "RowMetadata",
    "RowProvenance",
    "TrainingRow",
    "TurnRow",
    "UsageRow",
    "decode_row",
    "parse_line",
    "part_name",
    "part_number",
    "row_arrow_schema",
    "row_builtins",
    "row_line",
    "torn_tail",
    "training_row",
]
