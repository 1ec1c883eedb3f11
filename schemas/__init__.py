"""The topic contracts: every event that travels between draftstream's stages.

Evolution follows msgspec's rules: new fields get defaults, existing field types never
change, unknown fields are tolerated on the wire. Every event carries
``schema_version``; a record newer than this code (``schema_version`` above
``SCHEMA_VERSION``) is refused with :class:`SchemaError` rather than half-understood.

Keys on every topic are ``<dataset>:<sample_id>`` (see :func:`sample_key`), except
``control`` (keyed by scope) and ``budget-state`` (keyed by dataset).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
import msgspec.inspect
from msgspec import Meta, Struct

from schemas import topology as _topology

__all__ = [
    "ACCEPTED_TOPIC",
    "BUDGET_STATE_TOPIC",
    "CONTROL_TOPIC",
    "CONVERSATIONS_TOPIC",
    "DEAD_LETTER_TOPIC",
    "DLQ_HEADERS",
    "GLOBAL_SCOPE",
    "HeldAttempt",
    "LEASES_TOPIC",
    "PROMPTS_TOPIC_PREFIX",
    "PROVIDER_FACTS_TOPIC",
    "REQUESTS_TOPIC",
    "RESPONSES_TOPIC",
    "RESPONSE_INDEX_TOPIC",
    "RESPONSE_STORE_TOPIC",
    "SAMPLES_TOPIC",
    "SCHEMA_VERSION",
    "BudgetSnapshot",
    "CheckResult",
    "ControlEvent",
    "ConversationTurn",
    "ConversationProgressed",
    "DeadLetterHeaders",
    "Halt",
    "LeaseEvent",
    "LeaseGranted",
    "LeasePolicy",
    "LeaseReleased",
    "LeaseRequested",
    "LogprobToken",
    "Message",
    "PromptPublished",
    "ProviderFactRecorded",
    "ReplayRecorded",
    "RequestStarted",
    "ResponseIndexed",
    "ResponseReceived",
    "Resume",
    "SampleAudited",
    "SampleReconstructed",
    "SchemaError",
    "StoreCheckpointed",
    "StoreIndexEvent",
    "ToolCall",
    "ToolFunction",
    "Usage",
    "YieldFigures",
    "decode",
    "decode_control",
    "decode_lease",
    "lease_key",
    "attempt_key",
    "decode_store_index",
    "encode",
    "encode_forwarding",
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
# Multi-turn regeneration.
CONVERSATIONS_TOPIC: Final = _topology.CONVERSATIONS
LEASES_TOPIC: Final = _topology.LEASES
RESPONSE_INDEX_TOPIC: Final = _topology.RESPONSE_INDEX
PROVIDER_FACTS_TOPIC: Final = _topology.PROVIDER_FACTS
GLOBAL_SCOPE: Final = "global"

# Bounds that make absurd numbers a decode error instead of a silent corruption.
_MAX_TOKENS = 50_000_000
NonNegInt = Annotated[int, Meta(ge=0, le=_MAX_TOKENS)]
TokenId = Annotated[int, Meta(ge=0, le=10_000_000)]
NonNegFloat = Annotated[float, Meta(ge=0.0, le=1e9)]
# A record newer than this build (``schema_version`` above ``SCHEMA_VERSION``) is refused,
# at every level (a response's prompt too), rather than half-understood.
Version = Annotated[int, Meta(ge=1, le=SCHEMA_VERSION)]
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
    """One chat turn of a prompt (OpenAI ``messages`` shape).

    On the wire an assistant turn with tool calls may carry ``"content": null`` (as OpenAI
    writes it); it decodes to ``""``, what the publisher makes of the same turn.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def wire_messages(messages: list[Message], *, reasoning: bool = False) -> list[dict[str, Any]]:
    """The OpenAI ``messages`` a request carries for a prompt: what the server's template sees.

    ``content`` always present; ``tool_calls``, ``tool_call_id`` and ``name`` when set; earlier
    turns' ``reasoning_content`` only with ``reasoning`` (a multi-turn regeneration passes the
    model's own reasoning back and lets its chat template decide what of it to render; a dataset's
    history written by another model is never sent with its reasoning). The prompt ids are rendered
    from exactly this.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if reasoning and m.role == "assistant" and m.reasoning_content:
            item["reasoning_content"] = m.reasoning_content
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


class ConversationTurn(Struct, kw_only=True, omit_defaults=True):
    """Which turn of which conversation a prompt is, in a ``turns = "all"`` dataset.

    ``original`` is the dataset's whole conversation as published (every assistant turn
    included): the continuation stage takes the next user turn and the cached tool results from
    it. ``turn`` counts the regenerated assistant turns from 0.
    """

    conversation_id: Name
    turn: Annotated[int, Meta(ge=0, le=100_000)]
    original: list[Message]
    # The previous turn's full sequence (prompt + output ids): its length and schemas.prefix.ids_digest.
    # Set from turn 1 on; the row says whether its prompt ids extend it.
    previous_length: NonNegInt = 0
    previous_digest: str = ""


class PromptPublished(Struct, kw_only=True):
    """A prompt waiting for the target model's answer, on ``prompts.<dataset>``.

    ``conversation`` is set on the prompts of a ``turns = "all"`` dataset: their sample id is
    ``<conversation_id>:<turn>`` and their messages carry the regenerated history.
    """

    dataset: Name
    sample_id: Name
    messages: list[Message]
    schema_version: Version = SCHEMA_VERSION
    tools: list[dict[str, Any]] | None = None
    max_tokens: NonNegInt | None = None
    source: str = ""
    published_at: float = 0.0
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    conversation: ConversationTurn | None = None

    @property
    def wire(self) -> list[dict[str, Any]]:
        """The messages as a request carries them (:func:`wire_messages`; reasoning in a regenerated history)."""
        return wire_messages(self.messages, reasoning=self.conversation is not None)


class RequestStarted(Struct, kw_only=True):
    """An inference worker is sending a prompt to the provider: spend may follow (``requests``).

    It is published, and acknowledged, before the request's first byte goes out. When a halt
    lands in between, the request is held back and the same record follows again with
    ``withheld`` set: that attempt was never sent, cost nothing and is no longer in flight.
    """

    dataset: Name
    sample_id: Name
    max_tokens: NonNegInt
    worker: str = ""
    attempt: int = 1
    started_at: float = 0.0
    withheld: bool = False
    schema_version: Version = SCHEMA_VERSION
    # The budget's lease epoch the request was admitted under ("" when no lease was needed).
    lease_epoch: str = ""
    # This attempt's own id (fresh per attempt): the budget holds its worst case until the
    # answer naming it arrives. "" on records of older workers (the budget then keys the
    # attempt by its number).
    attempt_id: str = ""
    # The id of this worker's previous attempt of the same prompt, which ended with an error
    # the worker read (nothing billed): the budget stops holding it. "" for none.
    supersedes: str = ""

    @property
    def attempt_key(self) -> str:
        """``<dataset>:<sample_id>#<attempt id>`` (the attempt number when the id is missing)."""
        return attempt_key(self.dataset, self.sample_id, self.attempt_id or str(self.attempt))


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
    schema_version: Version = SCHEMA_VERSION
    # SHA-256 of the exact request (messages as sent, tools, model, sampling parameters,
    # max_tokens): the response store's key beside dataset and sample id.
    request_hash: str = ""
    # True when this record re-sends a response already paid for (from the response
    # store) rather than a new provider answer: the budget does not count it again.
    reused: bool = False
    # "completions": the prompt was rendered by the profile's template and sent as text to
    # the provider's text-completions endpoint; ``text`` is the model's raw output (specials
    # kept, the stop token dropped by the server's detokenizer) and ``sent_prompt`` the exact
    # prompt text sent. "chat": ``reasoning``/``content``/``tool_calls`` as the server parsed them.
    mode: Literal["chat", "completions"] = "chat"
    text: str = ""
    sent_prompt: str = ""
    # The id of the attempt (its RequestStarted) this answer answers; "" on older records.
    attempt_id: str = ""

    @property
    def attempt_key(self) -> str:
        """The :attr:`RequestStarted.attempt_key` of the attempt this answers."""
        return attempt_key(self.dataset, self.sample_id, self.attempt_id or str(self.attempt))


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


