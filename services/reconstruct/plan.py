"""A response half-way through reconstruction, and what every way of planning it shares: the
profile's face, the output's layout under its prompt, the vocabulary check. ``core`` plans
chat responses, ``raw`` completions-mode ones; both build a :class:`Plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from schemas import Message, ResponseReceived, ToolCall
from services.common.records import DeadLetter
from services.profiles import PromptState
from services.reconstruct.restore import Slot

__all__ = [
    "EMPTY_RESPONSE",
    "ID_OUT_OF_VOCAB",
    "TEMPLATE_ERROR",
    "Layout",
    "Plan",
    "ReconstructProfile",
    "check_ids",
    "output_layout",
]

EMPTY_RESPONSE = "empty_response"
ID_OUT_OF_VOCAB = "id_out_of_vocab"
TEMPLATE_ERROR = "chat_template_error"


class ReconstructProfile(Protocol):
    """The part of ``services.profiles.Profile`` reconstruction uses."""

    name: str
    end_of_turn: str
    end_of_turn_id: int
    think_start: str | None
    think_start_id: int | None
    think_end: str | None
    think_end_id: int | None
    tool_tokens: dict[str, int]
    tool_format: str
    vocab_size: int
    special_ids: frozenset[int]

    @property
    def special_strings(self) -> tuple[str, ...]:
        """Every control string of the profile."""
        ...

    def thinks(self) -> bool:
        """Whether the model produces a think block under this profile."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode model text: specials parsed, no BOS, no normalising."""
        ...

    def encode_prompt_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode prompts as the server does."""
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

    def render_prompt(
        self, messages: Sequence[Message], tools: list[dict[str, object]] | None, *, reasoning: bool = False
    ) -> str:
        """The chat-templated prompt over the messages as sent (history reasoning with ``reasoning``)."""
        ...

    def prompt_state(self, prompt_text: str) -> PromptState:
        """Whether the prompt opened the think block, closed it, or left it alone."""
        ...

    def tool_call_pieces(self, calls: Sequence[ToolCall]) -> list[str | tuple[str]]:
        """Native text of structured tool calls with its gaps."""
        ...

    def partial_char_prefixes(self) -> frozenset[bytes]:
        """Visible byte strings some token extends with an incomplete character."""
        ...


@dataclass(frozen=True)
class Layout:
    """How a response's output is laid out under its prompt: what the model wrote first."""

    think_start: bool  # the model itself wrote the think-start
    think_end: bool  # the output holds the think-end
    end_of_turn: bool  # the answer finished


def output_layout(
    profile: ReconstructProfile, prompt_text: str, *, reasoning: str, closed: bool, finished: bool
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
    # Slots the upstream's facts closed (strip gaps, argument choices): kept to test a contradiction.
    closed: list[Slot] = field(default_factory=list)


def check_ids(ids: Sequence[int], profile: ReconstructProfile, what: str) -> DeadLetter | None:
    """A dead letter when any id lies outside the profile's vocabulary."""
    bad = [i for i in ids if not 0 <= i < profile.vocab_size]
    if bad:
        return DeadLetter(
            ID_OUT_OF_VOCAB,
            f"{len(bad)} {what} id(s) outside the {profile.name} vocabulary ({profile.vocab_size}), e.g. {bad[0]}",
        )
    return None
