"""Rebuild the token ids of a response: pure functions over schema objects and a profile.

Output ids come, in order of trust, from the provider's native ids (``native``), from
its logprob tokens mapped to vocabulary ids (``logprobs``), else from re-encoding the
text with the specials providers strip put back (``reencode``):
``reasoning + THINK_END + content + native tool calls + END_OF_TURN``.

Prompt ids are the encoded chat template (generation prompt on, which for thinking
profiles ends with the think-start token); the loss mask is 0 over them and 1 over the
output. Bad input is a :class:`DeadLetter` with a stable reason code, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from schemas import (
    LogprobToken,
    Message,
    ResponseReceived,
    SampleReconstructed,
    SchemaError,
    ToolCall,
    decode,
    sample_key,
)
from services.common.records import DeadLetter
from services.profiles import ProfileError

__all__ = [
    "EMPTY_RESPONSE",
    "LineResult",
    "ID_OUT_OF_VOCAB",
    "INVALID_TOOL_ARGUMENTS",
    "LOGPROBS_UNMAPPABLE",
    "SPECIAL_TOKEN_IN_TEXT",
    "ReconstructProfile",
    "reconstruct",
    "reconstruct_batch",
    "reconstruct_lines",
]

EMPTY_RESPONSE = "empty_response"
INVALID_TOOL_ARGUMENTS = "invalid_tool_arguments"
SPECIAL_TOKEN_IN_TEXT = "special_token_in_text"  # noqa: S105 - a reason code
LOGPROBS_UNMAPPABLE = "logprobs_unmappable"
ID_OUT_OF_VOCAB = "id_out_of_vocab"
TEMPLATE_ERROR = "chat_template_error"


class ReconstructProfile(Protocol):
    """The part of ``services.profiles.Profile`` reconstruction uses."""

    name: str
    end_of_turn: str
    end_of_turn_id: int
    think_start: str | None
    think_end: str | None
    think_end_id: int | None
    tool_tokens: dict[str, int]
    vocab_size: int
    special_ids: frozenset[int]

    @property
    def special_strings(self) -> tuple[str, ...]:
        """Every special token string of the profile."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode with specials parsed, no BOS."""
        ...

    def id_of_bytes(self, b: bytes) -> int | None:
        """The id whose bytes are exactly ``b``."""
        ...

    def id_of_token_string(self, s: str) -> int | None:
        """The id of a raw vocabulary string."""
        ...

    def token_strings(self, ids: list[int]) -> list[str]:
        """Raw vocabulary strings of ids."""
        ...

    def render_prompt(self, messages: Sequence[Message], tools: list[dict[str, object]] | None) -> str:
        """The chat-templated prompt, generation prompt on."""
        ...

    def render_output(
        self,
        *,
        reasoning: str,
        content: str,
        tool_calls: Sequence[ToolCall] = (),
        finished: bool = True,
        reasoning_closed: bool = True,
    ) -> str:
        """Output text with the stripped specials put back."""
        ...


@dataclass
class _Plan:
    """One response half-way: the texts to encode, or ids already known."""

    response: ResponseReceived
    prompt_text: str
    output_text: str | None
    output_ids: list[int] | None
    method: str
    think_ends: int = 0
    end_of_turns: int = 0


_TOKEN_ID_FORM = re.compile(r"^token_id:(\d+)$")


def _check_ids(ids: Sequence[int], profile: ReconstructProfile, what: str) -> DeadLetter | None:
    bad = [i for i in ids if not 0 <= i < profile.vocab_size]
    if bad:
        return DeadLetter(
            ID_OUT_OF_VOCAB,
            f"{len(bad)} {what} id(s) outside the {profile.name} vocabulary ({profile.vocab_size}), e.g. {bad[0]}",
        )
    return None


def _logprob_id(token: LogprobToken, profile: ReconstructProfile) -> int | None:
    """Vocabulary id of one logprob token: explicit id, exact bytes, "token_id:N", or its text."""
    if token.id is not None:
        return token.id
    if token.bytes is not None:
        return profile.id_of_bytes(bytes(token.bytes))
    match = _TOKEN_ID_FORM.match(token.token)
    if match:
        return int(match.group(1))
    found = profile.id_of_bytes(token.token.encode("utf-8"))
    if found is None:
        found = profile.id_of_token_string(token.token)
    return found