class YieldFigures(Struct, kw_only=True):
    """Audit verdicts of a dataset (or of one upstream serving it), as the budget's quality halt saw them.

    ``window_*`` cover the last ``[budget] quality_window`` verdicts; ``verdicts`` and
    ``accepted`` every verdict counted since the budget's first start; ``window_reasons``
    the primary dead-letter reason codes inside the window; ``kept_completion_tokens`` the
    paid completion tokens of the accepted samples (tokens kept, against tokens paid).
    """

    verdicts: int = 0
    accepted: int = 0
    window_verdicts: int = 0
    window_accepted: int = 0
    window_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    kept_completion_tokens: int = 0
class LeasePolicy(Struct, kw_only=True, tag="policy", tag_field="action"):
    """The budget's announcement on ``leases``: whether requests need a lease, and its epoch.

    A new epoch (a budget restart) voids every grant of an older one.
    """

    epoch: Name
    in_force: bool = True
    ttl_s: NonNegFloat = 10.0
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


class LeaseRequested(Struct, kw_only=True, tag="request", tag_field="action"):
    """A worker asks for (or renews) headroom of one dataset: a cumulative grant of ``target`` tokens.

    ``step`` is one waiting request's worst case: the budget grants whole steps only.
    """

    worker: Name
    dataset: Name
    epoch: str
    target: NonNegInt = 0
    step: NonNegInt = 0
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


