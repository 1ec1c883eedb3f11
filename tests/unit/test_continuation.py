"""Multi-turn regeneration (issue 26): publish's first turn, the continuation core, and how each
template family carries the regenerated history, with truth from the OFFICIAL chat templates.

The expected history of every turn is written out here by hand (user turns and cached tool
results from the dataset, assistant turns as the model answered), rendered with the official
template from ``../shared/reference`` and encoded with the truth tokenizer of
``tests/conformance/truth.py``; the prompt the core built must carry exactly those messages and
our profile's prompt ids must equal the truth's.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

import schemas as s
from services.continuation import core as C
from services.publish.core import NormaliseOptions, RowError, normalise
from tests.conformance import truth as T
from tests.conformance.test_matrix import profile_for

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def accepted(prompt: s.PromptPublished, *, reasoning: str = "", content: str = "", calls: Any = (),
             mode: str = "chat") -> s.SampleAudited:
    """An accepted sample of ``prompt`` whose answer is the given reasoning, content and tool calls."""
    response = s.ResponseReceived(
        dataset=prompt.dataset, sample_id=prompt.sample_id, prompt=prompt, provider="sim", model="m",
        reasoning=reasoning, content=content, tool_calls=[msgspec.convert(c, s.ToolCall) for c in calls],
        finish_reason="stop", mode=mode,  # type: ignore[arg-type]
    )
    sample = s.SampleReconstructed(dataset=prompt.dataset, sample_id=prompt.sample_id, profile="qwen3",
                                   response=response, prompt_ids=[1], output_ids=[2], loss_mask=[0, 1],
                                   method="reencode")
    return s.SampleAudited(dataset=prompt.dataset, sample_id=prompt.sample_id, sample=sample, passed=True)


def call(name: str, call_id: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tool call in OpenAI's shape."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args or {})}}


SHAREGPT = {
    "id": "conv-7",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Name a prime."},
        {"from": "gpt", "value": "7 (old model)"},
        {"from": "human", "value": "And another?"},
        {"from": "gpt", "value": "11 (old model)"},
        {"from": "human", "value": "Their sum?"},
        {"from": "gpt", "value": "18 (old model)"},
    ],
}


def all_turns(record: dict[str, Any]) -> s.PromptPublished:
    return normalise(record, NormaliseOptions(dataset="chat", turns="all"))


# ---- publish: turn 0 -------------------------------------------------------------------------------------------


def test_turns_all_publishes_turn_zero_with_the_whole_conversation() -> None:
    prompt = all_turns(SHAREGPT)
    assert prompt.sample_id == "conv-7:0"
    assert s.sample_key(prompt.dataset, prompt.sample_id) == "chat:conv-7:0"
    assert [(m.role, m.content) for m in prompt.messages] == [("system", "Be brief."), ("user", "Name a prime.")]
    assert prompt.conversation is not None and prompt.conversation.turn == 0
    assert prompt.conversation.conversation_id == "conv-7"
    assert [m.content for m in prompt.conversation.original][-1] == "18 (old model)"
    assert len(C.turn_points(prompt.conversation.original)) == 3
    # turns = "last" is today's behaviour: no conversation, the final answer dropped, the row's id
    last = normalise(SHAREGPT, NormaliseOptions(dataset="chat"))
    assert last.conversation is None and last.sample_id == "conv-7" and last.messages[-1].content == "Their sum?"


def test_a_conversation_without_an_id_is_keyed_by_a_stable_content_hash() -> None:
    record = {k: v for k, v in SHAREGPT.items() if k != "id"}
    a, b = all_turns(record), all_turns(json.loads(json.dumps(record)))
    assert a.sample_id == b.sample_id and a.sample_id.endswith(":0")
    other = json.loads(json.dumps(record))
    other["conversations"][4]["value"] = "13"  # a later turn differs: another conversation
    assert all_turns(other).sample_id != a.sample_id


def test_turns_all_refuses_a_conversation_that_answers_before_any_user_turn() -> None:
    record = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}]}
    with pytest.raises(RowError) as err:
        all_turns(record)
    assert err.value.reason == "no_user_turn"


def test_old_prompt_payloads_decode_without_a_conversation() -> None:
    from pathlib import Path

    data = (Path(__file__).parents[1] / "fixtures" / "payloads" / "v1_prompt.json").read_bytes()
    assert s.decode(data, s.PromptPublished).conversation is None


# ---- the continuation core ------------------------------------------------------------------------------------


def test_each_accepted_turn_yields_the_next_on_the_regenerated_history_then_finishes() -> None:
    p0 = all_turns(SHAREGPT)
    v1 = C.continue_conversation(accepted(p0, reasoning="r0", content="2"), at=5.0)
    assert isinstance(v1, C.Continued)
    p1 = v1.prompt
    assert p1.sample_id == "conv-7:1" and p1.conversation is not None and p1.conversation.turn == 1
    assert p1.published_at == 5.0
    assert p1.wire == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "2", "reasoning_content": "r0"},
        {"role": "user", "content": "And another?"},
    ]
    assert v1.progress.state == "in_progress" and v1.progress.next_turn == 1
    v2 = C.continue_conversation(accepted(p1, content="3"))
    assert isinstance(v2, C.Continued)
    assert [m["content"] for m in v2.prompt.wire] == ["Be brief.", "Name a prime.", "2", "And another?", "3",
                                                      "Their sum?"]
    end = C.continue_conversation(accepted(v2.prompt, content="5"))
    assert isinstance(end, C.Ended)
    assert end.progress.state == "finished" and end.progress.turns_done == 3 and end.progress.reason == "finished"
    # the same accepted turn gives the same next prompt (a replay publishes the same request, same key)
    again = C.continue_conversation(accepted(p0, reasoning="r0", content="2"), at=5.0)
    assert isinstance(again, C.Continued) and again.prompt == p1


TRAJECTORY = {
    "id": "traj-1",
    "tools": WEATHER,
    "messages": [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "old-1", {"city": "Oslo"}),
                                                           call("get_weather", "old-2", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "old-1", "content": "Oslo: 3C"},
        {"role": "tool", "tool_call_id": "old-2", "content": "Rome: 17C"},
        {"role": "assistant", "content": "Oslo 3C, Rome 17C."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ],
}


def test_cached_tool_results_pair_with_the_regenerated_calls_in_order() -> None:
    p0 = all_turns(TRAJECTORY)
    regenerated = [call("get_weather", "new-a", {"city": "Oslo"}), call("get_weather", "new-b", {"city": "Rome"})]
    verdict = C.continue_conversation(accepted(p0, reasoning="look both up", calls=regenerated))
    assert isinstance(verdict, C.Continued)
    wire = verdict.prompt.wire
    assert wire[1]["tool_calls"] == regenerated and wire[1]["reasoning_content"] == "look both up"
    assert wire[2:] == [
        {"role": "tool", "content": "Oslo: 3C", "tool_call_id": "new-a"},
        {"role": "tool", "content": "Rome: 17C", "tool_call_id": "new-b"},
    ]
    assert verdict.prompt.tools == WEATHER


@pytest.mark.parametrize(
    ("calls", "reason"),
    [
        ([call("get_time", "x")], C.TOOL_CALL_COUNT),
        ([call("get_time", "x"), call("get_weather", "y")], C.TOOL_NAME_MISMATCH),
        ([], C.TOOL_CALL_MISSING),
    ],
)
def test_a_diverging_tool_turn_ends_the_conversation_with_its_reason(calls: list[Any], reason: str) -> None:
    p0 = all_turns(TRAJECTORY)
    verdict = C.continue_conversation(accepted(p0, content="I don't know.", calls=calls))
    assert isinstance(verdict, C.Ended)
    assert verdict.progress.state == "ended_early" and verdict.progress.reason == reason
    assert verdict.progress.turns_done == 1 and verdict.progress.message


def test_a_call_where_the_dataset_answered_ends_early() -> None:
    p0 = all_turns(SHAREGPT)
    verdict = C.continue_conversation(accepted(p0, calls=[call("search", "c")]))
    assert isinstance(verdict, C.Ended) and verdict.progress.reason == C.UNEXPECTED_TOOL_CALL


def test_completions_mode_without_an_output_format_and_single_turn_prompts_and_bad_turns() -> None:
    p0 = all_turns(SHAREGPT)
    with pytest.raises(C.ConversationError) as no_format:
        C.continue_conversation(accepted(p0, content="2", mode="completions"))
    assert no_format.value.reason == C.CONVERSATION_INVALID
    single = normalise(SHAREGPT, NormaliseOptions(dataset="chat"))
    assert C.continue_conversation(accepted(single, content="x")) is None
    assert p0.conversation is not None
    broken = msgspec.structs.replace(p0, conversation=msgspec.structs.replace(p0.conversation, turn=9))
    with pytest.raises(C.ConversationError) as err:
        C.continue_conversation(accepted(broken, content="x"))
    assert err.value.reason == C.CONVERSATION_INVALID


def test_a_conversation_ending_on_a_user_turn_regenerates_that_too() -> None:
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}]}
    p0 = all_turns(record)
    assert p0.conversation is not None and C.turn_points(p0.conversation.original) == [1, 3]
    v1 = C.continue_conversation(accepted(p0, content="B"))
    assert isinstance(v1, C.Continued) and [m.content for m in v1.prompt.messages] == ["a", "B", "c"]
    end = C.continue_conversation(accepted(v1.prompt, content="C"))
    assert isinstance(end, C.Ended) and end.progress.state == "finished"


# ---- template families: how the history is carried, from the official templates ----------------------------------

FAMILY = {
    # (model of truth.py) -> whether the official template keeps turn 0's reasoning in turn 1's prompt
    # (after the tool result, same query) and in turn 2's prompt (after a new user query).
    "qwen3": (True, True),  # the reference Qwen3-0.6B copy keeps any reasoning passed (`or reasoning_content`)
    "qwen3-thinking-2507": (True, False),  # kept within the tool loop, dropped before the last user query
    "deepseek-r1": (False, False),  # R1 keeps only the text after </think>
    "deepseek-v3.1": (False, False),  # V3.1 renders history turns without their reasoning
    "kimi-k2-thinking": (True, False),  # kept after the last assistant turn without tool calls only
}


def official_ids(
    model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[str, list[int]]:
    """The official template's render of ``messages`` (as a server hands them to it) and its true ids."""
    spec = T._SPECS[model]
    thinking = {spec.thinking_kwarg: True} if spec.thinking_kwarg else {}  # the profiles think
    text = T.render_template(T._template_text(model), T.server_messages(model, messages), tools=tools,
                             add_generation_prompt=True, bos_token=spec.bos, eos_token=spec.eos, **thinking)
    return text, list(T.truth_tokenizer(model).encode_prompt(text))


