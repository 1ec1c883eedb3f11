"""Multi-turn regeneration: an accepted turn becomes the next turn's prompt (pure: no I/O, no clock).

A ``turns = "all"`` dataset regenerates every assistant turn of a conversation on the
*regenerated* history (on-policy multi-turn). ``publish`` sends turn 0; each accepted turn k
comes here and yields turn k+1's prompt: the original conversation up to the next user (or
tool-result) turn, every earlier assistant turn replaced by the model's own answer: its
content, its tool calls and its reasoning. The reasoning is passed back on every regenerated
turn and the model's chat template decides what of it the model sees (DeepSeek-R1 and V3.1 drop
it, Qwen3-2507 drops it before the last user query, Kimi-K2-Thinking keeps it after the last
assistant turn without tool calls): the request carries it (:func:`schemas.wire_messages`), and the prompt ids
are the template's render of exactly that.

A completions-mode turn comes back as the model's raw text: it is split into the same message
(reasoning, content, tool calls with their arguments' exact text) by the profile's own output
format (:mod:`services.profiles.split`, the inverse of what the template renders), never by a
server's parser; the next prompt is then rendered from that history like any other. A raw text
that is no history turn of its format (a think block that never closes, a malformed tool block,
a call to a function the prompt did not offer) ends the conversation with the split's reason.

Each next prompt carries the length and digest of the turn's full sequence (prompt + output ids),
so its row can say whether its prompt ids extend it (:mod:`schemas.prefix`).

Tool results are paired semi-on-policy (vLLM speculators PR #750): tools are not executed;
the i-th regenerated call of a turn gets the i-th tool result the dataset cached after the
original turn, under the regenerated call's id. The conversation ends early, with a reason
code, when a regenerated call names another function or the turn structure diverges.

The generation points of a conversation (:func:`turn_points`) are the index of each original
assistant message, plus the end when the conversation ends on a user or tool turn (the
single-turn behaviour of ``turns = "last"`` for a conversation without a final answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from schemas import (
    ConversationProgressed,
    ConversationTurn,
    Message,
    PromptPublished,
    ResponseReceived,
    SampleAudited,
    ToolCall,
)
from schemas.prefix import ids_digest
from services.profiles.split import (
    SPLIT_REASONS,
    OutputFormat,
    SplitError,
    offered_tool_names,
    prompt_state,
    split_output,
)

# Reasons a conversation ends before its last turn (label values of a metric: keep the set bounded).
FINISHED: Final = "finished"
TOOL_NAME_MISMATCH: Final = "tool_name_mismatch"
TOOL_CALL_MISSING: Final = "tool_call_missing"
UNEXPECTED_TOOL_CALL: Final = "unexpected_tool_call"
TOOL_CALL_COUNT: Final = "tool_call_count"
TOOL_RESULT_COUNT: Final = "tool_result_count"
NO_NEXT_QUERY: Final = "no_next_query"
END_REASONS: Final = (
    TOOL_NAME_MISMATCH,
    TOOL_CALL_MISSING,
    UNEXPECTED_TOOL_CALL,
    TOOL_CALL_COUNT,
    TOOL_RESULT_COUNT,
    NO_NEXT_QUERY,
    *SPLIT_REASONS,
)

# Dead-letter reasons: the accepted record cannot be continued at all (bad input).
CONVERSATION_INVALID: Final = "conversation_invalid"


class ConversationError(ValueError):
    """A conversation that cannot be planned (a turn out of range, no user turn before the first answer)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def turn_sample_id(conversation_id: str, turn: int) -> str:
    """The sample id of one turn: ``<conversation_id>:<turn>`` (the key is ``dataset:conversation:turn``)."""
    return f"{conversation_id}:{turn}"


def turn_points(original: Sequence[Message]) -> list[int]:
    """Where the model generates: each assistant message's index, and the end after a final user/tool turn."""
    points = [i for i, m in enumerate(original) if m.role == "assistant"]
    if original and original[-1].role != "assistant":
        points.append(len(original))
    return points


def first_turn(original: list[Message], conversation_id: str) -> tuple[list[Message], ConversationTurn]:
    """Turn 0 of a conversation: the messages before its first answer, and the turn record.

    Raises :class:`ConversationError` when no user turn precedes the first answer.
    """
    points = turn_points(original)
    messages = list(original[: points[0]]) if points else []
    if not any(m.role == "user" for m in messages):
        raise ConversationError("no_user_turn", "no user turn before the first assistant turn")
    return messages, ConversationTurn(conversation_id=conversation_id, turn=0, original=list(original))


def regenerated_message(response: ResponseReceived) -> Message:
    """The model's answer as a history turn: content, tool calls and reasoning as it produced them."""
    return Message(
        role="assistant",
        content=response.content,
        reasoning_content=response.reasoning or None,
        tool_calls=list(response.tool_calls) or None,
    )


def completions_message(response: ResponseReceived, fmt: OutputFormat) -> Message:
    """A completions-mode answer as a history turn: its raw text split by the profile's output format.

    Raises :class:`services.profiles.split.SplitError` when the text is no history turn of that format.
    """
    offered = offered_tool_names(response.prompt.tools) if response.tools_sent else frozenset()
    state = prompt_state(fmt, response.sent_prompt)
    split = split_output(response.text, fmt, state=state, offered=offered, call_id=f"call_{response.sample_id}")
    return Message(
        role="assistant",
        content=split.content,
        reasoning_content=split.reasoning or None,
        tool_calls=list(split.tool_calls) or None,
    )


