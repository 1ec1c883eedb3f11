"""Normalisation of dataset rows: each input format, tools, stable ids, and every bad-row kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.publish.app import Rejection, iter_prompts
from services.publish.core import (
    EMPTY_CONTENT,
    INVALID_JSON,
    INVALID_TOOLS,
    NO_USER_TURN,
    OVERSIZE,
    UNKNOWN_FORMAT,
    UNKNOWN_ROLE,
    NormaliseOptions,
    RowError,
    detect_format,
    normalise,
    tools_from_system_text,
)

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
OPTS = NormaliseOptions(dataset="demo")


def rows(name: str) -> list[dict]:
    path = DATA / name
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def test_glaive_tool_prompt_keeps_system_text_and_parses_functions() -> None:
    record = rows("glaive_tools.jsonl")[0]
    prompt = normalise(record, OPTS, source="glaive_tools.jsonl:1")
    assert prompt.sample_id == "glaive-00017"
    assert [m.role for m in prompt.messages] == ["system", "user"]  # trailing assistant dropped
    assert prompt.messages[0].content == record["messages"][0]["content"]  # verbatim
    assert prompt.tools is not None
    names = [t["function"]["name"] for t in prompt.tools]
    assert names == ["convert_currency", "get_exchange_history"]
    assert all(t["type"] == "function" for t in prompt.tools)
    assert prompt.tools[0]["function"]["parameters"]["required"] == ["amount", "from_currency", "to_currency"]
    assert prompt.source == "glaive_tools.jsonl:1"


def test_tools_field_as_json_text_is_parsed_and_wins_over_system_text() -> None:
    record = rows("glaive_tools.jsonl")[1]
    prompt = normalise(record, OPTS)
    assert prompt.tools is not None and prompt.tools[0]["function"]["name"] == "search_flights"
    assert [m.role for m in prompt.messages] == ["system", "user"]


def test_custom_tools_field() -> None:
    record = {
        "messages": [{"role": "user", "content": "weather in Oslo?"}],
        "functions": [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}],
    }
    assert normalise(record, OPTS).tools is None
    prompt = normalise(record, NormaliseOptions(dataset="demo", tools_field="functions"))
    assert prompt.tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
        }
    ]


def test_invalid_tools_field_is_a_row_error() -> None:
    record = {"messages": [{"role": "user", "content": "hi"}], "tools": "[{not json"}
    with pytest.raises(RowError) as info:
        normalise(record, OPTS)
    assert info.value.reason == INVALID_TOOLS


def test_system_text_without_function_specs_gives_no_tools() -> None:
    assert tools_from_system_text('You are helpful. Output JSON like {"answer": 1}.') is None
    assert tools_from_system_text("[1, 2] {broken") is None


def test_sharegpt_chat_maps_roles_and_drops_last_answer() -> None:
    first, second = rows("sharegpt_chat.json")
    prompt = normalise(first, OPTS)
    assert detect_format(first) == "sharegpt"
    assert [m.role for m in prompt.messages] == ["user", "assistant", "user"]
    assert prompt.messages[-1].content.startswith("So is a thread")
    assert prompt.sample_id == "sg_4kx1"
    prompt2 = normalise(second, OPTS)
    assert [m.role for m in prompt2.messages] == ["system", "user"]
    assert prompt2.tools is None


def test_openai_math_prompt_and_content_hash_ids() -> None:
    plain, with_uuid = rows("openai_math.jsonl")
    a = normalise(plain, OPTS)
    b = normalise(json.loads(json.dumps(plain)), OPTS)
    assert a.sample_id == b.sample_id and len(a.sample_id) == 32  # content hash, stable
    changed = {"messages": [{"role": "user", "content": plain["messages"][0]["content"] + " "}]}
    assert normalise(changed, OPTS).sample_id != a.sample_id
    c = normalise(with_uuid, OPTS)
    assert c.sample_id == "7f1c2a9e-33b0-4c1e-9d55-0b7e3c1f8a21"
    assert [m.role for m in c.messages] == ["system", "user"]


def test_alpaca_instruction_with_and_without_input() -> None:
    with_input, without = rows("alpaca.jsonl")
    prompt = normalise(with_input, OPTS)
    assert [m.role for m in prompt.messages] == ["user"]
    assert prompt.messages[0].content == (
        "Rewrite the following sentence in the passive voice.\n\n"
        "The committee approved the new budget on Friday."
    )
    assert "budget was approved" not in json.dumps([m.content for m in prompt.messages])
    assert normalise(without, OPTS).messages[0].content == without["instruction"]


def test_default_system_prompt_only_when_row_has_none() -> None:
    opts = NormaliseOptions(dataset="demo", system="Think step by step.")
    prompt = normalise({"messages": [{"role": "user", "content": "2+2?"}]}, opts)
    assert prompt.messages[0].role == "system" and prompt.messages[0].content == "Think step by step."
    own = normalise(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]}, opts
    )
    assert [m.content for m in own.messages] == ["Be brief.", "2+2?"]


def test_openai_content_parts_and_tool_turns_are_kept() -> None:
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Book "}, {"type": "text", "text": "it"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "book", "arguments": {"seat": "12A"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
            {"role": "assistant", "content": "Booked."},
        ]
    }
    prompt = normalise(record, OPTS)
    assert [m.role for m in prompt.messages] == ["user", "assistant", "tool"]
    assert prompt.messages[0].content == "Book it"
    call = prompt.messages[1].tool_calls
    assert call is not None and call[0].function.arguments == '{"seat": "12A"}'
    assert prompt.messages[2].tool_call_id == "c1"


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (
            {"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]},
            NO_USER_TURN,
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, UNKNOWN_ROLE),
        (
            {"conversations": [{"from": "narrator", "value": "x"}, {"from": "human", "value": "y"}]},
            UNKNOWN_ROLE,
        ),
        ({"messages": [{"role": "user", "content": "\n  "}]}, EMPTY_CONTENT),
        ({"instruction": "", "input": ""}, EMPTY_CONTENT),
        ({"messages": [{"role": "user", "content": "x" * 101}]}, OVERSIZE),
        ({"text": "plain text row"}, UNKNOWN_FORMAT),
    ],
)
def test_bad_rows_have_reason_codes(record: dict, reason: str) -> None:
    with pytest.raises(RowError) as info:
        normalise(record, NormaliseOptions(dataset="demo", max_prompt_chars=100))
    assert info.value.reason == reason


def test_forced_format_that_does_not_fit_is_unknown_format() -> None:
    with pytest.raises(RowError) as info:
        normalise(
            {"messages": [{"role": "user", "content": "hi"}]}, NormaliseOptions(dataset="d", fmt="alpaca")
        )
    assert info.value.reason == UNKNOWN_FORMAT


def test_bad_rows_file_reports_file_and_line() -> None:
    path = DATA / "bad_rows.jsonl"
    items = list(iter_prompts([path], NormaliseOptions(dataset="demo", max_prompt_chars=4000)))
    rejections = {(r.line, r.reason) for r in items if isinstance(r, Rejection)}
    assert rejections == {
        (2, INVALID_JSON),
        (3, NO_USER_TURN),
        (4, UNKNOWN_ROLE),
        (5, EMPTY_CONTENT),
        (6, OVERSIZE),
        (8, UNKNOWN_FORMAT),
    }
    assert all(r.path == str(path) for r in items if isinstance(r, Rejection))
    good = [p for p in items if p is not None and not isinstance(p, Rejection)]
    assert len(good) == 1 and good[0].source == "bad_rows.jsonl:1"
    assert items.count(None) == 1  # line 9 repeats line 1


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=200).filter(
    lambda s: s.strip() != ""
)


@settings(max_examples=60, deadline=None)
@given(user=_text, answer=_text, system=st.one_of(st.none(), _text))
def test_sample_id_depends_on_the_prompt_not_the_input_format(
    user: str, answer: str, system: str | None
) -> None:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]
    sharegpt = ([{"from": "system", "value": system}] if system else []) + [
        {"from": "human", "value": user},
        {"from": "gpt", "value": answer},
    ]
    a = normalise({"messages": messages}, OPTS)
    b = normalise({"conversations": sharegpt}, OPTS)
    assert a.sample_id == b.sample_id
    assert a.messages == b.messages
    assert a.messages[-1].content == user
