"""The wire contracts: round trips, typed errors naming the field, old payloads, exports."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import schemas as s
from schemas.export import render

FIXTURES = Path(__file__).parent.parent / "fixtures" / "payloads"


def make_response(n_ids: int = 3) -> s.ResponseReceived:
    prompt = s.PromptPublished(
        dataset="math",
        sample_id="a1",
        messages=[s.Message(role="system", content="be brief"), s.Message(role="user", content="2+2?")],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    )
    return s.ResponseReceived(
        dataset="math",
        sample_id="a1",
        prompt=prompt,
        provider="openrouter",
        model="deepseek/deepseek-v3",
        reasoning="think",
        content="4",
        tool_calls=[s.ToolCall(id="c1", function=s.ToolFunction(name="add", arguments='{"a":2}'))],
        finish_reason="stop",
        usage=s.Usage(prompt_tokens=10, completion_tokens=n_ids, reasoning_tokens=1, cost=0.001),
        native_output_ids=list(range(n_ids)),
        logprobs=[s.LogprobToken(token="4", bytes=[52], logprob=-0.1)],
    )


def all_events() -> list[msgspec.Struct]:
    response = make_response()
    sample = s.SampleReconstructed(
        dataset="math",
        sample_id="a1",
        profile="deepseek-v3",
        response=response,
        prompt_ids=[5, 6],
        output_ids=[7, 8],
        loss_mask=[0, 0, 1, 1],
        method="native",
    )
    return [
        response.prompt,
        s.RequestStarted(dataset="math", sample_id="a1", max_tokens=100),
        response,
        sample,
        s.SampleAudited(
            dataset="math",
            sample_id="a1",
            sample=sample,
            passed=True,
            results=[s.CheckResult(code="ends_with_end_of_turn", passed=True)],
        ),
        s.Halt(scope="global", reason="cap", by="budget"),
        s.Resume(scope="math", by="alice"),
        s.BudgetSnapshot(scope="math", completion_tokens=5, offsets={"responses:0": 3}),
        s.ConversationProgressed(
            dataset="chat", conversation_id="c1", state="ended_early", turns_done=2, reason="tool_name_mismatch"
        ),
        s.PromptPublished(
            dataset="chat",
            sample_id="c1:1",
            messages=[s.Message(role="user", content="hi"), s.Message(role="assistant", content="yo",
                                                                        reasoning_content="r")],
            conversation=s.ConversationTurn(
                conversation_id="c1", turn=1, original=[s.Message(role="user", content="hi")]
            ),
        ),
        s.LeasePolicy(epoch="e1", ttl_s=5.0),
        s.LeaseRequested(worker="w1", dataset="math", epoch="e1", target=200, step=100),
        s.LeaseGranted(worker="w1", dataset="math", epoch="e1", granted=200),
        s.LeaseReleased(worker="w1", dataset="math", epoch="e1"),
        s.ResponseIndexed(partition=2, offset=41),
        s.StoreCheckpointed(partition=2, next_offset=42),
        s.ProviderFactRecorded(upstream="Lossless/qwen3", place="content_start", evidence="math:a1"),
    ]


@pytest.mark.parametrize("event", all_events(), ids=lambda e: type(e).__name__)
def test_every_event_round_trips_and_carries_its_version(event: msgspec.Struct) -> None:
    data = s.encode(event)
    assert b'"schema_version":1' in data
    if isinstance(event, s.Halt | s.Resume):
        assert s.decode_control(data) == event
    elif isinstance(event, s.LeaseEvent):
        assert s.decode_lease(data) == event
    elif isinstance(event, s.ResponseIndexed | s.StoreCheckpointed):
        assert s.decode_store_index(data) == event
    else:
        assert s.decode(data, type(event)) == event


def test_unknown_fields_are_tolerated_on_the_wire() -> None:
    data = s.encode(s.RequestStarted(dataset="d", sample_id="x", max_tokens=1))
    widened = data[:-1] + b',"added_in_v2":{"x":1}}'
    assert s.decode(widened, s.RequestStarted).sample_id == "x"


@pytest.mark.parametrize(
    ("payload", "reason", "names"),
    [
        (b"{", "invalid_json", ""),
        (b"\xff\xfe{}", "invalid_utf8", ""),
        (b"", "empty_record", ""),
        (b'{"dataset":"d","messages":[]}', "missing_field", "sample_id"),
        (b'{"dataset":5,"sample_id":"x","messages":[]}', "invalid_field", "$.dataset"),
        (b'{"dataset":"d","sample_id":"x","messages":[{"role":"wizard"}]}', "invalid_field", "role"),
        (b'{"dataset":"d","sample_id":"x","messages":[],"schema_version":7}', "unsupported_schema_version", "7"),
        (b'{"dataset":"d","sample_id":"x","messages":[],"max_tokens":-1}', "invalid_field", "max_tokens"),
    ],
)
def test_bad_records_raise_a_typed_error_naming_the_field(payload: bytes, reason: str, names: str) -> None:
    with pytest.raises(s.SchemaError) as info:
        s.decode(payload, s.PromptPublished)
    assert info.value.reason == reason
    assert names in info.value.message


def test_absurd_usage_is_refused() -> None:
    data = s.encode(make_response()).replace(b'"completion_tokens":3', b'"completion_tokens":99999999999')
    with pytest.raises(s.SchemaError, match="completion_tokens"):
        s.decode(data, s.ResponseReceived)


def test_control_event_with_unknown_action_is_an_error_not_a_resume() -> None:
    with pytest.raises(s.SchemaError) as info:
        s.decode_control(b'{"action":"explode","scope":"global"}')
    assert info.value.reason == "unknown_action"


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("v1_*.json")), ids=lambda p: p.name)
def test_old_payloads_still_decode(path: Path) -> None:
    kind = path.stem.removeprefix("v1_")
    types = {
        "prompt": s.PromptPublished,
        "response": s.ResponseReceived,
        "sample": s.SampleReconstructed,
        "audited": s.SampleAudited,
        "budget": s.BudgetSnapshot,
        "request": s.RequestStarted,
    }
    data = path.read_bytes()
    if kind == "control":
        assert isinstance(s.decode_control(data), s.Halt)
    else:
        assert s.decode(data, types[kind]).schema_version == 1


def test_a_response_that_still_carries_the_simulators_truth_decodes_without_it() -> None:
    """Records written while ``debug_true_ids`` was a field decode; the field is not carried on."""
    old = msgspec.json.decode((FIXTURES / "v1_response.json").read_bytes())
    old["debug_true_ids"] = [1, 2, 3]
    decoded = s.decode(msgspec.json.encode(old), s.ResponseReceived)
    assert (decoded.dataset, decoded.sample_id, decoded.content) == (old["dataset"], old["sample_id"], old["content"])
    assert "debug_true_ids" not in msgspec.json.decode(s.encode(decoded))


def test_old_payload_fixtures_exist_for_every_event() -> None:
    names = {p.stem for p in FIXTURES.glob("v1_*.json")}
    assert names == {f"v1_{k}" for k in ("prompt", "response", "sample", "audited", "budget", "request", "control")}


def test_generated_json_schemas_are_fresh() -> None:
    folder = Path(__file__).parent.parent.parent / "schemas" / "generated"
    for name, text in render().items():
        path = folder / name
        assert path.exists(), f"{path} missing: run `make schemas`"
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run `make schemas`"


@given(
    dataset=st.from_regex(r"[a-z][a-z0-9_-]{0,20}", fullmatch=True),
    sample_id=st.text(min_size=1, max_size=40),
    content=st.text(max_size=200),
)
def test_prompt_round_trip_property(dataset: str, sample_id: str, content: str) -> None:
    prompt = s.PromptPublished(dataset=dataset, sample_id=sample_id, messages=[s.Message(role="user", content=content)])
    assert s.decode(s.encode(prompt), s.PromptPublished) == prompt
    assert s.split_key(s.sample_key(dataset, sample_id)) == (dataset, sample_id)