def _ids_from_logprobs(response: ResponseReceived, profile: ReconstructProfile) -> list[int] | DeadLetter:
    tokens = response.logprobs or []
    ids: list[int] = []
    for position, token in enumerate(tokens):
        found = _logprob_id(token, profile)
        if found is None:
            return DeadLetter(
                LOGPROBS_UNMAPPABLE,
                f"logprob token {position} ({token.token!r}) matches no {profile.name} vocabulary entry",
            )
        ids.append(found)
    # Providers differ on whether the final end-of-turn is listed: a finished answer has it.
    if response.finish_reason != "length" and (not ids or ids[-1] != profile.end_of_turn_id):
        ids.append(profile.end_of_turn_id)
    return ids


def _check_text(response: ResponseReceived, profile: ReconstructProfile) -> DeadLetter | None:
    """Specials that cannot stand in provider text (they would encode as special ids)."""
    tool_strings = set(profile.tool_tokens)
    for where, text in (("reasoning", response.reasoning), ("content", response.content)):
        for special in profile.special_strings:
            # Raw tool-call text in content is how a model answers without a tools parameter.
            if where == "content" and special in tool_strings and not response.tool_calls:
                continue
            if special in text:
                return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"{where} contains the special token {special!r}")
    for index, call in enumerate(response.tool_calls):
        for special in profile.special_strings:
            if special in call.function.name or special in call.function.arguments:
                return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"tool call {index} contains the special token {special!r}")
    return None


def _check_tool_calls(calls: Sequence[ToolCall]) -> DeadLetter | None:
    for index, call in enumerate(calls):
        if not call.function.name:
            return DeadLetter(INVALID_TOOL_ARGUMENTS, f"tool call {index} has no function name")
        try:
            json.loads(call.function.arguments)
        except ValueError as exc:
            return DeadLetter(
                INVALID_TOOL_ARGUMENTS,
                f"tool call {index} ({call.function.name}): arguments are not JSON: {exc}",
            )
    return None


def _plan(response: ResponseReceived, profile: ReconstructProfile) -> _Plan | DeadLetter:
    """Decide the method and the texts to encode for one response."""
    # The prompt ids must be what the model saw: tool definitions reach the template only
    # when the request carried them as `tools`; otherwise they are in the message text or
    # the model never saw them.
    tools = response.prompt.tools if response.tools_sent else None
    try:
        prompt_text = profile.render_prompt(response.prompt.messages, tools)
    except Exception as exc:  # a template error is this record's fault, not the stage's
        return DeadLetter(TEMPLATE_ERROR, f"chat template of {profile.name} failed: {type(exc).__name__}: {exc}")
    if response.native_output_ids is not None and response.native_output_ids:
        bad = _check_ids(response.native_output_ids, profile, "native output")
        if bad is not None:
            return bad
        return _Plan(response, prompt_text, None, list(response.native_output_ids), "native")
    if response.logprobs:
        ids = _ids_from_logprobs(response, profile)
        if isinstance(ids, DeadLetter):
            return ids
        bad = _check_ids(ids, profile, "logprob")
        if bad is not None:
            return bad
        return _Plan(response, prompt_text, None, ids, "logprobs")
    if not response.reasoning and not response.content and not response.tool_calls:
        return DeadLetter(EMPTY_RESPONSE, "the response has no reasoning, no content and no tool calls")
    bad = _check_tool_calls(response.tool_calls) or _check_text(response, profile)
    if bad is not None:
        return bad
    truncated = response.finish_reason == "length"
    # A truncated answer whose reasoning never closed stopped inside the think block: its
    # true ids are the reasoning alone (no think-end, no content, no end-of-turn).
    reasoning_closed = not truncated or bool(response.content or response.tool_calls)
    try:
        output_text = profile.render_output(
            reasoning=response.reasoning,
            content=response.content,
            tool_calls=response.tool_calls,
            finished=not truncated,
            reasoning_closed=reasoning_closed,
        )
    except ProfileError as exc:  # e.g. structured tool calls for a profile without a format
        return DeadLetter(exc.reason, exc.message)
    expected_think_ends = 1 if profile.think_end is not None and reasoning_closed else 0
    return _Plan(response, prompt_text, output_text, None, "reencode", expected_think_ends, 0 if truncated else 1)


def _check_output_ids(plan: _Plan, ids: list[int], profile: ReconstructProfile) -> DeadLetter | None:
    """After re-encoding: no special id the text should not hold, and each special once.

    Catches every added token of the vocabulary (thousands for some models), which a
    substring scan for the declared ones cannot.
    """
    allowed = {profile.end_of_turn_id, *profile.tool_tokens.values()}
    if profile.think_end_id is not None:
        allowed.add(profile.think_end_id)
    for i in ids:
        if i in profile.special_ids and i not in allowed:
            (text,) = profile.token_strings([i])
            return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"the text contains the special token {text!r} (id {i})")
    if profile.think_end_id is not None and ids.count(profile.think_end_id) != plan.think_ends:
        return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"the output holds {ids.count(profile.think_end_id)} think-end tokens")
    if ids.count(profile.end_of_turn_id) != plan.end_of_turns:
        return DeadLetter(
            SPECIAL_TOKEN_IN_TEXT, f"the output holds {ids.count(profile.end_of_turn_id)} end-of-turn tokens"
        )
    return None


