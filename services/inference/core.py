"""The inference stage's pure decisions: prompt checks, failure classes, offsets, halts.

Nothing here touches Kafka, HTTP, the clock or the environment; the shell in
:mod:`services.inference.app` feeds it facts and acts on what it returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import msgspec

from schemas import (
    LogprobToken,
    PromptPublished,
    RequestStarted,
    ResponseReceived,
    SchemaError,
    ToolCall,
    Usage,
    decode,
    sample_key,
    topology,
)
from services.budget.usage import UNANSWERED_REASONS
from services.common.records import DeadLetter

STAGE = "inference"
GROUP_ID = topology.GROUPS[STAGE]
PREFLIGHT_ACTOR = "preflight"
"""The ``by`` of halts (and resumes) from the checks made before the first paid request."""
OUTAGE_ACTOR = "outage-probe"
"""The ``by`` of outage halts and of the resumes the provider probe publishes."""
RATE_LIMIT_ACTOR = "rate-limit-probe"
"""The ``by`` of the halt a rate limit that admits nothing causes, and of the probe's resume."""
REPAY_HEADER = topology.REPAY_HEADER
"""A prompt record carrying this header (value ``1``) is sent again even if already paid for."""

# Failures that say "the provider (or the way to it) is down", not "this request is bad":
# enough of them in a row halt the provider's workers instead of draining the topic into dead letters.
CONNECTION_REASONS = frozenset(
    {
        "provider_connection_refused",
        "provider_dns",
        "provider_connect_timeout",
        "provider_timeout",
        "provider_connection_closed",
        "provider_connection",
        "provider_tls",
    }
)

# Statuses worth another attempt: the provider or a proxy is overloaded or flaky.
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})
# Statuses that mean "this account cannot spend": no prompt can succeed until a person acts.
FATAL_STATUSES = frozenset({401, 402})


