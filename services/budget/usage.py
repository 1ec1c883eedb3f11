"""What one answer counts: its completion tokens, its usage where the provider reported none, its price: pure.

The budget counts a response by these, and an inference worker its lease, so both agree on
every answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from schemas import LogprobToken, ResponseReceived, ToolCall, Usage

UNANSWERED_REASONS = frozenset({"provider_timeout", "provider_connection_closed", "provider_connection"})
"""Provider failures after the request went out and before an answer was read (no status): the
provider may be generating, and billing, an answer nobody reads (a non-streaming request runs
to its end). Such an attempt stays held; an inference dead letter with this reason releases nothing."""

CHARS_PER_TOKEN = 4
"""Characters per token when a response reports no usage (the usual English rule of thumb)."""


class Answer(Protocol):
    """What an answer needs for its completion count: a response, or a provider's raw result."""

    @property
    def usage(self) -> Usage: ...
    @property
    def native_output_ids(self) -> list[int] | None: ...
    @property
    def logprobs(self) -> list[LogprobToken] | None: ...
    @property
    def reasoning(self) -> str: ...
    @property
    def content(self) -> str: ...
    @property
    def tool_calls(self) -> list[ToolCall]: ...


def completion_tokens_of(answer: Answer) -> int:
    """Completion tokens of an answer: reported usage, else native ids, logprob tokens, characters / 4.

    The budget counts a response by it, and a worker its lease, so both agree on every answer.
    """
    if answer.usage.completion_tokens is not None:
        return answer.usage.completion_tokens
    if answer.native_output_ids is not None:
        return len(answer.native_output_ids)
    if answer.logprobs is not None:
        return len(answer.logprobs)
    chars = len(answer.reasoning) + len(answer.content)
    chars += sum(len(c.function.name) + len(c.function.arguments) for c in answer.tool_calls)
    return math.ceil(chars / CHARS_PER_TOKEN)


def estimate_usage(response: ResponseReceived) -> tuple[int, int, int]:
    """Prompt, completion and reasoning tokens of a response, estimating what usage lacks.

    Reported numbers win. Missing completion tokens come from the native output ids,
    else the logprob tokens, else ``ceil(characters / 4)`` of reasoning, content and tool
    calls; missing prompt tokens from ``ceil(characters / 4)`` of the prompt's messages.
    """
    usage = response.usage
    completion = completion_tokens_of(response)
    reasoning = usage.reasoning_tokens
    if reasoning is None:
        reasoning = min(completion, math.ceil(len(response.reasoning) / CHARS_PER_TOKEN))
    prompt = usage.prompt_tokens
    if prompt is None:
        chars = 0
        for message in response.prompt.messages:
            chars += len(message.content) + len(message.reasoning_content or "")
            chars += sum(len(c.function.name) + len(c.function.arguments) for c in message.tool_calls or ())
        prompt = math.ceil(chars / CHARS_PER_TOKEN)
    return prompt, completion, reasoning


def price_usd(
    prices: Mapping[str, Mapping[str, float]], model: str, prompt_tokens: int, completion_tokens: int
) -> float | None:
    """Dollars from a per-model price table in USD per million tokens; None when unpriced.

    Reasoning tokens are part of ``completion_tokens`` (OpenAI convention), so they are
    not priced twice.
    """
    table = prices.get(model)
    if table is None:
        return None
    return (prompt_tokens * table.get("prompt", 0.0) + completion_tokens * table.get("completion", 0.0)) / 1e6