def _sample(
    plan: _Plan, profile: ReconstructProfile, prompt_ids: list[int], output_ids: list[int]
) -> SampleReconstructed:
    response = plan.response
    return SampleReconstructed(
        dataset=response.dataset,
        sample_id=response.sample_id,
        profile=profile.name,
        response=response,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(output_ids),
        method=plan.method,  # type: ignore[arg-type]  # one of the three literals above
        prompt_text=plan.prompt_text,
    )


def reconstruct_batch(
    responses: Sequence[ResponseReceived], profile: ReconstructProfile
) -> list[SampleReconstructed | DeadLetter]:
    """Rebuild many responses of one profile with a single ``encode_batch`` call."""
    plans: list[_Plan | DeadLetter] = [_plan(r, profile) for r in responses]
    texts: list[str] = []
    for plan in plans:
        if isinstance(plan, _Plan):
            texts.append(plan.prompt_text)
            if plan.output_text is not None:
                texts.append(plan.output_text)
    encoded = iter(profile.encode_batch(texts))
    out: list[SampleReconstructed | DeadLetter] = []
    for plan in plans:
        if isinstance(plan, DeadLetter):
            out.append(plan)
            continue
        prompt_ids = next(encoded)
        output_ids = next(encoded) if plan.output_text is not None else plan.output_ids or []
        if not output_ids:
            out.append(DeadLetter(EMPTY_RESPONSE, "the rebuilt output has no tokens"))
            continue
        if plan.output_text is not None:
            bad = _check_output_ids(plan, output_ids, profile)
            if bad is not None:
                out.append(bad)
                continue
        out.append(_sample(plan, profile, prompt_ids, output_ids))
    return out


def reconstruct(response: ResponseReceived, profile: ReconstructProfile) -> SampleReconstructed | DeadLetter:
    """Rebuild one response: prompt ids, output ids, loss mask, or a dead-letter verdict."""
    return reconstruct_batch([response], profile)[0]


@dataclass
class LineResult:
    """The verdict on one line of an offline JSONL input (line numbers start at 1)."""

    line: int
    key: str
    verdict: SampleReconstructed | DeadLetter


def reconstruct_lines(
    lines: Iterable[bytes],
    resolve: Callable[[ResponseReceived], ReconstructProfile | DeadLetter],
    *,
    batch_size: int = 256,
) -> Iterator[LineResult]:
    """Rebuild a JSONL stream of ``ResponseReceived``, in batches, in input order.

    ``resolve`` picks the profile of a response (or a dead-letter verdict when it cannot
    be loaded). Blank lines are skipped; undecodable lines get their schema reason code.
    """
    pending: list[tuple[int, bytes]] = []
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            pending.append((number, raw))
        if len(pending) >= batch_size:
            yield from _reconstruct_chunk(pending, resolve)
            pending = []
    if pending:
        yield from _reconstruct_chunk(pending, resolve)


def _reconstruct_chunk(
    chunk: list[tuple[int, bytes]],
    resolve: Callable[[ResponseReceived], ReconstructProfile | DeadLetter],
) -> Iterator[LineResult]:
    verdicts: dict[int, LineResult] = {}
    groups: dict[int, tuple[ReconstructProfile, list[tuple[int, ResponseReceived]]]] = {}
    for number, raw in chunk:
        try:
            response = decode(raw, ResponseReceived)
        except SchemaError as exc:
            verdicts[number] = LineResult(number, "", DeadLetter(exc.reason, exc.message))
            continue
        key = sample_key(response.dataset, response.sample_id)
        profile = resolve(response)
        if isinstance(profile, DeadLetter):
            verdicts[number] = LineResult(number, key, profile)
            continue
        groups.setdefault(id(profile), (profile, []))[1].append((number, response))
    for profile, members in groups.values():
        for (number, response), verdict in zip(
            members, reconstruct_batch([r for _, r in members], profile), strict=True
        ):
            verdicts[number] = LineResult(number, sample_key(response.dataset, response.sample_id), verdict)
    for number, _ in chunk:
        yield verdicts[number]
