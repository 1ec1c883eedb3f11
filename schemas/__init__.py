"""The topic contracts: every event that travels between draftstream's stages.

Evolution follows msgspec's rules: new fields get defaults, existing field types never
change, unknown fields are tolerated on the wire. Every event carries
``schema_version``; a record newer than this code (``schema_version`` above
``SCHEMA_VERSION``) is refused with :class:`SchemaError` rather than half-understood.

Keys on every topic are ``<dataset>:<sample_id>`` (see :func:`sample_key`), except
``control`` (keyed by scope) and ``budget-state`` (keyed by dataset).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from schemas import topology as _topology

__all__ = [
    "ACCEPTED_TOPIC",
    "BUDGET_STATE_TOPIC",
    "CONTROL_TOPIC",
    "DEAD_LETTER_TOPIC",
    "DLQ_HEADERS",
    "GLOBAL_SCOPE",
    "PROMPTS_TOPIC_PREFIX",
    "REQUESTS_TOPIC",
    "RESPONSES_TOPIC",
    "RESPONSE_STORE_TOPIC",
    "SAMPLES_TOPIC",
    "SCHEMA_VERSION",
    "BudgetSnapshot",
    "CheckResult",
    "ControlEvent",
    "DeadLetterHeaders",
    "Halt",
    "LogprobToken",
    "Message",
    "PromptPublished",
    "ReplayRecorded",
    "RequestStarted",
    "ResponseReceived",
    "Resume",
    "SampleAudited",
    "SampleReconstructed",
    "SchemaError",
    "ToolCall",
    "ToolFunction",
    "Usage",
    "decode",
    "decode_control",
    "encode",
    "sample_key",
    "split_key",
    "wire_messages",
]

SCHEMA_VERSION: Final = 1

# Logical topic names, declared in schemas.topology (a configured prefix is prepended by
# services.common.config).
PROMPTS_TOPIC_PREFIX: Final = _topology.PROMPTS_PREFIX
REQUESTS_TOPIC: Final = _topology.REQUESTS
RESPONSES_TOPIC: Final = _topology.RESPONSES
SAMPLES_TOPIC: Final = _topology.SAMPLES
ACCEPTED_TOPIC: Final = _topology.ACCEPTED
DEAD_LETTER_TOPIC: Final = _topology.DEAD_LETTER
CONTROL_TOPIC: Final = _topology.CONTROL
BUDGET_STATE_TOPIC: Final = _topology.BUDGET_STATE
RESPONSE_STORE_TOPIC: Final = _topology.RESPONSE_STORE
GLOBAL_SCOPE: Final = "global"

# Bounds that make absurd numbers a decode error instead of a silent corruption.
_MAX_TOKENS = 50_000_000
NonNegInt = Annotated[int, Meta(ge=0, le=_MAX_TOKENS)]
TokenId = Annotated[int, Meta(ge=0, le=10_000_000)]
NonNegFloat = Annotated[float, Meta(ge=0.0, le=1e9)]
Version = Annotated[int, Meta(ge=1)]
Name = Annotated[str, Meta(min_length=1, max_length=200)]


class ToolFunction(Struct, kw_only=True, omit_defaults=True):
    """A function call: its name and its arguments as a JSON text (OpenAI shape)."""

    name: str
    arguments: str = "{}"


class ToolCall(Struct, kw_only=True, omit_defaults=True):
    """One structured tool call, as OpenAI-compatible APIs return it."""

    function: ToolFunction
    id: str = ""
    type: str = "function"


class Message(Struct, kw_only=True, omit_defaults=True):
    """One chat turn of a prompt (OpenAI ``messages`` shape)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def wire_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The OpenAI ``messages`` a request carries for a prompt: what the server's template sees.

    ``content`` always present; ``tool_calls``, ``tool_call_id`` and ``name`` when set; earlier
    turns' ``reasoning_content`` is never sent. The prompt ids are rendered from exactly this.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


class PromptPublished(Struct, kw_only=True):
    """A prompt waiting for the target model's answer, on ``prompts.<dataset>``."""

    dataset: Name
    sample_id: Name
    messages: list[Message]
    schema_version: Version = SCHEMA_VERSION
    tools: list[dict[str, Any]] | None = None
    max_tokens: NonNegInt | None = None
    source: str = ""
    published_at: float = 0.0
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


class RequestStarted(Struct, kw_only=True):
    """An inference worker sent a prompt to the provider: spend may follow (``requests``)."""

    dataset: Name
    sample_id: Name
    max_tokens: NonNegInt
    worker: str = ""
    attempt: int = 1
    started_at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


