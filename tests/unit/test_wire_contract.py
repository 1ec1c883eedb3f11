"""The published JSON Schemas and the decoder accept exactly the same records.

Every event's valid document is mutated at every node (numbers in every lexical form, nulls,
strings for numbers, big integers, unicode, missing and unknown fields) and each mutant goes
through BOTH the generated schema (a standard JSON parse, then ``jsonschema``'s draft 2020-12
validator) and the real decoder (:func:`schemas.decode`). Their verdicts must be equal, except
for the two leniencies docs/contracts.md documents, which are asserted as exactly that.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

import schemas as s
from schemas.export import EVENTS
from tests.unit.test_schemas import all_events

GENERATED = Path(__file__).resolve().parents[2] / "schemas" / "generated"
SLOT = "\u00a7slot\u00a7"
_FILE_OF = {t: name for name, t in EVENTS.items()}

# Raw JSON literals put in place of a value (bytes: some are not valid UTF-8 or not JSON).
NUMBERS = [
    b"0", b"-0", b"1", b"-1", b"7", b"1.0", b"-0.0", b"300.0", b"1e2", b"1E+2", b"2.5", b"1.000000000000000001",
    b"1e-400", b"1e400", b"-1e400", b"9007199254740993", b"9007199254740993.0", b"18446744073709551616",
    b"1" + b"0" * 308, b"1" + b"0" * 309, b"1.7976931348623157e308", b"9" * 4300, b"9" * 4301,
    b"NaN", b"Infinity", b"-Infinity", b"+1", b"01", b".5", b"1.",
]
STRINGS = [
    b'""', b'"1"', b'"1.0"', b'"x"', b'"halt"', b'"assistant"', "\"\u00e9t\u00e9 \u20ac \U0001f600\"".encode(),
    b'"\\u00e9\\ud83d\\ude00"', b'"\\ud800"', b'"\\udc00x"', b'"\xff"', b'"\xed\xa0\x80"', b'"\\u0000"',
    b'"' + b"x" * 200 + b'"', b'"' + b"x" * 201 + b'"', ('"' + "\u00e9" * 200 + '"').encode(),
]
OTHERS = [b"null", b"true", b"false", b"[]", b"{}", b"[1]", b'{"a": 1}', b"[null]"]
VALUES = NUMBERS + STRINGS + OTHERS
MISSING = b"<missing>"


@dataclass(frozen=True)
class Case:
    """One document for one event type; ``unread`` when the mutated value is in an unknown field."""

    name: str
    type_: Any
    data: bytes
    raw: bytes = b""
    unread: bool = False


@cache
def validator(type_: Any) -> Draft202012Validator:
    """The validator of the generated (committed) schema file of an event type."""
    schema = json.loads((GENERATED / f"{_FILE_OF[type_]}.schema.json").read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is outside the double range")
    return value


def _no_constants(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [k for k, _ in pairs]
    if len(names) != len(set(names)):
        raise ValueError("duplicate member name")
    return dict(pairs)


def schema_accepts(case: Case) -> bool:
    """The verdict of a standard validator: UTF-8 JSON text (I-JSON, RFC 7493), then the schema."""
    try:
        text = case.data.decode("utf-8")
        doc = json.loads(
            text, parse_float=_finite, parse_constant=_no_constants, object_pairs_hook=_unique_names
        )
    except ValueError:  # not UTF-8, not JSON, a non-finite number, a 4301-digit integer, a duplicate
        return False
    if _has_lone_surrogate(doc):
        return False
    return bool(validator(case.type_).is_valid(doc))


def decoder_accepts(case: Case) -> bool:
    """The verdict of the real decoder; anything but a SchemaError is a crash and fails the test."""
    try:
        if case.type_ == s.Halt | s.Resume:
            s.decode_control(case.data)
        elif case.type_ == s.LeaseEvent:
            s.decode_lease(case.data)
        else:
            s.decode(case.data, case.type_)
    except s.SchemaError:
        return False
    return True


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every node of a document (only the first item of a list)."""
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*path, key))
    elif isinstance(node, list) and node:
        yield from _paths(node[0], (*path, 0))