@dataclass(frozen=True)
class ProviderResult:
    """What one provider answer says, whatever the provider's wire shape."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    model: str | None = None
    upstream_provider: str | None = None
    native_output_ids: list[int] | None = None
    native_prompt_ids: list[int] | None = None
    logprobs: list[LogprobToken] | None = None
    # Completions mode: the model's raw text and the exact prompt text that was sent.
    mode: str = "chat"
    text: str = ""
    sent_prompt: str = ""


@dataclass(eq=False)
class ProviderFailure(Exception):  # noqa: N818 - reads better as a verdict than "...Error"
    """A failed provider call, classified: reason code, retryability, status, text."""

    reason: str
    message: str
    retryable: bool
    http_status: int | None = None
    retry_after_s: float | None = None
    fatal: bool = False
    attempt: int = 1
    # The OpenRouter upstream a refusal names (``error.metadata.provider_name``), if any.
    upstream: str | None = None
    # The request rate (per second) a 429's rate-limit headers state, if they state one.
    stated_rps: float | None = None
    # A bare count a 429's ``X-RateLimit-Limit`` states with no period (requests open at once, say).
    stated_count: int | None = None
    # Seconds this prompt waits before its next request (set by the shell: a refusal by an open cap).
    hold_s: float = 0.0
    # The sequence number (OutageDetector.begin) of this prompt's first outage-class failed
    # request (set by the shell): no later request answered means nobody got through.
    answered_mark: int | None = None

    def __str__(self) -> str:
        status = f" (HTTP {self.http_status})" if self.http_status is not None else ""
        return f"{self.reason}{status}: {self.message}"

    def __post_init__(self) -> None:
        super().__init__(self.reason, self.message)


class NotSent(Exception):  # noqa: N818 - a decision, not an error
    """A request withheld at the last moment: its ``may_send`` said no before a byte went out.

    Nothing reached the provider, so nothing is paid, retried or counted as a failure; the
    caller goes back to its halt gate.
    """


def status_reason(status: int) -> str:
    """The dead-letter reason code for a non-success HTTP status."""
    if status == 429:
        return "provider_http_429"
    if status == 408:
        return "provider_http_408"
    if 500 <= status <= 599:
        return "provider_http_5xx"
    return "provider_http_4xx"


def classify_status(status: int, text: str, retry_after: str | None = None) -> ProviderFailure:
    """Classify a non-2xx response: fatal (401/402), retryable (408/429/5xx) or final."""
    if status in FATAL_STATUSES:
        return ProviderFailure(
            reason=f"provider_http_{status}", message=text, retryable=False, http_status=status, fatal=True
        )
    retryable = status in RETRYABLE_STATUSES or 500 <= status <= 599
    return ProviderFailure(
        reason=status_reason(status),
        message=text,
        retryable=retryable,
        http_status=status,
        retry_after_s=parse_retry_after(retry_after) if retryable else None,
    )


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or an HTTP date).

    ``now`` (epoch seconds) is needed only for the date form; without it a date is ignored.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        if now is None:
            return None
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - now)
    if seconds != seconds or seconds < 0:  # NaN or negative: ignore
        return None
    return seconds


def backoff_for(failure: ProviderFailure, cap_s: float) -> bool | float:
    """What the retry policy does after ``failure``: False (give up), True (backoff) or seconds.

    A ``Retry-After`` the provider sent wins over the exponential backoff, capped at ``cap_s``.
    """
    if not failure.retryable or failure.fatal:
        return False
    if failure.retry_after_s is not None:
        return min(failure.retry_after_s, cap_s) if cap_s > 0 else failure.retry_after_s
    return True


def dead_letter_for(failure: ProviderFailure, attempt: int) -> DeadLetter:
    """The dead-letter verdict for a prompt whose provider call failed for good."""
    return DeadLetter(
        reason=failure.reason,
        message=failure.message,
        http_status=failure.http_status,
        attempt=attempt,
    )


def check_prompt(
    value: bytes | None, *, max_prompt_chars: int, topic_dataset: str | None = None
) -> PromptPublished | DeadLetter:
    """Decode and vet one prompt record; a bad one becomes a dead-letter verdict.

    ``topic_dataset`` is the dataset named by the topic the record came from: a prompt
    claiming another dataset would escape that dataset's halts and budget, so it is refused.
    """
    try:
        prompt = decode(value, PromptPublished)
    except SchemaError as exc:
        return DeadLetter(exc.reason, exc.message)
    if topic_dataset is not None and prompt.dataset != topic_dataset:
        return DeadLetter(
            "dataset_mismatch",
            f"prompt says dataset {prompt.dataset!r} but arrived on the topic of {topic_dataset!r}",
        )
    if not any(m.role == "user" for m in prompt.messages):
        return DeadLetter("no_user_turn", f"prompt {prompt.sample_id!r} has no user message")
    size = prompt_chars(prompt)
    if size > max_prompt_chars:
        return DeadLetter(
            "prompt_too_long", f"prompt has {size} characters, more than the limit of {max_prompt_chars}"
        )
    return prompt


def prompt_chars(prompt: PromptPublished) -> int:
    """Characters a prompt sends: every message's text plus its tool calls' arguments."""
    total = 0
    for message in prompt.messages:
        total += len(message.content) + len(message.reasoning_content or "")
        for call in message.tool_calls or ():
            total += len(call.function.name) + len(call.function.arguments)
    return total


def dataset_of_topic(topic: str, prompts_prefix: str) -> str | None:
    """The dataset a physical ``<prefix>prompts.<dataset>`` topic belongs to, else None."""
    if not topic.startswith(prompts_prefix):
        return None
    name = topic[len(prompts_prefix) :]
    return name or None


def request_max_tokens(prompt: PromptPublished, dataset_max_tokens: int) -> int:
    """The completion budget of one request: the prompt's own, else the dataset's."""
    return prompt.max_tokens if prompt.max_tokens else dataset_max_tokens


def request_started(
    prompt: PromptPublished, *, max_tokens: int, worker: str, attempt: int, now: float
) -> RequestStarted:
    """The event announcing that a request (which may spend money) is about to be sent."""
    return RequestStarted(
        dataset=prompt.dataset,
        sample_id=prompt.sample_id,
        max_tokens=max_tokens,
        worker=worker,
        attempt=attempt,
        started_at=now,
    )


def response_event(
    prompt: PromptPublished,
    result: ProviderResult,
    *,
    provider: str,
    model: str,
    profile: str,
    tools_sent: bool,
    max_tokens: int,
    latency_s: float,
    attempt: int,
    now: float,
) -> ResponseReceived:
    """The ``responses`` event for one successful provider call."""
    return ResponseReceived(
        dataset=prompt.dataset,
        sample_id=prompt.sample_id,
        prompt=prompt,
        provider=provider,
        model=result.model or model,
        profile=profile,
        upstream_provider=result.upstream_provider,
        reasoning=result.reasoning,
        content=result.content,
        tool_calls=list(result.tool_calls),
        finish_reason=result.finish_reason,
        native_finish_reason=result.native_finish_reason,
        usage=result.usage,
        native_output_ids=result.native_output_ids,
        native_prompt_ids=result.native_prompt_ids,
        logprobs=result.logprobs,
        tools_sent=tools_sent,
        mode="completions" if result.mode == "completions" else "chat",
        text=result.text,
        sent_prompt=result.sent_prompt,
        request_max_tokens=max_tokens,
        latency_s=max(0.0, latency_s),
        attempt=attempt,
        received_at=now,
    )



# --- the response store ---------------------------------------------------------------

_canonical = msgspec.json.Encoder(order="sorted")


def request_hash(identity: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a request's identity, as canonical JSON with sorted keys.

    The identity is what decides the answer: the messages as sent, the tools sent, the
    model, the sampling parameters (``extra_body``, ``chat_template_kwargs``) and
    ``max_tokens``; two requests with the same hash are the same request.
    """
    return hashlib.sha256(_canonical.encode(identity)).hexdigest()