class Usage(Struct, kw_only=True, omit_defaults=True):
    """Token and cost accounting as reported by the provider."""

    prompt_tokens: NonNegInt | None = None
    completion_tokens: NonNegInt | None = None
    reasoning_tokens: NonNegInt | None = None
    cost: NonNegFloat | None = None


class LogprobToken(Struct, kw_only=True, omit_defaults=True):
    """One generated token as a provider's logprobs report it (string and/or bytes)."""

    token: str
    bytes: list[Annotated[int, Meta(ge=0, le=255)]] | None = None
    logprob: float | None = None
    id: TokenId | None = None


class ResponseReceived(Struct, kw_only=True):
    """The provider's answer to one prompt, on ``responses``; carries its prompt along."""

    dataset: Name
    sample_id: Name
    prompt: PromptPublished
    provider: str
    model: str
    profile: str = ""
    upstream_provider: str | None = None
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    native_output_ids: list[TokenId] | None = None
    logprobs: list[LogprobToken] | None = None
    # The prompt ids the server says it fed the model (vLLM/SGLang can return them).
    native_prompt_ids: list[TokenId] | None = None
    tools_sent: bool = False
    request_max_tokens: NonNegInt | None = None
    latency_s: NonNegFloat = 0.0
    attempt: Annotated[int, Meta(ge=1)] = 1
    received_at: float = 0.0
    # Simulator-only ground truth for tests; no stage ever relies on it.
    debug_true_ids: list[int] | None = None
    schema_version: Version = SCHEMA_VERSION
    # SHA-256 of the exact request (messages as sent, tools, model, sampling parameters,
    # max_tokens): the response store's key beside dataset and sample id.
    request_hash: str = ""
    # True when this record re-sends a response already paid for (from the response
    # store) rather than a new provider answer: the budget does not count it again.
    reused: bool = False


class SampleReconstructed(Struct, kw_only=True):
    """Exact token ids of one prompt and its answer, on ``samples``.

    ``input_ids`` is ``prompt_ids + output_ids``; ``loss_mask`` is 0 over the prompt and
    1 over the output.
    """

    dataset: Name
    sample_id: Name
    profile: str
    response: ResponseReceived
    prompt_ids: list[TokenId]
    output_ids: list[TokenId]
    loss_mask: list[Annotated[int, Meta(ge=0, le=1)]]
    method: Literal["native", "logprobs", "reencode"]
    prompt_text: str = ""
    schema_version: Version = SCHEMA_VERSION


class CheckResult(Struct, kw_only=True, omit_defaults=True):
    """The outcome of one named audit check."""

    code: str
    passed: bool
    message: str = ""
    value: float | None = None


class SampleAudited(Struct, kw_only=True):
    """A sample with its audit verdict, on ``accepted`` when it passed."""

    dataset: Name
    sample_id: Name
    sample: SampleReconstructed
    passed: bool
    results: list[CheckResult] = msgspec.field(default_factory=list)
    reasons: list[str] = msgspec.field(default_factory=list)
    audited_at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


class Halt(Struct, kw_only=True, tag="halt", tag_field="action"):
    """Command: stop sending requests for a scope (``global`` or a dataset)."""

    scope: Name
    reason: str = ""
    by: str = ""
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


class Resume(Struct, kw_only=True, tag="resume", tag_field="action"):
    """Command: lift a halt for a scope."""

    scope: Name
    reason: str = ""
    by: str = ""
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


ControlEvent = Halt | Resume


class BudgetSnapshot(Struct, kw_only=True):
    """The budget service's totals for one scope, checkpointed on ``budget-state``.

    ``offsets`` maps ``"<topic>:<partition>"`` to the next offset not yet counted, so a
    restarted service resumes without forgetting or double-counting a response.
    """

    scope: Name
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0
    requests: int = 0
    responses_without_usage: int = 0
    cap_completion_tokens: int | None = None
    cap_usd: float | None = None
    state: Literal["running", "soft-limit", "halted"] = "running"
    halted_by: str = ""
    halted_reason: str = ""
    offsets: dict[str, int] = msgspec.field(default_factory=dict)
    updated_at: float = 0.0
    schema_version: Version = SCHEMA_VERSION
    # Added by the budget service (defaults keep older snapshots decodable).
    responses: int = 0
    # Requests sent but not yet answered: "<dataset>:<sample_id>" -> max_tokens.
    inflight: dict[str, int] = msgspec.field(default_factory=dict)
    inflight_tokens: int = 0
    rate_usd_per_s: float = 0.0
    rate_tokens_per_s: float = 0.0
    remaining_prompts: int | None = None
    projected_usd: float | None = None
    projected_completion_tokens: int | None = None


