"""A response half-way through reconstruction, and what every way of planning it shares: the
output's layout under its prompt, the vocabulary check, the reason codes and the places where
a provider can lose text. ``reencode`` plans chat responses, ``raw`` completions-mode ones;
both build a :class:`Plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas import ResponseReceived
from services.common.records import DeadLetter
from services.profiles import ProfileLike
from services.reconstruct.restore import Slot

__all__ = [
    "EMPTY_RESPONSE",
    "ID_OUT_OF_VOCAB",
    "TEMPLATE_ERROR",
    "Layout",
    "Plan",
    "check_ids",
    "output_layout",
]

EMPTY_RESPONSE = "empty_response"
ID_OUT_OF_VOCAB = "id_out_of_vocab"
TEMPLATE_ERROR = "chat_template_error"
INVALID_TOOL_ARGUMENTS = "invalid_tool_arguments"
SPECIAL_TOKEN_IN_TEXT = "special_token_in_text"  # noqa: S105 - a reason code
LOGPROBS_UNMAPPABLE = "logprobs_unmappable"
UNEXPECTED_REASONING = "unexpected_reasoning"
TOOL_ARGUMENTS_RESERIALIZED = "tool_arguments_reserialized"
WHITESPACE_STRIPPED = "whitespace_stripped"
WHITESPACE_AMBIGUOUS = "whitespace_ambiguous"
TOOL_TEXT_LOST = "tool_call_text_lost"
LOSS_UNVERIFIABLE = "lossy_text_unverifiable"
TRUNCATED_TAIL_LOST = "truncated_tail_lost"
TRUNCATED_TAIL_AMBIGUOUS = "truncated_tail_ambiguous"
THINK_LAYOUT_AMBIGUOUS = "think_layout_ambiguous"

# Where a provider can lose text (for messages): stripped field edges, around tool blocks,
# re-serialised tool arguments.
WHERE_STRIP = "strip"
WHERE_TOOL = "tool"
WHERE_ARGS = "arguments"

# The places in and around a tool block that a tool parser may have changed (docs/fidelity.md, "The rule"):
# each names what re-encoded text cannot show, so a re-encoded answer with structured tool calls is refused
# naming them; only native ids, logprob tokens or a route without a tool parser prove them.
TOOL_PLACES = {
    "before_tool": "the content before the block (a detector .strip()s it; whitespace-only content comes "
                   "back empty or null)",
    "tool_wrapper": "the block wrapper (the parser json.loads the whole call, so the whitespace and spelling "
                    "inside <tool_call> are its own)",
    "tool_arguments": "the argument text (re-serialised by the parser)",
    "around_arguments": "the whitespace around the arguments (the parser's regex consumes it)",
    "between_calls": "the text between calls (the parser keeps none of it)",
    "after_block": "the text after the block (dropped by the parsers, or appended to the content)",
}


@dataclass(frozen=True)
class Layout:
    """How a response's output is laid out under its prompt: what the model wrote first."""

    think_start: bool  # the model itself wrote the think-start
    think_end: bool  # the output holds the think-end
    end_of_turn: bool  # the answer finished


def output_layout(
    profile: ProfileLike, prompt_text: str, *, reasoning: str, closed: bool, finished: bool
) -> Layout:
    """The think tokens an output holds, from the prompt's state and the profile's facts.

    A prompt that opens the think block leaves the model inside it (a think-end follows
    unless the answer stopped inside the reasoning); one that closes it, or a model that
    never thinks, leaves no think token in the output; otherwise a thinking model opens
    the block itself, which a response shows by carrying reasoning.
    """
    state = profile.prompt_state(prompt_text)
    if profile.think_end is None or state == "closed":
        return Layout(False, False, finished)
    if state == "open":
        return Layout(False, closed, finished)
    if profile.thinks() and (reasoning or not closed):
        return Layout(True, closed, finished)
    return Layout(False, False, finished)


@dataclass
class Plan:
    """One response half-way: the texts to encode, or ids already known."""

    response: ResponseReceived
    prompt_text: str
    output_text: str | None
    output_ids: list[int] | None
    method: str
    layout: Layout | None = None
    # Every place the provider may have dropped or rewritten text (see restore.Slot).
    gaps: list[Slot] = field(default_factory=list)
    expected_count: int | None = None
    expected_reasoning: int | None = None  # ids before the think-end, where that count is established
    think_end_at: int | None = None  # offset of the think-end in output_text
    # Places whose field edge shows whitespace (evidence for the upstream's facts, facts.py).
    shown: frozenset[str] = frozenset()
    # Slots the upstream's facts closed (strip gaps): kept to test a contradiction.
    closed: list[Slot] = field(default_factory=list)
    # Places of TOOL_PLACES a tool parser may have changed in this answer, in text order.
    tool_places: tuple[str, ...] = ()


def check_ids(ids: Sequence[int], profile: ProfileLike, what: str) -> DeadLetter | None:
    """A dead letter when any id lies outside the profile's vocabulary."""
    bad = [i for i in ids if not 0 <= i < profile.vocab_size]
    if bad:
        return DeadLetter(
            ID_OUT_OF_VOCAB,
            f"{len(bad)} {what} id(s) outside the {profile.name} vocabulary ({profile.vocab_size}), e.g. {bad[0]}",
        )
    return None