@dataclass(frozen=True)
class Continued:
    """Turn k was accepted and turn k+1 follows: its prompt and the conversation's new state."""

    prompt: PromptPublished
    progress: ConversationProgressed


@dataclass(frozen=True)
class Ended:
    """Turn k was accepted and the conversation stops here: finished, or ended early with a reason."""

    progress: ConversationProgressed


Verdict = Continued | Ended


def _ended(prompt: PromptPublished, conv: ConversationTurn, reason: str, message: str, at: float) -> Ended:
    return Ended(
        ConversationProgressed(
            dataset=prompt.dataset,
            conversation_id=conv.conversation_id,
            state="finished" if reason == FINISHED else "ended_early",
            turns_done=conv.turn + 1,
            reason=reason,
            message=message,
            at=at,
        )
    )


def _pair_tool_results(
    original_calls: Sequence[ToolCall], calls: Sequence[ToolCall], results: Sequence[Message]
) -> list[Message] | tuple[str, str]:
    """The cached tool results under the regenerated calls' ids, or (reason, message) when they diverge."""
    if original_calls and not calls:
        return TOOL_CALL_MISSING, f"the original turn called {len(original_calls)} tool(s), the model called none"
    if calls and not original_calls:
        names = ", ".join(c.function.name for c in calls)
        return UNEXPECTED_TOOL_CALL, f"the model called {names}; the dataset has no cached result for it"
    if len(calls) != len(original_calls):
        return TOOL_CALL_COUNT, f"the model made {len(calls)} call(s), the original {len(original_calls)}"
    for i, (new, old) in enumerate(zip(calls, original_calls, strict=True)):
        if new.function.name != old.function.name:
            cached = old.function.name
            return TOOL_NAME_MISMATCH, f"call {i} names {new.function.name!r}, the cached result is {cached!r}'s"
    if len(results) != len(calls):
        return TOOL_RESULT_COUNT, f"{len(calls)} call(s) but {len(results)} cached tool result(s)"
    return [
        msgspec.structs.replace(result, tool_call_id=call.id or result.tool_call_id)
        for call, result in zip(calls, results, strict=True)
    ]


def continue_conversation(
    audited: SampleAudited, *, at: float = 0.0, output_format: OutputFormat | None = None
) -> Verdict | None:
    """What follows an accepted turn: the next turn's prompt, or the conversation's end.

    ``output_format`` is the sample's profile's (needed for a completions-mode turn: its raw
    text is split by it). None for a sample of a single-turn prompt (no ``conversation``):
    nothing to continue. Raises :class:`ConversationError` for a turn the conversation does not
    have, or a completions-mode turn without an output format.
    """
    response = audited.sample.response
    prompt = response.prompt
    conv = prompt.conversation
    if conv is None:
        return None
    points = turn_points(conv.original)
    k = conv.turn
    if k >= len(points):
        raise ConversationError(
            CONVERSATION_INVALID, f"turn {k} of a conversation with {len(points)} generation point(s)"
        )
    if k + 1 == len(points):
        return _ended(prompt, conv, FINISHED, f"all {len(points)} turn(s) regenerated", at)
    if response.mode != "completions":
        answer = regenerated_message(response)
    elif output_format is None:
        raise ConversationError(CONVERSATION_INVALID, "a completions-mode turn needs its profile's output format")
    else:
        try:
            answer = completions_message(response, output_format)
        except SplitError as exc:
            return _ended(prompt, conv, exc.reason, exc.message, at)
    original_turn = conv.original[points[k]]
    between = conv.original[points[k] + 1 : points[k + 1]]
    results = [m for m in between if m.role == "tool"]
    rest = between[len(results) :]
    if any(m.role == "tool" for m in rest):
        return _ended(prompt, conv, TOOL_RESULT_COUNT, "tool results after a user turn: no turn to pair them with", at)
    paired = _pair_tool_results(original_turn.tool_calls or (), answer.tool_calls or (), results)
    if isinstance(paired, tuple):
        return _ended(prompt, conv, paired[0], paired[1], at)
    following = [*paired, *rest]
    if not following:
        return _ended(prompt, conv, NO_NEXT_QUERY, "two assistant turns in a row: no user or tool turn between", at)
    nxt = k + 1
    messages = [*prompt.messages, answer, *following]
    sample = audited.sample
    sequence = [*sample.prompt_ids, *sample.output_ids]
    next_prompt = msgspec.structs.replace(
        prompt,
        sample_id=turn_sample_id(conv.conversation_id, nxt),
        messages=messages,
        published_at=at,
        conversation=ConversationTurn(
            conversation_id=conv.conversation_id,
            turn=nxt,
            original=conv.original,
            previous_length=len(sequence),
            previous_digest=ids_digest(sequence),
        ),
    )
    progress = ConversationProgressed(
        dataset=prompt.dataset,
        conversation_id=conv.conversation_id,
        state="in_progress",
        turns_done=nxt,
        next_turn=nxt,
        at=at,
    )
    return Continued(next_prompt, progress)


__all__ = [
    "CONVERSATION_INVALID",
    "END_REASONS",
    "FINISHED",
    "NO_NEXT_QUERY",
    "TOOL_CALL_COUNT",
    "TOOL_CALL_MISSING",
    "TOOL_NAME_MISMATCH",
    "TOOL_RESULT_COUNT",
    "UNEXPECTED_TOOL_CALL",
    "Continued",
    "ConversationError",
    "Ended",
    "Verdict",
    "completions_message",
    "continue_conversation",
    "first_turn",
    "regenerated_message",
    "turn_points",
    "turn_sample_id",
]