class ReplayRecorded(Struct, kw_only=True):
    """A dead letter was re-sent, on ``dlq-replayed`` keyed by its ``<partition>:<offset>``."""

    topic: str
    key: str = ""
    replay_count: NonNegInt = 1
    replayed_at_ms: int = 0
    schema_version: Version = SCHEMA_VERSION


class DeadLetterHeaders:
    """Header names on ``dead-letter`` records, in the style of Kafka Connect's DLQ."""

    STAGE: Final = "draftstream.errors.stage"
    REASON: Final = "draftstream.errors.reason"
    REASONS: Final = "draftstream.errors.reasons"
    MESSAGE: Final = "draftstream.errors.message"
    HTTP_STATUS: Final = "draftstream.errors.http.status"
    TOPIC: Final = "draftstream.errors.topic"
    PARTITION: Final = "draftstream.errors.partition"
    OFFSET: Final = "draftstream.errors.offset"
    DATASET: Final = "draftstream.errors.dataset"
    KEY: Final = "draftstream.errors.key"
    ATTEMPT: Final = "draftstream.errors.attempt"
    REPLAY_COUNT: Final = "draftstream.errors.replay.count"
    FIRST_FAILURE: Final = "draftstream.errors.first.failure.ms"
    FAILED_AT: Final = "draftstream.errors.failed.at.ms"


DLQ_HEADERS: Final = DeadLetterHeaders


class SchemaError(ValueError):
    """A record that does not decode as its schema; ``reason`` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t)
    for t in (
        PromptPublished,
        RequestStarted,
        ResponseReceived,
        SampleReconstructed,
        SampleAudited,
        BudgetSnapshot,
    )
}
_control_decoder: msgspec.json.Decoder[Halt | Resume] = msgspec.json.Decoder(Halt | Resume)
_version_probe = msgspec.json.Decoder(dict[str, Any])


def encode(event: Struct) -> bytes:
    """Serialise any event to its JSON wire form."""
    return _encoder.encode(event)


def _classify(exc: msgspec.DecodeError | msgspec.ValidationError, data: bytes) -> SchemaError:
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        reason = "missing_field" if "missing required field" in text.lower() else "invalid_field"
        return SchemaError(reason, text)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return SchemaError("invalid_utf8", f"not UTF-8: {text}")
    return SchemaError("invalid_json", text)


def _check_version(obj: Any) -> None:
    version = getattr(obj, "schema_version", SCHEMA_VERSION)
    if version > SCHEMA_VERSION:
        raise SchemaError(
            "unsupported_schema_version",
            f"schema_version {version} is newer than this build understands ({SCHEMA_VERSION})",
        )


def decode(data: bytes | None, type_: type[T]) -> T:
    """Decode a wire record as ``type_``; raises :class:`SchemaError` naming what is wrong."""
    if data is None:
        raise SchemaError("empty_record", "record has no value (tombstone)")
    if not data.strip():
        raise SchemaError("empty_record", "record value is empty")
    try:
        obj: T = _decoders[type_].decode(data)
    except UnicodeDecodeError as exc:  # msgspec raises this (not DecodeError) for bad UTF-8 in a string
        raise SchemaError("invalid_utf8", f"not UTF-8: {exc}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _classify(exc, data) from None
    _check_version(obj)
    return obj


def decode_control(data: bytes | None) -> Halt | Resume:
    """Decode a control record; raises :class:`SchemaError` for anything not a known action."""
    if data is None or not data.strip():
        raise SchemaError("empty_record", "control record has no value")
    try:
        obj = _control_decoder.decode(data)
    except UnicodeDecodeError as exc:
        raise SchemaError("invalid_utf8", f"not UTF-8: {exc}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        text = str(exc)
        if "Invalid value" in text and "action" in text:
            raise SchemaError("unknown_action", text) from None
        raise _classify(exc, data) from None
    _check_version(obj)
    return obj


def sample_key(dataset: str, sample_id: str) -> str:
    """The record key shared by every per-sample topic."""
    return f"{dataset}:{sample_id}"


def split_key(key: str) -> tuple[str, str]:
    """Split a ``<dataset>:<sample_id>`` key; the sample id may itself contain colons."""
    dataset, sep, sample_id = key.partition(":")
    if not sep:
        raise SchemaError("invalid_key", f"key {key!r} is not '<dataset>:<sample_id>'")
    return dataset, sample_id
