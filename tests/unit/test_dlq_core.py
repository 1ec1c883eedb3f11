"""Dead-letter filtering, grouping and replay planning (pure)."""

from __future__ import annotations

import pytest

from schemas import (
    DLQ_HEADERS,
    Message,
    PromptPublished,
    ResponseReceived,
    SampleAudited,
    SampleReconstructed,
    decode,
    encode,
)
from services.common.config import KafkaSettings
from services.common.kafka import DeadLetter, dead_letter
from services.dlq.core import (
    DeadLetterRecord,
    FilterError,
    Filters,
    group_by_reason,
    parse_time,
    plan_replay,
    preview,
    replay_headers,
    value_for_stage,
)

NOW = 1_790_000_000_000
KAFKA = KafkaSettings(topic_prefix="p.")
PREFIX = KAFKA.topic_prefix  # replays name topics as the services do


def letter(
    offset: int,
    *,
    stage: str = "audit",
    reason: str = "roundtrip_mismatch",
    key: str = "math:s1",
    topic: str = "p.samples",
    replay_count: int | None = None,
    failed_at: int = NOW,
    extra_headers: list[tuple[str, bytes]] | None = None,
    reasons: tuple[str, ...] = (),
    value: bytes | None = b'{"v": 1}',
) -> DeadLetterRecord:
    in_headers = list(extra_headers or [])
    if replay_count is not None:
        in_headers += [
            (DLQ_HEADERS.REPLAY_COUNT, str(replay_count).encode()),
            (DLQ_HEADERS.FIRST_FAILURE, b"1700000000000"),
        ]
    out = dead_letter(
        dlq_topic="p.dead-letter",
        stage=stage,
        verdict=DeadLetter(reason, "boom", reasons=reasons),
        value=value,
        key=key.encode(),
        topic=topic,
        partition=1,
        offset=40 + offset,
        in_headers=in_headers,
        now_ms=failed_at,
    )
    return DeadLetterRecord(
        partition=0,
        offset=offset,
        timestamp_ms=failed_at,
        key=out.key,
        value=out.value,
        headers=tuple(out.headers + list(extra_headers or [])),
    )


def test_record_view_reads_the_headers_dead_letter_writes() -> None:
    rec = letter(3, reasons=("roundtrip_mismatch", "usage_mismatch"))
    assert rec.id == "0:3"
    assert (rec.stage, rec.reason, rec.dataset, rec.original_topic) == (
        "audit",
        "roundtrip_mismatch",
        "math",
        "p.samples",
    )
    assert rec.reasons == ("roundtrip_mismatch", "usage_mismatch")
    assert rec.replay_count == 0 and rec.failed_at_ms == NOW and rec.first_failure_ms == NOW


def test_parse_time_relative_iso_and_errors() -> None:
    assert parse_time("1h", NOW) == NOW - 3_600_000
    assert parse_time("90s", NOW) == NOW - 90_000
    assert parse_time("2d ago", NOW) == NOW - 2 * 86_400_000
    assert parse_time("2026-01-31T12:00:00Z", NOW) == 1_769_860_800_000
    assert parse_time("2026-01-31T12:00:00", NOW) == 1_769_860_800_000  # naive = UTC
    assert parse_time("2026-01-31T13:00:00+01:00", NOW) == 1_769_860_800_000
    with pytest.raises(FilterError, match="cannot read time"):
        parse_time("yesterday", NOW)


def test_filters() -> None:
    a = letter(1, stage="audit", reason="r1", key="math:a", failed_at=NOW - 10_000)
    b = letter(2, stage="inference", reason="http_4xx", key="code:b", topic="p.prompts.code")
    c = letter(3, stage="audit", reason="r2", key="math:c", reasons=("r2", "r1"))
    assert [r.id for r in (a, b, c) if Filters(stage="audit").matches(r)] == ["0:1", "0:3"]
    assert [r.id for r in (a, b, c) if Filters(reason="r1").matches(r)] == ["0:1", "0:3"]  # any reason
    assert [r.id for r in (a, b, c) if Filters(dataset="code").matches(r)] == ["0:2"]
    assert [r.id for r in (a, b, c) if Filters(key="math:c").matches(r)] == ["0:3"]
    assert [r.id for r in (a, b, c) if Filters(since_ms=NOW - 5_000).matches(r)] == ["0:2", "0:3"]
    assert [r.id for r in (a, b, c) if Filters(until_ms=NOW - 5_000).matches(r)] == ["0:1"]


def test_group_by_reason_counts_with_one_example() -> None:
    records = [letter(i, reason="r1", key=f"math:{i}") for i in range(3)] + [
        letter(9, reason="r2", key="code:z")
    ]
    groups = group_by_reason(records)
    assert [(g.reason, g.count, g.example_key) for g in groups] == [("r1", 3, "math:0"), ("r2", 1, "code:z")]
    assert groups[1].datasets == ("code",)


def test_replay_headers_increment_count_keep_first_failure_and_drop_error_headers() -> None:
    rec = letter(1, replay_count=1, extra_headers=[("traceparent", b"00-abc-01")])
    headers = dict(replay_headers(rec))
    assert headers[DLQ_HEADERS.REPLAY_COUNT] == b"2"
    assert headers[DLQ_HEADERS.FIRST_FAILURE] == b"1700000000000"
    assert headers["traceparent"] == b"00-abc-01"
    assert DLQ_HEADERS.REASON not in headers and DLQ_HEADERS.STAGE not in headers
    first = dict(replay_headers(letter(2)))
    assert first[DLQ_HEADERS.REPLAY_COUNT] == b"1" and first[DLQ_HEADERS.FIRST_FAILURE] == str(NOW).encode()


