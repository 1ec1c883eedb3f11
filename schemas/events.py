"""The events that travel between the stages, one msgspec Struct per record type.

Events are named in the past tense, commands in the imperative; a topic that carries several
types has a tagged union (``ControlEvent``, ``LeaseEvent``, ``StoreIndexEvent``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from schemas.fields import SCHEMA_VERSION, Name, NonNegFloat, NonNegInt, Offset, TokenId, Version
from schemas.keys import attempt_key
from schemas.messages import ConversationTurn, Message, ToolCall, wire_messages


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
    # The messages' own text carries the tools (Glaive-style specs in the system message,
    # parsed into ``tools``): they are offered, and never rendered or sent a second time.
    tools_in_text: bool = False

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
    # The configured provider (``[providers.NAME]``, else the ``[provider]`` kind) the request
    # goes to: the budget's figures per provider. "" on records of older workers.
    provider_name: str = ""

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
    # The configured provider that answered (``[providers.NAME]``, else the ``[provider]``
    # kind); ``provider`` is its kind. "" on older records (read as ``provider``).
    provider_name: str = ""

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
    """Command: stop sending requests for a scope: ``global``, a dataset, or ``provider:<name>``.

    A provider scope (:func:`~schemas.keys.provider_scope`) pauses the workers of that
    configured provider only: its outage, pre-flight and refused-account halts.
    """

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


def lease_key(event: LeasePolicy | LeaseRequested | LeaseGranted | LeaseReleased) -> str:
    """The compaction key of a ``leases`` record: ``policy``, or ``<action>|<worker>|<dataset>``."""
    if isinstance(event, LeasePolicy):
        return "policy"
    action = type(event).__struct_config__.tag
    return f"{action}|{event.worker}|{event.dataset}"


class HeldAttempt(Struct, kw_only=True, omit_defaults=True):
    """One attempt the budget holds at its worst case until its own answer arrives."""

    max_tokens: int
    worker: str = ""
    started_at: float = 0.0
    # Its worker's lease expired (the worker died) or its answer is overdue: the provider may
    # have billed it, and no answer will come.
    lost: bool = False
    # The configured provider it was sent to (whose key's usage may release it); "": the default one.
    provider: str = ""


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
    # Only on ``global``: the keys whose latest outcome is a dead letter, with its stage and
    # reason. ``dead_letters`` counts each key once, by its latest failure: a replay that fails
    # again supersedes the dead letter before it, an accepted one removes it. None: not kept
    # (an older ledger), so a replay of an earlier dead letter is counted as a new one.
    dead_letter_keys: dict[str, tuple[str, str]] | None = None
    # A dataset scope's attempts sent and not answered (``inflight``'s keys are their
    # :attr:`RequestStarted.attempt_key`), with who sent them and whether they are lost.
    attempts: dict[str, HeldAttempt] = msgspec.field(default_factory=dict)
    # What the lost attempts hold now (their worst case, or less once reconciled with the
    # provider's key usage), and how many of their prompts were paid again by a later attempt.
    lost_tokens: int = 0
    lost_usd: float | None = None
    lost_repaid: int = 0
    # On ``global`` (the default provider's) and on ``provider:<name>`` scopes: the provider key's
    # usage in USD when this ledger began (None: the provider reports none), and what the last
    # reading left unexplained by the answers.
    key_usage_base_usd: float | None = None
    key_unexplained_usd: float | None = None
    # A ``provider:<name>`` scope: why its lost attempts cannot be released by its key's usage
    # ("" when they can, or none is lost), and its workers (those with attempts in flight).
    unreconciled: str = ""


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