@pytest.mark.parametrize("model", sorted(FAMILY))
def test_each_template_family_carries_the_regenerated_history_as_its_official_template(model: str) -> None:
    kimi = model.startswith("kimi")
    call_id = "functions.get_weather:0" if kimi else "call_0"
    first_call = call("get_weather", call_id, {"city": "Oslo"})
    record = {
        "id": "fam",
        "messages": [
            {"role": "system", "content": "You check the weather."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "orig", {"city": "Oslo"})]},
            {"role": "tool", "tool_call_id": "orig", "content": "Oslo: 3C, clear"},
            {"role": "assistant", "content": "It is 3C (old model)."},
            {"role": "user", "content": "And tomorrow?"},
            {"role": "assistant", "content": "Colder (old model)."},
        ],
    }
    p0 = all_turns(record)
    v1 = C.continue_conversation(accepted(p0, reasoning="REASON-ZERO need the tool", calls=[first_call]))
    assert isinstance(v1, C.Continued)
    v2 = C.continue_conversation(accepted(v1.prompt, reasoning="REASON-ONE read it", content="3C and clear."))
    assert isinstance(v2, C.Continued)

    sys_user = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    a0 = {"role": "assistant", "content": "", "tool_calls": [first_call],
          "reasoning_content": "REASON-ZERO need the tool"}
    t0 = {"role": "tool", "content": "Oslo: 3C, clear", "tool_call_id": call_id}
    a1 = {"role": "assistant", "content": "3C and clear.", "reasoning_content": "REASON-ONE read it"}
    u2 = {"role": "user", "content": "And tomorrow?"}
    expected = {1: [*sys_user, a0, t0], 2: [*sys_user, a0, t0, a1, u2]}
    profile = profile_for(model, True)
    kept = dict(zip((1, 2), FAMILY[model], strict=True))
    for turn, prompt in ((1, v1.prompt), (2, v2.prompt)):
        assert prompt.wire == expected[turn], f"{model} turn {turn}: the history is not the regenerated one"
        text, truth = official_ids(model, expected[turn], None)
        ours = profile.encode_prompt(profile.render_prompt(prompt.messages, None, reasoning=True))
        assert ours == truth, f"{model} turn {turn}: prompt ids differ from the official template's"
        # what the template does with the history: the tool call and result always, reasoning as it decides
        assert "Oslo: 3C, clear" in text and '"city"' in text
        assert ("REASON-ZERO" in text) is kept[turn], f"{model} turn {turn}: reasoning of turn 0"
        if turn == 2:
            assert "3C and clear." in text and "(old model)" not in text
            assert "REASON-ONE" not in text or model == "qwen3"