def test_plan_replay_sorts_every_record_into_one_outcome() -> None:
    fresh = letter(1)
    done = letter(2)
    worn = letter(3, replay_count=3)
    gone = letter(4, topic="p.deleted-topic")
    plan = plan_replay(
        [fresh, done, worn, gone],
        topic_prefix=PREFIX,
        existing_topics={"p.samples"},
        replayed_ids={"0:2"},
        max_replays=3,
    )
    assert [p.record.id for p in plan.send] == ["0:1"] and plan.send[0].topic == "p.samples"
    assert [r.id for r in plan.already_replayed] == ["0:2"]
    assert [r.id for r in plan.over_max_replays] == ["0:3"]
    assert [(r.id, t) for r, t in plan.missing_topic] == [("0:4", "p.deleted-topic")]
    # a higher limit lets the worn record through
    assert (
        len(
            plan_replay(
                [worn], topic_prefix=PREFIX, existing_topics={"p.samples"}, replayed_ids=(), max_replays=4
            ).send
        )
        == 1
    )


def test_a_tombstone_stays_null_through_its_dead_letter_and_replay() -> None:
    tombstone = letter(1, value=None, reason="empty_record")
    assert tombstone.value is None and tombstone.value_null
    assert tombstone.header(DLQ_HEADERS.VALUE_NULL) == "true"
    (planned,) = plan_replay([tombstone], topic_prefix=PREFIX, existing_topics={"p.samples"}, replayed_ids=()).send
    assert planned.payload is None
    assert DLQ_HEADERS.VALUE_NULL not in dict(planned.headers)  # the re-sent record is a plain tombstone
    # An empty value is kept as an empty value, and says nothing about null.
    empty = letter(2, value=b"", reason="empty_record")
    assert empty.value == b"" and not empty.value_null and empty.header(DLQ_HEADERS.VALUE_NULL) is None
    (sent,) = plan_replay([empty], topic_prefix=PREFIX, existing_topics={"p.samples"}, replayed_ids=()).send
    assert sent.payload == b""
    # A tombstone holds no event for a named stage to read.
    to_audit = plan_replay([tombstone], topic_prefix=PREFIX, existing_topics={"p.samples"}, replayed_ids=(), to="audit")
    assert [r.id for r in to_audit.wrong_kind] == ["0:1"] and not to_audit.send


def chain() -> tuple[PromptPublished, ResponseReceived, SampleReconstructed, SampleAudited]:
    prompt = PromptPublished(
        dataset="code", sample_id="x", messages=[Message(role="user", content="Reverse a list in Go.")]
    )
    response = ResponseReceived(
        dataset="code", sample_id="x", prompt=prompt, provider="simulator", model="m", content="Use slices."
    )
    sample = SampleReconstructed(
        dataset="code",
        sample_id="x",
        profile="deepseek-v3",
        response=response,
        prompt_ids=[0, 5],
        output_ids=[7, 1],
        loss_mask=[0, 0, 1, 1],
        method="reencode",
    )
    audited = SampleAudited(dataset="code", sample_id="x", sample=sample, passed=True)
    return prompt, response, sample, audited


def test_plan_replay_to_a_named_stage_sends_the_event_that_stage_reads() -> None:
    prompt, response, sample, audited = chain()
    rec = letter(1, stage="sink", key="code:x", topic="p.accepted", value=encode(audited))
    topics = {"p.prompts.code", "p.responses", "p.samples", "p.accepted"}
    for to, expected, event in [
        ("inference", "p.prompts.code", prompt),
        ("reconstruct", "p.responses", response),
        ("audit", "p.samples", sample),
        ("sink", "p.accepted", audited),
    ]:
        plan = plan_replay([rec], topic_prefix=PREFIX, existing_topics=topics, replayed_ids=(), to=to)
        assert plan.send[0].topic == expected
        assert decode(plan.send[0].payload, type(event)) == event
    same = plan_replay([rec], topic_prefix=PREFIX, existing_topics=topics, replayed_ids=(), to="sink")
    assert same.send[0].value is None and same.send[0].payload == rec.value  # untouched bytes
    # a prompt cannot be turned into a sample: skipped, not sent
    early = letter(2, stage="inference", key="code:x", topic="p.prompts.code", value=encode(prompt))
    plan = plan_replay([early], topic_prefix=PREFIX, existing_topics=topics, replayed_ids=(), to="audit")
    assert plan.send == [] and plan.wrong_kind == [early]
    garbage = letter(3, value=b"not json")
    assert value_for_stage(garbage.value, "inference") is None
    assert value_for_stage(garbage.value, None) == b"not json"
    rec = early
    with pytest.raises(FilterError, match="unknown stage"):
        plan_replay([rec], topic_prefix=PREFIX, existing_topics=topics, replayed_ids=(), to="budget")
    keyless = DeadLetterRecord(partition=0, offset=5, timestamp_ms=NOW, key=None, value=b"x", headers=())
    plan = plan_replay([keyless], topic_prefix=PREFIX, existing_topics=topics, replayed_ids=(), to="inference")
    assert plan.no_target == [keyless]


def test_preview_truncates_and_escapes() -> None:
    assert preview(b'{"a":\n1}') == '{"a":\\n1}'
    long = preview(b"x" * 1000, limit=10)
    assert long.startswith("x" * 10) and long.endswith("(1000 bytes)")
    assert preview(None) == "(no value)"