class LeaseGranted(Struct, kw_only=True, tag="grant", tag_field="action"):
    """The budget's lease of one worker and dataset: cumulative ``granted`` tokens, valid ``ttl_s``.

    The worker keeps the worst case of its requests in flight plus what its answers used
    (this epoch) within ``granted``; ``unlimited`` when no cap applies to the dataset.
    ``releases``: how many of the worker's :class:`LeaseReleased` the budget had applied when
    it granted this; a grant decided before the worker's last release is stale (the worker
    ignores it: its room went back to the budget).
    """

    worker: Name
    dataset: Name
    epoch: Name
    granted: NonNegInt = 0
    unlimited: bool = False
    ttl_s: NonNegFloat = 10.0
    releases: NonNegInt = 0
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


class LeaseReleased(Struct, kw_only=True, tag="release", tag_field="action"):
    """A worker gives its unused headroom of a dataset back: it stops, or it has nothing of the
    dataset to send (a killed one's lease expires instead).

    ``releases`` counts the worker's releases of this lease in the epoch, this one included.
    """

    worker: Name
    dataset: Name
    epoch: str
    releases: NonNegInt = 0
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


LeaseEvent = LeasePolicy | LeaseRequested | LeaseGranted | LeaseReleased


class HeldAttempt(Struct, kw_only=True, omit_defaults=True):
    """One attempt the budget holds at its worst case until its own answer arrives."""

    max_tokens: int
    worker: str = ""
    started_at: float = 0.0
    # Its worker's lease expired (the worker died) or its answer is overdue: the provider may
    # have billed it, and no answer will come.
    lost: bool = False


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
    # The quality halt's figures of a dataset scope, and per upstream (OpenRouter's ``provider``).
    quality: YieldFigures | None = None
    upstreams: dict[str, YieldFigures] = msgspec.field(default_factory=dict)
    # The ``global`` scope's tallies of the records it read on ``dead-letter`` (stage -> reason ->
    # count) and of the truncated answers accepted (dataset -> count), up to its ``offsets``:
    # ``status`` reads only the records after them instead of both topics whole. None: no
    # tally (another scope, or a ledger begun before tallies, which ``status`` reads whole).
    dead_letters: dict[str, dict[str, int]] | None = None
    accepted_truncated: dict[str, int] | None = None
    # A dataset scope's attempts sent and not answered (``inflight``'s keys are their
    # :attr:`RequestStarted.attempt_key`), with who sent them and whether they are lost.
    attempts: dict[str, HeldAttempt] = msgspec.field(default_factory=dict)
    # What the lost attempts hold now (their worst case, or less once reconciled with the
    # provider's key usage), and how many of their prompts were paid again by a later attempt.
    lost_tokens: int = 0
    lost_usd: float | None = None
    lost_repaid: int = 0
    # Only on ``global``: the provider key's usage in USD when this ledger began (None: the
    # provider reports none), and what the last reading left unexplained by the answers.
    key_usage_base_usd: float | None = None
    key_unexplained_usd: float | None = None


class ReplayRecorded(Struct, kw_only=True):
    """A dead letter was re-sent, on ``dlq-replayed`` keyed by its ``<partition>:<offset>``."""

    topic: str
    key: str = ""
    replay_count: NonNegInt = 1
    replayed_at_ms: int = 0
    schema_version: Version = SCHEMA_VERSION


