"""Encoding events to their JSON wire form and decoding records back, refusing what is not the contract."""

from __future__ import annotations

import re
from typing import Any, Final, TypeVar

import msgspec
import msgspec.inspect
from msgspec import Struct

from schemas.events import (
    BudgetSnapshot,
    ConversationProgressed,
    Halt,
    LeaseEvent,
    LeaseGranted,
    LeasePolicy,
    LeaseReleased,
    LeaseRequested,
    PromptPublished,
    ProviderFactRecorded,
    RequestStarted,
    ResponseIndexed,
    ResponseReceived,
    Resume,
    SampleAudited,
    SampleReconstructed,
    StoreCheckpointed,
)
from schemas.fields import SCHEMA_VERSION, SchemaError
from schemas.messages import Message

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_EVENTS: Final[tuple[Any, ...]] = (
    PromptPublished,
    RequestStarted,
    ResponseReceived,
    SampleReconstructed,
    SampleAudited,
    BudgetSnapshot,
    ProviderFactRecorded,
    Halt | Resume,
    ConversationProgressed,
    LeasePolicy | LeaseRequested | LeaseGranted | LeaseReleased,
    ResponseIndexed | StoreCheckpointed,
)
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {t: msgspec.json.Decoder(t) for t in _EVENTS}
_type_infos: dict[Any, msgspec.inspect.Type] = {t: msgspec.inspect.type_info(t) for t in _EVENTS}
_any_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()


def encode(event: Struct) -> bytes:
    """Serialise any event to its JSON wire form."""
    return _encoder.encode(event)


_forwarding_types: dict[tuple[type[Struct], str], type[Struct]] = {}


def _forwarding_type(event_type: type[Struct], nested: str) -> type[Struct]:
    """``event_type`` with the field ``nested`` typed ``msgspec.Raw``: same fields, order, defaults, options."""
    key = (event_type, nested)
    if key not in _forwarding_types:
        config = event_type.__struct_config__
        fields: list[tuple[str, Any, Any]] = []
        for f in msgspec.structs.fields(event_type):
            if f.name == nested:
                fields.append((f.name, msgspec.Raw, msgspec.NODEFAULT))
            elif f.default_factory is not msgspec.NODEFAULT:
                fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory, name=f.encode_name)))
            else:
                fields.append((f.name, f.type, msgspec.field(default=f.default, name=f.encode_name)))
        if nested not in {name for name, _, _ in fields}:
            raise TypeError(f"{event_type.__name__} has no field {nested!r}")
        _forwarding_types[key] = msgspec.defstruct(
            f"{event_type.__name__}Forwarding",
            [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields],
            kw_only=True,
            omit_defaults=config.omit_defaults,
            tag=config.tag,
            tag_field=config.tag_field,
        )
    return _forwarding_types[key]


def encode_forwarding(event: Struct, nested: str, raw: bytes) -> bytes:
    """Serialise ``event`` with its field ``nested`` written as ``raw``, the JSON it was decoded from.

    A stage that embeds the event it consumed (reconstruct puts the response into the
    sample, audit the sample into its verdict) forwards the consumed record's value byte
    for byte instead of encoding the decoded copy again: the same JSON when the record came
    from :func:`encode`, at a fraction of the cost for a large nested event. ``raw`` must
    be the value ``event.<nested>`` was decoded from.
    """
    values = msgspec.structs.asdict(event)
    values[nested] = msgspec.Raw(raw)
    return _encoder.encode(_forwarding_type(type(event), nested)(**values))


# The wire contract is the published JSON Schema (schemas/export.py renders it from these
# Structs); a test runs edge-case records through both and requires the same verdict.
# JSON Schema allows two things msgspec's strict decoding refuses, so records the strict
# pass refuses get a second pass that accepts exactly those:
# - a whole number written with a fraction or an exponent (``300.0``, ``1e2``, ``-0.0``) in an
#   integer field: draft 2020-12 counts any number with a zero fractional part as an integer,
#   and no schema keyword can tell ``1.0`` from ``1`` once a validator has parsed it;
# - ``"content": null`` on an assistant turn with tool calls, OpenAI's shape, read as ``""``.
# Values inside a field these Structs do not know are never read, only checked for JSON
# syntax and UTF-8 (docs/contracts.md lists what that leaves unchecked).


def _null_content_allowed(message: dict[str, Any]) -> bool:
    calls = message.get("tool_calls")
    return (
        "content" in message
        and message["content"] is None
        and message.get("role") == "assistant"
        and isinstance(calls, list)
        and len(calls) > 0
    )


def _union_member(value: Any, union: msgspec.inspect.UnionType) -> msgspec.inspect.Type | None:
    """The member of a union that a generic JSON value would decode as, if it matters."""
    if isinstance(value, float):
        if any(isinstance(m, msgspec.inspect.FloatType) for m in union.types):
            return None
        return next((m for m in union.types if isinstance(m, msgspec.inspect.IntType)), None)
    if isinstance(value, list):
        return next((m for m in union.types if isinstance(m, msgspec.inspect.ListType)), None)
    if isinstance(value, dict):
        for member in union.types:
            if isinstance(member, msgspec.inspect.DictType):
                return member
            if isinstance(member, msgspec.inspect.StructType) and (
                member.tag_field is None or value.get(member.tag_field) == member.tag
            ):
                return member
    return None