# ---- rows: one per regenerated turn, kept by the sink's schema and the exports ----------------------------------


def test_rows_carry_conversation_and_turn_and_the_history_reasoning_the_request_sent(tmp_path: Any) -> None:
    from services.export.core import row_from_line, speculators_row, upgrade_row
    from services.sink.core import row_line, training_row

    p0 = all_turns(SHAREGPT)
    v1 = C.continue_conversation(accepted(p0, reasoning="r0", content="2"))
    assert isinstance(v1, C.Continued)
    sample = accepted(v1.prompt, reasoning="r1", content="3")
    row = training_row(sample)
    assert row.id == "chat:conv-7:1"
    assert (row.metadata.conversation_id, row.metadata.turn) == ("conv-7", 1)
    assert [(t.role, t.content, t.reasoning_content) for t in row.conversations] == [
        ("system", "Be brief.", ""), ("user", "Name a prime.", ""), ("assistant", "2", "r0"),
        ("user", "And another?", ""), ("assistant", "3", "r1"),
    ]  # fmt: skip
    back = row_from_line(row_line(row), "part-00000.jsonl:1")
    assert back == row and speculators_row(back)["id"] == "chat:conv-7:1"
    # a single-turn row: no conversation, turn -1, and earlier reasoning never claimed
    single = training_row(accepted(normalise(SHAREGPT, NormaliseOptions(dataset="chat")), content="x"))
    assert (single.metadata.conversation_id, single.metadata.turn) == ("", -1)
    # rows of sinks older than multi-turn upgrade to the same defaults
    old = json.loads(row_line(single))
    del old["metadata"]["conversation_id"], old["metadata"]["turn"]
    assert upgrade_row(old)["metadata"]["turn"] == -1
    assert row_from_line(json.dumps(old).encode(), "old:1").metadata.turn == -1