def _with(doc: dict[str, Any], path: tuple[Any, ...], raw: bytes) -> bytes:
    """The document with the node at ``path`` replaced by a raw literal (or removed)."""
    out = copy.deepcopy(doc)
    parent: Any = out
    for step in path[:-1]:
        parent = parent[step]
    if raw == MISSING:
        if isinstance(parent, list):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
        return json.dumps(out, ensure_ascii=False).encode()
    parent[path[-1]] = SLOT
    text = json.dumps(out, ensure_ascii=False).encode()
    return text.replace(json.dumps(SLOT, ensure_ascii=False).encode(), raw)


def _event_type(event: msgspec.Struct) -> Any:
    if isinstance(event, s.Halt | s.Resume):
        return s.Halt | s.Resume
    if isinstance(event, s.LeaseEvent):
        return s.LeaseEvent
    if isinstance(event, s.ResponseIndexed | s.StoreCheckpointed):
        return s.ResponseIndexed | s.StoreCheckpointed
    return type(event)


def base_documents() -> list[tuple[str, Any, dict[str, Any]]]:
    """A valid document of every event type (both control actions), as parsed JSON."""
    out = [(type(e).__name__, _event_type(e), json.loads(s.encode(e))) for e in all_events()]
    tool_turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
    }
    prompt = json.loads(s.encode(all_events()[0]))
    prompt["messages"] += [tool_turn, {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    prompt["metadata"] = {"n": 1, "x": 1.5}
    out.append(("PromptWithToolTurn", s.PromptPublished, prompt))
    return out


def _member(info: mi.Type, value: Any) -> mi.Type:
    """The member of a union type that a (valid) value belongs to."""
    if not isinstance(info, mi.UnionType):
        return info
    for member in info.types:
        if isinstance(value, list) and isinstance(member, mi.ListType):
            return member
        if isinstance(value, dict) and isinstance(member, mi.DictType | mi.AnyType):
            return member
        if isinstance(value, dict) and isinstance(member, mi.StructType):
            if member.tag_field is None or value.get(member.tag_field) == member.tag:
                return member
    return info


def _step(info: mi.Type, value: Any, step: Any) -> mi.Type:
    """The type of ``value[step]`` when ``value`` has type ``info`` (a tag field: Any)."""
    info = _member(info, value)
    if isinstance(info, mi.StructType):
        return next((f.type for f in info.fields if f.encode_name == step), mi.AnyType())
    if isinstance(info, mi.ListType):
        return info.item_type
    if isinstance(info, mi.DictType):
        return info.value_type
    return mi.AnyType()


def _located(type_: Any, doc: Any) -> Iterator[tuple[tuple[Any, ...], Any, mi.Type, tuple[str, ...]]]:
    """(path, node, node type, where) for every node; ``where`` names the node from its
    nearest enclosing Struct, so the same field inside nested events is visited once.
    """
    todo: list[tuple[tuple[Any, ...], Any, mi.Type, tuple[str, ...]]] = [
        ((), doc, mi.type_info(type_), ("<root>", _FILE_OF[type_]))
    ]
    while todo:
        path, node, info, where = todo.pop()
        yield path, node, info, where
        if isinstance(node, dict):
            children = list(node.items())
        elif isinstance(node, list) and node:
            children = [(0, node[0])]
        else:
            children = []
        for step, child in children:
            inner = _member(info, node)
            label = (inner.cls.__name__, str(step)) if isinstance(inner, mi.StructType) else (*where, str(step))
            todo.append(((*path, step), child, _step(info, node, step), label))


def _struct(info: mi.Type, node: Any) -> bool:
    return isinstance(_member(info, node), mi.StructType)


def mutants() -> Iterator[Case]:
    """Every node of every base document replaced by every value, removed, and given a sibling.

    A field of a Struct nested in several events is mutated once, in the first event met.
    """
    seen: set[tuple[Any, ...]] = set()
    for name, type_, doc in base_documents():
        yield Case(f"{name} as is", type_, json.dumps(doc).encode())
        for path, node, info, where in _located(type_, doc):
            at = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
            if path:
                for raw in [*VALUES, MISSING]:
                    if (where, raw) not in seen:
                        seen.add((where, raw))
                        yield Case(f"{name} {at} = {raw[:24]!r}", type_, _with(doc, path, raw), raw)
            if isinstance(node, dict):
                for raw in VALUES:
                    if (where, "+", raw) not in seen:
                        seen.add((where, "+", raw))
                        yield Case(f"{name} {at}.added_later = {raw[:24]!r}", type_,
                                   _with(doc, (*path, "added_later"), raw), raw, unread=_struct(info, node))


# What the decoder accepts and a standard validator does not (docs/contracts.md): a value in a
# field these Structs do not know is skipped by msgspec after a syntax check, so the range
# limits of numbers do not apply to it.
UNREAD_NUMBERS = {b"1e400", b"-1e400", b"9" * 4301}


def documented_leniency(case: Case) -> bool:
    """True for a mutant that puts an out-of-range number in an unknown field."""
    return case.unread and case.raw in UNREAD_NUMBERS


@cache
def verdicts() -> list[tuple[Case, bool, bool]]:
    """Every mutant with the schema's and the decoder's verdict."""
    return [(case, schema_accepts(case), decoder_accepts(case)) for case in mutants()]


def test_the_corpus_reaches_every_event_and_both_verdicts() -> None:
    found = {(case.type_, by_schema) for case, by_schema, _ in verdicts()}
    for type_ in EVENTS.values():
        assert (type_, True) in found and (type_, False) in found, type_
    assert len(verdicts()) > 5000


def test_schema_and_decoder_agree_on_every_case() -> None:
    disagreements = []
    leniencies = 0
    for case, by_schema, by_decoder in verdicts():
        if documented_leniency(case):
            leniencies += 1
            if not (by_decoder and not by_schema):
                disagreements.append(f"{case.name}: documented leniency no longer holds")
        elif by_schema != by_decoder:
            disagreements.append(f"{case.name}: schema {by_schema}, decoder {by_decoder}")
    assert leniencies > 0
    assert not disagreements, f"{len(disagreements)} disagreements:\n" + "\n".join(disagreements[:40])


PROMPT = b'{"dataset":"d","sample_id":"x","messages":[{"role":"user","content":"hi"}]%s}'


@pytest.mark.parametrize(
    ("extra", "accepted", "max_tokens"),
    [
        (b',"max_tokens":300', True, 300),
        (b',"max_tokens":300.0', True, 300),
        (b',"max_tokens":1e2', True, 100),
        (b',"max_tokens":-0', True, 0),
        (b',"max_tokens":-0.0', True, 0),
        (b',"max_tokens":300.5', False, None),
        (b',"max_tokens":"300"', False, None),
        (b',"schema_version":1.0', True, None),
        (b',"schema_version":2', False, None),
        (b',"schema_version":2.0', False, None),
    ],
)
def test_the_integer_contract(extra: bytes, accepted: bool, max_tokens: int | None) -> None:
    case = Case("prompt", s.PromptPublished, PROMPT % extra)
    assert schema_accepts(case) is accepted
    assert decoder_accepts(case) is accepted
    if accepted:
        prompt = s.decode(case.data, s.PromptPublished)
        assert prompt.max_tokens == max_tokens and type(prompt.schema_version) is int
        if max_tokens is not None:
            assert type(prompt.max_tokens) is int


def test_whole_numbers_in_free_form_fields_stay_as_written() -> None:
    data = PROMPT % b',"metadata":{"n":2.0},"tools":[{"type":"function","function":{"name":"f","x":1.0}}]'
    prompt = s.decode(data + b" ", s.PromptPublished)
    assert prompt.metadata == {"n": 2.0} and type(prompt.metadata["n"]) is float
    assert prompt.tools is not None and type(prompt.tools[0]["function"]["x"]) is float
    relaxed = s.decode(data.replace(b'"hi"}]', b'"hi"}],"max_tokens":5.0'), s.PromptPublished)
    assert type(relaxed.metadata["n"]) is float and relaxed.max_tokens == 5


TOOL_CALL = b'[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]'


@pytest.mark.parametrize(
    ("turn", "accepted"),
    [
        (b'{"role":"assistant","content":null,"tool_calls":%s}' % TOOL_CALL, True),
        (b'{"role":"assistant","tool_calls":%s,"content":null}' % TOOL_CALL, True),
        (b'{"role":"assistant","content":null,"tool_calls":[]}', False),
        (b'{"role":"assistant","content":null,"tool_calls":null}', False),
        (b'{"role":"assistant","content":null}', False),
        (b'{"role":"user","content":null,"tool_calls":%s}' % TOOL_CALL, False),
        (b'{"role":"tool","content":null,"tool_call_id":"c1"}', False),
    ],
)
def test_null_content_only_on_an_assistant_tool_call_turn(turn: bytes, accepted: bool) -> None:
    data = b'{"dataset":"d","sample_id":"x","messages":[{"role":"user","content":"hi"},%s]}' % turn
    case = Case("prompt", s.PromptPublished, data)
    assert schema_accepts(case) is accepted
    assert decoder_accepts(case) is accepted
    if accepted:
        message = s.decode(data, s.PromptPublished).messages[1]
        assert message.content == "" and message.tool_calls
        assert s.wire_messages([message])[0]["content"] == ""


def test_duplicate_member_names_are_not_i_json_and_the_decoder_keeps_the_last() -> None:
    for doubled, last in ((b',"max_tokens":5,"max_tokens":6', 6), (b',"max_tokens":"x","max_tokens":6', 6)):
        data = PROMPT % doubled
        assert not schema_accepts(Case("dup", s.PromptPublished, data))
        assert s.decode(data, s.PromptPublished).max_tokens == last
    with pytest.raises(s.SchemaError, match="max_tokens"):
        s.decode(PROMPT % b',"max_tokens":6,"max_tokens":"x"', s.PromptPublished)


def test_an_out_of_range_number_in_an_unknown_field_is_skipped_unless_the_second_pass_runs() -> None:
    lenient = Case("unread", s.PromptPublished, PROMPT % b',"added_later":1e400', b"1e400", unread=True)
    assert documented_leniency(lenient) and decoder_accepts(lenient) and not schema_accepts(lenient)
    both = Case("both", s.PromptPublished, PROMPT % b',"added_later":1e400,"max_tokens":300.0')
    assert not decoder_accepts(both) and not schema_accepts(both)


def test_a_newer_nested_event_is_refused_by_both() -> None:
    event = all_events()[2]
    doc = json.loads(s.encode(event))
    doc["prompt"]["schema_version"] = 2
    case = Case("nested", s.ResponseReceived, json.dumps(doc).encode())
    assert not schema_accepts(case)
    with pytest.raises(s.SchemaError) as info:
        s.decode(case.data, s.ResponseReceived)
    assert info.value.reason == "unsupported_schema_version"
    assert "$.prompt.schema_version" in info.value.message and "2" in info.value.message


_LITERAL = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(min_value=-(10**6), max_value=10**6).map(lambda n: f"{n}.0"),
    st.tuples(st.integers(-999, 999), st.integers(-30, 30)).map(lambda t: f"{t[0]}e{t[1]}"),
)


@given(literal=_LITERAL, field=st.sampled_from(["max_tokens", "published_at", "schema_version", "source"]))
def test_any_number_literal_gets_the_same_verdict(literal: str, field: str) -> None:
    case = Case("prompt", s.PromptPublished, PROMPT % f',"{field}":{literal}'.encode())
    assert schema_accepts(case) == decoder_accepts(case)