def _wire_form(value: Any, info: msgspec.inspect.Type) -> Any:
    """A generic JSON value with whole numbers made ints and null contents made ``""``, where the
    type says so; everything else (``Any`` fields such as ``metadata`` included) untouched.
    """
    if isinstance(info, msgspec.inspect.UnionType):
        member = _union_member(value, info)
        if member is None:
            return value
        info = member
    if isinstance(value, float):
        return int(value) if isinstance(info, msgspec.inspect.IntType) and value.is_integer() else value
    if isinstance(value, list) and isinstance(info, msgspec.inspect.ListType):
        return [_wire_form(item, info.item_type) for item in value]
    if isinstance(value, dict) and isinstance(info, msgspec.inspect.DictType):
        return {k: _wire_form(v, info.value_type) for k, v in value.items()}
    if isinstance(value, dict) and isinstance(info, msgspec.inspect.StructType):
        fields = {f.encode_name: f.type for f in info.fields}
        out = {k: _wire_form(v, fields[k]) if k in fields else v for k, v in value.items()}
        if info.cls is Message and _null_content_allowed(out):
            out["content"] = ""
        return out
    return value


_NEWER_VERSION = re.compile(r"^Expected `int` <= \d+ - at `(\$[^`]*\.schema_version)`$")
_PATH_STEP = re.compile(r"\.([^.\[`]+)|\[(\d+)\]")


def _value_at(data: bytes, path: str) -> Any:
    """The value at a msgspec error path (``$.prompt.schema_version``), or None."""
    try:
        value: Any = _any_decoder.decode(data)
        for name, index in _PATH_STEP.findall(path[1:]):
            value = value[int(index)] if index else value[name]
    except (msgspec.DecodeError, LookupError, TypeError, ValueError):
        return None
    return value


def _classify(exc: msgspec.DecodeError, data: bytes) -> SchemaError:
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        newer = _NEWER_VERSION.match(text)
        if newer:
            return SchemaError(
                "unsupported_schema_version",
                f"schema_version {_value_at(data, newer.group(1))} at `{newer.group(1)}` is newer "
                f"than this build understands ({SCHEMA_VERSION})",
            )
        reason = "missing_field" if "missing required field" in text.lower() else "invalid_field"
        return SchemaError(reason, text)
    return SchemaError("invalid_json", text)


def _decode_wire(data: bytes, type_: Any) -> Any:
    """Decode against the wire contract; raises :class:`SchemaError`."""
    if not data.isascii():
        # msgspec skips unknown fields without checking their UTF-8; the contract checks all.
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SchemaError("invalid_utf8", f"not UTF-8: {exc}") from None
    try:
        return _decoders[type_].decode(data)
    except msgspec.ValidationError:
        pass  # maybe what JSON Schema allows and strict msgspec does not: the second pass
    except msgspec.DecodeError as exc:
        raise _classify(exc, data) from None
    try:
        relaxed = _wire_form(_any_decoder.decode(data), _type_infos[type_])
        return msgspec.convert(relaxed, type_)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise _classify(exc, data) from None


def decode(data: bytes | None, type_: type[T]) -> T:
    """Decode a wire record as ``type_``; raises :class:`SchemaError` naming what is wrong."""
    if data is None:
        raise SchemaError("empty_record", "record has no value (tombstone)")
    if not data.strip():
        raise SchemaError("empty_record", "record value is empty")
    obj: T = _decode_wire(data, type_)
    return obj


def decode_control(data: bytes | None) -> Halt | Resume:
    """Decode a control record; raises :class:`SchemaError` for anything not a known action."""
    if data is None or not data.strip():
        raise SchemaError("empty_record", "control record has no value")
    try:
        obj: Halt | Resume = _decode_wire(data, Halt | Resume)
    except SchemaError as exc:
        if exc.reason == "invalid_field" and "Invalid value" in exc.message and "action" in exc.message:
            raise SchemaError("unknown_action", exc.message) from None
        raise
    return obj


def decode_lease(data: bytes | None) -> LeasePolicy | LeaseRequested | LeaseGranted | LeaseReleased:
    """Decode a ``leases`` record; raises :class:`SchemaError` naming what is wrong."""
    if data is None or not data.strip():
        raise SchemaError("empty_record", "lease record has no value")
    obj: LeasePolicy | LeaseRequested | LeaseGranted | LeaseReleased = _decode_wire(data, LeaseEvent)
    return obj


def decode_store_index(data: bytes | None) -> ResponseIndexed | StoreCheckpointed:
    """Decode a ``response-index`` record; raises :class:`SchemaError` for anything else."""
    if data is None or not data.strip():
        raise SchemaError("empty_record", "response-index record has no value")
    obj: ResponseIndexed | StoreCheckpointed = _decode_wire(data, ResponseIndexed | StoreCheckpointed)
    return obj
