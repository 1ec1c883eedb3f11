"""The malformed-record corpus: records that bypass the publisher's validation, one list per
stage input topic, each with the dead-letter reason code it must end with.

Generated in code (not stored files) because several records are derived from valid events
(a future ``schema_version``, a missing field) and one is 10 MB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from schemas import (
    Message,
    PromptPublished,
    RequestStarted,
    ResponseReceived,
    SampleAudited,
    SampleReconstructed,
    ToolCall,
    ToolFunction,
    Usage,
    encode,
)

TEN_MB = 10 * 1024 * 1024


@dataclass(frozen=True)
class Poison:
    """One malformed record for one topic and what each reading stage must say about it."""

    name: str
    logical: str  # "prompts", "responses", "samples", "accepted", "requests"
    value: bytes | None
    expected: dict[str, str]  # stage -> reason code of its dead letter

    def key(self, dataset: str) -> bytes:
        """The record key: names the poison so its dead letter can be matched."""
        return f"{dataset}:poison-{self.logical}-{self.name}".encode()


def _mutate(base: bytes, **changes: Any) -> bytes:
    obj = json.loads(base)
    for name, value in changes.items():
        if value is _DROP:
            obj.pop(name)
        else:
            obj[name] = value
    return json.dumps(obj).encode()


_DROP = object()


def _generic(logical: str, base: bytes, stages: tuple[str, ...]) -> list[Poison]:
    """Malformations every decoder must turn into a specific reason."""

    def for_all(reason: str) -> dict[str, str]:
        return dict.fromkeys(stages, reason)

    return [
        Poison("invalid-json", logical, base[: len(base) // 2], for_all("invalid_json")),
        Poison("invalid-utf8", logical, b'{"dataset": "\xff\xfe\xfd", "sample_id": "x"}', for_all("invalid_utf8")),
        Poison("future-version", logical, _mutate(base, schema_version=99), for_all("unsupported_schema_version")),
        Poison("zero-version", logical, _mutate(base, schema_version=0), for_all("invalid_field")),
        Poison("wrong-type", logical, _mutate(base, sample_id=12345), for_all("invalid_field")),
        Poison("missing-field", logical, _mutate(base, dataset=_DROP), for_all("missing_field")),
        Poison("empty", logical, b"", for_all("empty_record")),
        Poison("whitespace", logical, b"  \n ", for_all("empty_record")),
        Poison("tombstone", logical, None, for_all("empty_record")),
        Poison("json-array", logical, b"[1, 2, 3]", for_all("invalid_field")),
        Poison("json-null", logical, b"null", for_all("invalid_field")),
        Poison("ten-mb-name", logical, _mutate(base, sample_id="x" * TEN_MB), for_all("invalid_field")),
    ]


def base_prompt(dataset: str, sample_id: str = "base", **kw: Any) -> PromptPublished:
    """A valid prompt to derive malformed ones from."""
    return PromptPublished(
        dataset=dataset,
        sample_id=sample_id,
        messages=[Message(role="system", content="Be brief."), Message(role="user", content="What is 2+2?")],
        max_tokens=64,
        **kw,
    )


def base_response(dataset: str, profile: str = "deepseek-r1", **kw: Any) -> ResponseReceived:
    """A valid response (text the deepseek-r1 tokenizer can rebuild)."""
    fields: dict[str, Any] = {
        "reasoning": "Two plus two is four.",
        "content": "4",
        "finish_reason": "stop",
        "usage": Usage(prompt_tokens=12, completion_tokens=10, cost=0.00002),
        **kw,
    }
    return ResponseReceived(
        dataset=dataset,
        sample_id="base",
        prompt=base_prompt(dataset),
        provider="simulator",
        model="deepseek/deepseek-v3",
        profile=profile,
        **fields,
    )


def base_sample(dataset: str, profile: str = "deepseek-r1", output_ids: list[int] | None = None) -> SampleReconstructed:
    """A structurally valid sample (its ids need not pass the audit)."""
    prompt_ids = [0, 128803, 17, 18, 128804]
    out = output_ids if output_ids is not None else [19, 20, 128799, 21, 1]
    return SampleReconstructed(
        dataset=dataset,
        sample_id="base",
        profile=profile,
        response=base_response(dataset, profile=profile),
        prompt_ids=prompt_ids,
        output_ids=out,
        loss_mask=[0] * len(prompt_ids) + [1] * len(out),
        method="reencode",
    )


def corpus(dataset: str) -> list[Poison]:
    """Every poison record, for every stage input topic, keyed under ``dataset``."""
    prompt = encode(base_prompt(dataset))
    response = encode(base_response(dataset))
    sample = encode(base_sample(dataset))
    audited = encode(SampleAudited(dataset=dataset, sample_id="base", sample=base_sample(dataset), passed=True))
    request = encode(RequestStarted(dataset=dataset, sample_id="base", max_tokens=64))
    inference = ("inference",)
    both = ("reconstruct", "budget")  # both read responses
    items: list[Poison] = []
    items += _generic("prompts", prompt, inference)
    items += [
        Poison("ten-mb-prompt", "prompts", encode(
            PromptPublished(dataset=dataset, sample_id="huge", messages=[Message(role="user", content="y" * TEN_MB)])
        ), {"inference": "prompt_too_long"}),
        Poison("no-user-turn", "prompts", encode(PromptPublished(
            dataset=dataset, sample_id="nouser", messages=[Message(role="system", content="hi")]
        )), {"inference": "no_user_turn"}),
        Poison("unknown-role", "prompts", json.dumps({
            "dataset": dataset, "sample_id": "role", "messages": [{"role": "robot", "content": "hi"}]
        }).encode(), {"inference": "invalid_field"}),
        Poison("negative-max-tokens", "prompts", _mutate(prompt, max_tokens=-5), {"inference": "invalid_field"}),
        Poison("absurd-max-tokens", "prompts", _mutate(prompt, max_tokens=10**15), {"inference": "invalid_field"}),
        Poison("unknown-dataset", "prompts", encode(base_prompt("no-such-dataset", "other")),
               {"inference": "dataset_mismatch"}),
    ]
    items += _generic("responses", response, both)
    items += [
        Poison("negative-usage", "responses", _mutate(
            response, usage={"prompt_tokens": 5, "completion_tokens": -3}), dict.fromkeys(both, "invalid_field")),
        Poison("absurd-usage", "responses", _mutate(
            response, usage={"prompt_tokens": 5, "completion_tokens": 10**13}), dict.fromkeys(both, "invalid_field")),
        Poison("absurd-cost", "responses", _mutate(
            response, usage={"completion_tokens": 5, "cost": 1e18}), dict.fromkeys(both, "invalid_field")),
        Poison("ids-outside-vocab", "responses", encode(base_response(
            dataset, native_output_ids=[19, 5_000_000, 1])), {"reconstruct": "id_out_of_vocab"}),
        # A response's profile name is only a default (a configured dataset's profile wins, so a
        # replay after a fix uses the fix): it decides only for a dataset the config does not name.
        Poison("unknown-profile", "responses", encode(base_response(
            f"{dataset}-unconfigured", profile="no-such-profile")), {"reconstruct": "unknown_profile"}),
        Poison("tool-json-broken", "responses", encode(base_response(
            dataset, content="", tool_calls=[ToolCall(id="c1", function=ToolFunction(
                name="get_weather", arguments='{"city": "Par'))], finish_reason="tool_calls",
        )), {"reconstruct": "invalid_tool_arguments"}),
    ]
    items += _generic("samples", sample, ("audit",))
    items += [
        Poison("ids-outside-vocab", "samples", encode(base_sample(dataset, output_ids=[19, 5_000_000, 1])),
               {"audit": "ids_in_vocab"}),
        Poison("unknown-profile", "samples", encode(base_sample(dataset, profile="no-such-profile")),
               {"audit": "unknown_profile"}),
        Poison("mask-not-binary", "samples", _mutate(sample, loss_mask=[0, 0, 0, 0, 0, 2, 1, 1, 1, 1]),
               {"audit": "invalid_field"}),
    ]
    items += _generic("accepted", audited, ("sink",))
    items += [
        Poison("not-passed", "accepted", encode(SampleAudited(
            dataset=dataset, sample_id="failed", sample=base_sample(dataset), passed=False, reasons=["x"]
        )), {"sink": "not_accepted"}),
    ]
    items += _generic("requests", request, ("budget",))
    items += [
        Poison("negative-max-tokens", "requests", _mutate(request, max_tokens=-1), {"budget": "invalid_field"}),
        Poison("global-dataset", "requests", _mutate(request, dataset="global"),
               {"budget": "reserved_dataset_name"}),
    ]
    return items


# Control records: unknown or malformed actions are logged and ignored, never a resume.
CONTROL_POISON: list[tuple[str, bytes | None]] = [
    ("unknown-action", json.dumps({"action": "unpause", "scope": "*"}).encode()),
    ("resume-typo", json.dumps({"action": "Resume", "scope": "hostile"}).encode()),
    ("no-action", json.dumps({"scope": "hostile"}).encode()),
    ("invalid-json", b'{"action": "resume", '),
    ("empty", b""),
]
