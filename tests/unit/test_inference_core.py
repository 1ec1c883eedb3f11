"""Pure decisions of the inference stage: prompt checks, failure classes, offsets, halts."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Halt, Message, PromptPublished, Resume, Usage, encode
from services.common.checkpoint import OffsetTracker
from services.common.halts import HaltState
from services.common.kafka import DeadLetter
from services.inference.core import (
    ProviderFailure,
    ProviderResult,
    backoff_for,
    check_prompt,
    classify_status,
    dataset_of_topic,
    dead_letter_for,
    parse_retry_after,
    request_max_tokens,
    response_event,
)


def _prompt(**kw: object) -> PromptPublished:
    base: dict[str, object] = {
        "dataset": "chat",
        "sample_id": "s1",
        "messages": [Message(role="system", content="be brief"), Message(role="user", content="hi")],
    }
    base.update(kw)
    return PromptPublished(**base)  # type: ignore[arg-type]


class TestCheckPrompt:
    def test_valid_prompt_decodes(self) -> None:
        result = check_prompt(encode(_prompt()), max_prompt_chars=100)
        assert isinstance(result, PromptPublished)
        assert result.sample_id == "s1"

    @pytest.mark.parametrize(
        ("value", "reason"),
        [
            (None, "empty_record"),
            (b"", "empty_record"),
            (b"{not json", "invalid_json"),
            (b"\xff\xfe", "invalid_utf8"),
            (b'{"dataset": "chat", "messages": []}', "missing_field"),
            (b'{"dataset": "chat", "sample_id": "x", "messages": [{"role": "robot"}]}', "invalid_field"),
        ],
    )
    def test_schema_failures_carry_the_schema_reason(self, value: bytes | None, reason: str) -> None:
        result = check_prompt(value, max_prompt_chars=100)
        assert isinstance(result, DeadLetter)
        assert result.reason == reason

    def test_no_user_turn(self) -> None:
        prompt = _prompt(messages=[Message(role="system", content="only a system turn")])
        result = check_prompt(encode(prompt), max_prompt_chars=100)
        assert isinstance(result, DeadLetter) and result.reason == "no_user_turn"

    def test_prompt_too_long(self) -> None:
        prompt = _prompt(messages=[Message(role="user", content="x" * 101)])
        result = check_prompt(encode(prompt), max_prompt_chars=100)
        assert isinstance(result, DeadLetter) and result.reason == "prompt_too_long"
        assert check_prompt(encode(_prompt(messages=[Message(role="user", content="x" * 100)])),
                            max_prompt_chars=100).__class__ is PromptPublished

    def test_dataset_must_match_the_topic(self) -> None:
        assert isinstance(check_prompt(encode(_prompt()), max_prompt_chars=100, topic_dataset="chat"),
                          PromptPublished)
        result = check_prompt(encode(_prompt()), max_prompt_chars=100, topic_dataset="code")
        assert isinstance(result, DeadLetter) and result.reason == "dataset_mismatch"

    def test_newer_schema_version_refused(self) -> None:
        raw = msgspec.json.decode(encode(_prompt()))
        raw["schema_version"] = 99
        result = check_prompt(msgspec.json.encode(raw), max_prompt_chars=100)
        assert isinstance(result, DeadLetter) and result.reason == "unsupported_schema_version"


class TestClassify:
    @pytest.mark.parametrize("status", [401, 402])
    def test_auth_and_credit_failures_are_fatal(self, status: int) -> None:
        failure = classify_status(status, "no credits")
        assert failure.fatal and not failure.retryable
        assert failure.reason == f"provider_http_{status}"
        assert backoff_for(failure, 30.0) is False

    @pytest.mark.parametrize(
        ("status", "reason"),
        [(429, "provider_http_429"), (408, "provider_http_408"), (500, "provider_http_5xx"),
         (503, "provider_http_5xx"), (599, "provider_http_5xx")],
    )
    def test_transient_statuses_retry(self, status: int, reason: str) -> None:
        failure = classify_status(status, "busy")
        assert failure.retryable and not failure.fatal
        assert failure.reason == reason and failure.http_status == status
        assert backoff_for(failure, 30.0) is True

    @pytest.mark.parametrize("status", [400, 404, 413, 422])
    def test_other_client_errors_are_final(self, status: int) -> None:
        failure = classify_status(status, "bad request")
        assert not failure.retryable and not failure.fatal
        assert failure.reason == "provider_http_4xx"

    def test_retry_after_wins_and_is_capped(self) -> None:
        assert backoff_for(classify_status(429, "slow down", "2"), 30.0) == 2.0
        assert backoff_for(classify_status(429, "slow down", "600"), 30.0) == 30.0

    def test_dead_letter_keeps_status_text_and_attempt(self) -> None:
        verdict = dead_letter_for(classify_status(503, "upstream overloaded"), attempt=4)
        assert (verdict.reason, verdict.http_status, verdict.attempt) == ("provider_http_5xx", 503, 4)
        assert verdict.message == "upstream overloaded"

    def test_failure_is_an_exception_with_readable_text(self) -> None:
        failure = ProviderFailure(reason="provider_timeout", message="ReadTimeout", retryable=True)
        with pytest.raises(ProviderFailure, match="provider_timeout: ReadTimeout"):
            raise failure


class TestRetryAfter:
    @pytest.mark.parametrize(
        ("value", "expected"), [("2", 2.0), ("0.25", 0.25), (" 7 ", 7.0), ("", None), (None, None),
                                ("-1", None), ("nan", None), ("soon", None)]
    )
    def test_delta_seconds(self, value: str | None, expected: float | None) -> None:
        assert parse_retry_after(value) == expected

    def test_http_date_needs_now(self) -> None:
        value = "Wed, 21 Oct 2015 07:28:00 GMT"
        assert parse_retry_after(value) is None
        assert parse_retry_after(value, now=1445412470.0) == pytest.approx(10.0)
        assert parse_retry_after(value, now=1445412490.0) == 0.0


class TestOffsetTracker:
    def test_out_of_order_commits_only_the_done_prefix(self) -> None:
        t = OffsetTracker()
        for off in (10, 11, 12, 13):
            t.take("p0", off)
        assert t.position("p0") == 10
        t.done("p0", 12)
        t.done("p0", 11)
        assert t.position("p0") == 10
        assert t.to_commit() == {"p0": 10}
        t.committed({"p0": 10})
        assert t.to_commit() == {}
        t.done("p0", 10)
        assert t.position("p0") == 13
        t.done("p0", 13)
        assert t.position("p0") == 14 and t.pending() == 0
        assert t.next_offset("p0") == 14

    def test_partitions_are_independent_and_forgettable(self) -> None:
        t = OffsetTracker()
        t.take("a", 0)
        t.take("b", 5)
        t.done("b", 5)
        assert t.to_commit() == {"a": 0, "b": 6}
        t.forget(["a"])
        assert t.position("a") is None
        t.done("a", 0)  # a late completion of a partition no longer owned is ignored
        assert t.position("a") is None and t.partitions() == ["b"]

    def test_an_offset_never_goes_back(self) -> None:
        t = OffsetTracker()
        t.take("p", 7)
        t.done("p", 7)
        t.committed(t.to_commit())
        assert t.to_commit() == {}
        t.take("p", 3)  # a record below the last commit, taken again without a rebalance
        with pytest.raises(ValueError, match="would go back from 8 to 3"):
            t.to_commit()
        t.forget(["p"])  # after a rebalance the partition starts afresh
        t.take("p", 3)
        assert t.to_commit() == {"p": 3}

    @settings(max_examples=200, deadline=None)
    @given(st.integers(min_value=1, max_value=60), st.integers(min_value=0, max_value=2**32), st.data())
    def test_position_is_lowest_not_done(self, n: int, seed: int, data: st.DataObject) -> None:
        t = OffsetTracker()
        offsets = list(range(100, 100 + n))
        for off in offsets:
            t.take(0, off)
        order = offsets[:]
        random.Random(seed).shuffle(order)
        k = data.draw(st.integers(min_value=0, max_value=n))
        done = set(order[:k])
        for off in order[:k]:
            t.done(0, off)
        not_done = [o for o in offsets if o not in done]
        assert t.position(0) == (min(not_done) if not_done else 100 + n)
        assert t.pending(0) == len(not_done)


class TestHaltState:
    def test_dataset_halt_and_resume(self) -> None:
        s = HaltState()
        assert s.apply(Halt(scope="code", reason="cap")) is True
        assert s.is_halted("code") and not s.is_halted("chat")
        assert s.apply(Halt(scope="code", reason="again")) is False
        assert s.apply(Resume(scope="chat")) is False
        assert s.apply(Resume(scope="code")) is True
        assert not s.is_halted("code")

    def test_global_halt_stops_every_dataset(self) -> None:
        s = HaltState()
        s.apply(Halt(scope="global"))
        assert s.is_halted("anything") and s.scopes() == ["global"]
        s.apply(Halt(scope="code"))
        s.apply(Resume(scope="global"))
        assert s.is_halted("code") and not s.is_halted("chat")


def test_dataset_of_topic() -> None:
    assert dataset_of_topic("t1.prompts.chat", "t1.prompts.") == "chat"
    assert dataset_of_topic("t1.prompts.", "t1.prompts.") is None
    assert dataset_of_topic("other.prompts.chat", "t1.prompts.") is None


def test_request_max_tokens_prefers_the_prompt() -> None:
    assert request_max_tokens(_prompt(max_tokens=77), 4096) == 77
    assert request_max_tokens(_prompt(), 4096) == 4096


def test_response_event_carries_prompt_and_request_facts() -> None:
    prompt = _prompt()
    result = ProviderResult(
        content="hello", reasoning="think", finish_reason="stop", usage=Usage(completion_tokens=5, cost=0.1),
        upstream_provider="DeepInfra", model="deepseek/deepseek-v3-0324",
    )
    event = response_event(
        prompt, result, provider="openrouter", model="deepseek/deepseek-v3", profile="deepseek-v3",
        tools_sent=False, max_tokens=256, latency_s=1.5, attempt=2, now=123.0,
    )
    assert event.prompt == prompt and event.profile == "deepseek-v3"
    assert event.model == "deepseek/deepseek-v3-0324" and event.upstream_provider == "DeepInfra"
    assert (event.request_max_tokens, event.attempt, event.latency_s) == (256, 2, 1.5)
    assert event.usage.cost == 0.1 and event.content == "hello" and event.reasoning == "think"


# --- outages, the response store's key ---------------------------------------------------


def _fail(reason: str, status: int | None = None) -> ProviderFailure:
    return ProviderFailure(reason=reason, message="x", retryable=True, http_status=status)


def test_outage_detector_trips_after_n_in_a_row_and_an_answer_resets_it() -> None:
    from services.inference.core import OutageDetector

    detector = OutageDetector(threshold=3)
    assert not detector.failure(_fail("provider_connection_refused"), detector.begin())
    assert not detector.failure(_fail("provider_http_5xx", 503), detector.begin())
    detector.success(detector.begin())
    assert not detector.failure(_fail("provider_timeout"), detector.begin())
    assert not detector.failure(_fail("provider_dns"), detector.begin())
    assert detector.failure(_fail("provider_http_4xx", 404), detector.begin())
    # a 429 is an answer: the provider is up, the streak ends
    detector.failure(_fail("provider_timeout"), detector.begin())
    assert not detector.failure(_fail("provider_http_429", 429), detector.begin())
    assert detector.consecutive == 0


def test_an_answer_to_a_request_sent_before_the_failures_proves_nothing() -> None:
    from services.inference.core import OutageDetector

    detector = OutageDetector(threshold=2)
    old = detector.begin()  # in flight when the provider went away
    first = detector.begin()
    detector.failure(_fail("provider_connection_refused"), first)
    detector.success(old)  # still answered: the server finishes what it had
    assert detector.failure(_fail("provider_connection_refused"), detector.begin())


def test_a_final_failure_is_an_outage_only_when_nobody_got_an_answer_since() -> None:
    from services.inference.core import OutageDetector, is_outage_failure

    detector = OutageDetector(threshold=8)
    old = detector.begin()
    failure = _fail("provider_connection_refused")
    failure.answered_mark = detector.begin()
    detector.failure(failure, failure.answered_mark)
    detector.success(old)
    assert detector.nobody_answered_since(failure)
    detector.success(detector.begin())
    assert not detector.nobody_answered_since(failure)
    assert not is_outage_failure(_fail("provider_http_429", 429))
    assert not is_outage_failure(_fail("provider_error_in_body", 200))
    assert is_outage_failure(_fail("provider_http_5xx", 502))


def test_outage_reason_names_a_wrong_base_url() -> None:
    from services.inference.core import OutageDetector, outage_reason

    detector = OutageDetector(threshold=2)
    detector.failure(_fail("provider_http_4xx", 404), detector.begin())
    detector.failure(_fail("provider_http_4xx", 404), detector.begin())
    assert outage_reason(detector, "http://x/v1").startswith("base URL answers 404")
    detector.failure(_fail("provider_connection_refused"), detector.begin())
    reason = outage_reason(detector, "http://x/v1")
    assert "3 consecutive failures" in reason and "provider_connection_refused" in reason


def test_store_key_and_repay_header() -> None:
    from services.inference.core import REPAY_HEADER, store_key, wants_repay

    assert store_key("math", "a:b", "f" * 64) == f"math:a:b|{'f' * 64}"
    assert wants_repay([(REPAY_HEADER, b"1")]) and not wants_repay([(REPAY_HEADER, b"0")]) and not wants_repay(None)