class ConversationProgressed(Struct, kw_only=True):
    """Where a multi-turn conversation stands, on ``conversation-state`` keyed ``<dataset>:<conversation_id>``.

    The continuation stage writes one per accepted turn: ``in_progress`` (turn ``next_turn`` was
    published), ``finished`` (the last turn was regenerated) or ``ended_early`` with ``reason``
    (a regenerated tool call named another function, the turn structure diverged, ...). The topic
    is compacted: the latest record of a conversation is its state.
    """

    dataset: Name
    conversation_id: Name
    state: Literal["in_progress", "finished", "ended_early"]
    turns_done: NonNegInt
    next_turn: NonNegInt | None = None
    reason: str = ""
    message: str = ""
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


class ProviderFactRecorded(Struct, kw_only=True):
    """A fact of one upstream, proven by one answer, on ``provider-facts`` keyed by ``<upstream>|<place>``.

    ``place`` is where a stripping server would remove whitespace (``reasoning_start``,
    ``reasoning_end``, ``content_start``, ...) and the fact says the upstream keeps it there,
    because the answer ``evidence`` (a sample key) shows whitespace at that place. A later
    answer whose own count shows whitespace missing there withdraws it: ``withdrawn`` with the
    contradicting sample key in ``contradicted_by`` (services/reconstruct/facts.py).
    ``place`` ``strips_at_edges`` says the opposite: the upstream, said to keep whitespace, lost
    it in answer ``evidence`` (``reason`` says how); never withdrawn (services/reconstruct/verify.py).
    """

    upstream: Name
    place: Name
    evidence: str = ""
    withdrawn: bool = False
    contradicted_by: str = ""
    reason: str = ""
    at: float = 0.0
    schema_version: Version = SCHEMA_VERSION


Offset = Annotated[int, Meta(ge=0)]


class ResponseIndexed(Struct, kw_only=True, tag="indexed", tag_field="kind"):
    """A paid response sits on ``response-store`` at this partition and offset (on ``response-index``).

    Keyed like the store record; a tombstone there is a tombstone here.
    """

    partition: Offset
    offset: Offset
    schema_version: Version = SCHEMA_VERSION


class StoreCheckpointed(Struct, kw_only=True, tag="checkpoint", tag_field="kind"):
    """Every ``response-store`` record of ``partition`` below ``next_offset`` is on ``response-index``.

    Keyed ``#<partition>``: a worker starting reads the index, then the store only from here.
    """

    partition: Offset
    next_offset: Offset
    schema_version: Version = SCHEMA_VERSION


StoreIndexEvent = ResponseIndexed | StoreCheckpointed


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
    # "true" when the failed record had no value (a tombstone): the dead letter's value is null
    # too, and a replay sends a tombstone again rather than an empty string.
    VALUE_NULL: Final = "draftstream.errors.value.null"


DLQ_HEADERS: Final = DeadLetterHeaders


class SchemaError(ValueError):
    """A record that does not decode as its schema; ``reason`` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


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


def lease_key(event: LeasePolicy | LeaseRequested | LeaseGranted | LeaseReleased) -> str:
    """The compaction key of a ``leases`` record: ``policy``, or ``<action>|<worker>|<dataset>``."""
    if isinstance(event, LeasePolicy):
        return "policy"
    action = type(event).__struct_config__.tag
    return f"{action}|{event.worker}|{event.dataset}"


def decode_store_index(data: bytes | None) -> ResponseIndexed | StoreCheckpointed:
    """Decode a ``response-index`` record; raises :class:`SchemaError` for anything else."""
    if data is None or not data.strip():
        raise SchemaError("empty_record", "response-index record has no value")
    obj: ResponseIndexed | StoreCheckpointed = _decode_wire(data, ResponseIndexed | StoreCheckpointed)
    return obj


def sample_key(dataset: str, sample_id: str) -> str:
    """The record key shared by every per-sample topic."""
    return f"{dataset}:{sample_id}"


def attempt_key(dataset: str, sample_id: str, attempt_id: str) -> str:
    """``<dataset>:<sample_id>#<attempt id>``: one attempt of a prompt, as the budget holds it."""
    return f"{sample_key(dataset, sample_id)}#{attempt_id}"


def split_key(key: str) -> tuple[str, str]:
    """Split a ``<dataset>:<sample_id>`` key; the sample id may itself contain colons."""
    dataset, sep, sample_id = key.partition(":")
    if not sep:
        raise SchemaError("invalid_key", f"key {key!r} is not '<dataset>:<sample_id>'")
    return dataset, sample_id