def store_key(dataset: str, sample_id: str, digest: str) -> str:
    """The response store's key of one request: ``<dataset>:<sample_id>|<request hash>``."""
    return f"{sample_key(dataset, sample_id)}|{digest}"


def wants_repay(headers: Iterable[tuple[str, bytes | None]] | None) -> bool:
    """Whether a prompt record asks to be paid for again (the ``REPAY_HEADER`` set to 1)."""
    for name, value in headers or ():
        if name == REPAY_HEADER and value is not None and value.strip() in (b"1", b"true", b"yes"):
            return True
    return False


# --- outages and pre-flight -------------------------------------------------------------


def is_rate_limited(failure: ProviderFailure) -> bool:
    """A rate-limit refusal (HTTP 429): the run was too fast, never the prompt's fault."""
    return failure.http_status == 429


def may_be_billed(failure: ProviderFailure) -> bool:
    """Whether a failed attempt may still have cost money: sent, and no status read back."""
    return failure.http_status is None and failure.reason in UNANSWERED_REASONS


def is_outage_failure(failure: ProviderFailure) -> bool:
    """A failure that blames the provider rather than the request: connection, timeout, 5xx, 404."""
    if failure.reason in CONNECTION_REASONS:
        return True
    status = failure.http_status
    return status is not None and (status == 404 or 500 <= status <= 599)


@dataclass
class OutageDetector:
    """Counts outage-class failures with no provider answer between them.

    Every request gets a sequence number when it is sent (:meth:`begin`). Only an answer
    to a request sent *after* a failure proves the provider is up again: a request that
    was already in flight when the provider went away may still be answered while every
    new connection is refused. ``answered_seq`` is the highest sequence number answered
    (a success, or a refusal such as 429, which the provider also has to be up to give).
    """

    threshold: int
    consecutive: int = 0
    sent: int = 0
    answered_seq: int = 0
    last_failure_seq: int = 0
    last: ProviderFailure | None = None
    kinds: dict[str, int] = field(default_factory=dict)

    def begin(self) -> int:
        """The sequence number of a request about to be sent."""
        self.sent += 1
        return self.sent

    def failure(self, failure: ProviderFailure, seq: int) -> bool:
        """Note one failed attempt; True when the outage threshold is reached."""
        if not is_outage_failure(failure):
            self.success(seq)  # the provider answered (a 429, a 400...): it is up
            return False
        self.consecutive += 1
        self.last_failure_seq = max(self.last_failure_seq, seq)
        self.last = failure
        kind = failure.reason if failure.http_status is None else f"HTTP {failure.http_status}"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return self.consecutive >= self.threshold

    def success(self, seq: int) -> None:
        """Note an answer to request ``seq``; it ends the streak if sent after its last failure."""
        self.answered_seq = max(self.answered_seq, seq)
        if seq > self.last_failure_seq:
            self.consecutive = 0
            self.kinds.clear()

    def nobody_answered_since(self, failure: ProviderFailure) -> bool:
        """True when no request sent after ``failure``'s prompt first failed got an answer."""
        return failure.answered_mark is not None and self.answered_seq <= failure.answered_mark


def outage_reason(detector: OutageDetector, base_url: str) -> str:
    """The halt reason of an outage, naming what failed and how often."""
    last = detector.last
    kinds = ", ".join(f"{n} x {k}" for k, n in sorted(detector.kinds.items(), key=lambda kv: -kv[1]))
    if last is not None and last.http_status == 404 and detector.kinds.get("HTTP 404", 0) == detector.consecutive:
        return (
            f"base URL answers 404: {detector.consecutive} consecutive requests to {base_url} "
            f"got HTTP 404 (check provider.base_url); last: {last.message[:200]}"
        )
    detail = f"{last.reason}: {last.message[:200]}" if last is not None else "?"
    return f"provider outage at {base_url}: {detector.consecutive} consecutive failures ({kinds}); last {detail}"


@dataclass(frozen=True)
class ProviderCheck:
    """What a pre-flight or probe request found: usable, or why not.

    ``outage`` is True when the cause may go away by itself (unreachable, 5xx, 404 from a
    server still starting): the probe resumes the halt once the provider answers; False
    when a person must act (no key, key refused, model not served). ``unknown`` is True
    with ``ok`` when the provider does not implement the checked endpoint (``GET /models``
    answered 404, 405 or 501): nothing says it is down, so the first real request decides.
    """

    ok: bool
    reason: str = ""
    message: str = ""
    outage: bool = False
    detail: str = ""
    unknown: bool = False
    rate_limit_rps: float | None = None  # the key's request rate as the provider states it
