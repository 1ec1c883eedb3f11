"""encode_forwarding: a stage forwards the nested event it consumed byte for byte, same wire form."""

from __future__ import annotations

import msgspec
import pytest

from schemas import (
    CheckResult,
    LogprobToken,
    Message,
    PromptPublished,
    ResponseReceived,
    SampleAudited,
    SampleReconstructed,
    ToolCall,
    ToolFunction,
    Usage,
    decode,
    encode,
    encode_forwarding,
)


def _response() -> ResponseReceived:
    prompt = PromptPublished(
        dataset="math",
        sample_id="q-1",
        messages=[
            Message(role="system", content="Be brief."),
            Message(role="user", content="2+2? \u00e9\u6f22 \"quoted\" \\ back"),
            Message(
                role="assistant",
                content="",
                tool_calls=[ToolCall(id="c1", function=ToolFunction(name="add", arguments='{"a": 2, "b": 2}'))],
            ),
            Message(role="tool", content="4", tool_call_id="c1", name="add"),
        ],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        max_tokens=512,
        metadata={"source_row": 7, "nested": {"x": [1, 2.5, None]}},
    )
    return ResponseReceived(
        dataset="math",
        sample_id="q-1",
        prompt=prompt,
        provider="simulator",
        model="m",
        reasoning="Two plus two.",
        content="4",
        finish_reason="stop",
        usage=Usage(prompt_tokens=40, completion_tokens=9),
        logprobs=[LogprobToken(token="4", logprob=-0.01, bytes=[52])],
        native_output_ids=[19, 20, 21],
        latency_s=0.25,
        received_at=1_800_000_000.5,
    )


def _sample(response: ResponseReceived) -> SampleReconstructed:
    return SampleReconstructed(
        dataset="math",
        sample_id="q-1",
        profile="qwen3",
        response=response,
        prompt_ids=[1, 2, 3],
        output_ids=[19, 20, 21],
        loss_mask=[0, 0, 0, 1, 1, 1],
        method="native",
        prompt_text="<|im_start|>user ...",
    )


def test_forwarded_sample_is_byte_identical_to_encoding_it_whole() -> None:
    response = _response()
    raw = encode(response)
    sample = _sample(decode(raw, ResponseReceived))
    assert encode_forwarding(sample, "response", raw) == encode(sample)


def test_forwarded_verdict_is_byte_identical_and_decodes_back() -> None:
    sample_raw = encode(_sample(_response()))
    sample = decode(sample_raw, SampleReconstructed)
    verdict = SampleAudited(
        dataset="math",
        sample_id="q-1",
        sample=sample,
        passed=False,
        results=[CheckResult(code="ends_with_eot", passed=False, message="no end of turn", value=1.0)],
        reasons=["ends_with_eot"],
        audited_at=1_800_000_001.0,
    )
    wire = encode_forwarding(verdict, "sample", sample_raw)
    assert wire == encode(verdict)
    assert decode(wire, SampleAudited) == verdict


def test_forwarding_keeps_the_consumed_bytes_as_they_came() -> None:
    # A response written by another producer: whitespace, an unknown field, ``content: null``
    # on a tool-call turn (valid on the wire). The sample carries exactly those bytes.
    raw = (
        b'{ "dataset": "math", "sample_id": "q-2", "provider": "p", "model": "m", "future_field": [1],'
        b' "prompt": {"dataset": "math", "sample_id": "q-2", "messages": [{"role": "user", "content": "hi"},'
        b' {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f"}}]}]} }'
    )
    response = decode(raw, ResponseReceived)
    sample = _sample(response)
    wire = encode_forwarding(sample, "response", raw)
    assert raw in wire
    again = decode(wire, SampleReconstructed)
    assert again.response == response
    assert again.response.prompt.messages[1].content == ""


def test_a_field_the_event_does_not_have_is_refused() -> None:
    with pytest.raises(TypeError, match="no field 'answer'"):
        encode_forwarding(_sample(_response()), "answer", b"{}")


def test_the_forwarded_field_is_written_verbatim_not_validated() -> None:
    # The caller's promise (raw is what the nested event was decoded from) is what makes the
    # output valid: the encoder writes whatever it is given.
    wire = encode_forwarding(_sample(_response()), "response", b'{"not": "a response"}')
    assert msgspec.json.decode(wire)["response"] == {"not": "a response"}
    with pytest.raises(Exception, match="missing required field"):
        decode(wire, SampleReconstructed)
